"""The autotune evidence harness without a testbed: specs, the recorded decision, medians, ratios, checks, tables.

The decisions are made up here (the shape ``HpzStrategy.autotune_decision.to_dict()`` returns); the script's loop runs
against a stand-in testbed and launcher, so nothing here needs root or starts a process.
"""

from __future__ import annotations

import json
import statistics
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import import_benchmark

from lightning_hpz.bench import autotune_grid as grid
from lightning_hpz.bench import configurations, lightning_worker, testbed, worker
from lightning_hpz.bench import launch as launch_module
from lightning_hpz.bench.lightning_worker import StepRecording, strategy_kwargs

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "autotune_testbed.py"
REGATHER = dict.fromkeys(grid.THRESHOLD_KEYS, 0)
DEFAULTS = {
    "stage3_max_live_parameters": 10**9,
    "stage3_max_reuse_distance": 10**9,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
}


def _candidate(name, hpz, thresholds, comm, fits=True):
    return {
        "name": name,
        "hpz_partition_size": hpz,
        "zero_thresholds": thresholds,
        "predicted_comm_s": comm,
        "predicted_memory_gib": 0.5,
        "fits": fits,
    }


def _decision(pick="hpz2-regather", inter_gbps=0.19):
    return {
        "hpz_partition_size": 2,
        "zero_thresholds": REGATHER,
        "candidate": pick,
        "links": {
            "intra_node_gbps": 8.0,
            "intra_node_latency_us": 40.0,
            "inter_node_gbps": inter_gbps,
            "inter_node_latency_us": 300.0,
            "probe_seconds": 1.5,
        },
        "candidates": [
            _candidate("zero3-regather", 1, REGATHER, 0.9),
            _candidate("hpz2-regather", 2, REGATHER, 0.6),
            _candidate("hpz2-keep", 2, DEFAULTS, 0.4, fits=False),  # fastest, but over the memory budget
        ],
        "memory_budget_gib": 1.0,
        "reason": "least predicted communication among the candidates that fit",
        "source": "probe",
    }


def _records(times, losses=(5.0, 4.0, 3.0, 2.0), decision=None, zero=None, world=4):
    records = []
    for rank in range(world):
        record = {
            "rank": rank,
            "losses": list(losses),
            "step_times": list(times),
            "tx_bytes_start": 0 if rank % 2 == 0 else None,
            "tx_bytes_end": 1000 if rank % 2 == 0 else None,
        }
        if decision is not None:
            record["autotune_decision"] = decision
        if zero is not None:
            record["deepspeed_config"] = {"zero_optimization": zero}
        records.append(record)
    return records


def _applied(hpz, thresholds):
    return {"stage": 3, "zero_hpz_partition_size": hpz, **thresholds}


# ------------------------------------------------------------------------------------------------------ launch specs
def test_a_candidate_is_reproduced_by_explicit_strategy_arguments():
    kwargs = grid.candidate_strategy_kwargs(_candidate("c", 2, DEFAULTS, 0.1))
    assert kwargs == {"stage": 3, "hpz_partition_size": 2, "config": {"zero_optimization": DEFAULTS}}
    assert "autotune" not in kwargs


def test_spec_strategy_kwargs_replace_the_configuration_arguments_entirely():
    configuration = configurations.CONFIGURATIONS[grid.LIGHTNING_CONFIGURATION]
    tuned = grid.launch_spec(grid.tuned_strategy_kwargs(2.5), {}, steps=6, warmup=2, devices=2)
    assert strategy_kwargs(tuned, configuration) == {"stage": 3, "autotune": True, "autotune_memory_gib": 2.5}
    plain = {k: v for k, v in tuned.items() if k != "strategy_kwargs"}
    assert strategy_kwargs(plain, configuration) == configuration.strategy_kwargs(2)


def test_strategy_kwargs_for_a_driver_other_than_lightning_are_refused(tmp_path):
    spec = {**grid.launch_spec({"stage": 3}, {}, 6, 2, 2), "configuration": "ddp"}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(SystemExit, match="HpzStrategy only"):
        worker.main([str(path)])


def test_the_recording_callback_keeps_the_strategy_decision():
    decision = _decision()
    trainer = SimpleNamespace(strategy=SimpleNamespace(autotune_decision=SimpleNamespace(to_dict=lambda: decision)))
    recording = StepRecording(steps=4, warmup=1)
    recording.on_train_start(trainer, None)
    assert recording.autotune_decision == decision
    untuned = StepRecording(steps=4, warmup=1)
    untuned.on_train_start(SimpleNamespace(strategy=SimpleNamespace()), None)
    assert untuned.autotune_decision is None


def test_rounds_alternate_and_folders_are_path_safe():
    assert grid.round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    assert grid.run_folder(3, "hpz 2/keep") == "03-hpz_2_keep"


# ------------------------------------------------------------------------------------------------------ the decision
def test_a_missing_or_disagreeing_decision_is_refused():
    records = _records([1.0, 1.0], decision=_decision())
    del records[3]["autotune_decision"]
    with pytest.raises(grid.DecisionMissingError, match=r"rank\(s\) \[3\]"):
        grid.recorded_decision(records)
    records = _records([1.0, 1.0], decision=_decision())
    records[1]["autotune_decision"] = _decision(pick="zero3-regather")
    with pytest.raises(grid.DecisionMissingError, match="different"):
        grid.recorded_decision(records)


def test_the_applied_engine_config_is_compared_with_the_pick():
    pick = _candidate("p", 2, REGATHER, 0.1)
    assert grid.applied_matches_pick({"deepspeed_config": {"zero_optimization": _applied(2, REGATHER)}}, pick)
    assert not grid.applied_matches_pick({"deepspeed_config": {"zero_optimization": _applied(1, REGATHER)}}, pick)
    assert not grid.applied_matches_pick({"deepspeed_config": {"zero_optimization": _applied(2, DEFAULTS)}}, pick)
    assert grid.applied_matches_pick({}, pick) is None


# ----------------------------------------------------------------------------------------------------- comparisons
@pytest.mark.parametrize(
    ("ratio", "probe", "pick"), [(1.0, "PASS", "PASS"), (1.05, "PASS", "PASS"), (1.06, "PASS", "FAIL")]
)
def test_pick_check_allows_five_percent(ratio, probe, pick):
    assert grid.verdict(grid.probe_passes(ratio)) == probe
    assert grid.verdict(grid.pick_passes(ratio)) == pick


@pytest.mark.parametrize(("gbps", "check"), [(0.2, "PASS"), (0.171, "PASS"), (0.169, "FAIL"), (0.231, "FAIL")])
def test_probe_check_allows_fifteen_percent_of_the_tc_rate(gbps, check):
    assert grid.verdict(grid.probe_passes(grid.probe_over_tc(gbps, "200mbit"))) == check


def test_missing_measurements_give_no_verdict():
    assert grid.verdict(grid.pick_passes(None)) == "n/a"


def _speed(pick_times, fastest_times, tuned_times=(1.1, 1.1, 1.1), pick="hpz2-regather"):
    decision = _decision(pick=pick)
    tuned = _records(tuned_times, decision=decision, zero=_applied(2, REGATHER))
    runs = {
        "zero3-regather": [_records(fastest_times[:2]), _records(fastest_times[2:])],  # two rounds, pooled
        "hpz2-regather": [_records(pick_times)],
        "hpz2-keep": [_records([0.1, 0.1, 0.1])],  # does not fit: never the reference
    }
    return grid.summarize_speed("200mbit", tuned, runs, {}, tokens_per_step=100)


def test_speed_summary_pools_rounds_and_compares_the_pick_with_the_fastest_fitting_candidate():
    speed = _speed(pick_times=[1.04, 1.04, 1.04], fastest_times=[1.0, 0.9, 1.1, 1.0])
    rows = {row["name"]: row for row in speed["candidates"]}
    assert rows["zero3-regather"]["measured_median_s"] == statistics.median([1.0, 0.9, 1.1, 1.0])
    assert rows["zero3-regather"]["rounds"] == 2 and rows["zero3-regather"]["measured_steps"] == 4
    assert speed["fastest"] == "zero3-regather"
    assert speed["pick_over_fastest"] == pytest.approx(1.04)
    assert speed["pick_over_fastest_by_round"] == []  # the pick ran one round, the fastest two
    assert speed["pick_check"] == "PASS"
    assert speed["tuned_over_fastest"] == pytest.approx(1.1)
    assert speed["probe_over_tc"] == pytest.approx(0.95)
    assert speed["probe_check"] == "PASS"
    assert speed["applied_matches_pick"] is True
    assert rows["hpz2-keep"]["over_fastest"] == pytest.approx(0.1)
    assert rows["hpz2-regather"]["loss_difference_to_tuned"] == 0.0
    assert grid.all_pass([speed])


def test_ratios_by_round_compare_round_medians():
    slow, fast = [_records([2.0, 3.0, 4.0]), _records([1.0, 1.0, 1.0])], [_records([1.0, 1.5, 9.0]), _records([2.0])]
    assert grid.ratios_by_round(slow, fast) == [2.0, 0.5]
    assert grid.ratios_by_round(slow, fast[:1]) == []


def test_a_slow_pick_fails_and_so_does_the_run():
    speed = _speed(pick_times=[1.2, 1.2, 1.2], fastest_times=[1.0, 1.0, 1.0, 1.0])
    assert speed["pick_check"] == "FAIL"
    assert not grid.all_pass([speed])


def test_a_failed_candidate_or_tuned_launch_fails_the_run():
    speed = _speed(pick_times=[1.0, 1.0, 1.0], fastest_times=[1.0, 1.0, 1.0, 1.0])
    speed["failed"] = {"hpz2-keep": "timed out"}
    assert not grid.all_pass([speed])
    assert not grid.all_pass([grid.failed_speed("50mbit", "no decision")])
    assert not grid.all_pass([])


# ------------------------------------------------------------------------------------------------------- rendering
def _results(speeds):
    return {
        "title": "2 nodes x 2",
        "command": "x",
        "rounds": 2,
        "steps": 8,
        "warmup": 2,
        "speeds": speeds,
        "all_pass": grid.all_pass(speeds),
        "notes": ["a note"],
    }


def test_markdown_shows_checks_pick_fastest_and_failures():
    passed = _speed(pick_times=[1.04, 1.04, 1.04], fastest_times=[1.0, 1.0, 1.0, 1.0])
    text = grid.markdown(_results([passed, grid.failed_speed("50mbit", "torchrun exited with [1, 1]")]))
    assert "| 200mbit (0.200 Gbit/s) | 0.190 | 0.950 | PASS | hpz2-regather | zero3-regather | 1.040 | PASS |" in text
    assert "| hpz2-regather (pick) | 2 | 0, 0, 0, 0 |" in text
    assert "| zero3-regather (fastest) |" in text
    assert "| hpz2-keep | 2 | 1e9, 1e9, 5e7, 100000 |" in text
    assert grid._count(1_850_368) == "1850368"
    assert "tuned launch failed: torchrun exited with [1, 1]" in text
    assert "Overall: FAIL" in text and "- a note" in text


# ------------------------------------------------------------------------------------------------------- the script
def _script():
    return import_benchmark("autotune_testbed")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speeds", "fast"], "200mbit"),
        (["--speeds", "50mbit", "50mbit"], "listed twice"),
        (["--steps", "3", "--warmup", "2"], "2 measured steps"),
        (["--memory-gib", "0"], "positive budget"),
        (["--devices-per-node", "1"], "at least 2"),
    ],
)
def test_bad_script_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        _script().parse_args(["--out", "x", *argv])
    assert message in capsys.readouterr().err


def test_without_root_the_script_refuses_before_building_anything(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(testbed.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as exit_info:
        _script().main(["--quick", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "needs root" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


class _FakeTestbed(nullcontext):
    def __init__(self, shape):
        super().__init__(self)
        self.shape = shape

    def leftovers(self):
        return []


def _fake_launches(monkeypatch, script, tmp_path):
    """Stand-ins for the two launch functions: the tuned launch decides, hpZ-1 candidates crash their launch."""
    launched = []

    def run_configuration(launch, spec, run_dir):
        launched.append(("tuned", run_dir.relative_to(tmp_path).as_posix()))
        assert spec["strategy_kwargs"] == {"stage": 3, "autotune": True, "autotune_memory_gib": 3.0}
        return _records([1.0] * 4, decision=_decision(inter_gbps=0.2), zero=_applied(2, REGATHER))

    def run_sequence(launch, spec, run_dir):
        outs = [Path(entry["out"]).relative_to(tmp_path).as_posix() for entry in spec["runs"]]
        launched.append((run_dir.relative_to(tmp_path).as_posix(), outs))
        records = []
        for entry in spec["runs"]:
            if entry["strategy_kwargs"]["hpz_partition_size"] == 1:
                return records + [None] * (len(spec["runs"]) - len(records)), "ranks died"
            records.append(_records([1.0] * 4))
        return records, None

    monkeypatch.setattr(script, "refuse_where_unavailable", lambda program: None)
    monkeypatch.setattr(script, "TwoNodeTestbed", _FakeTestbed)
    monkeypatch.setattr(script, "run_configuration", run_configuration)
    monkeypatch.setattr(script, "run_sequence", run_sequence)
    return launched


ARGV = ["--quick", "--speeds", "200mbit", "--rounds", "2", "--memory-gib", "3"]


def test_a_round_is_one_launch_of_every_candidate_in_alternating_order(monkeypatch, tmp_path):
    script = _script()
    launched = _fake_launches(monkeypatch, script, tmp_path)
    assert script.main([*ARGV, "--out", str(tmp_path)]) == 1  # a candidate failed
    round1 = [f"200mbit/{folder}/round1" for folder in ("00-zero3-regather", "01-hpz2-regather", "02-hpz2-keep")]
    assert launched == [
        ("tuned", "200mbit/tuned"),
        ("200mbit/launches/round1", round1),  # the first crashed: the others in it did not run
        ("200mbit/launches/round2", ["200mbit/02-hpz2-keep/round2", "200mbit/01-hpz2-regather/round2"]),
    ]
    results = json.loads((tmp_path / "results.json").read_text())
    (speed,) = results["speeds"]
    assert speed["failed"] == {"zero3-regather": "ranks died"}
    rows = {row["name"]: row for row in speed["candidates"]}
    assert rows["hpz2-regather"]["rounds"] == 1  # missed round 1: the launch crashed before it
    assert speed["fastest"] == "hpz2-regather" and speed["pick_check"] == "PASS"
    assert not results["all_pass"]
    assert (tmp_path / "results.md").read_text().startswith("Command: `python benchmarks/autotune_testbed.py")


def test_results_are_rebuilt_from_the_run_records_without_a_testbed(monkeypatch, tmp_path):
    script = _script()
    _fake_launches(monkeypatch, script, tmp_path)
    _write_fake_records(monkeypatch, script)
    script.main([*ARGV, "--out", str(tmp_path)])
    first = json.loads((tmp_path / "results.json").read_text())["speeds"][0]
    monkeypatch.setattr(testbed.os, "geteuid", lambda: 1000)  # no root needed to summarize
    script.main([*ARGV, "--from-runs", "--out", str(tmp_path)])
    again = json.loads((tmp_path / "results.json").read_text())["speeds"][0]
    del first["wall_s"]
    assert again["failed"] == {
        "zero3-regather": f"no complete round under {tmp_path / '200mbit' / '00-zero3-regather'}"
    }
    assert {k: v for k, v in again.items() if k != "failed"} == {k: v for k, v in first.items() if k != "failed"}


def _write_fake_records(monkeypatch, script):
    """Make the stand-in launches also leave their records on disk, as the ranks do."""
    for name in ("run_configuration", "run_sequence"):
        fake = getattr(script, name)

        def writing(launch, spec, run_dir, fake=fake):
            found = fake(launch, spec, run_dir)
            outs = [run_dir] if "runs" not in spec else [Path(entry["out"]) for entry in spec["runs"]]
            batches = [found] if "runs" not in spec else found[0]
            for out, records in zip(outs, batches, strict=True):
                out.mkdir(parents=True, exist_ok=True)
                for record in records or []:
                    (out / f"rank{record['rank']}.json").write_text(json.dumps(record))
            return found

        monkeypatch.setattr(script, name, writing)


def test_separate_launches_start_one_launch_per_candidate_and_round(monkeypatch, tmp_path):
    script = _script()
    launched = _fake_launches(monkeypatch, script, tmp_path)
    assert script.main([*ARGV, "--separate-launches", "--out", str(tmp_path)]) == 1
    assert [where for where, _ in launched] == [
        "tuned",
        "200mbit/00-zero3-regather/round1",
        "200mbit/01-hpz2-regather/round1",
        "200mbit/02-hpz2-keep/round1",
        "200mbit/02-hpz2-keep/round2",  # the failed candidate is not retried
        "200mbit/01-hpz2-regather/round2",
    ]
    (speed,) = json.loads((tmp_path / "results.json").read_text())["speeds"]
    assert {row["name"]: row["rounds"] for row in speed["candidates"]} == {
        "zero3-regather": 0,
        "hpz2-regather": 2,
        "hpz2-keep": 2,
    }


# ---------------------------------------------------------------------------------------- several runs, one launch
def test_a_worker_trains_each_entry_of_a_sequence_with_its_own_arguments(monkeypatch):
    trained = []
    monkeypatch.setattr(lightning_worker, "train", lambda spec, configuration, workload: trained.append(spec))
    entries = [({"stage": 3, "hpz_partition_size": 1}, "/a"), ({"stage": 3, "hpz_partition_size": 2}, "/b")]
    spec = grid.sequence_spec(entries, {}, steps=6, warmup=2, devices=2)
    lightning_worker.run(spec, configurations.CONFIGURATIONS[spec["configuration"]], None)
    assert [(s["strategy_kwargs"]["hpz_partition_size"], s["out"], s["steps"]) for s in trained] == [
        (1, "/a", 6),
        (2, "/b", 6),
    ]


def test_a_failed_sequence_keeps_what_finished(monkeypatch, tmp_path):
    def first_only(launch, spec, run_dir):
        out = Path(spec["runs"][0]["out"])
        for rank in range(4):
            (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank}))
        raise launch_module.ConfigurationFailedError("a node's torchrun exited with [1, None]")

    monkeypatch.setattr(launch_module, "run_ranks", first_only)
    spec = grid.sequence_spec([({}, str(tmp_path / "a")), ({}, str(tmp_path / "b"))], {}, 6, 2, 2)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "rank0.json").write_text("{}")  # stale, from an earlier run
    where = launch_module.Launch(testbed=None, devices_per_node=2, port=0, timeout_s=1)
    records, error = launch_module.run_sequence(where, spec, tmp_path / "launch")
    assert [r["rank"] for r in records[0]] == [0, 1, 2, 3]
    assert records[1] is None
    assert "exited with [1, None]" in error
