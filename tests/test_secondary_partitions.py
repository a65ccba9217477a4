"""Stale secondaries reproduced and fixed; the integrity check passes when healthy and names corrupted parameters.

Measured on DeepSpeed 0.19.8 (background.md): after a step and an eval forward, halving every primary shard left
hpZ's next forward on the old weights. Plain ZeRO-3 (hpz 1) is the ground truth.
"""

import pytest
from conftest import assert_succeeded, run_script

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def runs(module_tmp):
    results = {}
    for size in (1, 2):
        results[size] = run_script("secondary_partitions.py", {"hpz": size}, module_tmp / f"hpz{size}", ranks=4)
        assert_succeeded(results[size])
    return results


def test_both_runs_start_from_the_same_weights(runs):
    assert runs[1].ranks[0]["after_eval"] == runs[2].ranks[0]["after_eval"]


def test_write_to_primaries_leaves_hpz_forward_stale(runs):
    plain, hpz = runs[1].ranks[0], runs[2].ranks[0]
    assert plain["stale_forward"] != plain["after_eval"]  # ZeRO-3 sees the halved weights
    assert hpz["stale_forward"] == hpz["after_eval"]  # hpZ still serves the weights from before the write


def test_refresh_makes_hpz_match_plain_zero3(runs):
    assert runs[2].ranks[0]["dropped"] == 6
    for rank in range(4):
        assert runs[2].ranks[rank]["refreshed_forward"] == runs[1].ranks[rank]["stale_forward"]


def test_integrity_check_passes_on_healthy_shards(runs):
    for rank in range(4):
        record = runs[2].ranks[rank]
        assert record["secondaries_after_eval"] == 6
        assert record["check_healthy"] == {"ok": True, "checked": 6, "mismatched": []}


def test_integrity_check_names_stale_parameters_on_every_rank(runs):
    expected = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias", "net.4.weight", "net.4.bias"]
    for rank in range(4):
        assert runs[2].ranks[rank]["check_stale"] == {"ok": False, "checked": 6, "mismatched": expected}


def test_integrity_check_names_a_corrupted_shard_on_every_rank(runs):
    for rank in range(4):
        error = runs[2].ranks[rank]["corruption_error"]
        assert error is not None, "corrupting one shard on rank 1 must fail the check on all ranks"
        assert "for 1 of 6 parameters: net.0.weight" in error
        assert "refresh_secondary_partitions" in error


def test_without_hpz_there_is_nothing_to_check(runs):
    record = runs[1].ranks[0]
    assert record["secondaries_after_eval"] == 0
    assert record["check_healthy"]["checked"] == 0
    assert record["corruption_error"] is None


def test_load_state_dict_into_sharded_model_matches_plain_zero3(runs):
    for rank in range(4):
        hpz, plain = runs[2].ranks[rank], runs[1].ranks[rank]
        assert hpz["after_load_state_dict"] == plain["after_load_state_dict"]
        assert hpz["check_after_load_state_dict"]["ok"]


def test_write_under_gathered_parameters_reaches_the_secondaries(runs):
    # DeepSpeed #7606/#7130: before 0.18.3 the release after such a write kept the old secondary copies
    for rank in range(4):
        hpz, plain = runs[2].ranks[rank], runs[1].ranks[rank]
        assert hpz["after_gathered_write"] == plain["after_gathered_write"] != plain["after_load_state_dict"]
        assert hpz["check_after_gathered_write"]["ok"] and hpz["check_after_gathered_write"]["checked"] > 0
