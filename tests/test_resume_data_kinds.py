"""Exact resume from training data other than one map-style DataLoader read in order (2 CPU ranks, ZeRO 2): an
``IterableDataset`` with and without a position (``Stateful``), two training loaders of different lengths, and a
shuffled loader with worker processes. A run checkpointed mid-epoch at step 5 (or preempted) and resumed trains the
very batches an uninterrupted 12-step run trains after that step; a stream without a position is refused under
``exact_resume`` when the fit starts. One launch trains every case uninterrupted, a second resumes each
(tests/scripts/resume_data_kinds.py)."""

import pytest
from conftest import assert_succeeded, run_script

pytestmark = pytest.mark.multiprocess

KINDS = ["iterable", "stateful", "two_loaders", "shuffled_workers"]
STEPS, CHECKPOINT_STEP, PREEMPT_AFTER, RANKS = 12, 5, 4, 2  # 8 batches per rank and epoch: step 5 is mid-epoch
INEXACT = {"iterable"}  # no position: trained and resumed (the stream read again) with exact_resume=False only


def _ordered(batches: dict) -> list[str]:
    return sorted(batches, key=lambda key: tuple(int(part) for part in key.split(":")))


@pytest.fixture(scope="module")
def runs(module_tmp):
    cases = [
        {"kind": kind, "steps": STEPS, "checkpoint_step": CHECKPOINT_STEP, "exact_resume": kind not in INEXACT}
        for kind in KINDS
    ]
    preempted = {"kind": "stateful", "name": "stateful_preempted", "steps": STEPS, "preempt_step": PREEMPT_AFTER}
    # last in each launch: a refusal aborts the process groups
    refused_at_start = {**cases[0], "name": "refused_at_start", "exact_resume": True}
    full = run_script(
        "resume_data_kinds.py",
        {"devices": RANKS, "cases": [*cases, preempted, refused_at_start]},
        module_tmp / "full",
        ranks=RANKS,
    )
    assert_succeeded(full, ranks=RANKS)
    for case in cases:
        (checkpoint,) = (module_tmp / "full" / case["kind"]).glob(f"*-step={CHECKPOINT_STEP}.ckpt")
        case["resume_from"] = str(checkpoint)
    preempted["resume_from"] = full.ranks[0]["cases"]["stateful_preempted"]["checkpoint"]
    refused = {**cases[0], "name": "refused", "exact_resume": True}
    resumed = run_script(
        "resume_data_kinds.py",
        {"devices": RANKS, "cases": [*cases, preempted, refused]},
        module_tmp / "resumed",
        ranks=RANKS,
    )
    assert_succeeded(resumed, ranks=RANKS)
    return full, resumed


def _continuation(uninterrupted: dict, after_step: int) -> dict:
    return {key: uninterrupted[key] for key in _ordered(uninterrupted)[after_step:]}


@pytest.mark.parametrize("kind", KINDS)
def test_resumes_on_the_next_batch(runs, kind):
    full, resumed = runs
    for rank in range(RANKS):
        uninterrupted = full.ranks[rank]["cases"][kind]["batches"]
        assert len(uninterrupted) == STEPS, rank
        assert resumed.ranks[rank]["cases"][kind]["batches"] == _continuation(uninterrupted, CHECKPOINT_STEP), rank


def test_a_stateful_stream_resumes_each_rank_at_its_own_position(runs):
    full, resumed = runs
    ids = [[full.ranks[rank]["cases"]["stateful"]["batches"][f"0:{CHECKPOINT_STEP}"]["ids"]] for rank in range(RANKS)]
    assert ids == [[[40, 42, 44, 46]], [[41, 43, 45, 47]]]  # the ranks' positions differ: the test can tell them apart
    for rank in range(RANKS):
        (resumed_first, *_) = resumed.ranks[rank]["cases"]["stateful"]["batches"].values()
        assert resumed_first["ids"] == ids[rank][0]


def test_a_preempted_stateful_stream_resumes_on_the_next_batch(runs):
    full, resumed = runs
    for rank in range(RANKS):
        interrupted = full.ranks[rank]["cases"]["stateful_preempted"]
        step = interrupted["preempted_at"]
        assert PREEMPT_AFTER < step < STEPS, rank
        uninterrupted = full.ranks[rank]["cases"]["stateful"]["batches"]
        assert interrupted["batches"] == {key: uninterrupted[key] for key in _ordered(uninterrupted)[:step]}, rank
        assert resumed.ranks[rank]["cases"]["stateful_preempted"]["batches"] == _continuation(uninterrupted, step)


def test_the_iterable_skip_is_announced(runs):
    _, resumed = runs
    assert "Resuming an iterable training dataset: its first 5 batches of this epoch are read again" in resumed.output


def test_exact_resume_refuses_a_stream_without_a_position_when_training_starts_naming_the_fixes(runs):
    # the first run is refused before its first batch, not the resume after a preemption hours later; a resume the
    # same way (a checkpoint written with exact_resume=False), before the checkpoint's batches are skipped
    full, resumed = runs
    for launch, name in ((full, "refused_at_start"), (resumed, "refused")):
        for rank in range(RANKS):
            refusal = launch.ranks[rank]["cases"][name]
            assert refusal["batches"] == {}, (name, rank)
            assert refusal["refused"] == launch.ranks[0]["cases"][name]["refused"], (name, rank)  # every rank alike
            assert "checkpoint (a preemption's, for one) would be refused" in refusal["refused"]
            assert "the training IterableDataset RankStream cannot be positioned" in refusal["refused"]
            assert "state_dict()" in refusal["refused"] and "exact_resume=False" in refusal["refused"]
