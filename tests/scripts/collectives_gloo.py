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
    }
    collectives.barrier()
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
