"""A codec'd KV handoff on the reference model (the modest version of ``bench.codec_accuracy``):
lossless codecs change nothing; int8 keeps greedy decoding and KV error within its targets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:          # `bench` is a top-level package of the repository
    sys.path.insert(0, str(ROOT))

from bench.codec_accuracy import _prompts, evaluate, markdown  # noqa: E402
from kvbridge.workers.model import CausalLM  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_handoff_accuracy_on_reference_model() -> None:
    model = CausalLM.from_seed("tiny", seed=7)
    res = evaluate(["int8", "fp8", "lz4+shuffle", "zstd+shuffle"], model, _prompts(10, seed=3, lo=20, hi=90),
                   steps=16, pool_dtype="bfloat16")
    c = res["codecs"]
    for name in ("raw", "lz4+shuffle", "zstd+shuffle"):
        assert c[name]["token_agreement"] == 1.0 and c[name]["sequence_match"] == 1.0
        assert c[name]["kv_max_abs"] == 0.0 and c[name]["logit_max_abs"] == 0.0
    assert c["int8"]["steps"] == 160
    assert c["int8"]["token_agreement"] >= 0.99          # target >= 99% (bench: >= 100 prompts)
    assert c["int8"]["kv_rel_fro"] < 0.01                # target < 1% relative KV error
    assert c["fp8"]["token_agreement"] >= 0.95 and c["fp8"]["kv_rel_fro"] < 0.04
    assert c["int8"]["kv_rel_fro"] < c["fp8"]["kv_rel_fro"]  # 7 bits of mantissa-equivalent beat 3
    assert 0 < c["int8"]["logit_max_abs"] < c["fp8"]["logit_max_abs"]
    assert "| int8 |" in markdown(res, "tiny")
