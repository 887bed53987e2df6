"""Smoke run of ``python -m bench.copyhash`` (a verified copy against the copy alone): two sizes,
one repetition; every mode is timed for every size, and the bench itself fails if the one-pass
paths (AVX-512 where there is one, AVX2) and the chunked path disagree with ``hash_blocks``, or
a block of two parts hashes differently on one thread and on two."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("evict", [False, True])
def test_copyhash_times_every_mode(tmp_path: Path, evict: bool) -> None:
    from kvbridge import blockcopy
    if not blockcopy.NATIVE:
        pytest.skip("the extension is not built")
    out = tmp_path / "copyhash.json"
    cmd = [sys.executable, "-m", "bench.copyhash", "--sizes", "4096,1048577", "--reps", "1", "--out", str(out)]
    p = subprocess.run(cmd + (["--evict"] if evict else []), cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["evict"] is evict
    modes = {"memmove", "copy", "copy+hash", "copy+hash (AVX2)", "copy then hash", "hash", "copy+hash, 2 parts",
             "copy+hash, 2 parts, 2 threads"}
    for size in (4096, 1048577):
        rows = {r["mode"]: r for r in got["rows"] if r["size"] == size}
        assert set(rows) == modes
        assert all(r["us"]["median"] > 0 and r["ratio"]["median"] > 0 for r in rows.values())
        assert rows["memmove"]["ratio"]["median"] == 1.0
    assert (tmp_path / "copyhash.md").read_text().count("\n") == 2 + 2 * len(modes)
