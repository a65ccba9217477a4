"""The universal-format conversion shared by the ranks of a job (issue 40); run under torchrun over gloo.

``options``: ``checkpoint`` to convert, ``cache`` the folder its copy goes into. Each rank writes ``rank<r>.json``:
the ZeRO shards (data-parallel indices) it extracted, the parameters it merged, the seconds the conversion took, and
the copy's path. Seen through the functions DeepSpeed's item functions call, which stay in this process: the item
functions themselves travel by name to the other ranks and cannot be wrapped.

With ``options["nodes"]`` it runs as one rank per node instead (``python shared_conversion.py`` once per node, with
``NODE_RANK``), set up by ``HpzFabricStrategy`` with ``options["peer_timeout"]`` and ``["heartbeat_interval"]``,
whose peer watchdog runs beside the conversion; rank ``options["kill_rank"]`` SIGKILLs itself once it has written
its first item.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
from deepspeed.checkpoint import ds_to_universal

from lightning_hpz.checkpointing import universal, universal_location
from lightning_hpz.checkpointing.fault_points import CONVERSION_ITEM_WRITTEN, FAULT_POINT_ENV_VAR
from lightning_hpz.partitioning import resumable_conversion

SEEN = {"extracted": set(), "merged": set()}


def seen(original, kind, name_of):
    def call(*args, **kwargs):
        SEEN[kind].add(name_of(*args))
        return original(*args, **kwargs)

    return call


def init(options: dict) -> None:
    """The process group: torchrun's, or one rank per node with the strategy's peer watchdog."""
    if "nodes" not in options:
        dist.init_process_group("gloo")
        return
    import lightning as L

    from lightning_hpz import HpzFabricStrategy

    strategy = HpzFabricStrategy(
        stage=3, peer_timeout=options["peer_timeout"], heartbeat_interval=options["heartbeat_interval"]
    )
    L.Fabric(strategy=strategy, accelerator="cpu", devices=1, num_nodes=options["nodes"]).launch()
    if dist.get_rank() == options.get("kill_rank"):
        os.environ[FAULT_POINT_ENV_VAR] = CONVERSION_ITEM_WRITTEN


def main(options: dict) -> None:
    init(options)
    assert not resumable_conversion.UNSUPPORTED_REASON  # checked at import, against DeepSpeed's unwrapped functions
    os.environ[universal_location.CACHE_ENV_VAR] = options["cache"]
    # dump_param_fragment(dir, tp_index, dp_index, ...); _merge_zero_shards(param_base_path, state, ...)
    extracted = seen(ds_to_universal.dump_param_fragment, "extracted", lambda folder, tp, dp, *rest: dp)
    merged = seen(ds_to_universal._merge_zero_shards, "merged", lambda path, *rest: os.path.basename(path))
    ds_to_universal.dump_param_fragment, ds_to_universal._merge_zero_shards = extracted, merged
    started = time.monotonic()
    copy = universal.universal_copy(Path(options["checkpoint"]))
    record = {"copy": str(copy), "seconds": time.monotonic() - started, **{k: sorted(v) for k, v in SEEN.items()}}
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
