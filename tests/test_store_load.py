"""The peer watchdog's load on the rendezvous store, counted against a real ``TCPStore`` with up to 1,024 simulated
ranks (benchmarks/store_load.py; docs/scale.md has the measured busy times).

Per interval the store serves two requests per rank (a ``set`` and a ``multi_get``) and 2N - 2 key reads in all;
no rank reads more than its node's ranks and the node leaders. The counts are exact; the timings are not asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "store_load.py"


@pytest.fixture(scope="module")
def rows() -> dict:
    command = [sys.executable, str(SCRIPT), "--ranks", "24", "1024", "--per-node", "8", "--intervals", "1", "--json"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    return {row["ranks"]: row for row in json.loads(finished.stdout)}


@pytest.mark.parametrize("ranks", [24, 1024])
def test_each_rank_sends_two_requests_per_interval_and_the_store_reads_2n_keys(rows, ranks):
    row, per_node = rows[ranks], 8
    nodes = ranks // per_node
    assert row["nodes"] == nodes
    assert row["requests"] == 2 * ranks
    # a rank reads rank 0's key; a leader also its node's; rank 0 its node's and the other leaders'
    assert row["keys_read"] == (ranks - nodes) + (nodes - 1) * per_node + (per_node - 1) + (nodes - 1) == 2 * ranks - 2
    assert row["most_keys_at_one_rank"] == (per_node - 1) + (nodes - 1)
