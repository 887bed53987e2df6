"""The GPU check in one command: ``python -m bench.gpu [--out DIR] [--quick]``.

1. Runs the GPU tests (nvlink:// between two processes on one GPU, the conformance suite's
   nvlink column, CUDA pools over tcp/inproc, device checksums).
2. Measures, each against a ceiling in the same run, in alternating rounds (ABAB), medians
   and spread over the rounds:
   - nvlink fetch of a block-shaped handle (32 KiB pieces, leases off) from another process
     vs. one device-to-device copy of the same bytes, and vs. the same row copy in-process;
     the 128 MiB fetch's latency with its parts (copy alone; claim = leased minus unleased);
   - staging 32 KiB pieces into pinned host memory (one gather + one copy per slot) vs. one
     pinned device-to-host copy of the same bytes, and vs. one ``copy_`` per piece;
   - device pools vs. host pools over tcp (checksums on for both);
   - checksums of a device handle (hashed as its bytes are staged through host memory) vs.
     the nvlink fetch of the same handle.
3. Writes ``gpu.json`` and ``gpu.md`` to a scratch directory (or ``--out``).

Without a CUDA device it says so and exits 0. Sized to finish in under 5 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch

GIB, MIB = 1 << 30, 1 << 20


def _layout(layers: int = 32) -> Any:
    from kvbridge import KVLayout
    return KVLayout.vllm_flash(layers, 8, 128, 16, dtype="bfloat16")     # 32 KiB parts, 2 MiB blocks


def _peer(conn: Any, num_blocks: int) -> None:
    """Child process: CUDA and host pools served over nvlink:// and tcp://; publishes on request."""
    from kvbridge import KVPool, KVSender
    L = _layout()
    dev = KVPool.allocate(L, num_blocks, device="cuda")
    host = KVPool.allocate(L, min(num_blocks, 256))
    for p in (dev, host):
        for b in p.buffers:
            b.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (b.numel() * 2,), dtype=torch.uint8,
                                                             device=b.device))
        p.alloc(p.num_blocks)
        p.ref(range(p.num_blocks))
    torch.cuda.synchronize()
    senders = {"nvlink": KVSender(dev, "nvlink://", leases=False), "nvlink-leased": KVSender(dev, "nvlink://"),
               "tcp-device": KVSender(dev, "tcp://127.0.0.1:0", leases=False),
               "tcp-host": KVSender(host, "tcp://127.0.0.1:0", leases=False)}
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        name, ids = msg
        s = senders[name]
        for b in ids:                      # keep the blocks allocated after the receiver releases them
            s.pool.ref([b])
        conn.send(s.publish(f"r{time.monotonic_ns()}", ids, len(ids) * L.block_size).to_bytes())
    for s in senders.values():
        s.close()


def _timed(fn: Callable[[], Any], cuda: bool = True) -> float:
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _row(rows: list[dict], what: str, nbytes: int, system: list[float], ceiling: list[float],
         ceiling_name: str) -> None:
    ratios = [c / s for s, c in zip(system, ceiling)]           # paired per round: >1 means faster than the ceiling
    rows.append({"what": what, "bytes": nbytes, "ceiling": ceiling_name,
                 "system_s": _summary(system), "ceiling_s": _summary(ceiling),
                 "system_GBps": nbytes / statistics.median(system) / 1e9,
                 "ceiling_GBps": nbytes / statistics.median(ceiling) / 1e9,
                 "ratio": _summary(ratios)})
    print(f"  {what}: {nbytes / statistics.median(system) / 1e9:.1f} GB/s vs {ceiling_name} "
          f"{nbytes / statistics.median(ceiling) / 1e9:.1f} GB/s -> {statistics.median(ratios):.2f}x", flush=True)


def run_tests() -> dict[str, Any]:
    out = {}
    for name, args in [("gpu-files", ["tests/core/test_nvlink_cuda.py", "tests/core/test_staging.py",
                                      "tests/core/test_nvlink.py"]),
                       ("conformance-nvlink", ["tests/core/test_conformance.py", "-k", "nvlink"])]:
        t0 = time.monotonic()
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                               capture_output=True, text=True, timeout=150)
            tail = (r.stdout + r.stderr).strip().splitlines()[-15:]
            rc = r.returncode
        except subprocess.TimeoutExpired:
            tail, rc = ["timed out after 150 s"], 124
        out[name] = {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "tail": tail}
        print(f"tests {name}: rc={rc} ({out[name]['seconds']} s): {tail[-1] if tail else ''}", flush=True)
    return out


def measure(rounds: int, big_blocks: int) -> list[dict]:
    import random

    from kvbridge import KVHandle, KVPool, KVReceiver, integrity
    from kvbridge.transports import Spans
    from kvbridge.transports.staging import StagingRing, copy_pieces, flat_buffers, stage_out

    L = _layout()
    rows: list[dict] = []
    num_blocks = 2 * big_blocks
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child, num_blocks), daemon=True)
    proc.start()
    try:
        if not parent.poll(120) or parent.recv() != "ready":
            raise RuntimeError("the sender process did not start")

        def publish(name: str, ids: list[int]) -> KVHandle:
            parent.send((name, ids))
            return KVHandle.from_bytes(parent.recv())

        dst = KVPool.allocate(L, num_blocks, device="cuda")
        host_dst = KVPool.allocate(L, 256)
        rng = random.Random(0)
        rcv = KVReceiver(dst, leases=None)
        hrcv = KVReceiver(host_dst, leases=False)
        for n_blocks, label in [(big_blocks, f"{big_blocks * L.block_nbytes // MIB} MiB"), (64, "128 MiB")]:
            nbytes = n_blocks * L.block_nbytes
            src_ids = rng.sample(range(num_blocks), n_blocks)
            dst_ids = rng.sample(range(num_blocks), n_blocks)
            flat = flat_buffers(dst.buffers)
            scratch_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            scratch_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            rcv.fetch(publish("nvlink", src_ids), dst_ids)                  # warm: mappings open, kernels loaded
            fetch, d2d = [], []
            for _ in range(rounds):
                h = publish("nvlink", src_ids)
                fetch.append(_timed(lambda: rcv.fetch(h, dst_ids)))
                d2d.append(_timed(lambda: scratch_b.copy_(scratch_a)))
            _row(rows, f"nvlink fetch {label} (other process)", nbytes, fetch, d2d, "d2d copy of the same bytes")
            # the same row copy in this process, between two local pools: what IPC and control add
            segs_src = Spans.of_blocks(dst, src_ids).segments
            segs_dst = Spans.of_blocks(dst, dst_ids).segments
            local = [_timed(lambda: copy_pieces(flat, segs_dst, flat, segs_src)) for _ in range(rounds)]
            _row(rows, f"nvlink fetch {label} vs in-process row copy", nbytes, fetch, local,
                 "row copy in-process")
            if n_blocks == 64:
                leased = []
                for _ in range(rounds):
                    h = publish("nvlink-leased", src_ids)
                    leased.append(_timed(lambda: rcv.fetch(h, dst_ids)))
                rows.append({"what": "nvlink fetch 128 MiB latency parts", "bytes": nbytes,
                             "fetch_unleased_s": _summary(fetch), "fetch_leased_s": _summary(leased),
                             "copy_s": _summary(local),
                             "control_and_ipc_s": statistics.median(fetch) - statistics.median(local),
                             "claim_s": statistics.median(leased) - statistics.median(fetch)})
                # checksums of the same handle, hashed as the bytes are staged through host memory
                sums = [_timed(lambda: integrity.block_checksums(dst, src_ids)) for _ in range(rounds)]
                rows.append({"what": "checksums (staged xxh3) vs nvlink fetch, 128 MiB", "bytes": nbytes,
                             "checksum_s": _summary(sums), "fetch_s": _summary(fetch),
                             "checksum_over_fetch": statistics.median(sums) / statistics.median(fetch)})
                print(f"  checksums 128 MiB: {statistics.median(sums) * 1e3:.1f} ms = "
                      f"{statistics.median(sums) / statistics.median(fetch):.1f}x the nvlink fetch", flush=True)
        # staging: 4,096 scattered 32 KiB pieces (128 MiB) into pinned memory
        ids = rng.sample(range(num_blocks), 64)
        spans = Spans.of_blocks(dst, ids)
        nbytes = spans.nbytes
        ring = StagingRing()
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        flat = flat_buffers(dst.buffers)
        contiguous = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        staged, d2h, piecewise = [], [], []
        def per_piece() -> None:
            pos = 0
            for b, o, n in spans.segments:
                pinned[pos:pos + n].copy_(flat[b][o:o + n], non_blocking=True)
                pos += n
        for _ in range(rounds):
            staged.append(_timed(lambda: stage_out(spans, ring, lambda v: None)))
            d2h.append(_timed(lambda: pinned.copy_(contiguous, non_blocking=True)))
            piecewise.append(_timed(per_piece))
        _row(rows, "staging 4,096 x 32 KiB to pinned host", nbytes, staged, d2h, "pinned d2h of the same bytes")
        _row(rows, "staging vs one copy_ per piece", nbytes, staged, piecewise, "copy_ per piece")
        # device vs host pools over tcp, 128 MiB, checksums on
        n_blocks = 64
        tcp_dev, tcp_host = [], []
        src_ids = rng.sample(range(256), n_blocks)
        d_ids = rng.sample(range(256), n_blocks)
        for _ in range(rounds):
            h = publish("tcp-device", src_ids)
            tcp_dev.append(_timed(lambda: rcv.fetch(h, d_ids)))
            h = publish("tcp-host", src_ids)
            tcp_host.append(_timed(lambda: hrcv.fetch(h, d_ids), cuda=False))
        _row(rows, "device pools over tcp (checksums on)", n_blocks * L.block_nbytes, tcp_dev, tcp_host,
             "host pools over tcp (checksums on)")
        rcv.close()
        hrcv.close()
    finally:
        parent.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# GPU check ({result['device']}, torch {result['torch']}, CUDA {result['cuda']})", "",
             "| what | bytes | kvbridge GB/s | ceiling | ceiling GB/s | ratio (median, min-max) |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "ratio" in r:
            q = r["ratio"]
            lines.append(f"| {r['what']} | {r['bytes'] // MIB} MiB | {r['system_GBps']:.1f} | {r['ceiling']} | "
                         f"{r['ceiling_GBps']:.1f} | {q['median']:.2f} ({q['min']:.2f}-{q['max']:.2f}) |")
    lines.append("")
    for r in result["rows"]:
        if "ratio" not in r:
            lines.append(f"- {r['what']}: " + ", ".join(
                f"{k} {v['median'] * 1e3:.2f} ms" if isinstance(v, dict) else f"{k} {v:.4g}"
                for k, v in r.items() if k not in ("what", "bytes")))
    lines += ["", "Tests:"] + [f"- {k}: rc {v['rc']}, {v['tail'][-1] if v['tail'] else ''}"
                               for k, v in result["tests"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="directory for gpu.json and gpu.md (default: a scratch directory)")
    ap.add_argument("--quick", action="store_true", help="256 MiB instead of 1 GiB, 3 rounds")
    ap.add_argument("--no-tests", action="store_true", help="measure only")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu: no CUDA device here (torch.cuda.is_available() is False); nothing to run. "
              "Run it on a machine with a GPU, torch with CUDA and CuPy (pip install 'kvbridge[cupy]').")
        return 0
    try:
        import cupy  # noqa: F401
    except ImportError:
        print("bench.gpu: CuPy is missing (pip install 'kvbridge[cupy]': cupy-cuda12x or cupy-cuda13x, matching "
              f"torch's CUDA {torch.version.cuda}); nvlink:// cannot run. Exiting.")
        return 0
    t0 = time.monotonic()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "cuda": torch.version.cuda, "tests": {}, "rows": []}
    if not a.no_tests:
        result["tests"] = run_tests()
    print("measuring (ABAB rounds) ...", flush=True)
    result["rows"] = measure(3 if a.quick else 5, 128 if a.quick else 512)
    result["seconds"] = round(time.monotonic() - t0, 1)
    out = a.out or os.path.join(tempfile.gettempdir(), "kvbridge-bench-gpu")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "gpu.md"), "w") as f:
        f.write(markdown(result))
    print(markdown(result))
    print(f"wrote {out}/gpu.json and gpu.md in {result['seconds']} s")
    return 0 if all(v["rc"] == 0 for v in result["tests"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
