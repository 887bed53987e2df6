"""``kvbridge`` command line: ``up``, ``prefill``, ``decode``, ``colocated``, ``proxy``, ``leases``.

``kvbridge up`` runs the whole thing on this machine (embedded lease server, a prefill
and a decode worker, the HTTP proxy); ``kvbridge up --colocated`` runs one engine that
does both, for comparison. The other commands run one piece each.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time
from types import FrameType
from typing import Any, Callable, Optional, Sequence

from . import __version__
from .errors import ConfigError, KVBridgeError

__all__ = ["main", "build_parser"]

_MODEL_HELP = "preset (tiny, small, bench) with seeded weights, or a local HF checkpoint directory"
_FMT = argparse.ArgumentDefaultsHelpFormatter


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535; 0 picks a free one)")
    return port


def _checkpoint_dir(model: str) -> Optional[str]:
    """The checkpoint directory ``--model`` names, or None for a preset name; a path that is not a
    directory is an error (the proxy fell back to the byte tokenizer, so a mistyped checkpoint
    path tokenized every prompt as bytes in front of workers that load the real one)."""
    if os.path.isdir(model):
        return model
    if os.sep in model or model.startswith((".", "~")):
        raise ConfigError(f"--model {model!r} is not a checkpoint directory")
    return None


def _seed(text: str) -> int:
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= seed < 1 << 63:
        raise argparse.ArgumentTypeError(f"{seed} is not a seed (0 to 2**63 - 1)")
    return seed


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not v > 0 or not math.isfinite(v):   # nan and inf pass a plain `v <= 0` check
            raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
        return v
    parse.__name__ = kind.__name__
    return parse


def _engine_args(p: argparse.ArgumentParser, threads: int) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (HTTP, and the KV of a prefill worker)")
    g.add_argument("--advertise-host", default=None,
                   help="address other hosts reach this worker at, for its ready line and the KV handles of a "
                        "prefill worker (None: --host; needed when --host is 0.0.0.0)")
    g.add_argument("--port", type=_port, default=0, help="HTTP port (0: any free port)")
    g.add_argument("--model", default="small", help=_MODEL_HELP)
    g.add_argument("--seed", type=_seed, default=0, help="weight seed of a preset model")
    g.add_argument("--chunk-size", type=_positive(int), default=256, help="prefill chunk in tokens")
    g.add_argument("--block-size", type=_positive(int), default=16, help="tokens per KV block")
    g.add_argument("--num-blocks", type=_positive(int), default=2048, help="KV blocks in the pool")
    g.add_argument("--max-num-seqs", type=_positive(int), default=64, help="most requests batched at once")
    g.add_argument("--threads", type=_positive(int), default=threads, help="torch threads")
    g.add_argument("--request-timeout", type=_positive(float), default=300.0,
                   help="abort a request after this many seconds")
    g.add_argument("--max-connections", type=_positive(int), default=None,
                   help="HTTP connections open at once; one more is answered 503 and closed "
                        "(None: 1024, or half the open-file limit when that is lower)")
    g.add_argument("--step-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # fault drills
    g.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)   # set by `up`


def _proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routing", choices=["least-loaded", "round-robin"], default="least-loaded",
                   help="how to pick a prefill and a decode worker")
    p.add_argument("--on-decode-failure", choices=["retry", "reprefill"], default="retry",
                   help="a failed decode worker: retry the handle on another one, or re-prefill")
    p.add_argument("--ttft-slo", type=_positive(float), default=2.0, help="TTFT target in seconds, for goodput")
    p.add_argument("--tpot-slo", type=_positive(float), default=0.1, help="TPOT target in seconds, for goodput")
    p.add_argument("--worker-timeout", type=_positive(float), default=30.0,
                   help="seconds of silence from a worker before it counts as failed")
    p.add_argument("--max-body-bytes", type=_positive(int), default=8 << 20,
                   help="larger request bodies are refused with HTTP 413 before they are read")
    p.add_argument("--max-connections", type=_positive(int), default=None,
                   help="client connections open at once; one more is answered 503 and closed "
                        "(None: 1024, or half the open-file limit when that is lower)")
    p.add_argument("--worker-connections", type=_positive(int), default=512,
                   help="connections to the workers open at once, all workers together (health probes "
                        "have their own)")
    p.add_argument("--worker-pool-timeout", type=_positive(float), default=5.0,
                   help="a request that finds every worker connection in use this long is answered "
                        "503 overloaded")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvbridge", description="Move KV cache between prefill and decode "
                                 "workers; run a reference prefill/decode deployment on this machine.")
    ap.add_argument("--version", action="version", version=f"kvbridge {__version__}")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")

    up = sub.add_parser("up", help="run lease server, workers and proxy on this machine", formatter_class=_FMT,
                        description="Start the embedded lease server, worker processes and the OpenAI-compatible "
                                    "HTTP proxy; Ctrl-C stops everything.")
    up.add_argument("--host", default="127.0.0.1", help="address the proxy and workers listen on")
    up.add_argument("--port", type=_port, default=8000, help="proxy port")
    up.add_argument("--colocated", action="store_true", help="one engine does prefill and decode (baseline)")
    up.add_argument("--transport", choices=["tcp", "shm"], default="tcp", help="KV transport")
    up.add_argument("--prefill-workers", type=_positive(int), default=1, help="prefill worker processes")
    up.add_argument("--decode-workers", type=_positive(int), default=1, help="decode worker processes")
    up.add_argument("--model", default="small", help=_MODEL_HELP)
    up.add_argument("--seed", type=_seed, default=0, help="weight seed of a preset model")
    up.add_argument("--chunk-size", type=_positive(int), default=256, help="prefill chunk, same in both modes")
    up.add_argument("--block-size", type=_positive(int), default=16, help="tokens per KV block")
    up.add_argument("--num-blocks", type=_positive(int), default=2048, help="KV blocks per worker pool")
    up.add_argument("--threads", type=_positive(int), default=None,
                    help="torch threads per worker (None: 1 everywhere, so both modes compute the "
                         "same bits; use 2 with --colocated for an equal-cores comparison)")
    up.add_argument("--leases", default=None, help="redis:// URL of a lease server (None: start an embedded one)")
    up.add_argument("--ttl", type=_positive(float), default=30.0, help="seconds an unfetched handle lives")
    up.add_argument("--max-num-seqs", type=_positive(int), default=64, help="most requests batched at once per engine")
    up.add_argument("--request-timeout", type=_positive(float), default=300.0,
                    help="abort a request after this many seconds")
    up.add_argument("--log-dir", default=None,
                    help="folder for the worker logs, kept after exit (None: $TMPDIR/kvbridge-<uid>/up-<pid>, "
                         "removed on a clean exit)")
    up.add_argument("--keep-logs", action="store_true", help="keep the default log folder after a clean exit")
    up.add_argument("--no-progress", action="store_true", help="no periodic status lines")
    up.add_argument("--step-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    _proxy_args(up)

    pf = sub.add_parser("prefill", help="run a prefill worker (publishes KV handles)", formatter_class=_FMT)
    _engine_args(pf, threads=1)
    pf.add_argument("--leases", default=None, help="redis:// lease server URL (None: embedded in this process)")
    pf.add_argument("--transport", choices=["tcp", "shm", "inproc"], default="tcp",
                    help="how decode workers read the KV (shm also listens on tcp)")
    pf.add_argument("--ttl", type=_positive(float), default=30.0, help="seconds an unfetched handle lives")

    dc = sub.add_parser("decode", help="run a decode worker (fetches KV, generates)", formatter_class=_FMT)
    _engine_args(dc, threads=1)
    dc.add_argument("--leases", default=None, help="redis:// lease server URL (None: the one in each handle)")

    co = sub.add_parser("colocated", help="run one engine that does prefill and decode", formatter_class=_FMT)
    _engine_args(co, threads=1)

    px = sub.add_parser("proxy", help="run the HTTP front door (OpenAI-compatible API)", formatter_class=_FMT)
    px.add_argument("--host", default="127.0.0.1", help="address to listen on")
    px.add_argument("--port", type=_port, default=8000, help="HTTP port")
    px.add_argument("--prefill", action="append", default=[], metavar="URL", help="prefill worker URL (repeat)")
    px.add_argument("--decode", action="append", default=[], metavar="URL", help="decode worker URL (repeat)")
    px.add_argument("--colocated", default=None, metavar="URL", help="colocated worker URL")
    px.add_argument("--model", default="small",
                    help="the served model name; a checkpoint directory also gives the tokenizer")
    px.add_argument("--request-timeout", type=_positive(float), default=300.0,
                    help="abort a request after this many seconds")
    _proxy_args(px)

    ls = sub.add_parser("leases", help="list the leases of a lease server (for operators)", formatter_class=_FMT)
    ls.add_argument("--url", default=None, help="lease server URL (None: the running `kvbridge up`'s)")
    ls.add_argument("--owner", default=None, help="only leases of this owner")
    ls.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    return ap


def _worker_cfg(a: argparse.Namespace) -> Any:
    from .workers.server import WorkerConfig

    return WorkerConfig(model=a.model, seed=a.seed, num_blocks=a.num_blocks, block_size=a.block_size,
                        chunk_size=a.chunk_size, max_num_seqs=a.max_num_seqs, request_timeout=a.request_timeout,
                        step_delay=a.step_delay, max_connections=a.max_connections)


def _run_worker(a: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(max(1, a.threads))
    from .workers.server import run_until_signal

    cfg = _worker_cfg(a)
    if a.cmd == "prefill":
        from .workers.prefill import PrefillWorker
        # the KV listener binds the address decode workers reach, which the handles carry
        worker: object = PrefillWorker(cfg, a.transport, leases=a.leases, ttl=a.ttl,
                                       host=a.advertise_host or a.host)
    elif a.cmd == "decode":
        from .workers.decode import DecodeWorker
        worker = DecodeWorker(cfg, leases=a.leases)
    else:
        from .workers.colocated import ColocatedWorker
        worker = ColocatedWorker(cfg)
    return run_until_signal(worker, a.host, a.port, a.parent_pid, advertise=a.advertise_host)


def _run_proxy(a: argparse.Namespace) -> int:
    from .workers.proxy import Proxy, ProxyConfig
    from .workers.signals import StopSignals
    from .workers.tokenizer import load_tokenizer

    proxy = Proxy(ProxyConfig(prefill=a.prefill, decode=a.decode, colocated=a.colocated, routing=a.routing,
                              on_decode_failure=a.on_decode_failure, ttft_slo=a.ttft_slo, tpot_slo=a.tpot_slo,
                              worker_timeout=a.worker_timeout, request_timeout=a.request_timeout,
                              model_name=a.model, max_body_bytes=a.max_body_bytes,
                              max_connections=a.max_connections, worker_connections=a.worker_connections,
                              worker_pool_timeout=a.worker_pool_timeout),
                  tokenizer=load_tokenizer(_checkpoint_dir(a.model)))
    server = proxy.serve(a.host, a.port)
    from .workers.server import freeze_heap
    freeze_heap()
    print(json.dumps({"event": "ready", "role": "proxy", "url": server.url, "pid": os.getpid()}), flush=True)
    StopSignals().wait()
    proxy.close()
    return 0


def _run_up(a: argparse.Namespace) -> int:
    from .workers.launch import Cluster, UpConfig, forking

    if a.log_dir is not None:   # a folder that cannot hold the logs is the user's to fix, not a traceback
        try:
            os.makedirs(a.log_dir, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--log-dir {a.log_dir!r}: {exc.strerror or exc}") from None
        if not os.access(a.log_dir, os.W_OK | os.X_OK):
            raise ConfigError(f"--log-dir {a.log_dir!r} is not writable")
    cfg = UpConfig(host=a.host, port=a.port, colocated=a.colocated, transport=a.transport,
                   prefill_workers=a.prefill_workers, decode_workers=a.decode_workers, model=a.model,
                   seed=a.seed, chunk_size=a.chunk_size, block_size=a.block_size, num_blocks=a.num_blocks,
                   threads=a.threads, leases=a.leases, ttl=a.ttl, routing=a.routing,
                   on_decode_failure=a.on_decode_failure, ttft_slo=a.ttft_slo, tpot_slo=a.tpot_slo,
                   worker_timeout=a.worker_timeout, step_delay=a.step_delay,
                   max_num_seqs=a.max_num_seqs, request_timeout=a.request_timeout, max_body_bytes=a.max_body_bytes,
                   max_connections=a.max_connections, worker_connections=a.worker_connections,
                   worker_pool_timeout=a.worker_pool_timeout, log_dir=a.log_dir, keep_logs=a.keep_logs)
    cluster = Cluster(cfg)
    # Until wait() takes the signals over, SIGTERM and SIGHUP stop everything in order, as Ctrl-C
    # does (their default ended this process mid-start: workers SIGKILLed by their parent-death
    # signal, the lease server's folder left behind). Once only: a second one must not cut the
    # stop short.
    interrupt = _InterruptOnce(defer=forking)
    prev = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        cluster.start(check=interrupt.check)
        cluster.wait(progress=not a.no_progress)
    finally:
        interrupt.armed = False
        try:
            cluster.stop()
        finally:
            for s, h in prev.items():
                signal.signal(s, h)
    return 0


class _InterruptOnce:
    """A signal handler that raises KeyboardInterrupt the first time, and ignores later signals.
    While ``defer()`` is true (a child is being forked: raised inside the interpreter's at-fork
    hooks, the exception would only be printed) it only notes the signal, and :meth:`check`
    raises it once the fork is over; so it does where such an exception was swallowed anyway."""

    def __init__(self, defer: Callable[[], bool] = lambda: False) -> None:
        self.armed = True
        self.fired: Optional[str] = None
        self.defer = defer

    def __call__(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.armed:
            self.armed = False
            self.fired = signal.Signals(signum).name
            if self.defer():
                return
            raise KeyboardInterrupt(f"signal {self.fired}")

    def check(self) -> None:
        if self.fired is not None and self.armed is False:
            fired, self.fired = self.fired, None
            raise KeyboardInterrupt(f"signal {fired}")


def _run_leases(a: argparse.Namespace) -> int:
    from .lease import open_lease_store
    from .workers.launch import running_states

    url = a.url or os.environ.get("KVBRIDGE_LEASE_URL")
    if not url:
        states = running_states()
        if not states:
            print("kvbridge leases: no --url given and no running `kvbridge up` found", file=sys.stderr)
            return 2
        url = states[0]["leases"]
        if len(states) > 1:
            others = ", ".join(s["proxy"] for s in states[1:])
            print(f"kvbridge leases: {len(states)} deployments running; showing {states[0]['proxy']} "
                  f"(others: {others}; pass --url)", file=sys.stderr)
    store = open_lease_store(url)
    try:
        leases = store.list(a.owner)
    finally:
        store.close()
    if a.json:
        for ls in leases:
            print(json.dumps({"ref": ls.ref, "owner": ls.owner, "state": ls.state.value,
                              "live": _is_live(ls), "fence": str(ls.fence), "claimer": ls.claimer,
                              "ttl_ms_left": ls.ttl_ms_left, "num_blocks": ls.num_blocks, "meta": ls.meta}))
        return 0
    live = [ls for ls in leases if _is_live(ls)]
    ended = [ls for ls in leases if not _is_live(ls)]
    print(f"{len(live)} live lease(s) at {url} (published or claimed: their blocks are held)")
    _lease_table(live)
    if ended:
        print(f"\n{len(ended)} ended lease(s) (released or aborted; the owner frees the blocks, the record "
              f"expires with its TTL)")
        _lease_table(ended)
    return 0


def _is_live(ls: Any) -> bool:
    return str(ls.state.value) in ("published", "claimed")


def _lease_table(leases: Sequence[Any]) -> None:
    if not leases:
        return
    # A lease is listed by its ref (a one-way hash of its id: the server never holds the id, and
    # nothing here lets an operator act on it); the owner's logs and `LeaseStore.ref` map ids to refs.
    print(f"{'lease ref':40} {'state':10} {'blocks':>6} {'ttl ms':>7}  {'owner':40} claimer")
    for ls in leases:
        print(f"{ls.ref:40} {ls.state.value:10} {ls.num_blocks:>6} {ls.ttl_ms_left:>7}  "
              f"{ls.owner[:40]:40} {ls.claimer or ''}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if a.cmd is None:
        ap.print_help()
        return 2
    t0 = time.monotonic()
    try:
        if a.cmd == "up":
            return _run_up(a)
        if a.cmd in ("prefill", "decode", "colocated"):
            return _run_worker(a)
        if a.cmd == "proxy":
            return _run_proxy(a)
        return _run_leases(a)
    except KVBridgeError as exc:
        print(f"kvbridge {a.cmd}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"kvbridge {a.cmd}: interrupted after {time.monotonic() - t0:.1f}s", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
