"""A Fabric loop's ``optimizer.step()`` steps DeepSpeed's engine, not only its ZeRO optimizer: the DeepSpeed config's
scheduler advances step by step and the engine counts its steps (2 CPU processes, ZeRO 2 and 3)."""

import pytest
import torch
from conftest import assert_succeeded, run_script
from deepspeed.runtime.lr_schedules import WarmupLR

pytestmark = pytest.mark.multiprocess
STEPS = 6


def warmup_rates(steps: int) -> list[float]:
    """DeepSpeed's own WarmupLR, stepped alone with the script's parameters: the rate after each step."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    scheduler = WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=4, warmup_type="linear")
    rates = []
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    return rates


@pytest.mark.parametrize("stage", [2, 3])
def test_scheduler_and_counters_follow_the_loop(module_tmp, stage):
    run = run_script("fabric_engine_steps.py", {"stage": stage, "steps": STEPS}, module_tmp / f"stage{stage}", ranks=2)
    assert_succeeded(run, ranks=2)
    expected = warmup_rates(STEPS)
    assert expected[-1] == 0.01 and expected[0] < expected[1]  # the reference does warm up
    for rank, record in run.ranks.items():
        assert record["global_steps"] == STEPS, rank
        assert record["rates"] == pytest.approx(expected, rel=1e-12), rank


def test_the_loops_own_scheduler_steps_once_per_step(module_tmp):
    # passed to fabric.setup and stepped by the loop, as under every Fabric strategy: the engine must not step it too
    run = run_script(
        "fabric_engine_steps.py", {"stage": 3, "steps": STEPS, "own_scheduler": True}, module_tmp / "own", ranks=2
    )
    assert_succeeded(run, ranks=2)
    for rank, record in run.ranks.items():
        assert record["global_steps"] == STEPS, rank
        assert record["rates"] == pytest.approx([0.01 * 0.5 ** (step + 1) for step in range(STEPS)]), rank
