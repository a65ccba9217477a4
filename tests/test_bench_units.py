"""The benchmark's pure parts: argument checks, refusal without root, summaries, loss agreement, predictions."""

from __future__ import annotations

import json
import statistics

import pytest

from lightning_hpz.bench import command, configurations, results, testbed
from lightning_hpz.bench.prediction import predicted_cross_node_bytes


@pytest.mark.parametrize("text", ["200", "fast", "-5mbit", "0mbit"])
def test_bad_bandwidth_is_refused_with_the_expected_form(text):
    with pytest.raises(ValueError, match="200mbit"):
        testbed.parse_rate(text)


def test_rates_and_delays_parse_in_tc_units():
    assert testbed.parse_rate("200mbit") == 200e6
    assert testbed.parse_rate("1.5gbit") == 1.5e9
    assert testbed.parse_delay("1ms") == pytest.approx(1e-3)
    assert testbed.parse_delay("0") == 0.0
    with pytest.raises(ValueError, match="1ms"):
        testbed.parse_delay("soon")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices-per-node", "1"], "at least 2"),
        (["--steps", "3", "--warmup", "2"], "fewer than 2 measured"),
        (["--configs", "zero4"], "unknown configuration"),
        (["--configs", "zero3", "zero3"], "listed twice"),
        (["--mtu", "100"], "mtu=100"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        command.parse_args(["--out", "x", *argv])
    assert message in capsys.readouterr().err


def test_without_root_the_benchmark_refuses_before_building_anything(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(testbed.os, "geteuid", lambda: 1000)
    built = []
    monkeypatch.setattr(testbed.TwoNodeTestbed, "build", lambda self: built.append(self))
    with pytest.raises(SystemExit) as exit_info:
        command.bench_main(["--quick", "--out", str(tmp_path)])
    assert exit_info.value.code == command.EXIT_UNAVAILABLE
    assert "needs root" in capsys.readouterr().err
    assert not built and not any(tmp_path.iterdir())


def test_missing_tools_are_named(monkeypatch):
    monkeypatch.setattr(testbed.os, "geteuid", lambda: 0)
    monkeypatch.setattr(testbed.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    assert "tc not found" in testbed.unavailable_reason()


def test_quick_and_full_selections_hold_the_headline_configurations():
    quick = [c.name for c in configurations.select(None, quick=True)]
    full = [c.name for c in configurations.select(None, quick=False)]
    assert {"zero3", "hpz-event"} <= set(quick) <= set(full)
    assert {"hpz-stream", "zero1", "zero2", "deepspeed-hpz", "fsdp2-full", "fsdp2-node", "ddp"} <= set(full)


def test_zero3_configurations_regather_in_backward():
    for configuration in configurations.CONFIGURATIONS.values():
        if configuration.driver in ("lightning", "deepspeed") and configuration.zero_stage == 3:
            section = configuration.strategy_kwargs(2)["config"]["zero_optimization"]
            assert section["stage3_max_live_parameters"] == 0
            assert section["stage3_max_reuse_distance"] == 0


def _record(rank, losses, times, tx=(None, None)):
    return {"rank": rank, "losses": losses, "step_times": times, "tx_bytes_start": tx[0], "tx_bytes_end": tx[1]}


def test_summary_takes_median_step_time_and_both_link_ends():
    times = [1.0, 3.0, 2.0, 10.0]
    records = [
        _record(0, [4.0, 3.0], times, tx=(100, 900)),
        _record(1, [2.0, 1.0], times),
        _record(2, [4.0, 3.0], times, tx=(50, 450)),
        _record(3, [2.0, 1.0], times),
    ]
    summary = results.summarize_run("x", [records], tokens_per_step=1000)
    assert summary["step_time_median_s"] == statistics.median(times)
    assert summary["cross_node_bytes_per_step"] == (800 + 400) / len(times)
    assert summary["cross_node_bytes_per_rank_step"] == (800 + 400) / len(times) / 4
    assert summary["loss_trajectory"] == [3.0, 2.0]
    assert summary["tokens_per_s"] == pytest.approx(1000 / statistics.median(times))


def test_rounds_pool_step_times_and_compare_losses():
    first = [_record(0, [4.0, 3.0], [1.0, 1.0], tx=(0, 200)), _record(1, [2.0, 1.0], [1.0, 1.0], tx=(0, 200))]
    second = [_record(0, [4.0, 3.5], [5.0, 5.0], tx=(0, 600)), _record(1, [2.0, 1.0], [5.0, 5.0], tx=(0, 600))]
    summary = results.summarize_run("x", [first, second], tokens_per_step=10)
    assert summary["measured_steps"] == 4
    assert summary["step_time_median_s"] == statistics.median([1.0, 1.0, 5.0, 5.0])
    assert summary["cross_node_bytes_per_step_by_round"] == [200.0, 600.0]
    assert summary["loss_difference_between_rounds"] == pytest.approx(0.25)


def _summary(trajectory):
    return {"loss_trajectory": trajectory}


def test_loss_agreement_is_exact_for_zero3_twins_and_close_for_other_frameworks():
    base = [5.0, 4.0, 3.0]
    agreement = results.loss_agreement(
        {
            "zero3": _summary(base),
            "hpz-event": _summary([5.0, 4.0, 3.0 + 1e-4]),  # tiny, yet not allowed for the same arithmetic
            "ddp": _summary([5.0, 4.0, 3.0 + 1e-4]),  # fine for another reduction order
            "fsdp2-node": _summary([5.0, 4.5, 3.0]),
        }
    )
    checks = agreement["configurations"]
    assert agreement["reference"] == "zero3"
    assert not checks["hpz-event"]["agrees"]
    assert checks["ddp"]["agrees"]
    assert not checks["fsdp2-node"]["agrees"]
    assert not agreement["all_agree"]


def test_model_predicts_hpz_saves_cross_node_bytes_for_the_benchmark_layout():
    pytest.importorskip("lightning_hpz.planning.communication")
    parameters = 1_000_000
    predicted = {
        name: predicted_cross_node_bytes(configurations.CONFIGURATIONS[name], parameters, devices_per_node=2)[0]
        for name in ("zero3", "hpz-event", "fsdp2-full", "fsdp2-node", "ddp")
    }
    assert predicted["hpz-event"] < predicted["zero3"]
    assert predicted["fsdp2-node"] == predicted["hpz-event"]
    assert predicted["fsdp2-full"] == predicted["zero3"]
    assert 0 < predicted["ddp"] < predicted["zero3"]


def test_results_can_be_rebuilt_from_the_run_records_without_a_testbed(tmp_path, monkeypatch):
    monkeypatch.setattr(testbed.os, "geteuid", lambda: 1000)  # no root needed to summarize
    for name, link_bytes in (("zero3", 3000), ("hpz-event", 2000)):
        run = tmp_path / "runs" / name / "round1"
        run.mkdir(parents=True)
        for rank in range(4):
            tx = (0, link_bytes) if rank in (0, 2) else (None, None)
            record = _record(rank, [5.0, 4.0, 3.0, 2.0], [1.0, 1.0], tx=tx)
            (run / f"rank{rank}.json").write_text(json.dumps(record))
    argv = ["--quick", "--steps", "4", "--warmup", "2", "--configs", "zero3", "hpz-event", "--out", str(tmp_path)]
    command.bench_main([*argv, "--from-runs"])
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["headline"]["hpz_over_zero3_cross_node_bytes"] == pytest.approx(2000 / 3000)
    assert written["loss_agreement"]["all_agree"]
    assert (tmp_path / "results.png").stat().st_size > 0


def test_the_tcp_window_a_link_needs_covers_its_queue_and_delay_both_ways():
    assert testbed.LinkShape("2gbit").round_trip_bytes == 50_000_000  # 250 MB/s x 2 x 100 ms of queue
    assert testbed.LinkShape("2gbit", latency="5ms").round_trip_bytes == 52_500_000
    assert testbed.LinkShape("50mbit").round_trip_bytes == 1_250_000  # below Linux's usual maximum: left as it is


def test_prediction_gives_the_planners_link_bound_time_beside_the_measured_one():
    summary = {"cross_node_bytes_per_rank_step": 1.1e6, "link_bound_step_s": 0.5}
    # 1e6 bytes per rank, 2 ranks per node: one direction of a 25 MB/s (200 Mbit/s) link carries 2e6 bytes: 0.08 s.
    results.add_prediction(summary, 1e6, "model", devices_per_node=2, link_bytes_per_s=25e6)
    assert summary["measured_over_predicted"] == pytest.approx(1.1)
    assert summary["predicted_link_bound_step_s"] == pytest.approx(0.08)
