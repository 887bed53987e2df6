"""``int4`` (KIVI-style): keys per channel over a block's tokens, values per token; within bounds on
every layout kind, and its stated accuracy on the reference model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcodec_helpers import FLOAT_DTYPES, LAYOUTS, make_pool, parts_of

from kvbridge.codecs import get_codec
from kvbridge.codecs.kivi import quantize_int4
from kvbridge.errors import ConfigError
from kvbridge.layout import DTYPES, KVOrder, TokenOrder
from kvbridge.pool import KVPool

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytestmark = pytest.mark.timeout(60)
HALF_ULP = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def _bound(x: torch.Tensor, dim: int, dst: torch.dtype) -> torch.Tensor:
    """Half a step of the group's range (plus float16 rounding of scale and minimum)."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    b = (hi - lo) / 15 * (0.5 + 16 * 2.0 ** -11) + lo.abs() * 2.0 ** -11 + 2.0 ** -24
    return (b + (x.abs() + b) * HALF_ULP[dst]).expand_as(x)


@settings(max_examples=30)
@given(kind=st.sampled_from(sorted(LAYOUTS)), src_dtype=st.sampled_from(FLOAT_DTYPES),
       dst_dtype=st.sampled_from(FLOAT_DTYPES), data=st.data())
def test_int4_within_bounds(kind: str, src_dtype: str, dst_dtype: str, data: st.DataObject) -> None:
    nb = data.draw(st.integers(1, 6), label="num_blocks")
    src = make_pool(kind, src_dtype, num_blocks=nb, seed=data.draw(st.integers(0, 99)), block_size=8)
    dst = KVPool.allocate(type(src.layout)(**{**src.layout.to_dict(), "dtype": dst_dtype}), nb)
    ids = data.draw(st.lists(st.integers(0, nb - 1), min_size=1, max_size=nb, unique=True), label="ids")
    frame = get_codec("int4").encode(src, ids)
    get_codec("int4").decode(bytes(frame), dst, list(range(len(ids))))
    tok = 2 if src.layout.token_order is TokenOrder.HND and src.layout.kv_order is not KVOrder.LATENT else 1
    for layer in range(3):
        for p, (s, d) in enumerate(zip(parts_of(src, layer, ids), parts_of(dst, layer, list(range(len(ids)))))):
            x = s.float()
            bound = _bound(x, tok if p == 0 else -1, DTYPES[dst_dtype])  # keys per channel, values per token
            assert bool(((x - d.float()).abs() <= bound).all())


def test_int4_ratio_and_refusals() -> None:
    pool = make_pool("vllm_flash", "bfloat16", num_blocks=4, block_size=16)
    assert get_codec("int4").encode(pool, [0, 1, 2, 3]).ratio > 2.5  # 16-token blocks: ~3x for bf16
    with pytest.raises(ConfigError, match="float16"):
        quantize_int4(torch.tensor([[0.0, 1e6]]), -1)


def test_int4_accuracy_is_reported_honestly() -> None:
    from bench.codec_accuracy import _prompts, evaluate
    from kvbridge.workers.model import CausalLM

    res = evaluate(["int4", "int8"], CausalLM.from_seed("tiny", seed=7), _prompts(10, seed=3, lo=20, hi=90), 16)
    c = res["codecs"]
    assert c["int4"]["ratio"] > c["int8"]["ratio"]
    assert c["int4"]["kv_rel_fro"] > c["int8"]["kv_rel_fro"]   # 4 bits lose more than 8
    assert c["int4"]["kv_rel_fro"] < 0.15 and c["int4"]["token_agreement"] >= 0.85
