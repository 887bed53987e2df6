"""Smoke run of ``python -m bench.fetch_cpu`` (where a 4 KiB tcp fetch spends its CPU): a few
calls per mode; the JSON names every mode with latencies and per-thread CPU of both processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("torch")
pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="per-thread CPU comes from Linux /proc")]


def test_fetch_cpu_reports_every_mode(tmp_path: Path) -> None:
    out = tmp_path / "fetch_cpu.json"
    p = subprocess.run([sys.executable, "-m", "bench.fetch_cpu", "--n", "50", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(out.read_text())
    modes = ["plain 4 KiB ping-pong", "read (transport.read)", "keep (fetch, release=False)", "release (fetch)"]
    for m in modes:
        r = got[m]
        assert r["median_us"] > 0 and r["mean_us"] > 0
        assert set(r["cpu_us_per_call"]) == {"sender", "receiver"}
        assert r["cpu_us_per_call_total"] > 0
