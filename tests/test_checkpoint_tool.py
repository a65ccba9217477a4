"""`lightning-hpz consolidate` refuses paths that are not sharded checkpoints, naming the fix."""

import pytest

from lightning_hpz.checkpointing.consolidate import CheckpointNotFoundError, consolidate_main


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"No checkpoint at .*nothing.ckpt.*ModelCheckpoint"):
        consolidate_main([str(tmp_path / "nothing.ckpt"), str(tmp_path / "out.pt")])


def test_single_file_is_not_a_sharded_checkpoint(tmp_path):
    single = tmp_path / "model.ckpt"
    single.write_bytes(b"\0")
    with pytest.raises(CheckpointNotFoundError, match=r"is not a sharded DeepSpeed checkpoint.*'latest'"):
        consolidate_main([str(single), str(tmp_path / "out.pt")])
