"""A checkpoint save or commit that fails on one rank (a full disk, a lost mount) is raised on every rank at once,
naming the rank and the error; no rank is left waiting in a collective until the process group times out, and the
checkpoint committed before stays in place.

Two real processes over gloo (a 60 s process-group timeout, so a rank left waiting would show as a timeout, not a
refusal) commit ``last.ckpt`` at step 1, then fail the commit of step 2 at one step of one rank.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from warm_launcher import free_port

from lightning_hpz.checkpointing.manifest import read_manifest, verify_files

pytestmark = pytest.mark.multiprocess

COMMIT_THEN_FAIL = textwrap.dedent(
    """
    import datetime, json, os, sys, time
    from pathlib import Path
    from types import SimpleNamespace
    import torch, torch.distributed as dist
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from lightning_hpz import durability
    from lightning_hpz.checkpointing import commit, manifest
    from lightning_hpz.checkpointing.errors import CheckpointStorageError
    from lightning_hpz.partitioning import hashed_writes

    final, failing_rank, step_name = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()

    def save(step):
        run = {"stage": 3, "world_size": 2, "hpz_partition_size": 1, "global_step": step}
        engine = SimpleNamespace(checkpoint_engine=TorchCheckpointEngine())  # as DeepSpeed's save writes
        with commit.committed_save(final, run, engine) as staging:
            (staging / "checkpoint").mkdir(parents=True, exist_ok=True)
            name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            shard = {"w": torch.full((256,), float(step))}
            engine.checkpoint_engine.save(shard, str(staging / "checkpoint" / name))

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    save(1)
    if rank == failing_rank:
        modules = {"persist_files": durability, "digests": manifest, "write_manifest": manifest}
        module = modules.get(step_name, hashed_writes)
        setattr(module, step_name, no_space)
    started = time.monotonic()
    try:
        save(2)
        outcome = "saved"
    except CheckpointStorageError as refusal:
        outcome = str(refusal)
    print(json.dumps({"rank": rank, "outcome": outcome, "seconds": time.monotonic() - started}), flush=True)
    """
)


# _write_hashed: a shard write inside DeepSpeed's save (a full disk reported at fsync), on one rank; the others are
# rank 0's steps of the commit (making `latest` durable, reading it back, writing the manifest)
FAILURES = [(1, "_write_hashed"), (0, "persist_files"), (0, "digests"), (0, "write_manifest")]


@pytest.mark.parametrize(("failing_rank", "step"), FAILURES)
def test_a_commit_failing_on_one_rank_is_raised_on_every_rank(tmp_path, failing_rank, step):
    final = tmp_path / "last.ckpt"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "MASTER_ADDR": "127.0.0.1"}
    env.update(MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", COMMIT_THEN_FAIL, str(final), str(failing_rank), step],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    records = [json.loads(rank.communicate(timeout=120)[0].strip().splitlines()[-1]) for rank in ranks]
    for record in records:
        named = rf"rank {failing_rank}: (writing .*)?\[Errno 28\] No space left on device"
        assert re.search(named, record["outcome"]), record
        assert "the checkpoint that was at" in record["outcome"] and record["seconds"] < 30, record
    recorded = read_manifest(final)
    assert recorded["run"]["global_step"] == 1 and verify_files(final, recorded, list(recorded["files"])) == []
