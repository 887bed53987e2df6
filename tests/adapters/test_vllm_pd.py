"""The vLLM connector with the real engine: the README's ``python -m kvbridge_vllm.pd_demo``
command, as documented (two vLLM instances + a reference one, 50 prompts, both kill tests), with
the consumer loading asynchronously (the default) and layer by layer.

Marker ``vllm``; skipped where vLLM is not installed (``pip install 'kvbridge[vllm]'``).
Takes about 2-3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vLLM: pip install 'kvbridge[vllm]' (after torch==2.13.0)")]


def readme_command() -> list[str]:
    text = (ROOT / "adapters" / "kvbridge_vllm" / "README.md").read_text()
    (line,) = [ln for ln in re.findall(r"^python -m kvbridge_vllm\.pd_demo.*$", text, re.M)]
    return shlex.split(line)


@pytest.mark.parametrize("load", ["async", "layerwise"])
def test_pd_equals_single_instance_and_kills_leak_nothing(tmp_path: pathlib.Path, load: str) -> None:
    cmd = readme_command() + (["--consumer-load", load] if load != "async" else [])
    out = tmp_path / "report.json"
    cmd = [sys.executable if c == "python" else c for c in cmd]
    cmd[cmd.index("--out") + 1] = str(out)
    cmd += ["--model-dir", str(tmp_path / "model")]
    env = dict(os.environ)
    if importlib.util.find_spec("kvbridge_vllm") is None:   # an editable install that predates the adapters
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "adapters"), str(ROOT), env.get("PYTHONPATH", "")])
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=840)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-5000:]
    r = json.loads(out.read_text())
    assert r["pd"]["identical"] == r["pd"]["of"] >= 50, r["pd"]
    assert r["pd"]["load_failures"] == 0 and r["pd"]["handles_missing"] == 0
    assert r["pd"]["producer_free_blocks_after"] == r["pd"]["producer_free_blocks_start"]
    k = r["kill_consumer"]
    assert k["blocks_held_at_kill"] > 0 and k["blocks_leaked"] == 0 and k["producer_requests_left"] == 0, k
    kp = r["kill_producer"]
    assert kp["recompute"]["identical_after_reprefill"] == kp["recompute"]["requests"], kp
    assert kp["fail"]["finish_reasons"] == ["error"] and kp["fail"]["tokens_generated"] == 0, kp
    assert kp["recompute"]["free_blocks_back"] and kp["fail"]["free_blocks_back"]
    assert r["passed"] and p.returncode == 0
