"""Each file DeepSpeed reads while loading a checkpoint is checked against the manifest from the bytes it loads: a
file changed after the verification before the load is refused, not loaded unverified."""

import types
from functools import partial

import pytest
import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from lightning_hpz.checkpointing.errors import CheckpointIntegrityError
from lightning_hpz.checkpointing.manifest import file_digest
from lightning_hpz.checkpointing.resume import _check_loaded_bytes
from lightning_hpz.partitioning.verified_reads import VerifiedReads, verifying_reads

NAME = "checkpoint/mp_rank_00_model_states.pt"


@pytest.fixture
def checkpoint(tmp_path):
    folder = tmp_path / "step=4.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    torch.save({"weight": torch.arange(6.0)}, folder / "checkpoint" / "mp_rank_00_model_states.pt")
    recorded = {"files": {NAME: file_digest(folder / NAME)}}
    return folder, recorded


def _reads(folder, recorded) -> VerifiedReads:
    """The wrapper as a resume builds it: the manifest's sizes, its digests checked by resume.py."""
    entry = recorded["files"].get
    size_of = lambda name: (entry(name) or {}).get("size")  # noqa: E731
    return VerifiedReads(TorchCheckpointEngine(), folder, size_of, partial(_check_loaded_bytes, folder, entry))


def _engine() -> types.SimpleNamespace:
    return types.SimpleNamespace(checkpoint_engine=TorchCheckpointEngine())


def test_a_listed_file_loads_from_the_bytes_that_were_hashed(checkpoint):
    folder, recorded = checkpoint
    reads = _reads(folder, recorded)
    loaded = reads.load(str(folder / "checkpoint" / "mp_rank_00_model_states.pt"), map_location="cpu")
    assert torch.equal(loaded["weight"], torch.arange(6.0))
    assert reads.verified == ["checkpoint/mp_rank_00_model_states.pt"]


def test_a_file_changed_after_verification_is_refused_naming_it(checkpoint):
    folder, recorded = checkpoint
    torch.save({"weight": torch.ones(6)}, folder / "checkpoint" / "mp_rank_00_model_states.pt")  # same size, new bytes
    reads = _reads(folder, recorded)
    with pytest.raises(CheckpointIntegrityError, match="changed between its verification and its load") as refused:
        reads.load(str(folder / "checkpoint" / "mp_rank_00_model_states.pt"), map_location="cpu")
    assert "mp_rank_00_model_states.pt: expected" in str(refused.value)


def test_files_outside_the_manifest_pass_through(checkpoint, tmp_path):
    folder, recorded = checkpoint
    torch.save({"step": 4}, tmp_path / "elsewhere.pt")
    reads = _reads(folder, recorded)
    assert reads.load(str(tmp_path / "elsewhere.pt"))["step"] == 4
    assert reads.verified == []


def test_the_engine_reads_verified_only_during_the_load(checkpoint):
    folder, _ = checkpoint
    engine = _engine()
    original = engine.checkpoint_engine
    with verifying_reads(engine, folder, {NAME: 1}.get, lambda name, data: None):
        assert isinstance(engine.checkpoint_engine, VerifiedReads)
        assert engine.checkpoint_engine.inner is original
    assert engine.checkpoint_engine is original


@pytest.mark.parametrize("case", ["no manifest", "another checkpoint engine"])
def test_nothing_is_wrapped_without_a_manifest_or_for_another_engine(checkpoint, case):
    folder, _ = checkpoint
    engine = _engine() if case == "no manifest" else types.SimpleNamespace(checkpoint_engine=object())
    original = engine.checkpoint_engine
    with verifying_reads(engine, folder, None if case == "no manifest" else {NAME: 1}.get, lambda name, data: None):
        assert engine.checkpoint_engine is original
