"""A fit under HpzStrategy, one that raises, then plain DeepSpeed in the same process, as a notebook would do it.

Each phase records whether lightning_hpz's wrappers were still in place and what DeepSpeed's own code did. Run
with one device (no launcher): ``python plain_deepspeed_after_fit.py '<json options>'``; writes ``rank0.json``.
"""

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader
from toy_training import RegressionData, ToyRegressor

import lightning_hpz


class AsyncLikeAccelerator:
    """Answers partition_parameters like DeepSpeed's CUDA accelerator and counts host synchronizes."""

    def __init__(self) -> None:
        self.synchronized = 0
        self.events = 0

    def resolves_data_dependency(self) -> bool:
        return False

    def current_stream(self):
        return SimpleNamespace(synchronize=self._synchronize, wait_event=lambda event: None)

    def _synchronize(self) -> None:
        self.synchronized += 1

    def Event(self):
        self.events += 1
        return SimpleNamespace(record=lambda stream: None)

    def pin_memory(self, tensor):
        return tensor


def fit(mode: str, fail: bool) -> None:
    strategy = lightning_hpz.HpzStrategy(stage=3, hpz_sync=mode)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = ToyRegressor(fail_on_rank=0 if fail else -1)
    trainer.fit(model, DataLoader(RegressionData(), batch_size=8))


def wrappers_in_place() -> dict:
    from deepspeed.runtime.zero import partition_parameters
    from deepspeed.utils import groups

    functions = [
        partition_parameters.Init._partition_param_sec,
        partition_parameters.Init._convert_to_deepspeed_param,
        groups._create_zero_param_parallel_group,
    ]
    return {"owners": sorted({f.__module__.split(".")[0] for f in functions})}


def stock_copy_synchronize() -> dict:
    """DeepSpeed's own ``_partition_param_sec`` on an asynchronous accelerator synchronizes once (PR #5216)."""
    from deepspeed.runtime.zero import partition_parameters
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    accelerator = AsyncLikeAccelerator()
    shipped = partition_parameters.get_accelerator
    partition_parameters.get_accelerator = lambda: accelerator
    try:
        param = nn.Parameter(torch.arange(8.0))
        param.ds_status, param.ds_secondary_tensor, param.ds_numel, param.ds_id = ZeroParamStatus.AVAILABLE, None, 8, 0
        owner = SimpleNamespace(
            _aligned_size=lambda p: 8, dp_world_size=2, num_ranks_in_param_group=2, rank_in_group=0,
            remote_device="cpu", pin_memory=False, quantized_nontrainable_weights=False,
        )  # fmt: skip
        partition_parameters.Init._partition_param_sec(owner, param)
    finally:
        partition_parameters.get_accelerator = shipped
    return {"synchronized": accelerator.synchronized, "events": accelerator.events}


def plain_deepspeed_training() -> dict:
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    losses = []
    for _ in range(3):
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # a gather wrapped by lightning_hpz is a function of its modules; DeepSpeed's own is DeepSpeed's
    ordered = sum(p.all_gather_coalesced.__module__.startswith("lightning_hpz") for p in model.parameters())
    return {"losses_finite": all(math.isfinite(v) for v in losses), "ordered_gathers": ordered}


def main(options: dict) -> None:
    record = {}
    fit("event", fail=False)
    record["after_fit"] = {**wrappers_in_place(), **stock_copy_synchronize()}
    try:
        fit("none", fail=True)
    except RuntimeError as err:
        record["raised"] = str(err)
    record["after_exception"] = {**wrappers_in_place(), **stock_copy_synchronize()}
    record["plain"] = plain_deepspeed_training()
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "rank0.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
