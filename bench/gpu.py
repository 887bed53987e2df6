"""The GPU check in one command: ``python -m bench.gpu [--out DIR] [--quick] [--no-tests]``.

0. Prints what it runs on (torch, CUDA, CuPy, driver, device) and what the tests need.
1. Runs the GPU tests (nvlink:// between two processes on one GPU, the conformance suite's
   nvlink column, CUDA pools over tcp/inproc, device checksums); each file set is bounded in
   time and its whole output is kept in ``tests-<name>.log``.
2. Measures, each against a ceiling in the same run, in alternating rounds (ABAB), medians
   and spread over the rounds:
   - nvlink fetch of a block-shaped handle (32 KiB pieces, leases and checksums off; one
     verified fetch first proves the bytes) from another process vs. one device-to-device
     copy of the same bytes, and vs. the same row copy in-process between two pools;
     the 128 MiB fetch's latency with its parts (copy alone; claim = leased minus unleased);
   - staging 32 KiB pieces into pinned host memory (one gather + one copy per slot) vs. one
     pinned device-to-host copy of the same bytes, and vs. one ``copy_`` per piece;
   - device pools vs. host pools over tcp (checksums on for both);
   - checksums of a device handle (hashed as its bytes are staged through host memory) vs.
     the nvlink fetch of the same handle.
   A section that fails is recorded (with its error) and the next one runs.
3. Writes ``gpu.json`` and ``gpu.md`` to a scratch directory (or ``--out``), after every
   step, so a run cut short still leaves what it measured.

Without a CUDA device it says so and exits 0. Sized to finish in about 5 minutes on one GPU
(the tests at most 120 + 150 s; no measurement section starts after 200 s).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

GIB, MIB = 1 << 30, 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_SETS = [("gpu-files", ["tests/core/test_nvlink_cuda.py", "tests/core/test_gpucopy.py",
                            "tests/core/test_staging.py", "tests/core/test_nvlink.py"], 120),
             ("conformance-nvlink", ["tests/core/test_conformance.py", "-k", "nvlink"], 150)]
MEASURE_BUDGET_S = 200.0      # no new section starts after this long
REPLY_S = 120.0               # the sender process answers a publish within this


def _layout(layers: int = 32) -> Any:
    from kvbridge import KVLayout
    return KVLayout.vllm_flash(layers, 8, 128, 16, dtype="bfloat16")     # 32 KiB parts, 2 MiB blocks


def _peer(conn: Any, num_blocks: int) -> None:
    """Child process: CUDA and host pools served over nvlink:// and tcp://; publishes on request.

    Senders: "nvlink-verified" (checksums on: the first fetch proves the bytes), "nvlink"
    (checksums and leases off: what the timed rounds read), "nvlink-leased" (leases on,
    needs the embedded lease server), "tcp-device" and "tcp-host" (checksums on)."""
    try:
        from kvbridge import KVPool, KVSender
        L = _layout()
        dev = KVPool.allocate(L, num_blocks, device="cuda")
        host = KVPool.allocate(L, min(num_blocks, 256))
        for p in (dev, host):
            for b in p.buffers:
                flat = b.view(-1).view(torch.uint8)
                flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, device=b.device))
            p.alloc(p.num_blocks)
            p.ref(range(p.num_blocks))
        torch.cuda.synchronize()
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    senders: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name, make in [("nvlink-verified", lambda: KVSender(dev, "nvlink://", leases=False)),
                       ("nvlink", lambda: KVSender(dev, "nvlink://", leases=False, checksums=False)),
                       ("nvlink-leased", lambda: KVSender(dev, "nvlink://", checksums=False)),
                       ("tcp-device", lambda: KVSender(dev, "tcp://127.0.0.1:0", leases=False)),
                       ("tcp-host", lambda: KVSender(host, "tcp://127.0.0.1:0", leases=False))]:
        try:
            senders[name] = make()
        except Exception as exc:          # e.g. no lease server binary: that sender's rows are skipped
            errors[name] = f"{type(exc).__name__}: {exc}"
    conn.send(("ready", errors))
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            name, ids = msg
            try:
                s = senders[name]
                s.pool.ref(ids)               # keep the blocks allocated after the receiver releases them
                conn.send(("ok", s.publish(f"r{time.monotonic_ns()}", ids, len(ids) * L.block_size).to_bytes()))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    except (EOFError, OSError):
        pass
    finally:
        for s in senders.values():
            try:
                s.close()
            except Exception:
                pass


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
    ratios = [c / s for s, c in zip(system, ceiling)]     # paired per round: < 1 slower than the ceiling
    rows.append({"what": what, "bytes": nbytes, "ceiling": ceiling_name,
                 "system_s": _summary(system), "ceiling_s": _summary(ceiling),
                 "system_GBps": nbytes / statistics.median(system) / 1e9,
                 "ceiling_GBps": nbytes / statistics.median(ceiling) / 1e9,
                 "ratio": _summary(ratios)})
    print(f"  {what}: {nbytes / statistics.median(system) / 1e9:.1f} GB/s vs {ceiling_name} "
          f"{nbytes / statistics.median(ceiling) / 1e9:.1f} GB/s -> ceiling time / kvbridge time "
          f"{statistics.median(ratios):.2f}", flush=True)


def _ok(res: Any, what: str) -> Any:
    if not res.ok:
        raise RuntimeError(f"{what} failed: {type(res.error).__name__}: {res.error}")
    return res


# -- environment ---------------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    """What this run is on, and what the tests and measurements need (printed first)."""
    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0),
                           "device_count": torch.cuda.device_count(),
                           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    try:
        import cupy  # type: ignore[import-not-found,unused-ignore]
        env["cupy"] = cupy.__version__
        env["cupy_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        env["driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception as exc:
        env["cupy_error"] = f"{type(exc).__name__}: {exc}"
    env["missing"] = [m for m in ("pytest", "pytest_timeout", "hypothesis", "xxhash", "numpy", "redis")
                      if importlib.util.find_spec(m) is None]
    try:
        from kvbridge.lease.embedded import find_server_binary
        env["lease_server"] = find_server_binary()
    except Exception as exc:
        env["lease_server"] = f"none ({type(exc).__name__}: {exc}): the leased rows and lease tests will fail"
    print("bench.gpu: " + ", ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    if "expandable_segments:true" in env["alloc_conf"].replace(" ", "").lower():
        print("bench.gpu: WARNING PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True; nvlink:// cannot "
              "export such memory (cudaIpcGetMemHandle). Unset it.", flush=True)
    if env["missing"]:
        print(f"bench.gpu: WARNING missing Python modules {env['missing']}: the tests may not start", flush=True)
    return env


# -- tests ---------------------------------------------------------------------------------------
def run_tests(out_dir: str) -> dict[str, Any]:
    out = {}
    for name, args, limit in TEST_SETS:
        t0 = time.monotonic()
        log = os.path.join(out_dir, f"tests-{name}.log")
        # -o addopts=: the ini's addopts name pytest-benchmark's option, which would stop pytest
        # before any test where that plugin is not installed
        cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-rfEs", "--tb=short",
               "-p", "no:cacheprovider", *args]
        with open(log, "w") as f:
            p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = p.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)        # pytest and the sender processes it started
                p.wait()
                rc = 124
        with open(log, errors="replace") as f:
            lines = f.read().strip().splitlines()
        if rc == 124:
            lines.append(f"timed out after {limit} s (killed)")
        tail = lines[-15:]
        out[name] = {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "tail": tail, "log": log}
        print(f"tests {name}: rc={rc} ({out[name]['seconds']} s): {tail[-1] if tail else ''}", flush=True)
        if rc != 0:
            print("\n".join("    " + ln for ln in lines[-40:]), flush=True)
    return out


# -- measurements --------------------------------------------------------------------------------
class _Sender:
    """The child process that serves the pools; ``publish`` returns a handle."""

    def __init__(self, num_blocks: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer, args=(child, num_blocks), daemon=True)
        self.proc.start()
        child.close()
        msg = self._reply(120)
        if msg[0] != "ready":
            raise RuntimeError(f"the sender process did not start:\n{msg[1]}")
        self.errors: dict[str, str] = msg[1]
        for k, v in self.errors.items():
            print(f"  sender {k!r} unavailable: {v}", flush=True)

    def _reply(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"the sender process did not answer within {timeout:.0f} s")
        try:
            return self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the sender process exited (exit code {self.proc.exitcode})") from None

    def publish(self, name: str, ids: list[int]) -> Any:
        from kvbridge import KVHandle
        if name in self.errors:
            raise RuntimeError(f"sender {name!r} unavailable: {self.errors[name]}")
        self.conn.send((name, list(ids)))
        kind, body = self._reply(REPLY_S)
        if kind != "ok":
            raise RuntimeError(f"publish on {name!r} failed in the sender process: {body}")
        return KVHandle.from_bytes(body)

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def measure(rounds: int, big_blocks: int, save: Callable[[list[dict]], None]) -> list[dict]:
    import random

    from kvbridge import KVPool, KVReceiver, integrity
    from kvbridge.transports import Spans
    from kvbridge.transports.staging import StagingRing, copy_pieces, flat_buffers, stage_out

    L = _layout()
    rows: list[dict] = []
    num_blocks = 2 * big_blocks
    deadline = time.monotonic() + MEASURE_BUDGET_S
    rng = random.Random(0)
    state: dict[int, Any] = {}

    def section(name: str, fn: Callable[[], None]) -> None:
        if time.monotonic() > deadline:
            rows.append({"what": name, "skipped": f"the measurement budget ({MEASURE_BUDGET_S:.0f} s) ran out"})
            print(f"  {name}: skipped (time budget)", flush=True)
        else:
            t0 = time.monotonic()
            try:
                fn()
            except Exception as exc:
                rows.append({"what": name, "error": f"{type(exc).__name__}: {exc}"})
                print(f"  {name}: FAILED\n" + "".join("    " + ln for ln in traceback.format_exc().splitlines(True)),
                      flush=True)
            print(f"  ({name}: {time.monotonic() - t0:.1f} s)", flush=True)
        save(rows)

    sender = _Sender(num_blocks)
    receivers: list[Any] = []
    try:
        dst = KVPool.allocate(L, num_blocks, device="cuda")
        src_local = KVPool.allocate(L, num_blocks, device="cuda")    # the in-process row copy's source
        host_dst = KVPool.allocate(L, 256)
        rcv = KVReceiver(dst, leases=None)
        receivers.append(rcv)
        hrcv = KVReceiver(host_dst, leases=False)
        receivers.append(hrcv)

        def nvlink(n_blocks: int) -> None:
            label = f"{n_blocks * L.block_nbytes // MIB} MiB"
            nbytes = n_blocks * L.block_nbytes
            src_ids = rng.sample(range(num_blocks), n_blocks)
            dst_ids = rng.sample(range(num_blocks), n_blocks)
            # correctness first: a verified fetch (the receiver checks the handle's checksums)
            h = sender.publish("nvlink-verified", src_ids)
            assert len(h.checksums) == n_blocks
            _ok(rcv.fetch(h, dst_ids), "verified nvlink fetch")
            _ok(rcv.fetch(sender.publish("nvlink", src_ids), dst_ids), "nvlink fetch (warm-up)")
            scratch_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            scratch_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            fetch, d2d = [], []
            for _ in range(rounds):
                h = sender.publish("nvlink", src_ids)
                res: list[Any] = []
                fetch.append(_timed(lambda: res.append(rcv.fetch(h, dst_ids))))
                _ok(res[0], "nvlink fetch")
                d2d.append(_timed(lambda: scratch_b.copy_(scratch_a)))
            _row(rows, f"nvlink fetch {label} (other process, checksums off)", nbytes, fetch, d2d,
                 "d2d copy of the same bytes")
            # the same row copy in this process, between two pools: what IPC and control add
            segs_src = Spans.of_blocks(src_local, src_ids).segment_array      # (n, 3) arrays, as nvlink:// plans
            segs_dst = Spans.of_blocks(dst, dst_ids).segment_array
            fsrc, fdst = flat_buffers(src_local.buffers), flat_buffers(dst.buffers)
            copy_pieces(fdst, segs_dst, fsrc, segs_src)                  # warm
            local = [_timed(lambda: copy_pieces(fdst, segs_dst, fsrc, segs_src)) for _ in range(rounds)]
            _row(rows, f"nvlink fetch {label} vs in-process row copy", nbytes, fetch, local,
                 "row copy in-process")
            state[n_blocks] = (src_ids, dst_ids, fetch, local)

        def latency_parts() -> None:
            src_ids, dst_ids, fetch, local = state[64]
            _ok(rcv.fetch(sender.publish("nvlink-leased", src_ids), dst_ids), "leased nvlink fetch (warm-up)")
            leased = []
            for _ in range(rounds):
                h = sender.publish("nvlink-leased", src_ids)
                res: list[Any] = []
                leased.append(_timed(lambda: res.append(rcv.fetch(h, dst_ids))))
                _ok(res[0], "leased nvlink fetch")
            one = []                                   # a one-block handle: the fixed cost of a fetch
            for _ in range(rounds):
                h1 = sender.publish("nvlink", src_ids[:1])
                r1: list[Any] = []
                one.append(_timed(lambda: r1.append(rcv.fetch(h1, dst_ids[:1]))))
                _ok(r1[0], "one-block nvlink fetch")
            rows.append({"what": "nvlink fetch 128 MiB latency parts", "bytes": 64 * L.block_nbytes,
                         "fetch_one_block_s": _summary(one),
                         "fetch_unleased_s": _summary(fetch), "fetch_leased_s": _summary(leased),
                         "copy_s": _summary(local),
                         "control_and_ipc_s": statistics.median(fetch) - statistics.median(local),
                         "claim_s": statistics.median(leased) - statistics.median(fetch)})
            print(f"  one-block fetch {statistics.median(one) * 1e3:.2f} ms; "
                  f"128 MiB fetch: unleased {statistics.median(fetch) * 1e3:.2f} ms, leased "
                  f"{statistics.median(leased) * 1e3:.2f} ms, row copy {statistics.median(local) * 1e3:.2f} ms",
                  flush=True)

        def profile() -> None:
            """Where the receiver's time goes in an unleased 128 MiB fetch (cProfile, 3 fetches)."""
            import cProfile
            import io
            import pstats
            src_ids, dst_ids, _, _ = state[64]
            handles = [sender.publish("nvlink", src_ids) for _ in range(3)]
            prof = cProfile.Profile()
            prof.enable()
            for h in handles:
                _ok(rcv.fetch(h, dst_ids), "nvlink fetch (profiled)")
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
            pstats.Stats(prof, stream=out).print_callers("sleep")
            text = out.getvalue()
            rows.append({"what": "profile of 3 nvlink fetches of 128 MiB (receiver; by own time, by cumulative)",
                         "text": text[text.find("ncalls"):]})
            print(text[text.find("ncalls"):], flush=True)

        def checksums() -> None:
            src_ids, _, fetch, _ = state[64]
            integrity.block_checksums(dst, src_ids)                       # warm: ring allocated
            sums = [_timed(lambda: integrity.block_checksums(dst, src_ids)) for _ in range(rounds)]
            rows.append({"what": "checksums (staged xxh3) vs nvlink fetch, 128 MiB", "bytes": 64 * L.block_nbytes,
                         "checksum_s": _summary(sums), "fetch_s": _summary(fetch),
                         "checksum_over_fetch": statistics.median(sums) / statistics.median(fetch)})
            print(f"  checksums 128 MiB: {statistics.median(sums) * 1e3:.1f} ms = "
                  f"{statistics.median(sums) / statistics.median(fetch):.1f}x the nvlink fetch", flush=True)

        def staging() -> None:
            # 4,096 scattered 32 KiB pieces (128 MiB) into pinned memory
            ids = rng.sample(range(num_blocks), 64)
            spans = Spans.of_blocks(dst, ids)
            nbytes = spans.nbytes
            ring = StagingRing()
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            flat = flat_buffers(dst.buffers)
            contiguous = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

            def per_piece() -> None:
                pos = 0
                for b, o, n in spans.segments:
                    pinned[pos:pos + n].copy_(flat[b][o:o + n], non_blocking=True)
                    pos += n
            stage_out(spans, ring, lambda v: None)                        # warm
            staged, d2h, piecewise = [], [], []
            for _ in range(rounds):
                staged.append(_timed(lambda: stage_out(spans, ring, lambda v: None)))
                d2h.append(_timed(lambda: pinned.copy_(contiguous, non_blocking=True)))
                piecewise.append(_timed(per_piece))
            _row(rows, f"staging {len(spans.segments):,} pieces (128 MiB) to pinned host", nbytes, staged, d2h,
                 "pinned d2h of the same bytes")
            _row(rows, "staging vs one copy_ per piece", nbytes, staged, piecewise, "copy_ per piece")

        def tcp() -> None:
            # device vs host pools over tcp, 128 MiB, checksums on
            n_blocks = 64
            src_ids = rng.sample(range(256), n_blocks)
            d_ids = rng.sample(range(256), n_blocks)
            _ok(rcv.fetch(sender.publish("tcp-device", src_ids), d_ids), "tcp device fetch (warm-up)")
            _ok(hrcv.fetch(sender.publish("tcp-host", src_ids), d_ids), "tcp host fetch (warm-up)")
            tcp_dev, tcp_host = [], []
            for _ in range(rounds):
                h = sender.publish("tcp-device", src_ids)
                res: list[Any] = []
                tcp_dev.append(_timed(lambda: res.append(rcv.fetch(h, d_ids))))
                h = sender.publish("tcp-host", src_ids)
                tcp_host.append(_timed(lambda: res.append(hrcv.fetch(h, d_ids)), cuda=False))
                for r in res:
                    _ok(r, "tcp fetch")
            _row(rows, "device pools over tcp (checksums on)", n_blocks * L.block_nbytes, tcp_dev, tcp_host,
                 "host pools over tcp (checksums on)")

        section(f"nvlink {big_blocks * L.block_nbytes // MIB} MiB", lambda: nvlink(big_blocks))
        section("nvlink 128 MiB", lambda: nvlink(64))
        if 64 in state:
            section("nvlink 128 MiB latency parts", latency_parts)
            section("checksums 128 MiB", checksums)
            section("profile 128 MiB", profile)
        section("staging", staging)
        section("tcp device vs host", tcp)
    finally:
        for r in receivers:
            try:
                r.close()
            except Exception:
                pass
        sender.close()
    return rows


def markdown(result: dict[str, Any]) -> str:
    env = result.get("env", {})
    lines = [f"# GPU check ({result['device']}, torch {result['torch']}, CUDA {result['cuda']}, "
             f"CuPy {env.get('cupy', '?')})", "",
             "| what | bytes | kvbridge GB/s | ceiling | ceiling GB/s "
             "| ceiling time / kvbridge time (median, min-max) |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "ratio" in r:
            q = r["ratio"]
            lines.append(f"| {r['what']} | {r['bytes'] // MIB} MiB | {r['system_GBps']:.1f} | {r['ceiling']} | "
                         f"{r['ceiling_GBps']:.1f} | {q['median']:.2f} ({q['min']:.2f}-{q['max']:.2f}) |")
    lines.append("")
    for r in result["rows"]:
        if "ratio" in r:
            continue
        if "error" in r or "skipped" in r:
            lines.append(f"- {r['what']}: " + (f"FAILED: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"))
            continue
        if "text" in r:
            lines += [f"- {r['what']}:", "", "```", r["text"].rstrip(), "```", ""]
            continue
        parts = []
        for k, v in r.items():
            if k in ("what", "bytes"):
                continue
            if isinstance(v, dict):
                parts.append(f"{k} {v['median'] * 1e3:.2f} ms")
            elif isinstance(v, float):
                parts.append(f"{k} {v:.4g}")
            else:
                parts.append(f"{k} {v}")
        lines.append(f"- {r['what']}: " + ", ".join(parts))
    lines += ["", "Tests:"] + [f"- {k}: rc {v['rc']}, {v['tail'][-1] if v['tail'] else ''}"
                               for k, v in result["tests"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", help="directory for gpu.json and gpu.md (default: a scratch directory)")
    ap.add_argument("--quick", action="store_true", help="256 MiB instead of 1 GiB, 3 rounds")
    ap.add_argument("--no-tests", action="store_true", help="measure only")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu: no CUDA device here (torch.cuda.is_available() is False); nothing to run. "
              "Run it on a machine with a GPU, torch with CUDA and CuPy (pip install 'kvbridge[cupy]').")
        return 0
    t0 = time.monotonic()
    env = environment()
    if "cupy_error" in env:
        print(f"bench.gpu: CuPy cannot be used ({env['cupy_error']}); nvlink:// needs it: pip install "
              f"cupy-cuda12x or cupy-cuda13x, matching torch's CUDA {torch.version.cuda}. Exiting.")
        return 1
    out = a.out or os.path.join(tempfile.gettempdir(), "kvbridge-bench-gpu")
    os.makedirs(out, exist_ok=True)
    result: dict[str, Any] = {"device": env["device"], "torch": torch.__version__, "cuda": torch.version.cuda,
                              "env": env, "tests": {}, "rows": []}

    def save(rows: list[dict] | None = None) -> None:
        if rows is not None:
            result["rows"] = rows
        result["seconds"] = round(time.monotonic() - t0, 1)
        with open(os.path.join(out, "gpu.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(out, "gpu.md"), "w") as f:
            f.write(markdown(result))

    if not a.no_tests:
        result["tests"] = run_tests(out)
        save()
    print("measuring (ABAB rounds) ...", flush=True)
    try:
        measure(3 if a.quick else 5, 128 if a.quick else 512, save)
    except Exception as exc:
        result["measure_error"] = f"{type(exc).__name__}: {exc}"
        print("measurements FAILED:\n" + traceback.format_exc(), flush=True)
    save()
    print(markdown(result))
    print(f"wrote {out}/gpu.json and gpu.md in {result['seconds']} s")
    failed = [r["what"] for r in result["rows"] if "error" in r]
    ok = all(v["rc"] == 0 for v in result["tests"].values()) and not failed and "measure_error" not in result
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
