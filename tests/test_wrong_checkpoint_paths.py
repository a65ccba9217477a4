"""A path that is not a DeepSpeed checkpoint gets Lightning's own error and guidance, before any of this package's
checkpoint checks run (as with Lightning's DeepSpeedStrategy), from the strategy alone and from every entry point."""

import pytest
from conftest import assert_succeeded, run_script

from lightning_hpz import HpzStrategy

NOT_A_CHECKPOINT = "The provided path is not a valid DeepSpeed checkpoint"
USE_THE_PARENT = "Try to load using this parent directory instead"


def fake_checkpoint(root):
    """The layout Lightning recognises as a DeepSpeed checkpoint: a folder with a ``checkpoint`` subfolder."""
    (root / "ckpt" / "checkpoint").mkdir(parents=True)
    inside = root / "ckpt" / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    inside.write_bytes(b"")
    (root / "empty").mkdir()
    return {"missing": root / "missing", "empty": root / "empty", "subfolder": inside.parent, "file": inside}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", ["missing", "empty", "subfolder", "file"])
def test_strategy_alone_raises_lightnings_error(tmp_path, stage, name):
    path = fake_checkpoint(tmp_path)[name]
    with pytest.raises(FileNotFoundError, match=NOT_A_CHECKPOINT) as raised:
        HpzStrategy(stage=stage).load_checkpoint(path)
    assert (USE_THE_PARENT in str(raised.value)) == (name in ("subfolder", "file"))


@pytest.mark.multiprocess
def test_every_entry_point_gives_the_guidance(module_tmp):
    run = run_script("wrong_checkpoint_paths.py", {"stage": 3}, module_tmp / "paths", ranks=1)
    assert_succeeded(run, ranks=1)
    for rank, record in run.ranks.items():
        parent = record.pop("checkpoint")
        for attempt, raised in record.items():
            assert raised["type"] == "FileNotFoundError", (rank, attempt, raised)
            assert NOT_A_CHECKPOINT in raised["message"], (rank, attempt, raised)
            if attempt.endswith(("subfolder", "file")):
                assert f"{USE_THE_PARENT}: {parent}" in raised["message"], (rank, attempt, raised)
