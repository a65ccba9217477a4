"""prepare-data, then train on the shards under HpzStrategy (real DeepSpeed, 2 CPU ranks), then resume mid-epoch.

One run trains 10 steps and checkpoints after step 4 (mid-epoch) without stopping; a second run resumes from that
checkpoint. The resumed steps must see the same examples and give the same losses, to the last digit.
"""

import pytest
from conftest import assert_succeeded, run_script

from lightning_hpz.cli import main as cli_main

pytestmark = pytest.mark.multiprocess
STEPS, CHECKPOINT_AT = 10, 4


@pytest.fixture(scope="module")
def runs(module_tmp):
    source = module_tmp / "corpus.txt"
    words = ["the", "river", "runs", "over", "stone", "and", "light", "falls", "on", "the", "quick", "brown", "fox"]
    source.write_text("\n\n".join(" ".join(words[(i + j) % len(words)] for j in range(i % 40 + 5)) for i in range(400)))
    prepared = module_tmp / "prepared"
    cli_main(["prepare-data", "--source", str(source), "--tokenizer", "byte", "--out", str(prepared), "--quiet"])
    data = {"source": str(prepared), "sequence_length": 64, "batch_size": 4}
    full = run_script(
        "prepared_data_training.py",
        {"data": data, "steps": STEPS, "checkpoint_at": CHECKPOINT_AT},
        module_tmp / "full",
        ranks=2,
    )
    assert_succeeded(full, ranks=2)
    checkpoint = module_tmp / "full" / "mid_epoch.ckpt"
    resumed = run_script(
        "prepared_data_training.py",
        {"data": data, "steps": STEPS, "resume_from": str(checkpoint)},
        module_tmp / "resumed",
        ranks=2,
    )
    assert_succeeded(resumed, ranks=2)
    return full, resumed


def test_checkpoint_is_mid_epoch(runs):
    full, _ = runs
    assert full.ranks[0]["batches_per_epoch"] - 1 > CHECKPOINT_AT


@pytest.mark.parametrize("rank", [0, 1])
def test_resume_continues_with_the_same_examples_and_losses(runs, rank):
    full, resumed = runs
    after = [str(step) for step in range(CHECKPOINT_AT, STEPS)]
    assert sorted(resumed.ranks[rank]["losses"], key=int) == after  # nothing before the checkpoint is trained again
    assert [resumed.ranks[rank]["samples"][s] for s in after] == [full.ranks[rank]["samples"][s] for s in after]
    assert [resumed.ranks[rank]["losses"][s] for s in after] == [full.ranks[rank]["losses"][s] for s in after]


def test_ranks_train_on_different_examples(runs):
    full, _ = runs
    for step in map(str, range(STEPS)):
        assert not set(full.ranks[0]["samples"][step]) & set(full.ranks[1]["samples"][step])
