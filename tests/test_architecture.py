"""The package's layers import downwards only: no two subpackages reach into each other (directly or round a cycle),
and neither training nor the benchmark imports the other; what both need lives in `flashdraft.evaluation`."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flashdraft"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def imported_modules(path: Path) -> set[str]:
    """Every flashdraft module `path` imports, at the top or inside a function (lazy imports count too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("flashdraft")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("flashdraft"):
                found.add(target)
                names = (f"{target}.{alias.name}" for alias in node.names)
                found |= {module for module in names if is_module(module)}  # `from . import x` names a module
    return found


CORE_PACKAGES = ("engine", "native")  # packages that belong to the core: the CPU engine and its C kernels, beside the
# target adapter


def layer(module: str) -> str:
    """The subpackage a module belongs to; modules directly in flashdraft/ and the core's packages form the core."""
    parts = module.split(".")
    package = parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else "core"
    return "core" if package in CORE_PACKAGES else package


def layer_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = layer(module_name(path)) if module_name(path) != "flashdraft" else "core"
        for target in imported_modules(path):
            if target != "flashdraft" and layer(target) != source:
                graph.setdefault(source, set()).add(layer(target))
    return graph


def test_training_and_the_benchmark_do_not_import_each_other():
    graph = layer_graph()
    assert "train" not in graph.get("bench", set())
    assert "bench" not in graph.get("train", set())
    assert {"evaluation"} <= graph["train"] and {"evaluation"} <= graph["bench"]


def test_no_cycle_between_subpackages():
    graph = layer_graph()

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, set()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(node for node in graph if reaches(node, node, {node}))
    assert cycles == [], f"subpackages on an import cycle: {cycles} (graph: {graph})"


def test_the_check_sees_lazy_and_relative_imports():
    """The walker itself: a lazy relative import inside a function is found and placed in its layer."""
    found = imported_modules(PACKAGE / "cli.py") | imported_modules(PACKAGE / "train" / "regenerate.py")
    assert "flashdraft.target" in found  # `from ..target import TargetModel` in train/regenerate.py
    assert layer("flashdraft.train.regenerate") == "train" and layer("flashdraft.target") == "core"
    assert layer("flashdraft.evaluation") == "evaluation"


def module_graph() -> dict[str, set[str]]:
    """Every flashdraft module -> the flashdraft modules it imports (at the top or inside a function)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        graph[name] = {target for target in imported_modules(path) if target != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm): each is an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph.get(module, ()):
            if imported not in graph:
                continue
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycle_between_modules():
    """Inside a subpackage too, lazy imports included: shared code moves down instead of being imported lazily."""
    cycles = import_cycles(module_graph())
    assert cycles == [], f"modules on an import cycle: {cycles}"


def test_the_cycle_check_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
