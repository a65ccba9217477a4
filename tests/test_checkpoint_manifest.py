"""Manifest, atomic commit, compatibility and the inspect/consolidate tools, in one process (no launch needed)."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_hpz.checkpointing import (
    CheckpointIntegrityError,
    CheckpointMismatchError,
    last_good_checkpoint,
    read_manifest,
)
from lightning_hpz.checkpointing.commit import committed_save, wait_for_old_copy_deletion
from lightning_hpz.checkpointing.compatibility import mismatches
from lightning_hpz.checkpointing.consolidate import consolidate
from lightning_hpz.checkpointing.inspect_command import checkpoint_main
from lightning_hpz.checkpointing.manifest import file_digest, verify_files
from lightning_hpz.checkpointing.resume import refuse_mismatches
from lightning_hpz.checkpointing.staging import staging_path

RUN = {"stage": 3, "world_size": 2, "hpz_partition_size": 1, "global_step": 4, "epoch": 0, "optimizer": "AdamW"}
SHARD = "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _write_shards(directory: Path, value: float) -> None:
    (directory / "checkpoint").mkdir(parents=True)
    for rank in range(2):
        torch.save(
            {"w": torch.full((64,), value)}, directory / f"checkpoint/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        )
    torch.save({"module": {}}, directory / "checkpoint/zero_pp_rank_0_mp_rank_00_model_states.pt")
    (directory / "latest").write_text("checkpoint")


def _commit(path: Path, value: float, step: int = 4) -> Path:
    with committed_save(path, {**RUN, "global_step": step, "parameters": {"w": [64]}}) as staging:
        _write_shards(staging, value)
    return path


def test_commit_moves_a_complete_checkpoint_into_place_with_its_manifest(tmp_path):
    path = _commit(tmp_path / "step=4.ckpt", 1.0)
    recorded = read_manifest(path)
    assert sorted(recorded["files"]) == [
        "checkpoint/zero_pp_rank_0_mp_rank_00_model_states.pt",
        "checkpoint/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        SHARD,
        "latest",  # a resume reads it too (the tag to open)
    ]
    assert recorded["files"][SHARD] == file_digest(path / SHARD)
    assert not staging_path(tmp_path / "step=4.ckpt").exists()
    # no staging folder left behind; the writer claim stays until the run tears down
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hpz-writer.json", "step=4.ckpt"]


def test_crash_during_save_leaves_the_previous_checkpoint_in_place(tmp_path):
    path = _commit(tmp_path / "last.ckpt", 1.0, step=2)
    with pytest.raises(RuntimeError, match="killed"), committed_save(path, RUN) as staging:
        _write_shards(staging, 2.0)
        raise RuntimeError("killed while writing")
    assert read_manifest(path)["run"]["global_step"] == 2
    assert torch.load(path / SHARD)["w"][0].item() == 1.0
    assert not verify_files(path, read_manifest(path), list(read_manifest(path)["files"]))


def test_a_crash_while_saving_does_not_move_lightnings_hpc_resume_point(tmp_path):
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    newest_hpc_version = _CheckpointConnector._CheckpointConnector__max_ckpt_version_in_folder  # what "hpc" resumes
    _commit(tmp_path / "hpc_ckpt_1.ckpt", 1.0, step=2)
    with pytest.raises(RuntimeError, match="killed"), committed_save(tmp_path / "hpc_ckpt_2.ckpt", RUN) as staging:
        _write_shards(staging, 2.0)
        raise RuntimeError("killed while writing")
    assert staging.exists()  # what the killed save left behind
    assert newest_hpc_version(tmp_path, "hpc_ckpt_") == 1


def test_overwrite_replaces_the_checkpoint_only_when_complete(tmp_path):
    _commit(tmp_path / "last.ckpt", 1.0, step=2)
    path = _commit(tmp_path / "last.ckpt", 2.0, step=4)
    assert read_manifest(path)["run"]["global_step"] == 4
    assert torch.load(path / SHARD)["w"][0].item() == 2.0
    wait_for_old_copy_deletion()  # the replaced copy is deleted off the save's critical path
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hpz-writer.json", "last.ckpt"]


@pytest.mark.parametrize("kind", ["file", "folder", "link"])
def test_whatever_another_strategy_left_at_the_path_is_replaced(tmp_path, kind):
    # LitGPT's `final/lit_model.pth`, a file under DDP, is a folder under DeepSpeed; a killed save left a stale
    # `.partial` file in staging: the save replaces both and reports what is on disk, and the next save works too
    final, target = tmp_path / "lit_model.pth", tmp_path / "elsewhere"
    target.write_text("kept")
    {
        "file": lambda: final.write_text("ddp"),
        "folder": lambda: final.mkdir(),
        "link": lambda: final.symlink_to(target),
    }[kind]()
    staging_path(final).parent.mkdir()
    staging_path(final).write_text("stale")
    for step, value in ((2, 1.0), (4, 2.0)):
        assert read_manifest(_commit(final, value, step=step))["run"]["global_step"] == step
    wait_for_old_copy_deletion()
    assert torch.load(final / SHARD)["w"][0].item() == 2.0 and target.read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hpz-writer.json", "elsewhere", "lit_model.pth"]


def test_verify_names_flipped_truncated_and_missing_files(tmp_path):
    path = _commit(tmp_path / "step=4.ckpt", 1.0)
    recorded = read_manifest(path)
    data = bytearray((path / SHARD).read_bytes())
    data[len(data) // 2] ^= 1
    (path / SHARD).write_bytes(bytes(data))
    model = path / "checkpoint/zero_pp_rank_0_mp_rank_00_model_states.pt"
    os.truncate(model, 10)
    (path / "checkpoint/zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    problems = verify_files(path, recorded, sorted(recorded["files"]))
    assert len(problems) == 3
    assert "model_states.pt: expected" in problems[0] and "found 10 bytes" in problems[0]
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt: missing" in problems[1]
    assert SHARD in problems[2] and recorded["files"][SHARD]["blake2b"] in problems[2]


def test_last_good_checkpoint_is_the_newest_intact_sibling(tmp_path):
    _commit(tmp_path / "step=2.ckpt", 1.0, step=2)
    _commit(tmp_path / "step=4.ckpt", 1.0, step=4)
    damaged = _commit(tmp_path / "step=6.ckpt", 1.0, step=6)
    staging_path(tmp_path / "step=8.ckpt").mkdir(parents=True)
    os.truncate(damaged / SHARD, 5)
    assert last_good_checkpoint(damaged) == (tmp_path / "step=4.ckpt").resolve()
    assert last_good_checkpoint(tmp_path / "step=4.ckpt") == (tmp_path / "step=2.ckpt").resolve()


@pytest.mark.parametrize("with_manifest", [True, False])
def test_consolidate_of_a_truncated_file_names_it(tmp_path, with_manifest):
    path = _commit(tmp_path / "step=4.ckpt", 1.0)
    if not with_manifest:
        (path / "hpz_manifest.json").unlink()
    os.truncate(path / SHARD, (path / SHARD).stat().st_size // 2)
    with pytest.raises(CheckpointIntegrityError, match=rf"{SHARD}: "):
        consolidate(path, tmp_path / "out.pt")


def test_mismatches_name_both_sides_and_accept_hpz_and_world_size_changes():
    saved = {**RUN, "parameters": {"a": [4, 4], "b": [4]}}
    same_but_moved = {**saved, "world_size": 8, "hpz_partition_size": 4}
    assert mismatches(saved, same_but_moved) == []
    current = {**saved, "stage": 2, "optimizer": "SGD", "parameters": {"a": [4, 8], "c": [1]}}
    stage, optimizer, shapes = mismatches(saved, current)
    assert "written with stage 3, this run uses stage 2" in stage
    assert "holds AdamW state, this run's optimizer is SGD" in optimizer
    assert (
        "a [4, 4] -> [4, 8]" in shapes
        and "not in the checkpoint: c" in shapes
        and "only in the checkpoint: b" in shapes
    )


def test_inspect_reports_the_run_and_fails_on_damage(tmp_path, capsys):
    path = _commit(tmp_path / "step=4.ckpt", 1.0)
    checkpoint_main(["inspect", str(path)])
    report = capsys.readouterr().out
    assert "ZeRO stage   3" in report and "world size   2 ranks" in report and "step         4 (epoch 0)" in report
    assert "integrity    ok (checksums match)" in report
    assert f"size         {_kib(path)} KiB in 4 files" in report
    os.truncate(path / SHARD, 5)
    with pytest.raises(SystemExit) as exited:
        checkpoint_main(["inspect", str(path)])
    assert exited.value.code == 1
    assert f"DAMAGED: {path / SHARD}: expected" in capsys.readouterr().out


def test_inspect_of_a_checkpoint_without_manifest_exits_2(tmp_path, capsys):
    path = _commit(tmp_path / "step=4.ckpt", 1.0)
    (path / "hpz_manifest.json").unlink()
    with pytest.raises(SystemExit) as exited:
        checkpoint_main(["inspect", str(path)])
    assert exited.value.code == 2  # not 0: nothing vouches for its files
    assert "not verifiable" in capsys.readouterr().out


def _kib(path: Path) -> str:
    total = sum(entry["size"] for entry in read_manifest(path)["files"].values())
    return f"{total / 1024:.1f}"


def test_world_size_change_refused_when_optimizer_state_cannot_be_converted():
    strategy = SimpleNamespace(config={"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})
    saved, current = {**RUN, "world_size": 4}, {**RUN, "world_size": 2}
    with pytest.raises(CheckpointMismatchError, match=r"written on 4 ranks, this run has 2.*NVMe.*Resume on 4 ranks"):
        refuse_mismatches(Path("x.ckpt"), [], saved, current, strategy)
    refuse_mismatches(Path("x.ckpt"), [], saved, current, SimpleNamespace(config={}))


def test_resize_of_an_optimizer_the_conversion_cannot_carry_is_refused_naming_it():
    from lightning_hpz.checkpointing.resume import refuse_unconvertible_optimizer

    with pytest.raises(CheckpointMismatchError, match=r"it holds SGD state, and the conversion carries only Adam"):
        refuse_unconvertible_optimizer(Path("x.ckpt"), {**RUN, "optimizer": "SGD"})
    refuse_unconvertible_optimizer(Path("x.ckpt"), {**RUN, "optimizer": "AdamW"})  # carried exactly
    # AMSGrad's running maximum is not among what the conversion carries
    groups = [{"lr": 0.1, "amsgrad": False}, {"lr": 0.1, "amsgrad": True}]
    with pytest.raises(CheckpointMismatchError, match=r"it holds AdamW\(amsgrad=True\) state"):
        refuse_unconvertible_optimizer(Path("x.ckpt"), {**RUN, "optimizer": "AdamW", "param_groups": groups})


def test_group_settings_are_recorded_and_put_back():
    from lightning_hpz.checkpointing.compatibility import group_settings
    from lightning_hpz.checkpointing.universal import restore_group_settings

    weights, biases = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    groups = [{"params": [weights], "weight_decay": 0.1}, {"params": [biases], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    recorded = group_settings(optimizer)
    assert [group["weight_decay"] for group in recorded] == [0.1, 0.0] and recorded[0]["betas"] == [0.9, 0.95]
    for group in optimizer.param_groups:  # what DeepSpeed's universal load leaves under ZeRO-3
        group["weight_decay"] = 0.1
    restore_group_settings(optimizer, recorded)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    assert optimizer.param_groups[1]["betas"] == (0.9, 0.95)


def test_verification_shares_are_balanced_by_bytes():
    from lightning_hpz.checkpointing.rank_agreement import verification_shares

    # ZeRO-3 on 4 ranks: big optimizer shards, small model-state files (a split by name gave ranks 1 and 3 every
    # optimizer shard)
    sizes = {f"checkpoint/zero_pp_rank_{r}_mp_rank_00_optim_states.pt": 1000 for r in range(4)}
    sizes |= {f"checkpoint/zero_pp_rank_{r}_mp_rank_00_model_states.pt": 10 for r in range(4)} | {"latest": 1}
    shares = verification_shares({"files": {name: {"size": size} for name, size in sizes.items()}}, 4)
    assert sorted(name for share in shares for name in share) == sorted(sizes)  # each file once
    loads = [sum(sizes[name] for name in share) for share in shares]
    assert max(loads) - min(loads) <= 10
