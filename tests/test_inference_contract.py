"""trainer.validate/test/predict as Lightning's DeepSpeedStrategy promises them: after fit, and on a fresh Trainer
from a checkpoint, for ZeRO stages 1-3, hpZ 2 and ZeRO off, on 1 and 2 CPU processes (real DeepSpeed over gloo).

One launch per device count runs every setting in turn (see tests/scripts/inference_contract.py).
"""

import pytest
from conftest import CUDA_SEMANTICS_OFF, assert_succeeded, run_script

pytestmark = pytest.mark.multiprocess

ONE_DEVICE = {"stage1": {"stage": 1}, "stage2": {"stage": 2}, "stage3": {"stage": 3}}
# hpZ first: its untrained validate is the process's first engine, so no earlier engine has built the hpZ groups
TWO_DEVICES = {
    "hpz2": {"stage": 3, "hpz_partition_size": 2},
    "hpz2_configure_model": {"stage": 3, "hpz_partition_size": 2},
    "stage3": {"stage": 3, "hpz_partition_size": 1},
    "stage2": {"stage": 2},
    "stage1": {"stage": 1},
    "zero_off": {"zero_optimization": False},
}


def _launch(module_tmp, devices: int, settings: dict, env: dict):
    runs = [
        {"name": name, "strategy": kwargs, "model": "configured" if name.endswith("configure_model") else "boring"}
        for name, kwargs in settings.items()
    ]
    options = {"devices": devices, "runs": runs}
    # every setting is a fresh fit and three evaluations in one launch: about 100 s alone, past the default 240 s
    # under the full suite's load (the clean-clone CI of 2026-12-05 killed it during its last setting)
    out = module_tmp / f"devices{devices}"
    run = run_script("inference_contract.py", options, out, timeout=480, ranks=devices, env=env)
    assert_succeeded(run, ranks=devices)
    return run


@pytest.fixture(scope="module")
def launches(module_tmp):
    # two devices take Lightning's CUDA branch (evaluation under torch.inference_mode, the suite's default); one device
    # its gloo branch (no_grad), so both stay covered
    return {1: _launch(module_tmp, 1, ONE_DEVICE, CUDA_SEMANTICS_OFF), 2: _launch(module_tmp, 2, TWO_DEVICES, {})}


def _records(launches):
    for devices, run in launches.items():
        for rank, per_setting in run.ranks.items():
            for name, record in per_setting.items():
                yield f"{name} on {devices} device(s), rank {rank}", record


def test_every_setting_ran_validate_test_predict_on_every_rank(launches):
    assert set(launches[1].ranks[0]) == set(ONE_DEVICE)
    assert set(launches[2].ranks[0]) == set(launches[2].ranks[1]) == set(TWO_DEVICES)


def test_fresh_trainer_from_checkpoint_reproduces_results_after_fit(launches):
    for where, record in _records(launches):
        assert record["from_checkpoint"] == record["after_fit"], where
        assert len(record["after_fit"]["predict"]) > 0, where


def test_inference_after_fit_sees_the_trained_weights(launches):
    for where, record in _records(launches):
        after = record["after_fit"]
        assert after["val"] < 0.8 * record["untrained_val"], where  # fit lowered the loss the engine reports
        assert after["test"] == after["val"], where  # same data, same weights


def test_hpz_changes_no_inference_result(launches):
    for rank in (0, 1):
        hpz, plain = launches[2].ranks[rank]["hpz2"], launches[2].ranks[rank]["stage3"]
        assert hpz["zero_config"]["zero_hpz_partition_size"] == 2
        for key in ("untrained_val", "after_fit", "from_checkpoint"):
            assert hpz[key] == plain[key], f"{key}, rank {rank}"


def test_hpz_inference_of_model_built_outside_configure_model(launches):
    # DeepSpeed 0.19.8 alone raises AttributeError (_set_zero_group_parallelism) in this first validate
    for rank in (0, 1):
        records = launches[2].ranks[rank]
        assert records["hpz2"]["untrained_val"] == records["hpz2_configure_model"]["untrained_val"]


def test_zero_optimization_false_runs_without_zero(launches):
    for rank in (0, 1):
        assert launches[2].ranks[rank]["zero_off"]["zero_config"] is None


def test_evaluation_took_the_branch_asked_for(launches):
    # on gloo Lightning evaluates under no_grad; the emulation makes it choose inference_mode, as on CUDA
    for name, record in _records(launches):
        assert record["inference_mode_seen"] == ([True] if "2 device" in name else [False]), name


def test_four_ranks_hpz2_evaluates_after_fit_as_hpz1_does(module_tmp):
    # the reproduction of issue 24 as filed: 4 processes, hpZ 2 over node halves, Lightning's CUDA evaluation branch
    settings = {"hpz2": TWO_DEVICES["hpz2"], "stage3": TWO_DEVICES["stage3"]}
    run = _launch(module_tmp, 4, settings, {})
    for rank in range(4):
        hpz, plain = run.ranks[rank]["hpz2"], run.ranks[rank]["stage3"]
        assert hpz["inference_mode_seen"] == [True], rank
        assert hpz["zero_config"]["zero_hpz_partition_size"] == 2
        for key in ("untrained_val", "after_fit", "from_checkpoint"):
            assert hpz[key] == plain[key], f"{key}, rank {rank}"
