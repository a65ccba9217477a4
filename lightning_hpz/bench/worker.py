"""Entry point of one benchmark rank: ``torchrun ... -m lightning_hpz.bench.worker SPEC.json``.

The spec names the configuration, the workload, the step counts and the output folder; the rank writes
``rank<r>.json`` there (see :mod:`lightning_hpz.bench.recording`).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

from lightning_hpz.bench.configurations import CONFIGURATIONS
from lightning_hpz.bench.workload import Workload


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: torchrun ... -m lightning_hpz.bench.worker SPEC.json")
    spec: dict[str, Any] = json.loads(Path(argv[0]).read_text())
    configuration = CONFIGURATIONS[spec["configuration"]]
    if ("strategy_kwargs" in spec or "runs" in spec) and configuration.driver != "lightning":
        raise SystemExit(
            f"spec {argv[0]}: strategy_kwargs and runs apply to HpzStrategy only, but configuration "
            f"{configuration.name!r} is driven by {configuration.driver!r}; name a 'lightning' configuration."
        )
    workload = Workload(**spec["workload"])
    warnings.filterwarnings("ignore", category=FutureWarning)
    if configuration.driver == "lightning":
        from lightning_hpz.bench import lightning_worker

        lightning_worker.run(spec, configuration, workload)
        return
    from lightning_hpz.bench import manual_workers

    runners = {
        "deepspeed": manual_workers.run_deepspeed,
        "fsdp2": manual_workers.run_fsdp2,
        "ddp": manual_workers.run_ddp,
    }
    runners[configuration.driver](spec, configuration, workload)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
