"""FSDP2 HSDP and DeepSpeed MiCS trained by the benchmark's own workers on 2 simulated nodes x 2 CPU ranks.

Each configuration starts as the testbed starts it (one torchrun agent per node, ``--nnodes=2``, the bench worker on
each rank), here over loopback without namespaces: the losses are checked, not the bytes (the netns test does those).
Every step's rank-mean loss must be finite and agree with plain ZeRO-3's (``HpzStrategy``, same model, data, seed)
within the bench's own tolerance for another reduction order: 2e-3 of the largest loss
(:data:`lightning_hpz.bench.results.CLOSE_TOLERANCE`). MiCS runs only where it can: DeepSpeed 0.19.8 removed it,
and 0.18.9's needs coalesced collectives, which torch's gloo lacks (``configurations.unavailable_reason``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from conftest import free_port

from lightning_hpz.bench import configurations, results
from lightning_hpz.bench.launch import Launch, run_configuration
from lightning_hpz.bench.workload import QUICK_WORKLOAD

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
DEVICES_PER_NODE = 2
STEPS, WARMUP = 5, 1


@dataclass
class LoopbackNodes:
    """The testbed's interface to :mod:`lightning_hpz.bench.launch` with both "nodes" in this network namespace."""

    def exec_prefix(self, node: int) -> list[str]:
        return []

    def address(self, node: int) -> str:
        return "127.0.0.1"

    def interface(self, node: int) -> str:
        return "lo"


def _train(name: str, out) -> list[float]:
    spec = {
        "configuration": name,
        "workload": QUICK_WORKLOAD.to_dict(),
        "steps": STEPS,
        "warmup": WARMUP,
        "devices_per_node": DEVICES_PER_NODE,
    }
    launch = Launch(LoopbackNodes(), DEVICES_PER_NODE, free_port(), timeout_s=420)
    records = run_configuration(launch, spec, out / name)
    return results.summarize_run(name, [records], tokens_per_step=1)["loss_trajectory"]


@pytest.fixture(scope="module")
def zero3_losses(tmp_path_factory) -> list[float]:
    return _train("zero3", tmp_path_factory.mktemp("zero3"))


@pytest.mark.parametrize("name", ["fsdp2-hsdp", "deepspeed-mics"])
def test_replica_per_node_trains_like_zero3(name, zero3_losses, tmp_path):
    reason = configurations.CONFIGURATIONS[name].unavailable_reason()
    if reason:
        pytest.skip(reason)
    losses = _train(name, tmp_path)
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses), losses
    agreement = results.loss_agreement({"zero3": {"loss_trajectory": zero3_losses}, name: {"loss_trajectory": losses}})
    check = agreement["configurations"][name]
    assert check["expected"] == "close" and check["agrees"], (check, losses, zero3_losses)
