"""Exact resume from training data other than one map-style DataLoader read in order (2 CPU ranks, ZeRO 2): an
``IterableDataset``, two training loaders of different lengths, and a shuffled loader with worker processes. A run
checkpointed mid-epoch at step 5 and resumed trains the very batches an uninterrupted 12-step run trains after step 5.
One launch trains every case uninterrupted, a second resumes each (tests/scripts/resume_data_kinds.py)."""

import pytest
from conftest import assert_succeeded, run_script

pytestmark = pytest.mark.multiprocess

KINDS = ["iterable", "two_loaders", "shuffled_workers"]
STEPS, CHECKPOINT_STEP, RANKS = 12, 5, 2  # 8 batches per rank and epoch: step 5 is mid-epoch


@pytest.fixture(scope="module")
def runs(module_tmp):
    cases = [{"kind": kind, "steps": STEPS, "checkpoint_step": CHECKPOINT_STEP} for kind in KINDS]
    full = run_script("resume_data_kinds.py", {"devices": RANKS, "cases": cases}, module_tmp / "full", ranks=RANKS)
    assert_succeeded(full, ranks=RANKS)
    for case in cases:
        (checkpoint,) = (module_tmp / "full" / case["kind"]).glob(f"*-step={CHECKPOINT_STEP}.ckpt")
        case["resume_from"] = str(checkpoint)
    resumed = run_script(
        "resume_data_kinds.py", {"devices": RANKS, "cases": cases}, module_tmp / "resumed", ranks=RANKS
    )
    assert_succeeded(resumed, ranks=RANKS)
    return full, resumed


@pytest.mark.parametrize("kind", KINDS)
def test_resumes_on_the_next_batch(runs, kind):
    full, resumed = runs
    for rank in range(RANKS):
        uninterrupted = full.ranks[rank]["cases"][kind]
        assert len(uninterrupted) == STEPS, rank
        ordered = sorted(uninterrupted, key=lambda key: tuple(int(part) for part in key.split(":")))
        expected = {key: uninterrupted[key] for key in ordered[CHECKPOINT_STEP:]}
        assert resumed.ranks[rank]["cases"][kind] == expected, rank


def test_the_iterable_skip_is_announced(runs):
    _, resumed = runs
    assert "Resuming an iterable training dataset: its first 5 batches of this epoch are read again" in resumed.output
