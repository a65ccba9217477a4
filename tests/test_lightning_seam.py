"""Lightning's internals are reached through lightning_hpz/lightning_internals.py only, and it checks the release."""

import ast
import re
from pathlib import Path

import lightning
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hpz import lightning_internals
from lightning_hpz.lightning_internals import IncompatibleLightningError

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_hpz"
SEAM = PACKAGE / "lightning_internals.py"
LIGHTNING = Path(lightning.__file__).parent

# Private names a module of the package defines or reads for itself that Lightning happens to define too.
OWN_NAMES_THAT_LIGHTNING_ALSO_USES = {
    "bench/command.py": {"_spec"},
    "bench/testbed.py": {"_run"},
    "callbacks/loss_stability_monitor.py": {"_step"},
    "callbacks/model_flops.py": {"_get"},
    "callbacks/token_throughput_monitor.py": {"_log", "_update"},
    "checkpointing/preemption_retention.py": {"_step"},
    "data/shard_writer.py": {"_name"},
    "lifecycle/peer_watchdog.py": {"_lock"},
    "partitioning/cpu_adam_op.py": {"_load"},
    "partitioning/cpu_comm_op.py": {"_load"},
    "partitioning/deepspeed_patch.py": {"_version"},  # torch's Tensor._version
    "partitioning/resumable_conversion.py": {"_save_checkpoint"},  # DeepSpeed's ds_to_universal writer
    "study/study_config.py": {"_launcher", "_mapping"},
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _mangled(node: ast.AST) -> bool:
    name = getattr(node, "name", "")
    return isinstance(node, ast.FunctionDef) and name.startswith("__") and not name.endswith("__")


def lightning_private_names() -> set[str]:
    """Every private name Lightning's Trainer and Fabric define: functions, classes, methods, attributes, globals."""
    names = set()
    for path in [*(LIGHTNING / "pytorch").rglob("*.py"), *(LIGHTNING / "fabric").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):  # name-mangled members, as read from outside the class
                names |= {f"_{node.name}{child.name}" for child in node.body if _mangled(child)}
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {name for name in names if _private(name)}


def lightning_privates_used(source: str, lightning_names: set[str]) -> set[str]:
    """Private Lightning names ``source`` imports, reads, assigns or overrides (as a method), also by ``getattr``."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning":
            parts = node.module.split(".")
            used |= {f"{node.module}.{alias.name}" for alias in node.names if _private(alias.name)}
            used |= {node.module for part in parts if _private(part)}
        elif isinstance(node, ast.Import):
            used |= {
                alias.name
                for alias in node.names
                if alias.name.split(".")[0] == "lightning" and any(map(_private, alias.name.split(".")))
            }
        elif isinstance(node, ast.Attribute) and node.attr in lightning_names:
            used.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in lightning_names:
            used.add(node.name)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr"):
            used |= {
                arg.value for arg in node.args[1:2] if isinstance(arg, ast.Constant) and arg.value in lightning_names
            }
    return used


@pytest.fixture(scope="module")
def lightning_names():
    return lightning_private_names()


def test_lightning_internals_are_reached_only_through_the_seam(lightning_names):
    outside = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == SEAM:
            continue
        relative = path.relative_to(PACKAGE).as_posix()
        used = lightning_privates_used(path.read_text(), lightning_names)
        used -= OWN_NAMES_THAT_LIGHTNING_ALSO_USES.get(relative, set())
        if used:
            outside[relative] = sorted(used)
    assert outside == {}, f"Lightning internals outside lightning_internals.py (route them through it): {outside}"


def test_the_scan_finds_each_kind_of_access(lightning_names):
    source = (
        "from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher\n"
        "import lightning.fabric.utilities._private\n"
        "connector = trainer._checkpoint_connector\n"
        "class Strategy:\n    def _configure_launcher(self): ...\n"
        "own = self.configure_launcher\n"
        "folder = callback._ModelCheckpoint__resolve_ckpt_dir(trainer)\n"
        "attached = getattr(module, '_trainer', None)\n"
    )
    assert lightning_privates_used(source, lightning_names) == {
        "lightning.pytorch.strategies.launchers._SubprocessScriptLauncher",
        "lightning.fabric.utilities._private",
        "_checkpoint_connector",
        "_configure_launcher",
        "_ModelCheckpoint__resolve_ckpt_dir",
        "_trainer",
    }


def test_every_name_allowed_as_the_packages_own_is_still_used_there(lightning_names):
    # a stale entry would let a real Lightning access of that name through unnoticed
    stale = {
        relative: sorted(names - lightning_privates_used((PACKAGE / relative).read_text(), lightning_names))
        for relative, names in OWN_NAMES_THAT_LIGHTNING_ALSO_USES.items()
    }
    assert {relative: names for relative, names in stale.items() if names} == {}


@pytest.mark.parametrize("version", ["2.5.0", "2.5.6", "2.6.0", "2.6.6"])
def test_supported_lightning_releases_pass_the_version_check(version):
    lightning_internals.check_lightning_version(version)


@pytest.mark.parametrize("version", ["2.4.0", "2.7.0", "3.0.0", "2.50.1"])
def test_other_lightning_releases_are_refused_naming_the_release_to_install(version):
    with pytest.raises(IncompatibleLightningError, match=re.escape(version)) as refused:
        lightning_internals.check_lightning_version(version)
    assert "pip install 'lightning>=2.5,<2.7'" in str(refused.value)


def test_the_installed_lightning_has_every_internal_the_seam_names():
    lightning_internals.check_lightning_internals()
    assert lightning.__version__[:3] in lightning_internals.SUPPORTED_LIGHTNING


def test_a_lightning_without_one_of_them_is_refused_by_name(monkeypatch):
    monkeypatch.delattr(ModelCheckpoint, "_ModelCheckpoint__resolve_ckpt_dir")
    with pytest.raises(IncompatibleLightningError, match=r"lacks ModelCheckpoint.__resolve_ckpt_dir"):
        lightning_internals.check_lightning_internals()


def test_the_supported_releases_are_the_declared_range():
    pyproject = (REPO / "pyproject.toml").read_text()
    declared = re.search(r'"lightning>=(\d+\.\d+),<(\d+)\.(\d+)"', pyproject)
    assert declared is not None
    low, major, high = declared.group(1), int(declared.group(2)), int(declared.group(3))
    minors = [f"{major}.{minor}" for minor in range(int(low.split(".")[1]), high)]
    assert tuple(minors) == lightning_internals.SUPPORTED_LIGHTNING
    assert f"lightning>={low},<{major}.{high}" in lightning_internals.INSTALL_HINT
