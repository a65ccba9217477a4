"""lightning_hpz.collectives: the device each collective's tensors go to, and every helper on real gloo ranks."""

import pytest
import torch
from conftest import assert_succeeded, run_script

from lightning_hpz import collectives


def test_without_a_process_group_each_helper_is_the_world_of_one():
    tensor = torch.tensor([1.0, 2.0])
    reduced = collectives.all_reduce(tensor)
    assert reduced.tolist() == [1.0, 2.0] and reduced is not tensor
    assert collectives.all_reduce_values([3.0]) == [3.0]
    assert [t.tolist() for t in collectives.all_gather_tensor(tensor)] == [[1.0, 2.0]]
    assert collectives.all_gather_object("x") == ["x"]
    assert collectives.broadcast_object("y") == "y"
    assert collectives.scatter_object(["z", None]) == "z"
    assert (collectives.rank(), collectives.world_size()) == (0, 1)
    collectives.barrier()


def test_unknown_reduce_op_names_the_choices():
    with pytest.raises(ValueError, match=r"op='mean': choose one of \['max', 'min', 'product', 'sum'\]"):
        collectives.all_reduce(torch.ones(1), op="mean")


@pytest.mark.parametrize(("backend", "expected"), [("nccl", torch.device("cuda", 3)), ("gloo", torch.device("cpu"))])
def test_tensors_go_to_this_ranks_gpu_under_nccl_only(monkeypatch, backend, expected):
    # NCCL refuses CPU tensors: under it a collective's tensor must be on the rank's current GPU
    monkeypatch.setattr(collectives, "is_distributed", lambda: True)
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collectives.collective_device() == expected


@pytest.fixture(scope="module")
def gloo_ranks(module_tmp):
    run = run_script("collectives_gloo.py", {}, module_tmp / "gloo", timeout=180, ranks=2)
    assert_succeeded(run, ranks=2)
    return run.ranks


def test_reductions_over_gloo(gloo_ranks):
    for record in gloo_ranks.values():
        assert record["device"] == "cpu"
        assert record["sum"] == [3.0, 30.0]
        assert record["max"] == [2.0, 20.0]
        assert record["min_in_subgroup"] == [1.0, 10.0]
        assert record["values"] == [1.0, 2.0]
    assert [gloo_ranks[r]["input_unchanged"] for r in (0, 1)] == [[1.0, 10.0], [2.0, 20.0]]


def test_gathers_and_broadcast_over_gloo(gloo_ranks):
    for rank, record in gloo_ranks.items():
        assert (record["rank"], record["world_size"]) == (rank, 2)
        assert record["gathered"] == [[0, 0], [1, 1]]
        assert record["objects"] == [{"rank": 0}, {"rank": 1}]
        assert record["broadcast"] == "from rank 1"
        assert record["scattered"] == f"for rank {rank}"


def test_a_manifest_cut_short_on_rank_zero_is_refused_on_every_rank(gloo_ranks):
    # rank 0 alone reads it: its error must reach the others through the scatter, not leave them waiting in it
    refusals = [gloo_ranks[rank]["cut_short_manifest"] for rank in (0, 1)]
    assert refusals[0] == refusals[1] and refusals[0]["type"] == "CheckpointIntegrityError"
    assert "hpz_manifest.json: cannot be read (JSONDecodeError" in refusals[0]["message"]
