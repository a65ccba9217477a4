"""The shared-folder check of the first save (checkpointing/shared_folder.py) without processes: collectives faked
as one job's rank 0 (that sees its folder), with a second job probing the same folder while the first waits."""

import pytest

from lightning_hpz import collectives
from lightning_hpz.checkpointing import shared_folder
from lightning_hpz.checkpointing.errors import CheckpointStorageError


@pytest.fixture
def one_rank_job(monkeypatch):
    monkeypatch.setattr(shared_folder, "_checked", set())
    monkeypatch.setattr(collectives, "is_distributed", lambda: True)
    monkeypatch.setattr(collectives, "rank", lambda: 0)
    monkeypatch.setattr(collectives, "all_reduce_values", lambda values, op: values)
    monkeypatch.setattr(collectives, "all_gather_object", lambda value: [value])
    monkeypatch.setattr(collectives, "broadcast_object", lambda value: value)


def test_two_jobs_probing_one_folder_at_once_both_see_it(one_rank_job, monkeypatch, tmp_path):
    def broadcast_while_another_job_probes(token):
        # the second job writes and deletes its own probe between the first job's write and its read-back
        monkeypatch.setattr(collectives, "broadcast_object", lambda value: value)
        shared_folder._checked.clear()
        shared_folder.check_one_folder_for_all_ranks(tmp_path)
        return token

    monkeypatch.setattr(collectives, "broadcast_object", broadcast_while_another_job_probes)
    shared_folder.check_one_folder_for_all_ranks(tmp_path)  # no false "node-local disks" refusal
    assert list(tmp_path.iterdir()) == []  # both probes are gone


def test_a_rank_that_does_not_see_the_probe_is_named(one_rank_job, monkeypatch, tmp_path):
    # rank 1's problem makes the all-reduce non-zero; only then do the names travel
    monkeypatch.setattr(collectives, "all_reduce_values", lambda values, op: [1.0])
    monkeypatch.setattr(collectives, "all_gather_object", lambda value: [value, ["rank 1 on node-b"]])
    with pytest.raises(CheckpointStorageError, match=r"rank 1 on node-b cannot see a file rank 0 wrote there"):
        shared_folder.check_one_folder_for_all_ranks(tmp_path)
