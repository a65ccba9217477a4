"""``fabric.save`` commits and ``fabric.load`` verifies, as the Trainer's checkpoints do (docs/checkpoints.md).

Two launches of tests/scripts/fabric_checkpoints.py (ZeRO-3, real DeepSpeed over gloo). The first (2 CPU ranks) saves
and loads back, is refused a damaged copy, and is killed (the whole job, SIGKILL) at a commit fault point of its third
save, after the manifest of the new copy was written and before anything moved. Between the launches the test moves
its first checkpoint aside as a commit killed between its two renames leaves it. The second launch, on one rank,
loads what the kill left (through DeepSpeed's universal format, as a resume on another number of ranks does) and then
the checkpoint moved aside, by its path.
"""

import signal

import pytest
from conftest import assert_succeeded, run_script

from lightning_hpz.checkpointing.fault_points import FAULT_AT_ENV_VAR, FAULT_POINT_ENV_VAR, FAULT_SCOPE_ENV_VAR
from lightning_hpz.checkpointing.manifest import complete_manifest, read_manifest, verify_files
from lightning_hpz.checkpointing.staging import STAGING_FOLDER, replaced_path, staging_path
from lightning_hpz.checkpointing.writer_lock import LOCK_NAME

pytestmark = pytest.mark.multiprocess

RANKS = 2
KILLED_COMMIT = 3  # saved/a, run/last at step 3, run/last at step 4 (killed)
KILL = {
    FAULT_POINT_ENV_VAR: "commit:manifest_written",
    FAULT_AT_ENV_VAR: str(KILLED_COMMIT),
    FAULT_SCOPE_ENV_VAR: "job",
}


def _verified_step(path) -> int:
    recorded = read_manifest(path)
    assert recorded is not None, path
    assert verify_files(path, recorded, list(recorded["files"])) == []
    return recorded["run"]["global_step"]


@pytest.fixture(scope="module")
def launches(module_tmp):
    root = module_tmp
    options = {"phase": "first", "root": str(root)}
    first = run_script("fabric_checkpoints.py", options, root / "first", env=KILL, ranks=RANKS)
    assert first.returncode == -signal.SIGKILL, first.output[-4000:]  # the fault point killed the job
    assert sorted(first.ranks) == [0, 1], first.output[-4000:]
    saved, last = root / "saved", root / "run" / "last"
    left = {
        "a": _verified_step(saved / "a"),
        "staged_in_saved": (saved / STAGING_FOLDER).exists(),
        "last": _verified_step(last),
        "staged": complete_manifest(staging_path(last)),
    }
    replaced_path(saved / "a").parent.mkdir(exist_ok=True)
    (saved / "a").rename(replaced_path(saved / "a"))  # the old copy aside, the new one never staged
    options = {"phase": "after_kill", "root": str(root), "devices": 1}
    second = run_script("fabric_checkpoints.py", options, root / "second", ranks=1)
    assert_succeeded(second, ranks=1)
    return root, first, left, second


def test_save_commits_with_a_manifest_and_load_restores_exactly(launches):
    root, first, left, _ = launches
    assert left["a"] == 2  # the engine's step counter, recorded in the manifest
    assert not left["staged_in_saved"]  # every save there completed: nothing staged is left
    for rank in range(RANKS):
        record = first.ranks[rank]
        assert record["exact"], rank  # weight shards, fp32 master partitions, Adam's state, engine step: equal
        assert record["loaded_step"] == 2
        # as in Lightning: what the state did not ask for comes back (beside DeepSpeed's own keys), what it did not
        assert "note" in record["remainder"] and "step" not in record["remainder"]
        assert f"checkpoint/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in record["verified_in_load"]
        assert "filter" in record["filter_refusal"]  # Lightning's refusal, before anything was written
    assert not (root / "saved" / "refused").exists()


def test_a_damaged_shard_is_refused_alike_on_every_rank(launches):
    root, first, _, _ = launches
    messages = {first.ranks[rank]["integrity_refusal"] for rank in range(RANKS)}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in message
    assert f"The last good checkpoint in {root / 'saved'} is {root / 'saved' / 'a'}" in message


def test_a_save_killed_while_committing_leaves_the_previous_checkpoint(launches):
    root, first, left, second = launches
    # killed after the new copy's manifest, before it moved: the path still holds the previous commit
    assert left["last"] == 3 and left["staged"]["run"]["global_step"] == 4
    resumed = second.ranks[0]
    assert resumed["loaded_step"] == 3 and resumed["engine_step"] == 3
    # converted from 2 ranks to 1 with the weights exact: rank 0's batch of step 3 has the loss it had before the kill
    assert resumed["losses"]["3"] == first.ranks[0]["losses"]["3"]
    assert "Resuming a checkpoint written on 2 ranks on 1 ranks" in second.output
    # the next save of that path cleared the staged copy and committed; teardown released the folder
    assert _verified_step(root / "run" / "last") == 4
    assert not (root / "run" / "last" / "universal").exists()  # went with the copy that save replaced
    assert not (root / "run" / STAGING_FOLDER).exists()
    assert not (root / "run" / LOCK_NAME).exists()


def test_a_commit_caught_between_its_renames_is_repaired_before_the_load(launches):
    root, _, _, second = launches
    assert second.ranks[0]["repaired_step"] == 2  # rolled back to the copy moved aside, then loaded
    assert _verified_step(root / "saved" / "a") == 2
    assert not replaced_path(root / "saved" / "a").exists()
