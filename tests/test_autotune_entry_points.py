"""strategy="hpz_auto" on one process: every Trainer entry point, a module built in configure_model, and Fabric."""

from __future__ import annotations

import math

import pytest
from conftest import run_script


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("autotune_entry") / "out"
    run = run_script("autotune_entry_points.py", {}, out, timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    return run.ranks[0]


def test_fit_tunes_without_a_probe_on_one_process(record):
    decision = record["trainer"]["fit_decision"]
    assert record["trainer"]["preset_name"] == "hpz_auto"
    assert decision["links"] is None and decision["layout"] == [1, 1]
    assert decision["hpz_partition_size"] == 1
    # One process sends nothing: every setting is equally fast, so the one needing least memory wins.
    assert {c["predicted_comm_s"] for c in decision["candidates"]} == {0.0}
    chosen = next(c for c in decision["candidates"] if c["name"] == decision["candidate"])
    assert chosen["predicted_memory_gib"] == min(c["predicted_memory_gib"] for c in decision["candidates"])


def test_validate_test_and_predict_run_after_a_tuned_fit(record):
    trainer = record["trainer"]
    assert len(trainer["validate"]) == 1 and len(trainer["test"]) == 1
    assert trainer["predict_batches"] == 2


def test_a_module_built_in_configure_model_is_tuned_with_its_parameters(record):
    decision = record["configure_model"]["decision"]
    assert record["configure_model"]["global_step"] == 2
    thresholds = decision["zero_thresholds"]
    assert thresholds["stage3_prefetch_bucket_size"] == 32 * 2 + 2  # one module: the layer made in configure_model


def test_fabric_setup_tunes_the_engine(record):
    decision = record["fabric"]["decision"]
    assert decision["hpz_partition_size"] == 1 and decision["source"] == "probe"
    assert math.isfinite(record["fabric"]["loss"])


def test_the_peak_through_step_one_is_checked_against_the_budget(record):
    check = record["trainer"]["memory_check"]  # the default budget: the host's memory
    assert 0 < check["peak_gib"] < check["budget_gib"]
    assert check["predicted_gib"] < check["peak_gib"]  # a process holds more than the model's states
    assert record["fabric"]["memory_check"]["peak_gib"] > 0  # Fabric's loop is checked too


def test_a_peak_over_the_budget_warns_with_the_numbers_and_the_fixes(record):
    small = record["small_budget"]
    assert small["global_step"] == 2 and not small["within_budget"]
    assert small["memory_check"]["budget_gib"] == pytest.approx(0.05)
    assert small["memory_check"]["peak_gib"] > 0.05
    assert len(small["warnings"]) == 1  # once per run, not every step
    assert f"{small['memory_check']['peak_gib']:.2f} GiB" in small["warnings"][0]
    assert "autotune_memory_gib" in small["warnings"][0] and "activation checkpointing" in small["warnings"][0]
