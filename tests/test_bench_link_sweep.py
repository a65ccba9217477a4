"""``lightning-hpz bench --bandwidth R1 R2 ...``: one benchmark per rate, then the comparison across rates (tables per
rate, the step times side by side, the verdict, the log-log chart), checked on made-up results without a testbed."""

import argparse
import copy

import pytest

from lightning_hpz.bench import link_sweep
from lightning_hpz.bench.command import parse_args


def _summary(step_s: float, ratio: float) -> dict:
    return {
        "step_time_median_s": step_s,
        "step_time_iqr_s": [step_s * 0.9, step_s * 1.1],
        "link_bound_step_s": step_s / 2,
        "predicted_link_bound_step_s": step_s / 2.1,
        "cross_node_bytes_per_rank_step": 1e6 * ratio,
        "predicted_cross_node_bytes_per_rank_step": 1e6,
        "measured_over_predicted": ratio,
        "predicted_model_state_bytes_per_rank": 3 * 2**20,
        "peak_rss_bytes_per_rank": 500 * 2**20,
    }


def _results(bandwidth: str, scale: float, ratio: float = 1.01, agrees: bool = True, failed=None) -> dict:
    names = ("zero3", "fsdp2-hsdp")
    return {
        "command": "lightning-hpz bench --bandwidth 50mbit 2gbit",
        "link": {"bandwidth": bandwidth},
        "devices_per_node": 2,
        "parameter_count": 1_850_368,
        "rounds": 3,
        "steps": 14,
        "warmup": 3,
        "configurations": {name: _summary(scale * (i + 1), ratio) for i, name in enumerate(names)},
        "failed": failed or {},
        "loss_agreement": {
            "reference": "zero3",
            "configurations": {
                name: {"max_difference": 0.0, "tolerance": 1e-6, "agrees": agrees or name == "zero3"} for name in names
            },
        },
    }


def test_every_rate_passing_is_a_pass():
    outcome = link_sweep.verdicts([_results("50mbit", 4.0), _results("2gbit", 0.2)])
    assert outcome["all_pass"] and set(outcome["speeds"]) == {"50mbit", "2gbit"}


@pytest.mark.parametrize(
    "broken",
    [{"ratio": 1.06}, {"ratio": 0.94}, {"agrees": False}, {"failed": {"fsdp2-hsdp": "exit 1"}}],
    ids=["bytes-6%-over", "bytes-6%-under", "loss-disagrees", "a-configuration-failed"],
)
def test_one_rate_out_of_bounds_fails_the_comparison(broken):
    assert not link_sweep.verdicts([_results("50mbit", 4.0), _results("2gbit", 0.2, **broken)])["all_pass"]


def test_the_comparison_has_a_table_per_rate_and_the_step_times_side_by_side():
    text = link_sweep.comparison_markdown([_results("50mbit", 4.0), _results("2gbit", 0.2)])
    assert text.count("### 50mbit") == 1 and text.count("### 2gbit") == 1
    assert "| fsdp2-hsdp | 8.000 | 0.400 |" in text  # the overview row: one median per rate
    assert "| 3.0 | 500 |" in text  # model states (planner) and peak RSS (measured), MiB per rank
    assert text.startswith("Command: `lightning-hpz bench --bandwidth 50mbit 2gbit`")
    assert text.rstrip().endswith("**yes**.")


def test_the_chart_is_written(tmp_path):
    link_sweep.write_chart([_results("50mbit", 4.0), _results("2gbit", 0.2)], tmp_path / "chart.png")
    assert (tmp_path / "chart.png").stat().st_size > 10_000


def test_each_rate_runs_into_its_own_folder_and_the_ports_keep_counting(tmp_path):
    args = parse_args(["--bandwidth", "50mbit", "2gbit", "--out", str(tmp_path), "--configs", "zero3"])
    seen = []

    def run_one(speed_args: argparse.Namespace, command: str) -> dict:
        seen.append((speed_args.shape.bandwidth, speed_args.out, speed_args.port))
        speed_args.port += 5  # five launches at this rate
        return _results(speed_args.shape.bandwidth, 1.0)

    link_sweep.run_sweep(copy.copy(args), "cmd", run_one)
    assert seen == [("50mbit", tmp_path / "50mbit", args.port), ("2gbit", tmp_path / "2gbit", args.port + 5)]
    assert (tmp_path / "comparison.md").is_file() and (tmp_path / "step_time_vs_link.png").is_file()


def test_a_rate_given_twice_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--bandwidth", "50mbit", "50mbit", "--out", "x"])
    assert "a rate is listed twice" in capsys.readouterr().err
