"""The memory check after step 1: its verdict and message (units), and the peak it reads on CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_hpz.autotune.memory_check import MemoryCheck, check_memory, peak_memory_bytes
from lightning_hpz.planning.tuning import GIB
from lightning_hpz.planning.tuning_decision import TuningDecision


def _decision(budget_gib: float) -> TuningDecision:
    candidates = ({"name": "hpz1-half", "predicted_memory_gib": 1.5}, {"name": "hpz1-keep", "predicted_memory_gib": 3})
    return TuningDecision(
        hpz_partition_size=1,
        zero_thresholds={},
        candidate="hpz1-half",
        links=None,
        candidates=candidates,
        memory_budget_gib=budget_gib,
        reason="",
        source="probe",
        layout=(1, 1),
    )


@pytest.mark.parametrize(("peak_gib", "within"), [(1.9, True), (2.0, True), (2.1, False)])
def test_the_verdict_compares_the_peak_with_the_budget(peak_gib, within):
    check = check_memory(_decision(2.0), torch.device("cpu"), own_peak_bytes=peak_gib * GIB)
    assert check.within_budget is within
    assert check.predicted_gib == 1.5  # the chosen candidate's prediction, not another's


def test_a_peak_over_the_budget_names_the_numbers_and_the_fixes():
    message = MemoryCheck(peak_gib=9.5, budget_gib=8.0, predicted_gib=5.25).message()
    assert "9.50 GiB" in message and "8.00 GiB" in message and "5.25" in message and "20%" in message
    assert "autotune_memory_gib" in message and "micro-batch" in message and "activation checkpointing" in message
    within = MemoryCheck(peak_gib=7.0, budget_gib=8.0, predicted_gib=5.25).message()
    assert "autotune_memory_gib" not in within


def test_the_cpu_peak_is_this_process_resident_set_and_grows_with_what_it_holds():
    before = peak_memory_bytes(torch.device("cpu"))
    resident_now = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    held = torch.ones(int(before - resident_now + 64 * 2**20) // 4)  # touched: resident 64 MiB past the old peak
    assert float(held[-1]) == 1.0
    assert peak_memory_bytes(torch.device("cpu")) - before > 32 * 2**20
