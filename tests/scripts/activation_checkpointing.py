"""What DeepSpeed's activation checkpointing is configured with after the strategy forwards its settings.

Run as ``python activation_checkpointing.py '<json options>'`` (one process; DeepSpeed's ``checkpointing.configure``
needs its communication backend). Writes ``rank0.json`` with DeepSpeed's resulting module-level settings.
"""

import json
import sys
from pathlib import Path

import deepspeed
from deepspeed.runtime.activation_checkpointing import checkpointing

import lightning_hpz


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    deepspeed.init_distributed(
        "gloo", auto_mpi_discovery=False, init_method=f"file://{out / 'store'}", rank=0, world_size=1
    )
    strategy = lightning_hpz.HpzStrategy(**options["strategy"])
    strategy._set_deepspeed_activation_checkpointing()  # what Lightning calls once the engine exists
    record = {
        "contiguous": checkpointing.CONTIGUOUS_CHECKPOINTING,
        "partition_activations": checkpointing.PARTITION_ACTIVATIONS,
        "layers": checkpointing.num_layers,
        "synchronize": checkpointing.SYNCHRONIZE,
        "cpu_checkpointing": checkpointing.CPU_CHECKPOINT,
    }
    (out / "rank0.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
