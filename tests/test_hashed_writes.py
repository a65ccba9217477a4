"""DeepSpeed's shards are checksummed while they are written: the manifest's digest of each is the digest of the file
as it lies on disk, the commit reads back only what was written otherwise (``latest``), and the files load.

DeepSpeed's own ``TorchCheckpointEngine`` writes, in both of torch's formats (DeepSpeed's engine picks the legacy one
without a checkpoint config), inside a real commit.
"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from lightning_hpz.checkpointing import commit, manifest
from lightning_hpz.checkpointing.manifest import file_digest, read_manifest, verify_files
from lightning_hpz.partitioning import hashing_writes

SHARD = "checkpoint/mp_rank_00_model_states.pt"


@pytest.mark.parametrize("zip_format", [True, False])
def test_shards_are_hashed_as_written_and_only_latest_is_read_back(tmp_path, monkeypatch, zip_format):
    inner = TorchCheckpointEngine()
    inner.zipfile_serialization = zip_format
    engine = SimpleNamespace(checkpoint_engine=inner)
    read_back = []
    reread = manifest.digests
    monkeypatch.setattr(manifest, "digests", lambda root, names: read_back.extend(names) or reread(root, names))
    state = {"w": torch.randn(3, 1000), "step": 7, "nested": {"b": torch.arange(5)}}
    final = tmp_path / "last.ckpt"
    with commit.committed_save(final, {"global_step": 7}, engine) as staging:
        (staging / "checkpoint").mkdir(parents=True)
        engine.checkpoint_engine.save(state, str(staging / SHARD))
        (staging / "latest").write_text("checkpoint")  # DeepSpeed writes it with open(), not through the engine
    assert engine.checkpoint_engine is inner  # the wrapper is gone after the save
    assert read_back == ["latest"]
    recorded = read_manifest(final)
    assert recorded["files"][SHARD] == file_digest(final / SHARD)  # what was hashed is what lies on disk
    assert verify_files(final, recorded, list(recorded["files"])) == []
    loaded = torch.load(final / SHARD, weights_only=False)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["nested"]["b"], state["nested"]["b"])


def test_a_file_outside_the_checkpoint_is_written_by_the_engine_itself(tmp_path):
    engine = SimpleNamespace(checkpoint_engine=TorchCheckpointEngine())
    with hashing_writes(engine, tmp_path / "staging") as writes:
        engine.checkpoint_engine.save({"x": torch.ones(2)}, str(tmp_path / "elsewhere.pt"))
    assert writes.digests == {} and torch.equal(torch.load(tmp_path / "elsewhere.pt")["x"], torch.ones(2))


def test_another_checkpoint_engine_is_left_alone(tmp_path):
    other = SimpleNamespace(save=lambda state, path: None)
    engine = SimpleNamespace(checkpoint_engine=other)
    with hashing_writes(engine, tmp_path) as writes:
        assert writes is None and engine.checkpoint_engine is other


class _EngineWithSave:
    """DeepSpeed's save_checkpoint reduced to its I/O: shards through the checkpoint engine, `latest` by rank 0."""

    def __init__(self) -> None:
        self.checkpoint_engine = TorchCheckpointEngine()
        self.asked_for_latest = []

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True):  # noqa: B006 - DeepSpeed's
        self.asked_for_latest.append(save_latest)
        self.checkpoint_engine.save({"w": torch.ones(8)}, str(Path(save_dir) / tag / "mp_rank_00_model_states.pt"))
        if save_latest:
            (Path(save_dir) / "latest").write_text(tag)


def test_latest_is_written_by_the_commit_not_by_deepspeed(tmp_path):
    # rank 0 writes `latest` alone, just before DeepSpeed's barrier: failing there, it would hang the other ranks
    engine = _EngineWithSave()
    final = tmp_path / "last.ckpt"
    with commit.committed_save(final, {"global_step": 1}, engine) as staging:
        (staging / "checkpoint").mkdir(parents=True)
        engine.save_checkpoint(staging, tag="checkpoint", client_state={})
        assert not (staging / "latest").exists()
    assert engine.asked_for_latest == [False] and "save_checkpoint" not in vars(engine)  # the method is back
    assert (final / "latest").read_text() == "checkpoint"
    recorded = read_manifest(final)
    assert sorted(recorded["files"]) == ["checkpoint/mp_rank_00_model_states.pt", "latest"]
    assert verify_files(final, recorded, list(recorded["files"])) == []
