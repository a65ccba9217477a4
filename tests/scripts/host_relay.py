"""The host relay of benchmarks/shared_gpu.py against gloo's own results, on CPU processes under torchrun.

On one GPU the benchmark relays the collectives gloo refuses with CUDA tensors through host memory. No GPU here, so
the relay is told to take CPU tensors: each collective runs once natively and once relayed, with ``async_op`` both
ways, and each rank writes whether the outputs match and the inputs were left alone to ``rank<r>.json``.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from shared_gpu import RELAYED, relay_through_host


def calls(rank: int, world: int) -> dict:
    """Each relayed collective as a function of fresh inputs: returns (outputs, inputs) after the call."""

    def gather_into_tensor(async_op):
        output, piece = torch.zeros(world * 3), torch.arange(3.0) + 10 * rank
        _finish(dist.all_gather_into_tensor(output, piece, async_op=async_op))
        return output, piece

    def reduce_scatter(async_op):
        output, full = torch.zeros(3), torch.arange(world * 3.0) * (rank + 1)
        _finish(dist.reduce_scatter_tensor(output=output, input=full, async_op=async_op))
        return output, full

    def all_reduce(async_op):
        tensor = torch.arange(4.0) + rank
        _finish(dist.all_reduce(tensor, async_op=async_op))
        return tensor, torch.tensor([])

    def broadcast(async_op):
        tensor = torch.full((4,), float(rank))
        _finish(dist.broadcast(tensor, src=1, async_op=async_op))
        return tensor, torch.tensor([])

    def all_gather(async_op):
        pieces, piece = [torch.zeros(2) for _ in range(world)], torch.full((2,), rank + 0.5)
        _finish(dist.all_gather(tensor_list=pieces, tensor=piece, async_op=async_op))  # by keyword, as DeepSpeed
        return torch.cat(pieces), piece

    return dict(zip(RELAYED, (gather_into_tensor, reduce_scatter, all_reduce, broadcast, all_gather), strict=True))


def _finish(work) -> None:
    if work is not None:
        assert work.wait() is not False


def run_all(rank: int, world: int) -> dict:
    return {
        f"{name}/async={async_op}": [t.tolist() for t in call(async_op)]
        for name, call in calls(rank, world).items()
        for async_op in (False, True)
    }


def main(options: dict) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    native = run_all(rank, world)
    relay_through_host(list(RELAYED), relays=lambda tensor: True)
    relayed = run_all(rank, world)
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"native": native, "relayed": relayed}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
