"""Where an nvlink:// fetch's time goes, on both sides: ``python -m bench.nvlink_parts``.

A sender process serves a CUDA pool over nvlink:// (checksums and leases off); this process
fetches one-block and 64-block handles from it, alternating, with the main steps of both
sides timed (each function's calls and wall time, summed; nested steps are inside their
callers' times). Prints, per side, each step's mean time per fetch. Without a CUDA device and
CuPy it says so and exits 0.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import multiprocessing as mp
import statistics
import time
import traceback
from typing import Any

import torch

from bench.gpucopy import no_gpu

SENDER_STEPS = ["kvbridge.transports.shm_server:ShmServer.handle", "kvbridge.sender_serving:SenderServing.open_read",
                "kvbridge.transports.nvlink:NVLinkServer._body", "kvbridge.transports.nvlink:_Exports.get",
                "kvbridge.transports.nvlink:_Exports.record", "kvbridge.published:Grant.close",
                "kvbridge.published:Grant.vouch"]
RECEIVER_STEPS = ["kvbridge.receiver:KVReceiver.fetch", "kvbridge.transports.shm:ShmTransport.read_small",
                  "kvbridge.transports.shm:ShmTransport.read", "kvbridge.transports.shm:ShmTransport._exchange",
                  "kvbridge.transports.sockets:SocketClient.call", "kvbridge.transports.shm:recv_exact",
                  "kvbridge.transports.nvlink:NVLinkTransport._move",
                  "kvbridge.transports.nvlink:NVLinkTransport._flats",
                  "kvbridge.transports.nvlink:NVLinkTransport._wait_event", "kvbridge.transports.nvlink:copy_pieces",
                  "kvbridge.transports.nvlink:_parse_mapped", "kvbridge.receiver_pipeline:ReceiverPipeline._settle"]


def _instrument(steps: list[str]) -> dict[str, list[float]]:
    """Wrap each ``module:Owner.name`` (or ``module:name``) to add its calls and seconds."""
    acc: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for spec in steps:
        mod_name, path = spec.split(":")
        mod = importlib.import_module(mod_name)
        owner: Any = mod
        parts = path.split(".")
        for p in parts[:-1]:
            owner = getattr(owner, p)
        fn = getattr(owner, parts[-1])

        def wrapped(*a: Any, __fn: Any = fn, __key: str = path, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return __fn(*a, **k)
            finally:
                d = acc[__key]
                d[0] += 1
                d[1] += time.perf_counter() - t0
        setattr(owner, parts[-1], wrapped)
    return acc


def _sender(conn: Any) -> None:
    try:
        from kvbridge import KVLayout, KVPool, KVSender
        acc = _instrument(SENDER_STEPS)
        L = KVLayout.vllm_flash(32, 8, 128, 16, dtype="bfloat16")
        pool = KVPool.allocate(L, 256, device="cuda", allocator="engine")
        snd = KVSender(pool, "nvlink://", leases=False, checksums=False)
        conn.send(("ready", None))
        while True:
            msg = conn.recv()
            if msg is None:
                break
            if msg == "stats":
                conn.send(("stats", {k: tuple(v) for k, v in acc.items()}))
                acc.clear()
                continue
            name, ids = msg
            conn.send(("ok", snd.publish(name, ids, len(ids) * L.block_size).to_bytes()))
        snd.close()
    except BaseException:
        conn.send(("failed", traceback.format_exc()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args(argv)
    why = no_gpu()
    if why:
        print(f"bench.nvlink_parts: {why}; nothing to measure")
        return 0
    from kvbridge import KVHandle, KVLayout, KVPool, KVReceiver
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(child,), daemon=True)
    proc.start()
    kind, body = conn.recv()
    if kind != "ready":
        print(body)
        return 1
    acc = _instrument(RECEIVER_STEPS)
    L = KVLayout.vllm_flash(32, 8, 128, 16, dtype="bfloat16")
    rcv = KVReceiver(KVPool.allocate(L, 256, device="cuda"), leases=False)
    try:
        for nb in (1, 64, 1, 64):                         # warm, then measured
            lat = []
            acc.clear()
            conn.send("stats")
            conn.recv()
            for i in range(a.rounds):
                conn.send((f"b{nb}-{i}-{time.monotonic_ns()}", list(range(nb))))
                _, raw = conn.recv()
                h = KVHandle.from_bytes(raw)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                res = rcv.fetch(h, list(range(100, 100 + nb)))
                lat.append(time.perf_counter() - t0)
                assert res.ok, res.error
            conn.send("stats")
            _, sent = conn.recv()
            print(f"== {nb} block(s) ({nb * L.block_nbytes >> 20} MiB): fetch median "
                  f"{statistics.median(lat) * 1e3:.3f} ms (min {min(lat) * 1e3:.3f})", flush=True)
            for side, d in (("receiver", acc), ("sender", sent)):
                for k, (n, s) in sorted(d.items(), key=lambda kv: -kv[1][1]):
                    print(f"   {side:8s} {k:45s} {n / a.rounds:5.1f} calls/fetch {s / a.rounds * 1e3:8.3f} ms/fetch")
    finally:
        rcv.close()
        conn.send(None)
        proc.join(20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
