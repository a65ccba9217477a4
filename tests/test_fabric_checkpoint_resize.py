"""``fabric.load`` of a checkpoint written on another number of ranks keeps everything the optimizer had: the weights,
each parameter group's settings (learning rate, betas, weight decay: different in each group) and Adam's moments, bit
for bit, under ZeRO-1, ZeRO-2 and ZeRO-3 + hpZ 2; SGD with momentum, whose state the conversion does not carry, is
refused naming the optimizer; a read-only checkpoint (a real read-only bind mount) resizes through the cache folder.

Two launches of tests/scripts/fabric_checkpoint_resize.py (real DeepSpeed over gloo, a new Fabric per layout in the
same processes): 2 CPU ranks train 3 steps and save; 1 rank loads each checkpoint (through DeepSpeed's universal
format, as every resize does) and trains one more step. The Trainer's resizes are tests/test_checkpoint_trust.py.
"""

import math
import os
import shutil
import subprocess

import pytest
import torch
from conftest import assert_read_in_parts, assert_succeeded, run_script, universal_state_bytes

from lightning_hpz.checkpointing.manifest import read_manifest
from lightning_hpz.checkpointing.universal_location import CACHE_ENV_VAR

pytestmark = pytest.mark.multiprocess

# (ZeRO stage, hpZ partition size, optimizer) of the 2-rank run that saves
ADAM_LAYOUTS = [(1, 1, "adamw"), (2, 1, "adamw"), (3, 2, "adamw")]
LAYOUTS = [*ADAM_LAYOUTS, (1, 1, "sgd")]


@pytest.fixture(scope="module")
def moved(module_tmp):
    options = {"root": str(module_tmp / "ckpts"), "layouts": LAYOUTS}
    saved = run_script("fabric_checkpoint_resize.py", {**options, "phase": "save", "devices": 2}, module_tmp / "save",
                       ranks=2)  # fmt: skip
    assert_succeeded(saved, ranks=2)
    loaded = run_script("fabric_checkpoint_resize.py", {**options, "phase": "load", "devices": 1}, module_tmp / "load",
                        ranks=1)  # fmt: skip
    assert_succeeded(loaded, ranks=1)
    return module_tmp, saved, loaded


@pytest.mark.parametrize("stage", [stage for stage, _, _ in ADAM_LAYOUTS])
def test_two_to_one_rank_keeps_weights_groups_and_moments(moved, stage):
    root, saved, loaded = moved
    layout = f"stage{stage}_adamw"
    recorded = read_manifest(root / "ckpts" / layout)
    assert recorded["run"]["world_size"] == 2 and recorded["run"]["stage"] == stage
    before = torch.load(root / "save" / f"saved_{layout}.pt")
    after = torch.load(root / "load" / f"loaded_{layout}.pt")
    assert sorted(before) == sorted(after)
    assert sum(name.endswith(".exp_avg_sq") for name in before) == 4  # two weights and two biases
    differing = [name for name in before if not torch.equal(before[name], after[name])]
    assert not differing, f"changed in the move from 2 ranks to 1: {differing}"
    assert all(before[name].abs().sum() > 0 for name in before if name.endswith("exp_avg"))  # real moments
    record = loaded.ranks[0][layout]
    assert record["step"] == 3
    assert record["groups"] == saved.ranks[1][layout]["groups"]
    assert [group["weight_decay"] for group in record["groups"]] == [0.1, 0.0]
    assert [group["lr"] for group in record["groups"]] == [1e-2, 5e-3]
    assert [group["betas"] for group in record["groups"]] == [[0.9, 0.999], [0.8, 0.99]]
    assert math.isfinite(record["next_loss"])
    assert_read_in_parts([record["universal_reads"]], universal_state_bytes(root / "ckpts" / layout / "universal"))


def test_sgd_with_momentum_is_refused_naming_the_optimizer(moved):
    _, _, loaded = moved
    refusal = loaded.ranks[0]["stage1_sgd"]["refused"]
    assert refusal is not None and "it holds SGD state" in refusal and "Resume on 2 ranks" in refusal, refusal


def test_each_load_went_through_the_conversion_for_another_world_size(moved):
    _, _, loaded = moved
    conversions = loaded.output.count("Resuming a checkpoint written on 2 ranks on 1 ranks")
    assert conversions == len(ADAM_LAYOUTS), loaded.output[-3000:]


def _read_only_mount(folder):
    """Bind-mount ``folder`` read-only over itself (root only, as on an archive or another team's storage)."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    remounted = subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], capture_output=True, text=True)
    if remounted.returncode != 0:
        subprocess.run(["umount", str(folder)], check=False)
        pytest.skip(f"cannot remount read-only here: {remounted.stderr.strip()}")


def test_a_read_only_checkpoint_resizes_through_the_cache_folder(moved, module_tmp):
    # an archived checkpoint (no universal copy inside, no way to write one) resumes on another number of ranks
    root, _, _ = moved
    archive = module_tmp / "archive"
    without_copy = shutil.ignore_patterns("universal")
    shutil.copytree(root / "ckpts" / "stage3_adamw", archive / "stage3_adamw", ignore=without_copy)
    _read_only_mount(archive)
    try:
        options = {"root": str(archive), "layouts": [ADAM_LAYOUTS[-1]], "phase": "load", "devices": 1}
        cache = module_tmp / "universal-cache"
        loaded = run_script("fabric_checkpoint_resize.py", options, module_tmp / "load_ro", ranks=1,
                            env={CACHE_ENV_VAR: str(cache)})  # fmt: skip
    finally:
        subprocess.run(["umount", str(archive)], check=True)
    assert_succeeded(loaded, ranks=1)
    assert not (archive / "stage3_adamw" / "universal").exists()
    copies = list(cache.iterdir())
    assert [copy.name.split("-")[0] for copy in copies] == ["stage3_adamw"] and read_manifest(copies[0]) is not None
    before = torch.load(root / "save" / "saved_stage3_adamw.pt")
    after = torch.load(module_tmp / "load_ro" / "loaded_stage3_adamw.pt")
    assert all(torch.equal(before[name], after[name]) for name in before)
