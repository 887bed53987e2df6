"""Smoke run of the end-to-end benchmark (``python -m bench.e2e``) with the tiny model.

A handful of short requests per mix, both deployments really started with ``kvbridge up``;
checks the structure of the JSON, Markdown and PNG outputs, and that disaggregated and
colocated produced the same greedy tokens for the same seeded trace. The full benchmark
is ``python -m bench.e2e`` (see bench/results/e2e.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:          # `bench` is a top-level package of the repository
    sys.path.insert(0, str(ROOT))

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from bench import e2e  # noqa: E402

pytestmark = pytest.mark.timeout(120)

N = 5


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("e2e")
    out = {"json": d / "e2e.json", "md": d / "e2e.md", "png": d / "e2e.png"}
    cmd = [sys.executable, "-m", "bench.e2e", "--model", "tiny", "--mix", "both", "--requests", str(N),
           "--rate", "20", "--seed", "3", "--prompt-range", "8", "48", "--output-range", "3", "12",
           "--cores", "2", "--out", str(out["json"]), "--md", str(out["md"]), "--png", str(out["png"])]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "## Targets" in p.stdout                  # the Markdown report is printed too
    assert "[e2e" in p.stderr                        # progress on stderr
    return out


def test_trace_is_seeded_and_rate_scaled() -> None:
    mix = e2e.MIXES["long"]
    a, b = e2e.make_trace(mix, 20, seed=7), e2e.make_trace(mix, 20, seed=7)
    assert a == b and a != e2e.make_trace(mix, 20, seed=8)
    unit, prompts, outs = a
    assert all(mix.prompt[0] <= len(p) <= mix.prompt[1] for p in prompts)
    assert all(mix.output[0] <= o <= mix.output[1] for o in outs)
    assert all(0 <= t < e2e.VOCAB for p in prompts for t in p)
    slow, fast = e2e.at_rate(unit, prompts, outs, 1.0), e2e.at_rate(unit, prompts, outs, 2.0)
    assert [r.prompt_ids for r in slow] == [r.prompt_ids for r in fast]
    assert all(abs(s.at - 2 * f.at) < 1e-9 for s, f in zip(slow, fast))


def test_json_structure_and_token_agreement(run: dict[str, Path]) -> None:
    res = json.loads(run["json"].read_text())
    assert {"meta", "calibration", "mixes", "targets"} <= set(res)
    assert res["meta"]["model"] == "tiny" and res["meta"]["cores"] == 2
    assert set(res["mixes"]) == {"short", "long"}
    for name, mx in res["mixes"].items():
        assert mx["requests"] == N and len(mx["cells"]) == 1
        cell = mx["cells"][0]
        assert cell["rate"] == 20
        for mode in e2e.MODES:
            c = cell[mode]
            assert c["mode"] == mode
            s = c["summary"]
            assert s["requests"] == N and s["ok"] == N and s["failed"] == 0
            for k in ("ttft", "tpot", "e2e"):
                assert s[k]["p50"] is not None and s[k]["p50"] > 0
            assert set(s["buckets"]) == {"prompt", "output"}
            assert sum(b["requests"] for b in s["buckets"]["prompt"].values()) == N
            assert s["slo"] == {"ttft_s": mx["mix"]["ttft_slo"], "tpot_s": mx["mix"]["tpot_slo"]}
            assert len(c["records"]) == N
            for r in c["records"]:
                assert r["ok"], r["error"]
                assert len(r["tokens"]) == r["max_tokens"] == r["output_tokens"]   # ignore_eos: exact lengths
                assert len(r["token_times"]) == len(r["tokens"])
                assert r["ttft"] > 0 and r["server"] is not None                  # joined with the proxy's record
            assert c["cpu"]["wall_s"] > 0
        pd = cell["disaggregated"]
        assert all(r["kv_bytes"] > 0 and r["kv_transfer_s"] > 0 for r in pd["records"])
        assert pd["summary"]["kv_transfer"]["p50"] > 0
        cmp_ = cell["compare"]
        assert cmp_["tokens_different"] == 0 and cmp_["tokens_identical"] == N, cmp_
        by_idx = {r["idx"]: r["tokens"] for r in cell["colocated"]["records"]}
        assert all(r["tokens"] == by_idx[r["idx"]] for r in pd["records"])
        for k in ("goodput_requests", "ttft_p50", "ttft_p95", "ttft_p99", "tpot_p50", "tpot_p95", "tpot_p99"):
            assert k in cmp_
    assert len(res["targets"]) == 4 and all("met" in t and "measured" in t for t in res["targets"])
    assert res["calibration"]["threads"] == [1, 2] and res["calibration"]["ops"]


def test_markdown_and_png(run: dict[str, Path]) -> None:
    md = run["md"].read_text()
    for needle in ("## Targets", "## Engine calibration", "## short mix", "## long mix",
                   "| metric | colocated | disaggregated | PD / colo |", "TTFT P99, ms", "TPOT P99, ms",
                   "by prompt length", "by output length", "goodput"):
        assert needle in md, needle
    png = run["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
