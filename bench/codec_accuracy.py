"""Accuracy of a codec'd KV handoff on the reference model.

For each prompt: prefill on a *prefill* pool, move its blocks to a *decode* pool through a
codec (encode -> frame bytes -> decode), then decode greedily there. The reference is the
same handoff with ``raw`` (bit-exact). Reported per codec:

* **token agreement**: teacher-forced, over all prompts and steps: at each step both runs
  are fed the reference token and the argmax must agree (so one early flip is counted once,
  not for every later token); and the share of prompts whose whole free-running greedy
  continuation equals the reference;
* **KV error** over the prompt tokens (padding slots excluded): max and mean absolute,
  relative (||x' - x||_F / ||x||_F, and max |x' - x| / max |x|);
* **logit error**: max and mean |logits' - logits| over the decode steps, and relative to
  the reference logits' standard deviation;
* **logit margins** of the reference (top-1 minus top-2): a flip needs an error larger than
  the margin, so random weights with small margins make agreement harder, not easier.

All prompts decode as one batch (the same batch in every run), so the reference and the
codec runs compute with the same shapes.

Run::

    python -m bench.codec_accuracy [--prompts 128] [--steps 16] [--model small] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from kvbridge.codecs import get_codec
from kvbridge.pool import KVPool
from kvbridge.workers.engine import Engine
from kvbridge.workers.model import CausalLM

__all__ = ["evaluate", "markdown", "main"]


def _prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _kv(pool: KVPool, blocks: Sequence[Sequence[int]], lengths: Sequence[int]) -> torch.Tensor:
    """Every prompt token's K and V, all layers, float32, flattened."""
    out = []
    for layer in range(pool.layout.num_layers):
        k, v = pool.layer_kv(layer)  # type: ignore[misc]
        for b, n in zip(blocks, lengths):
            idx = torch.tensor(list(b))
            out.append(k[idx].flatten(0, 1)[:n].float().flatten())
            out.append(v[idx].flatten(0, 1)[:n].float().flatten())
    return torch.cat(out)


def _decode_run(engine: Engine, blocks: list[list[int]], lengths: list[int], first: list[int], steps: int,
                forced: Optional[list[list[int]]]) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy decode of all prompts as one batch; ``forced`` feeds the reference tokens instead."""
    toks = [[t] for t in first]
    logits = []
    for i in range(steps):
        feed = [f[i] for f in forced] if forced is not None else [t[-1] for t in toks]
        lg = engine.decode_step([(b, n + i, t) for b, n, t in zip(blocks, lengths, feed)])
        logits.append(lg)
        for row, t in zip(toks, lg.argmax(-1).tolist()):
            row.append(int(t))
    return toks, torch.stack(logits, 1)  # (P, steps, vocab)


def evaluate(codecs: Sequence[str], model: CausalLM, prompts: Sequence[Sequence[int]], steps: int = 16,
             pool_dtype: str = "bfloat16", block_size: int = 16, chunk_size: int = 256) -> dict[str, Any]:
    """Run the handoff for every codec; returns ``{"codecs": {name: metrics}, ...}``."""
    layout = model.kv_layout(block_size, pool_dtype)
    need = [-(-(len(p) + steps) // block_size) for p in prompts]
    src = KVPool.allocate(layout, sum(-(-len(p) // block_size) for p in prompts) + 1)
    dst = KVPool.allocate(layout, sum(need) + 1)
    pre, dec = Engine(model, src), Engine(model, dst)
    src_blocks, first = [], []
    for p in prompts:
        b = src.alloc(-(-len(p) // block_size))
        first.append(int(pre.prefill(p, b, chunk_size).argmax()))
        src_blocks.append(b)
    lengths = [len(p) for p in prompts]
    dst_blocks = [dst.alloc(n) for n in need]
    flat_src = [b for bs in src_blocks for b in bs]
    flat_dst = [b for bs, s in zip(dst_blocks, src_blocks) for b in bs[:len(s)]]
    x_ref = _kv(src, src_blocks, lengths)
    results: dict[str, Any] = {}
    ref_toks: Optional[list[list[int]]] = None
    ref_logits = torch.empty(0)
    for name in ["raw", *[c for c in codecs if c != "raw"]]:
        codec = get_codec(name)
        for buf in dst.buffers:
            buf.zero_()
        t0 = time.perf_counter()
        frame = codec.encode(src, flat_src)
        codec.decode(bytes(frame), dst, flat_dst)
        moved = time.perf_counter() - t0
        x = _kv(dst, [d[:len(s)] for d, s in zip(dst_blocks, src_blocks)], lengths)
        err = (x - x_ref).abs()
        if ref_toks is None:
            ref_toks, ref_logits = _decode_run(dec, dst_blocks, lengths, first, steps, None)
            free_toks = ref_toks
            logits = ref_logits
        else:
            for buf in dst.buffers:  # fresh copy: the forced run appended tokens
                buf.zero_()
            codec.decode(bytes(frame), dst, flat_dst)
            free_toks, _ = _decode_run(dec, dst_blocks, lengths, first, steps, None)
            codec.decode(bytes(frame), dst, flat_dst)
            _, logits = _decode_run(dec, dst_blocks, lengths, first, steps, ref_toks)
        agree = (logits.argmax(-1) == ref_logits.argmax(-1)).float()
        dl = (logits - ref_logits).abs()
        results[name] = {
            "ratio": frame.ratio, "lossless": codec.lossless, "handoff_s": moved,
            "token_agreement": float(agree.mean()), "steps": int(agree.numel()),
            "sequence_match": sum(a == b for a, b in zip(free_toks, ref_toks)) / len(prompts),
            "kv_max_abs": float(err.max()), "kv_mean_abs": float(err.mean()),
            "kv_rel_fro": float(torch.linalg.vector_norm(x - x_ref) / torch.linalg.vector_norm(x_ref)),
            "kv_rel_max": float(err.max() / x_ref.abs().max()),
            "logit_max_abs": float(dl.max()), "logit_mean_abs": float(dl.mean()),
            "logit_rel_max": float(dl.max() / ref_logits.std()),
        }
    top2 = ref_logits.topk(2, dim=-1).values
    margins = (top2[..., 0] - top2[..., 1]).flatten()
    q = torch.quantile(margins, torch.tensor([0.01, 0.05, 0.5]))
    for r in results.values():
        r["steps_with_margin_below_max_logit_error"] = float((margins < r["logit_max_abs"]).float().mean())
    return {"codecs": results, "prompts": len(prompts), "steps": steps, "pool_dtype": pool_dtype,
            "block_size": block_size, "logit_std": float(ref_logits.std()),
            "margin_p01": float(q[0]), "margin_p05": float(q[1]), "margin_median": float(q[2]),
            "prompt_tokens": [min(lengths), max(lengths), int(statistics.mean(lengths))]}


def markdown(res: dict[str, Any], model: str) -> str:
    lines = [f"Model `{model}` (seeded random weights), {res['prompts']} prompts of "
             f"{res['prompt_tokens'][0]}-{res['prompt_tokens'][1]} tokens, {res['steps']} greedy steps each, "
             f"{res['pool_dtype']} pools, block size {res['block_size']}. Reference logits: std "
             f"{res['logit_std']:.2f}; top-1 minus top-2 margin median {res['margin_median']:.3f}, 5th percentile "
             f"{res['margin_p05']:.4f}, 1st percentile {res['margin_p01']:.4f}.", "",
             "| codec | ratio | token agreement | sequences identical | KV rel. error (Frobenius) | KV max abs / "
             "mean abs | KV max rel. | logit max / mean abs | logit max / logit std | steps with margin < "
             "max logit err |",
             "|---|---:|---:|---:|---:|---|---:|---|---:|---:|"]
    for name, r in res["codecs"].items():
        lines.append(
            f"| {name} | {r['ratio']:.2f} | {100 * r['token_agreement']:.2f}% of {r['steps']} | "
            f"{100 * r['sequence_match']:.0f}% | {100 * r['kv_rel_fro']:.3f}% | {r['kv_max_abs']:.3g} / "
            f"{r['kv_mean_abs']:.2g} | {100 * r['kv_rel_max']:.2f}% | {r['logit_max_abs']:.3g} / "
            f"{r['logit_mean_abs']:.2g} | {r['logit_rel_max']:.3f} | "
            f"{100 * r['steps_with_margin_below_max_logit_error']:.1f}% |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", help="model preset (default small)")
    ap.add_argument("--model-seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=(32, 512), metavar=("LO", "HI"))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-dtype", default="bfloat16")
    ap.add_argument("--codecs", default="int8,fp8,fp8-block,zstd+shuffle")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "kvbridge-bench", "codec_accuracy.json"),
                    help="JSON path (Markdown next to it); default a scratch directory")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = CausalLM.from_seed(a.model, seed=a.model_seed)
    prompts = _prompts(a.prompts, a.seed, *a.prompt_range)
    print(f"accuracy: {len(prompts)} prompts, model {a.model}", file=sys.stderr)
    res = evaluate([c for c in a.codecs.split(",") if c], model, prompts, a.steps, a.pool_dtype)
    res.update(model=a.model, model_seed=a.model_seed, seed=a.seed, torch=torch.__version__)
    md = markdown(res, a.model)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out} and {out.with_suffix('.md')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
