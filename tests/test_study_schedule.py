"""The learning-rate schedule of a study cell: linear warm-up, then cosine decay to a share of the peak at the last
step, so that a short cell's losses fall (one process, no training)."""

import itertools
from types import SimpleNamespace

import pytest

from lightning_hpz.study.study_model import StudyModel

TINY_LLAMA = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2}  # fmt: skip


def _learning_rates(steps: int, **schedule) -> list[float]:
    model = StudyModel("tiny", "llama2", TINY_LLAMA, learning_rate=1e-3, **schedule)
    model._trainer = SimpleNamespace(max_steps=steps, strategy=SimpleNamespace(config={}))  # what it reads
    model.configure_model()
    configured = model.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert configured["lr_scheduler"]["interval"] == "step"
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_warm_up_then_cosine_decay_to_the_final_share():
    rates = _learning_rates(12, lr_warmup_steps=4, lr_min_ratio=0.1)
    assert rates[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])  # linear warm-up to the peak
    decay = rates[4:]
    assert all(a > b for a, b in itertools.pairwise(decay))  # falls at every step
    assert 1e-4 < decay[-1] < 2e-4  # close to 10% of the peak at the last step


def test_defaults_keep_the_rate_constant():
    assert _learning_rates(6) == pytest.approx([1e-3] * 6)
