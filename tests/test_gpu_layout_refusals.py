"""Settings that only go wrong on GPUs, refused while the strategy is built, tested without a GPU: the strategy is
handed CUDA devices as the Trainer would hand them, and the visible GPU count is what the cluster node would show."""

from unittest import mock

import pytest
import torch

from lightning_hpz import HpzConfigurationError, HpzStrategy


def strategy_on_gpus(devices_per_node: int, nodes: int, **kwargs) -> HpzStrategy:
    strategy = HpzStrategy(**kwargs)
    strategy.parallel_devices = [torch.device("cuda", index) for index in range(devices_per_node)]
    strategy.num_nodes = nodes
    return strategy


@pytest.mark.parametrize("nodes", [2, 3, 4])
def test_qgz_on_part_of_a_node_is_refused_with_the_fix(nodes):
    # 4 of 8 GPUs per node: DeepSpeed would build qgZ groups of 8 ranks, spanning nodes (2, 4) or asserting (3)
    strategy = strategy_on_gpus(4, nodes, quantized_gradients=True, hpz_partition_size=4)
    with mock.patch("torch.cuda.device_count", return_value=8), pytest.raises(HpzConfigurationError) as refusal:
        strategy._resolve_layout()
    message = str(refusal.value)
    assert "qgZ" in message and "devices=8" in message and "CUDA_VISIBLE_DEVICES" in message


def test_qgz_on_one_visible_gpu_per_process_is_refused():
    # SLURM's per-task CUDA_VISIBLE_DEVICES: each process sees one GPU, so a qgZ "node" would be one rank
    strategy = strategy_on_gpus(8, 2, quantized_gradients=True, hpz_partition_size=8)
    with mock.patch("torch.cuda.device_count", return_value=1), pytest.raises(HpzConfigurationError, match="qgZ"):
        strategy._resolve_layout()


def test_qgz_on_whole_nodes_is_accepted():
    strategy = strategy_on_gpus(8, 2, quantized_gradients=True, hpz_partition_size=8)
    with mock.patch("torch.cuda.device_count", return_value=8):
        strategy._resolve_layout()
    assert strategy.config["zero_optimization"]["zero_quantized_gradients"] is True


def test_hpz_under_deepcompile_is_refused_naming_both_fixes():
    strategy = strategy_on_gpus(8, 2, hpz_partition_size=8, config={"compile": {"deepcompile": True}})
    with pytest.raises(HpzConfigurationError, match="DeepCompile") as refusal:
        strategy._resolve_layout()
    assert "hpz_partition_size=1" in str(refusal.value)


def test_hpz_with_nvme_parameter_offload_is_refused():
    nvme = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}}
    strategy = strategy_on_gpus(8, 2, hpz_partition_size=8, config=nvme)
    with pytest.raises(HpzConfigurationError, match="NVMe"):
        strategy._resolve_layout()


def test_deepcompile_and_nvme_without_hpz_are_left_alone():
    nvme = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}}
    for config in ({"compile": {"deepcompile": True}}, nvme):
        strategy = strategy_on_gpus(8, 2, hpz_partition_size=1, config=config)
        strategy._resolve_layout()
        assert strategy.hpz_partition_size == 1
