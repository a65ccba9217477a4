"""The package layout is the architecture (docs/architecture.md): few modules at the top, one concern per folder,
imports only downward through the layers, no import cycle. Read from the source, so nothing is imported."""

import ast
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_hpz"
ARCHITECTURE = REPO / "docs" / "architecture.md"
MAX_TOP_LEVEL_MODULES = 6

# Bottom to top: a module may import from its own part and from parts of a lower layer only. The root package
# (`lightning_hpz/__init__.py`, the public names) sits above everything it re-exports.
LAYERS = [
    {"lazy_names", "process_memory", "collectives", "durability", "lightning_internals"},
    {"partitioning", "planning", "exact_resume"},
    {"data", "models"},
    {"checkpointing"},
    {"lifecycle", "autotune"},
    {"callbacks"},
    {"strategy"},
    {"__init__"},
    {"bench", "study"},
    {"cli"},
]
LAYER_OF = {part: index for index, parts in enumerate(LAYERS) for part in parts}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def part_of(module: str) -> str:
    """The top-level part of the package a module belongs to: its folder, a top-level module, or the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(module: str) -> set[str]:
    """Every module of the package that ``module`` imports, at the top or inside a function.

    ``from package import name`` counts as an import of ``package.name`` when that is a module, else of ``package``.
    """
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {name for name in found if name in MODULES and name != module}


GRAPH = {module: imported_modules(module) for module in MODULES}


def test_at_most_a_handful_of_modules_at_the_top():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_every_part_of_the_package_has_a_layer():
    parts = {part_of(module) for module in MODULES}
    assert parts == set(LAYER_OF), f"parts without a layer: {parts - set(LAYER_OF)}; gone: {set(LAYER_OF) - parts}"


def test_imports_only_go_down_the_layers():
    upward = [
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if part_of(target) != part_of(module) and LAYER_OF[part_of(target)] >= LAYER_OF[part_of(module)]
    ]
    assert upward == []


def test_no_import_cycle():
    cycles = [component for component in strongly_connected(GRAPH) if len(component) > 1]
    assert cycles == []


def test_a_cycle_and_an_upward_import_are_found():
    # the two checks above on a graph that has both, so a broken check cannot pass silently
    graph = {"lightning_hpz.data.a": {"lightning_hpz.data.b"}, "lightning_hpz.data.b": {"lightning_hpz.data.a"}}
    assert [sorted(c) for c in strongly_connected(graph) if len(c) > 1] == [sorted(graph)]
    assert LAYER_OF[part_of("lightning_hpz.strategy.x")] > LAYER_OF[part_of("lightning_hpz.data.a")]


@pytest.mark.parametrize("folder", sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()))
def test_architecture_page_names_every_folder(folder):
    assert f"`{folder}/`" in ARCHITECTURE.read_text()


def test_every_folder_the_architecture_page_names_exists():
    named = set(re.findall(r"`([a-z_]+)/`", ARCHITECTURE.read_text()))
    assert named, "docs/architecture.md names no folder"
    assert sorted(folder for folder in named if not (PACKAGE / folder).is_dir()) == []


@pytest.mark.parametrize(
    "package",
    ["lightning_hpz", "lightning_hpz.callbacks", "lightning_hpz.models", "lightning_hpz.data", "lightning_hpz.cli"],
)
def test_public_names_still_import(package):
    # the paths users write (README, YAML class_path) survive any move inside the package
    module = importlib.import_module(package)
    assert module.__all__
    assert [name for name in module.__all__ if getattr(module, name, None) is None] == []


def test_the_strategies_keep_their_public_names():
    import lightning_hpz

    assert lightning_hpz.HpzStrategy.__name__ == "HpzStrategy"
    assert lightning_hpz.HpzFabricStrategy.__name__ == "HpzFabricStrategy"
    assert importlib.import_module("lightning_hpz.callbacks").PreemptionCheckpoint.__name__ == "PreemptionCheckpoint"


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of ``graph`` (module -> modules it imports)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for node in graph:
        if node not in index:
            visit(node)
    return components
