"""Every helper of lightning_hpz.collectives on a real gloo process group; run under torchrun (one process per rank).

Each rank writes ``rank<r>.json`` into ``out`` with what it received.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_hpz import collectives


def main(options: dict) -> None:
    dist.init_process_group("gloo")
    rank = collectives.rank()
    mine = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    subgroup = dist.new_group(list(range(collectives.world_size())))
    record = {
        "rank": rank,
        "world_size": collectives.world_size(),
        "device": str(collectives.collective_device()),
        "sum": collectives.all_reduce(mine).tolist(),
        "max": collectives.all_reduce(mine, op="max").tolist(),
        "min_in_subgroup": collectives.all_reduce(mine, op="min", group=subgroup).tolist(),
        "input_unchanged": mine.tolist(),
        "values": collectives.all_reduce_values([float(rank), 1.0]),
        "gathered": [t.tolist() for t in collectives.all_gather_tensor(torch.full((2,), rank, dtype=torch.int64))],
        "objects": collectives.all_gather_object({"rank": rank}),
        "broadcast": collectives.broadcast_object(f"from rank {rank}", src=1),
        "scattered": collectives.scatter_object([f"for rank {r}" for r in range(2)] if rank == 0 else None),
    }
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    record["cut_short_manifest"] = _cut_short_manifest_refused(out / "cut_short.ckpt")
    collectives.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def _cut_short_manifest_refused(checkpoint: Path) -> dict:
    """Rank 0 alone reads the manifest, cut short; what each rank raises."""
    from lightning_hpz.checkpointing import resume
    from lightning_hpz.checkpointing.rank_agreement import dealt_by_rank_zero

    if collectives.rank() == 0:
        (checkpoint / "checkpoint").mkdir(parents=True, exist_ok=True)
        (checkpoint / "hpz_manifest.json").write_text('{"format": 1, "files": {"lat')
    try:
        dealt_by_rank_zero(lambda: resume._manifest_dealt(checkpoint, {"world_size": 2, "stage": 3}, False))
    except Exception as error:
        return {"type": type(error).__name__, "message": str(error)}
    return {}


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
