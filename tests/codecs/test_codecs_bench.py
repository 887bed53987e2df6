"""Smoke run of the codec benchmark (``python -m bench.codecs``) on a little KV: the JSON and
Markdown it writes, ratios against the ceiling measured in the same run, break-even figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:          # `bench` is a top-level package of the repository
    sys.path.insert(0, str(ROOT))

from bench import codecs as bc  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_bench_codecs_smoke(tmp_path: Path) -> None:
    out = tmp_path / "codecs.json"
    assert bc.main(["--model", "tiny", "--sizes-mib", "0.0625,0.25", "--rounds", "2", "--min-seconds", "0.001",
                    "--codecs", "raw,int8,zstd+shuffle", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {(s["size"], s["codec"]): s for s in res["summary"]}
    assert len(rows) == 6 and all(len(r["enc"]) == 2 == len(r["ceil"]) for r in res["raw"])
    big = max(s for s, _ in rows)
    assert rows[(big, "int8")]["ratio"] > 1.3 and rows[(big, "raw")]["break_even_serial_gbps"] == 0
    assert rows[(big, "zstd+shuffle")]["break_even_overlap_gbps"] > 0
    assert res["ratios"]["zstd+shuffle, zero blocks"] > 50
    md = out.with_suffix(".md").read_text()
    assert "| int8 |" in md and "break-even" in md and "token XOR delta" in md
