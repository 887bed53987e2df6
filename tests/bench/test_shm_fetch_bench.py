"""Smoke run of ``python -m bench.shm_fetch`` (where an shm fetch's time goes): one size, one
short repetition; every mode is timed, and the bench itself fails if a read or fetch does not
land the handle's bytes (its C calls must return code 0 and the handle's checksums)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(120)


def test_shm_fetch_times_every_mode(tmp_path: Path) -> None:
    from kvbridge import blockcopy
    if blockcopy.shm_read is None:
        pytest.skip("the extension is not built")
    out = tmp_path / "shm_fetch.json"
    cmd = [sys.executable, "-m", "bench.shm_fetch", "--sizes", "65536", "--reps", "1", "--iters", "50",
           "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"memmove", "shm_read", "+ compare", "fetch (keep)", "fetch"}
    assert all(r["us"]["median"] > 0 for r in rows.values())
    assert rows["memmove"]["ratio"]["median"] == 1.0
