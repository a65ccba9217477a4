"""No module of lightning_hpz calls a torch.distributed collective except lightning_hpz/collectives.py.

A collective written directly works in the CPU tests and crashes the first NCCL run when its tensor is on the CPU
(the integrity check once all-reduced a CPU tensor at the first step after every hpZ resume). Process-group setup and
queries (``init_process_group``, ``is_initialized``, ``get_backend``) are not collectives and stay allowed, so the
benchmark workers that build their own process group keep doing so.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_hpz"
ALLOWED = {PACKAGE / "collectives.py"}
COLLECTIVES = {
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
}


def _distributed_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names bound to torch.distributed (``dist``) and collectives imported from it by name."""
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            modules |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            functions |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
    return modules, functions


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def direct_collectives(source: str) -> list[str]:
    """``line: call`` for every torch.distributed collective called in ``source``."""
    tree = ast.parse(source)
    modules, functions = _distributed_names(tree)
    modules.add("torch.distributed")
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        owner, _, attribute = name.rpartition(".")
        if (owner in modules and attribute in COLLECTIVES) or name in functions:
            found.append(f"{node.lineno}: {name}")
    return found


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist\ndist.all_reduce(t)",
        "import torch\ntorch.distributed.all_gather_object(out, x)",
        "from torch import distributed as d\nd.barrier()",
        "from torch.distributed import broadcast as bcast\nbcast(t, 0)",
    ],
)
def test_scan_finds_each_way_of_calling_a_collective(source):
    assert len(direct_collectives(source)) == 1


def test_scan_allows_setup_and_queries():
    source = "import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.get_rank()\ndist.is_initialized()"
    assert direct_collectives(source) == []


def test_no_module_calls_a_collective_outside_the_helper():
    offenders = {
        str(path.relative_to(PACKAGE.parent)): calls
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in ALLOWED and (calls := direct_collectives(path.read_text()))
    }
    assert offenders == {}, f"call these through lightning_hpz.collectives instead: {offenders}"
