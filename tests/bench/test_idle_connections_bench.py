"""Smoke run of ``python -m bench.idle_connections``: one quiet/idle round pair with a few idle
connections; every fetch must succeed (the bench raises otherwise), and the report names the
sender's threads and RSS beside the latencies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def test_idle_connections_bench_runs_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "idle.json"
    cmd = [sys.executable, "-m", "bench.idle_connections", "--idle", "50", "--rounds", "1", "--fetches", "60",
           "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stderr[-2000:]
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["quiet_us"] > 0 and row["idle_us"] > 0 and row["threads_idle"] >= 1 and row["rss_idle"] > 0
    assert data["target"] == 1.2 and "met" in data
