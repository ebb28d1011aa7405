"""Package attributes loaded on first use (PEP 562), so light uses of a package (the command line's parser, a
data module) do not load torch and transformers through the package's `__init__`."""

from __future__ import annotations

import importlib
from collections.abc import Callable


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

    return __getattr__, __dir__
