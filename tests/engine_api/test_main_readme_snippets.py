"""The main README's runnable Python snippets run as written.

``tests/adapters/test_readme_snippets.py`` runs the adapters' READMEs; this runs the top-level
README's "API in a dozen lines" block as pasted (a fresh interpreter, default leases: the
embedded lease server) and checks the fetch it shows succeeded, and the Codecs block with
the pool, blocks and link speed it leaves to the reader defined first. The engine sketch
(``...`` placeholders, names of an engine) and the OpenAI client block (a running
``kvbridge up``; the client is exercised in ``tests/e2e``) are not runnable alone."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)

CODEC_PRELUDE = """
import torch
from kvbridge import KVLayout, KVPool
layout = KVLayout.vllm_flash(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
src, dst = KVPool.allocate(layout, 8), KVPool.allocate(layout, 8)
blocks, dst_blocks = src.alloc(4), dst.alloc(4)
for buf in src.buffers:
    buf.copy_(torch.randn(buf.shape).to(buf.dtype))
link_gbps = 1.25
"""

CODEC_CHECK = """
for layer in range(layout.num_layers):
    for s, d in zip(blocks, dst_blocks):
        a, b = src.block(layer, s), dst.block(layer, d)
        for x, y in zip(a, b):
            err = (x.float() - y.float()).abs().max().item()
            assert err <= 0.02 * x.float().abs().max().item() + 1e-6, err
assert choice.codec in ("raw", "lz4", "lz4+shuffle", "zstd", "zstd+shuffle"), choice.codec
print("ok")
"""


def _block(marker: str) -> str:
    found = [b for b in BLOCKS if marker in b]
    assert len(found) == 1, f"README: {len(found)} python blocks contain {marker!r}"
    return found[0]


def _run(code: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess[str]:
    f = tmp_path / "snippet.py"
    f.write_text(code)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, str(f)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.timeout(150)
def test_the_api_in_a_dozen_lines_runs(tmp_path: pathlib.Path) -> None:
    code = _block("KVLayout.vllm_flash(num_layers=32")
    check = ("\nassert result.ok and result.nbytes == 4 * layout.block_nbytes, result\n"
             "assert not result.failed_block_ids, result\nprint('ok')\n")
    p = _run(code + check, tmp_path)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]


@pytest.mark.timeout(150)
def test_the_codecs_block_runs(tmp_path: pathlib.Path) -> None:
    p = _run(CODEC_PRELUDE + _block("from kvbridge.codecs import") + CODEC_CHECK, tmp_path)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]
