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
