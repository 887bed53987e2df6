"""Smoke tests of ``bench.handoff`` and ``bench.api_overhead`` in tiny, bounded runs, so the
benchmarks cannot rot. They check that every mode completes with the decode side's bytes
equal to the prefill side's KV and that the outputs are written -- not speed (that is what
the benchmarks themselves report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:          # `bench` is a top-level package of the repository
    sys.path.insert(0, str(ROOT))

pytest.importorskip("torch")

from bench import api_overhead, handoff  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def _check_handoff(base: Path, kind: str) -> dict:
    d = json.loads(base.with_suffix(".json").read_text())
    assert d["setup"]["link"]["kind"] == kind
    assert base.with_suffix(".md").read_text().startswith(f"Link: **{kind}**")
    modes = {(t["mode"], t["tokens"]) for t in d["trials"]}
    assert modes == {(m, n) for m in handoff.MODES for n in d["buckets"]}
    for t in d["trials"]:
        assert t["exposed_s"] > 0 and t["nbytes"] > 0
    for r in d["summary"]:
        assert r["ceiling_whole_s"]["median"] > 0 and r["rtt_s"]["median"] > 0
        for m in handoff.MODES:
            assert r[m]["x_ceiling"]["median"] > 0
    return d


def test_handoff_token_bucket_quick(tmp_path: Path) -> None:
    """The fallback link (no namespaces): both peers on loopback behind an in-process bucket."""
    base = tmp_path / "handoff"
    assert handoff.main(["--link", "bucket", "--model", "tiny", "--buckets", "64,128", "--reps", "1",
                         "--pings", "3", "--out", str(base)]) == 0
    d = _check_handoff(base, "bucket")
    assert "why" in d["setup"]["link"]


def test_handoff_netns_quick(tmp_path: Path) -> None:
    why = handoff.NetnsLink.available()
    if why is not None:
        pytest.skip(f"cannot make network namespaces here: {why}")
    base = tmp_path / "handoff"
    assert handoff.main(["--link", "netns", "--model", "tiny", "--buckets", "64,128", "--reps", "1",
                         "--pings", "3", "--out", str(base)]) == 0
    d = _check_handoff(base, "netns")
    # Everything it made is gone.
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for ns in d["setup"]["link"]["namespaces"]:
        assert ns not in left
    links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    for dev in d["setup"]["link"]["veth"]:
        assert dev not in links


def test_api_overhead_quick(tmp_path: Path) -> None:
    base = tmp_path / "api"
    assert api_overhead.main(["--quick", "--reps", "1", "--iters", "50", "--blocks", "64", "--layers", "8",
                              "--fetches", "1", "--out", str(base)]) == 0
    d = json.loads(base.with_suffix(".json").read_text())
    assert [r["transport"] for r in d["percall"]] == ["inproc", "tcp"]
    for r in d["percall"]:
        assert r["fetch_us"]["median"] > 0 and r["start_result_us"]["median"] > 0
    assert [r["loop"] for r in d["loop_lag"]] == ["select", "select + gc.freeze()", "default"]
    for r in d["loop_lag"]:
        assert r["busy_max_ms"] >= 0 and r["per_rep"][0]["busy_wakeups"] > 0
    assert "start_fetch().result()" in base.with_suffix(".md").read_text()
