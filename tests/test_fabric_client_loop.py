"""A Fabric loop written for FSDP-style strategies runs unchanged on ``HpzFabricStrategy`` and trains as DDP does.

The loop (tests/scripts/fabric_client_loop.py) sets up the model, then the optimizer; accumulates two micro-batches
under ``fabric.no_backward_sync``; clips by norm with ``fabric.clip_gradients``; steps. DDP runs the same loop on one
micro-batch per step: accumulation must equal training on the larger batch, and the clip norm must equal DDP's
``clip_grad_norm_`` up to reduction order. Launches of 2 CPU processes (4 for hpZ 2), real DeepSpeed over gloo.
"""

import math

import pytest
from conftest import REGATHER_EVERY_MODULE, assert_succeeded, run_script

pytestmark = pytest.mark.multiprocess

STEPS = 4
MAX_NORM = 0.05  # below every step's norm: each step is clipped
# fp32 sums in another order (DeepSpeed's shards and buckets against DDP's buckets), on a 1.6k-parameter model
TOLERANCE = 1e-5

ZERO_RUNS = {
    "zero1": ({"strategy": "hpz", "stage": 1}, 2),
    "zero2": ({"strategy": "hpz", "stage": 2}, 2),
    "zero3": ({"strategy": "hpz", "stage": 3, "config": REGATHER_EVERY_MODULE}, 2),
    "zero3_hpz2": ({"strategy": "hpz", "stage": 3, "hpz": 2, "config": REGATHER_EVERY_MODULE}, 4),
}


def _launch(module_tmp, name: str, options: dict, ranks: int):
    options = {"steps": STEPS, "max_norm": MAX_NORM, "devices": ranks, **options}
    return run_script("fabric_client_loop.py", options, module_tmp / name, ranks=ranks)


@pytest.fixture(scope="module")
def ddp(module_tmp):
    run = _launch(module_tmp, "ddp", {"strategy": "ddp", "micro_batches": 1}, 2)
    assert_succeeded(run, ranks=2)
    record = run.ranks[0]
    assert all(norm > MAX_NORM for norm in record["norms"])  # the clip acts at every step
    assert all(math.isfinite(loss) for loss in record["losses"])
    return record


@pytest.mark.parametrize("name", sorted(ZERO_RUNS))
def test_accumulating_clipping_loop_trains_as_ddp(module_tmp, ddp, name):
    options, ranks = ZERO_RUNS[name]
    probe = name == "zero3_hpz2"  # also sets up a reference model between the model and its optimizer
    options = {**options, "micro_batches": 2, "probe_refusals": probe, "reference_model": probe}
    run = _launch(module_tmp, name, options, ranks)
    assert_succeeded(run, ranks=ranks)
    for rank, record in run.ranks.items():
        assert record["norms"] == pytest.approx(ddp["norms"], rel=TOLERANCE), rank
        assert record["losses"] == pytest.approx(ddp["losses"], rel=TOLERANCE), rank
        assert record["global_steps"] == STEPS, rank  # optimizer.step() stepped DeepSpeed's engine
    if name == "zero3_hpz2":
        refusals = run.ranks[0]["refusals"]
        assert refusals["second_setup_optimizers"].startswith("RuntimeError: `fabric.setup_optimizers`")
        assert "fabric.setup(model, optimizer)" in refusals["second_setup_optimizers"]
        assert refusals["clip_val"].startswith("NotImplementedError") and "max_norm" in refusals["clip_val"]
        assert refusals["norm_type_inf"].startswith("ValueError: norm_type=inf")
        assert refusals["closure"].startswith("ValueError: `optimizer.step(closure)` cannot run under DeepSpeed")
        # the model set up alone ran (an inference engine was built at its first forward), so no optimizer can join
        assert refusals["setup_optimizers_after_inference"].startswith("RuntimeError: `fabric.setup_optimizers`")


def test_accumulation_under_deepspeeds_own_counting_is_refused(module_tmp):
    # DeepSpeed's managed mode with its count at 1 keeps only the last micro-batch's gradient under ZeRO 1 and 2
    options = {"strategy": "hpz", "stage": 2, "micro_batches": 2, "config": {"managed_gradient_accumulation": True}}
    run = _launch(module_tmp, "managed", options, 2)
    assert run.returncode != 0
    assert "`fabric.no_backward_sync` accumulates over several backwards" in run.output
    assert "managed_gradient_accumulation: true" in run.output
