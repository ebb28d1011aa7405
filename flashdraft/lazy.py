"""Package attributes loaded on first use (PEP 562), so light uses of a package (the command line's parser, a
data module) do not load torch and transformers through the package's `__init__`."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable


class _ExportsKeepTheirNames(types.ModuleType):
    """Importing a submodule makes it an attribute of its package. Where a submodule has an exported name
    (`flashdraft.train.regenerate`, the module of the function `regenerate`), the export keeps the name, as an eager
    `from .regenerate import regenerate` in the package's `__init__` would."""

    _exports: dict[str, str] = {}

    def __setattr__(self, name: str, value) -> None:
        if name in self._exports and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


def lazy_exports(package: str, exports: dict[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """`__getattr__` and `__dir__` for `package`, whose public name N lives in its submodule `exports[N]`."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        namespace[name] = value  # later lookups find it directly
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    package_module = sys.modules[package]
    package_module.__class__ = type(_ExportsKeepTheirNames.__name__, (_ExportsKeepTheirNames,), {"_exports": exports})
    return __getattr__, __dir__
