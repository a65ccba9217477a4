"""Peak FLOP/s for the device names real GPUs report: Lightning's table first, this package's for the chips it
lacks or misreads, and no error (one warning, no MFU) for a chip nobody knows."""

import warnings
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.utilities.throughput import _CUDA_FLOPS
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from lightning_hpz.callbacks import TokenThroughputMonitor
from lightning_hpz.callbacks import peak_flops as peak

GPU = torch.device("cuda", 0)
# (name as torch.cuda.get_device_name reports it, where its bf16 peak must come from)
DEVICE_NAMES = [
    ("NVIDIA A100-SXM4-80GB", ("lightning", "a100")),
    ("NVIDIA H100 80GB HBM3", ("lightning", "h100 sxm")),
    ("NVIDIA H100 PCIe", ("lightning", "h100 pcie")),
    ("NVIDIA H100 NVL", ("lightning", "h100 nvl")),
    ("NVIDIA GeForce RTX 4090", ("lightning", "rtx 4090")),
    ("NVIDIA H200", ("table", "h200 sxm")),
    ("NVIDIA H200 NVL", ("table", "h200 nvl")),
    ("NVIDIA L40S", ("table", "l40s")),
    ("AMD Instinct MI300X", ("table", "mi300x")),
]
UNKNOWN = "Contoso Accelerator X9"


@pytest.fixture
def device_name(monkeypatch):
    """Make torch report a given GPU name (this machine has no GPU); each test starts with nothing reported."""
    monkeypatch.setattr(peak, "_reported_unknown", set(), raising=False)

    def use(name: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return use


@pytest.mark.parametrize(("name", "source"), DEVICE_NAMES, ids=[name for name, _ in DEVICE_NAMES])
def test_bf16_peak_of_real_device_names(device_name, name, source):
    device_name(name)
    where, chip = source
    expected = _CUDA_FLOPS[chip][torch.bfloat16] if where == "lightning" else peak.PEAK_FLOPS[chip]["bfloat16"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known chip is answered without any warning
        assert peak.peak_flops_for(GPU, torch.bfloat16) == pytest.approx(expected)


def test_unknown_chip_is_reported_once_and_gets_no_mfu(device_name):
    device_name(UNKNOWN)
    with pytest.warns(UserWarning, match=rf"No peak FLOP/s known for '{UNKNOWN}'") as caught:
        assert peak.peak_flops_for(GPU, torch.bfloat16) is None
        assert peak.peak_flops_for(GPU, torch.bfloat16) is None
    assert len([w for w in caught if UNKNOWN in str(w.message)]) == 1


@pytest.mark.parametrize(
    ("name", "precision"),
    [("NVIDIA H100 NVL", MixedPrecision("bf16-mixed", "cuda")), (UNKNOWN, Precision())],
)
def test_monitor_setup_on_any_gpu(device_name, name, precision):
    device_name(name)
    trainer = SimpleNamespace(precision_plugin=precision, strategy=SimpleNamespace(root_device=GPU), world_size=8)
    monitor = TokenThroughputMonitor(flops_per_token=6.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitor.setup(trainer, SimpleNamespace(), stage="fit")
    assert monitor._throughput is not None
    assert (monitor.peak_flops is None) == (name == UNKNOWN)
