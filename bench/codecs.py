"""Codec benchmark: ratio, encode and decode throughput against a copy ceiling measured in the
same run, and per codec the link bandwidth below which it makes a transfer faster.

The KV is real: the reference model (``--model``, seeded weights) prefills prompts made of
this repository's own text (byte tokens) into a paged pool; handles are sets of its blocks in
shuffled order (block-shaped, scattered). Prompts have random lengths, so last blocks are
partly filled (zeros past the last token), as in serving.

CPU mode (default): the ceiling is ``memcpy`` (a contiguous ``copy_`` of the same number of
bytes). Each round measures, for every codec in turn, the ceiling, then the codec's encode
(into a preallocated staging buffer) and decode (into another pool); ratios are per round
(paired), reported as median [min-max] over rounds. ``--gpu``: the pool lives on the GPU,
the ceiling is a device-to-device copy, and the fused CUDA kernels run against the
``torch.compile``d torch twin of gather+quantize (the issue's target: >= 0.9x of it).

Also a ratio study on the same KV: the registered codecs, byte shuffle and token-to-token
deltas (XOR of neighbouring tokens' bits, as CacheGen exploits), K vs V, full vs partly
filled blocks, zero blocks.

Run::

    python -m bench.codecs [--quick] [--gpu] [--out bench/results/codecs.json]
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
from typing import Any, Callable, Optional, Sequence

import torch

from kvbridge.codecs import CodecSpeed, available_codecs, break_even_gbps, get_codec
from kvbridge.codecs.base import layer_parts
from kvbridge.codecs.lossless import shuffle_bytes
from kvbridge.pool import KVPool
from kvbridge.workers.engine import Engine
from kvbridge.workers.model import CausalLM
from kvbridge.workers.tokenizer import ByteTokenizer

__all__ = ["build_kv", "ratio_study", "throughput", "markdown", "main"]

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _corpus() -> str:
    parts = [ROOT / "README.md", *sorted((ROOT / "kvbridge").rglob("*.py"))]
    return "\n".join(p.read_text(errors="replace") for p in parts if p.is_file())


def build_kv(model: CausalLM, kv_bytes: int, dtype: str, device: str = "cpu", seed: int = 0,
             block_size: int = 16, tile_to: int = 0) -> tuple[KVPool, list[int], list[int]]:
    """Prefill text prompts until the pool holds ``kv_bytes`` of KV; returns (pool, blocks, full
    blocks). Computed on the CPU, then copied to ``device``; ``tile_to`` repeats the blocks up to
    that many bytes (GPU mode: the lossy codecs' speed does not depend on repeats)."""
    layout = model.kv_layout(block_size, dtype)
    per_block = layout.block_nbytes
    nblocks = max(1, kv_bytes // per_block)
    pool = KVPool.allocate(layout, nblocks + 64)
    eng = Engine(model, pool)
    text = ByteTokenizer().encode(_corpus(), add_bos=False)
    rng = random.Random(seed)
    blocks: list[int] = []
    full: list[int] = []
    while len(blocks) < nblocks:
        n = min(rng.randint(200, 1500), (nblocks - len(blocks)) * block_size)
        start = rng.randrange(0, max(1, len(text) - n))
        prompt = text[start:start + n]
        b = pool.alloc(eng.blocks_needed(len(prompt)))
        eng.prefill(prompt, b, chunk_size=512)
        blocks += b
        full += b if len(prompt) % block_size == 0 else b[:-1]
    if device != "cpu" or tile_to > kv_bytes:
        reps = max(1, -(-tile_to // kv_bytes))
        dev = KVPool.allocate(layout, pool.num_blocks * reps, device=device)
        src_idx = torch.tensor(blocks)
        for layer in range(layout.num_layers):
            for d, s in zip(layer_parts(dev, layer), layer_parts(pool, layer)):
                for r in range(reps):
                    d[src_idx + r * pool.num_blocks] = s[src_idx].to(device)
        blocks = [b + r * pool.num_blocks for r in range(reps) for b in blocks]
        full = [b + r * pool.num_blocks for r in range(reps) for b in full]
        pool = dev
    return pool, blocks, full



def _xor_delta(x: torch.Tensor) -> torch.Tensor:
    """Bits of each token XOR the previous token's (per layer, part, block, head) -- NHD parts."""
    bits = x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)
    d = bits.clone()
    d[..., 1:, :, :] ^= bits[..., :-1, :, :]
    return d.view(x.dtype)


def ratio_study(pool: KVPool, blocks: list[int], full: list[int]) -> dict[str, float]:
    """Compression ratios of the registered codecs and of variants on this KV."""
    import zstandard

    out: dict[str, float] = {}
    names = [n for n in available_codecs()]
    for name in names:
        out[name] = get_codec(name).encode(pool, blocks).ratio
    L = pool.layout
    idx = torch.tensor(blocks)
    kv = torch.stack([torch.stack(pool.layer_kv(layer))[:, idx] for layer in range(L.num_layers)])  # type: ignore
    kv = kv.cpu().contiguous()  # (layers, 2, n, bs, heads, dim)
    z = zstandard.ZstdCompressor(level=1)

    def zr(t: torch.Tensor, shuffle: bool = True) -> float:
        b = shuffle_bytes(t.contiguous()) if shuffle else t.contiguous().view(-1).view(torch.uint8)
        return b.numel() / len(z.compress(memoryview(b.numpy())))

    out["zstd+shuffle, token XOR delta"] = zr(_xor_delta(kv))
    out["zstd+shuffle, K only"] = zr(kv[:, 0])
    out["zstd+shuffle, V only"] = zr(kv[:, 1])
    out["zstd+shuffle, full blocks only"] = get_codec("zstd+shuffle").encode(pool, full).ratio if full else 0.0
    zero = KVPool.allocate(L, 8)
    out["zstd+shuffle, zero blocks"] = get_codec("zstd+shuffle").encode(zero, list(range(8))).ratio
    out["lz4, zero blocks"] = get_codec("lz4").encode(zero, list(range(8))).ratio
    return out


def _time(fn: Callable[[], Any], sync: Callable[[], None], min_s: float) -> float:
    """Seconds per call: repeat until ``min_s`` has passed (at least twice), after one warm call."""
    fn()
    sync()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        sync()
        el = time.perf_counter() - t0
        if el >= min_s and n >= 2:
            return el / n


def throughput(pool: KVPool, blocks: list[int], sizes: Sequence[int], codecs: Sequence[str], rounds: int,
               min_s: float, extra: Optional[dict[str, Callable[[list[int]], Callable[[], Any]]]] = None,
               log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Per size and codec: samples of encode/decode GB/s and of the paired ceiling GB/s."""
    dev = pool.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    dst = KVPool.allocate(pool.layout, pool.num_blocks, device=dev)
    per_block = pool.layout.block_nbytes
    rows: list[dict[str, Any]] = []
    rng = random.Random(1)
    for size in sizes:
        n = max(1, min(len(blocks), size // per_block))
        ids = rng.sample(blocks, n)
        raw = n * per_block
        a = torch.empty(raw, dtype=torch.uint8, device=dev)
        b = torch.empty_like(a)
        a.copy_(torch.randint(0, 256, (raw,), dtype=torch.uint8).to(dev))
        frames = {}
        for name in codecs:
            c = get_codec(name)
            out = torch.empty(c.max_encoded_nbytes(pool.layout, n), dtype=torch.uint8, device=c.output_device(pool))
            frames[name] = (c, out, c.encode(pool, ids, out=out))
        samples: dict[str, dict[str, list[float]]] = {k: {"enc": [], "dec": [], "ceil": []}
                                                      for k in [*codecs, *(extra or {})]}
        for r in range(rounds):
            order = list(codecs[r % len(codecs):]) + list(codecs[:r % len(codecs)])
            for name in order:
                c, out, _ = frames[name]
                ceil = raw / _time(lambda: b.copy_(a), sync, min_s) / 1e9
                enc = raw / _time(lambda: c.encode(pool, ids, out=out), sync, min_s) / 1e9
                fr = frames[name][2]
                dec = raw / _time(lambda: c.decode(fr, dst, ids), sync, min_s) / 1e9
                s = samples[name]
                s["enc"].append(enc)
                s["dec"].append(dec)
                s["ceil"].append(ceil)
            for name, make in (extra or {}).items():
                fn = make(ids)
                ceil = raw / _time(lambda: b.copy_(a), sync, min_s) / 1e9
                samples[name]["enc"].append(raw / _time(fn, sync, min_s) / 1e9)
                samples[name]["ceil"].append(ceil)
            log(f"  {raw / MiB:.0f} MiB ({n} blocks): round {r + 1}/{rounds} done")
        for name, s in samples.items():
            ratio = frames[name][2].ratio if name in frames else None
            rows.append({"size": raw, "blocks": n, "codec": name, "ratio": ratio, **s,
                         "lossless": get_codec(name).lossless if name in frames else False})
    return rows


def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _spread(xs: Sequence[float], ys: Sequence[float]) -> str:
    r = [x / y for x, y in zip(xs, ys)]
    return f"{_med(r):.3f} [{min(r):.3f}-{max(r):.3f}]" if r else "-"


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        s = {"size": r["size"], "codec": r["codec"], "ratio": r["ratio"],
             "encode_gbps": _med(r["enc"]), "decode_gbps": _med(r["dec"]), "ceiling_gbps": _med(r["ceil"]),
             "encode_vs_ceiling": _spread(r["enc"], r["ceil"]), "decode_vs_ceiling": _spread(r["dec"], r["ceil"])}
        if r["ratio"] and r["dec"]:
            sp = CodecSpeed(r["codec"], r["ratio"], s["encode_gbps"], s["decode_gbps"], r["lossless"])
            s["break_even_serial_gbps"] = break_even_gbps(sp, overlap=False)
            s["break_even_overlap_gbps"] = break_even_gbps(sp, overlap=True)
        out.append(s)
    return out


def markdown(res: dict[str, Any]) -> str:
    ceil = "device-to-device copy" if res["gpu"] else "memcpy"
    lines = [f"KV of model `{res['model']}` ({res['pool_dtype']} pool, {res['layout']}), prefilled from this "
             f"repository's text; {res['rounds']} interleaved rounds, {res['threads']} torch thread(s), "
             f"{res['device']} (1-min load average {res['loadavg'][0]} at start, {res['loadavg'][1]} at end: "
             f"the machine is shared). Throughputs are GB/s of raw KV; ratios to the {ceil} ceiling are per round, "
             "median [min-max]. Break-even: the link bandwidth below which the codec makes a transfer "
             "faster (serial: encode, send, decode one after another; overlapped: pipelined layer by layer).",
             "", f"| size | codec | ratio | encode GB/s | decode GB/s | {ceil} GB/s | encode / {ceil} | "
             f"decode / {ceil} | break-even serial GB/s | break-even overlapped GB/s |",
             "|---|---|---:|---:|---:|---:|---|---|---:|---:|"]
    for s in res["summary"]:
        ratio = f"{s['ratio']:.2f}" if s["ratio"] else "-"
        dec = f"{s['decode_gbps']:.3g}" if s["decode_gbps"] == s["decode_gbps"] else "-"
        be = (f"{s['break_even_serial_gbps']:.3g} | {s['break_even_overlap_gbps']:.3g}"
              if "break_even_serial_gbps" in s else "- | -")
        lines.append(f"| {s['size'] / MiB:.0f} MiB | {s['codec']} | {ratio} | {s['encode_gbps']:.3g} | {dec} | "
                     f"{s['ceiling_gbps']:.3g} | {s['encode_vs_ceiling']} | {s['decode_vs_ceiling']} | {be} |")
    if res.get("kernels"):
        lines += ["", f"Kernels: {res['kernels']}.", ""]
        by = {(s["size"], s["codec"]): s for s in res["summary"]}
        for size in sorted({s["size"] for s in res["summary"]}):
            for q in ("int8", "fp8"):
                k, c = by.get((size, q)), by.get((size, f"{q} (torch.compile twin)"))
                if k and c:
                    lines.append(f"- {size / MiB:.0f} MiB {q}: fused gather+quantize {k['encode_gbps']:.4g} GB/s vs "
                                 f"torch.compile twin {c['encode_gbps']:.4g} GB/s = "
                                 f"{k['encode_gbps'] / c['encode_gbps']:.2f}x (target >= 0.9x)")
    if res.get("ratios"):
        lines += ["", "Compression ratio on the same KV (raw bytes / encoded bytes):", "",
                  "| what | ratio |", "|---|---:|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in res["ratios"].items()]
    return "\n".join(lines) + "\n"


def _gpu_references(pool: KVPool) -> dict[str, Callable[[list[int]], Callable[[], Any]]]:
    """Gather+quantize references on the GPU: each codec's eager torch twin (the codec with its
    kernels off), and the ``torch.compile``d twin (the issue's target: kernels >= 0.9x of it)."""
    from kvbridge.codecs.quant import FP8Codec, Int8Codec, quantize_fp8, quantize_int8

    L = pool.layout
    out: dict[str, Callable[[list[int]], Callable[[], Any]]] = {}
    for name, codec in (("int8 (eager twin)", Int8Codec(use_kernels=False)),
                        ("fp8 (eager twin)", FP8Codec(False, use_kernels=False))):
        def eager(ids: list[int], codec: Any = codec) -> Callable[[], Any]:
            return lambda: codec.encode(pool, ids)
        out[name] = eager
    for name, q in (("int8 (torch.compile twin)", quantize_int8), ("fp8 (torch.compile twin)", quantize_fp8)):
        def gq(k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, q: Any = q) -> Any:
            return q(torch.stack([k.index_select(0, idx), v.index_select(0, idx)]).view(-1, L.head_dim))
        fn = torch.compile(gq, dynamic=False)

        def make(ids: list[int], fn: Any = fn) -> Callable[[], Any]:
            idx = torch.tensor(ids, device=pool.device)
            return lambda: [fn(*pool.layer_kv(layer), idx) for layer in range(L.num_layers)]  # type: ignore
        out[name] = make
    return out


def _kernel_status() -> str:
    from kvbridge.codecs import gpu

    try:
        gpu.load_kernels()
        return "fused CUDA kernels loaded (CuPy/NVRTC)"
    except Exception as exc:  # BackendUnavailable, ConfigError: say why
        return f"fused kernels NOT loaded ({exc}); int8/fp8 rows are the torch twin on the device"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller KV, fewer rounds")
    ap.add_argument("--gpu", action="store_true", help="pool on the GPU; fused kernels vs torch.compile twin")
    ap.add_argument("--model", default="bench")
    ap.add_argument("--pool-dtype", default="bfloat16")
    ap.add_argument("--sizes-mib", default=None, help="comma-separated handle sizes in MiB")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--min-seconds", type=float, default=None, help="minimum timed span per sample")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one core, as memcpy)")
    ap.add_argument("--codecs", default=None, help="comma-separated (default: every installed codec)")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "kvbridge-bench", "codecs.json"),
                    help="JSON path, Markdown next to it (default: a scratch directory)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.gpu and not torch.cuda.is_available():
        print("--gpu needs a CUDA device (run bench/gpu_codecs.sh on a GPU machine)", file=sys.stderr)
        return 2
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    device = "cuda" if a.gpu else "cpu"
    if a.sizes_mib:
        sizes = [int(float(s) * MiB) for s in a.sizes_mib.split(",")]
    elif a.gpu:
        sizes = [64 * MiB, 256 * MiB] if a.quick else [64 * MiB, 256 * MiB, 1024 * MiB]
    else:
        sizes = [1 * MiB, 16 * MiB] if a.quick else [1 * MiB, 16 * MiB, 64 * MiB]
    rounds = a.rounds or (3 if a.quick else 5)
    min_s = a.min_seconds or (0.05 if a.quick else 0.2)
    codecs = a.codecs.split(",") if a.codecs else (["raw", "int8", "fp8", "fp8-block"] if a.gpu
                                                     else available_codecs())
    load_before = os.getloadavg()
    model = CausalLM.from_seed(a.model, seed=0)
    log(f"prefilling {max(sizes) / MiB:.0f} MiB of KV with model {a.model} ...")
    t0 = time.perf_counter()
    pool, blocks, full = build_kv(model, min(max(sizes), 32 * MiB) if a.gpu else max(sizes), a.pool_dtype, device,
                                  tile_to=max(sizes) if a.gpu else 0)
    log(f"  {len(blocks)} blocks in {time.perf_counter() - t0:.1f} s")
    ratios = ratio_study(pool, blocks, full) if not a.gpu else {}
    extra = _gpu_references(pool) if a.gpu else None
    rows = throughput(pool, blocks, sizes, codecs, rounds, min_s, extra, log)
    L = pool.layout
    res = {"model": a.model, "pool_dtype": a.pool_dtype, "gpu": a.gpu, "rounds": rounds, "threads": a.threads,
           "device": torch.cuda.get_device_name() if a.gpu else f"CPU, {os.cpu_count()} cores",
           "layout": f"{L.num_layers} layers x {L.num_kv_heads} kv heads x head_dim {L.head_dim}, "
                     f"block {L.block_size}", "torch": torch.__version__, "ratios": ratios, "raw": rows,
           "summary": summarize(rows), "kernels": _kernel_status() if a.gpu else None,
           "loadavg": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
    md = markdown(res)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(md)
    print(md)
    log(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
