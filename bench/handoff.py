"""Handoff over a shaped link: how much of the KV handoff a decode worker waits for.

A prefill worker and a decode worker run in two processes, each in its own network
namespace, joined by a veth pair shaped with ``tc qdisc ... tbf rate 10gbit`` on both
ends (this benchmark creates the namespaces, the pair and the qdiscs, and removes all
of them on exit, Ctrl-C, SIGTERM and errors included; only a SIGKILL leaves them behind:
``ip netns list | grep kvbh``, ``ip netns del NAME``). In those namespaces TCP slow start after
idle is off (``net.ipv4.tcp_slow_start_after_idle=0``, as for long-lived RPC connections;
``--slow-start-after-idle`` leaves it on): otherwise every connection idle for a prefill
restarts from a small window, which slows the whole-handle pull and the ceiling alike.
No delay is added: ``netem`` is not in
this kernel, and the veth's own round trip (measured, reported) is the link latency.
Where namespaces cannot be made (not root, or no ``ip``), both processes stay in this
namespace on 127.0.0.1 and every send of each process passes an in-process token
bucket at the same rate (``bench._handoff_peer.TokenBucket``); the output says which.

The prefill worker runs the reference model's real prefill (one forward pass over the
prompt, torch on one thread); a forward hook on each decoder layer tells it when a
layer's KV is written. For each prompt-length bucket it measures the **exposed
handoff** -- from the moment the last layer is computed (the KV is complete) to the
moment the decode worker's transfer has returned ok with every layer landed and
verified -- for:

* ``whole``: whole-handle pull. In the last layer's hook the worker publishes the
  handle (checksums over all layers) and sends it over the control connection; the
  decode worker ``fetch``es it.
* ``layerwise``: layer-wise pull. ``publish(..., layers_ready=0)`` before the prefill,
  the handle goes to the decode worker, which calls ``start_fetch`` and acknowledges;
  then the prefill runs and each layer's hook calls ``mark_ready(h, i + 1)``.
* ``push``: the decode worker ``reserve``s its blocks and sends the reservation; the
  prefill worker ``push``es with ``layers_ready=0`` and each hook calls
  ``mark_ready(push, i + 1)``.

The link's ceiling comes from the same run, interleaved with the modes: a plain socket
``sendall``/``recv_into`` of the whole KV's bytes and of one layer's bytes over the same
link, and a 1-byte round trip. Every figure is reported against it. Modes and the
ceiling rotate their order each round. Leases are off (``leases=False``): this measures
the data path on the link; lease round trips are measured by ``bench/lease_fetch.py``.
Both sides use the monotonic clock, which every process on the machine shares.

``--sender-layer-wait S`` changes how long a layer read waits on the sender for a layer
that is not ready (``kvbridge.sender.LAYER_WAIT``, 0.25 s; 0 keeps it): the wait ends as soon
as ``mark_ready`` announces the layer, and a read that finds nothing ready asks again.

Known issue, not worked around: ``Transfer.wait_layer(i)`` on a transfer that no worker
thread has picked up yet runs the whole transfer on the calling thread and returns only
when every layer has landed. The decode worker here calls ``wait_layer(0)`` right after
``start_fetch``, so in some layer-wise pull trials the per-layer landing times are
reported late (counted in the output); the bytes still move layer by layer as the
layers become ready, so the exposed handoff is measured correctly.

Run (root, for the namespaces)::

    python -m bench.handoff [--quick] [--reps N] [--buckets 256,2048,4096]
                            [--link auto|netns|bucket] [--out bench/results/handoff]

Progress goes to stderr, the Markdown table to stdout; JSON (raw samples) and Markdown
go to ``--out`` + ``.json``/``.md`` (default: a scratch path under /tmp).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from kvbridge.codecs import is_lossless
from kvbridge.frames import check_codec

from bench._report import emit, log, summarize

ROOT = Path(__file__).resolve().parents[1]
MODES: tuple[str, ...] = ("whole", "layerwise", "push")   # plus "whole:<codec>", "layerwise:<codec>" (--codecs)
SCRATCH = "/tmp/kvbridge-bench/handoff"
_MODE_TITLES = {"whole": "whole pull ms (× link)", "layerwise": "layer-wise pull ms (× link)",
                "push": "push ms (× link)"}
LAYERWISE_TARGET = 2.0          # whole-handle pull exposed / layer-wise exposed, prompts >= 2k tokens
LAYERWISE_MIN_TOKENS = 2048
LAYER_WAIT_WORKAROUND = 0.0     # seconds; 0 keeps the library's value (see the module doc)






# ============================================================================== the link

def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


class NetnsLink:
    """Two namespaces joined by a veth pair, both ends shaped with tbf. ``close()`` removes
    everything it made (and is registered with atexit and SIGTERM/SIGHUP)."""

    kind = "netns"

    def __init__(self, rate: str, burst: str, latency: str, slow_start_after_idle: bool = False) -> None:
        self.ssai = slow_start_after_idle
        tag = f"kvbh{os.getpid() % 100000}"
        self.ns = (f"{tag}p", f"{tag}d")
        self.dev = (f"{tag}a", f"{tag}b")
        k = os.getpid() % 16000
        base = f"10.{200 + k // 4000}.{(k % 4000) // 16}.{(k % 16) * 16}"
        o = [int(x) for x in base.split(".")]
        self.ip = (f"{o[0]}.{o[1]}.{o[2]}.{o[3] + 1}", f"{o[0]}.{o[1]}.{o[2]}.{o[3] + 2}")
        self.rate, self.burst, self.latency = rate, burst, latency
        self._made: list[str] = []
        self._closed = False
        atexit.register(self.close)
        try:
            for ns in self.ns:
                _run("ip", "netns", "add", ns)
                self._made.append(ns)
            _run("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            self._made.append("veth")
            for ns, dev, ip in zip(self.ns, self.dev, self.ip):
                _run("ip", "link", "set", dev, "netns", ns)
                _run("ip", "-n", ns, "addr", "add", f"{ip}/28", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                     "rate", rate, "burst", burst, "latency", latency)
                # Per-namespace: whether TCP restarts slow start on a connection idle for an RTO.
                _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                     f"net.ipv4.tcp_slow_start_after_idle={int(slow_start_after_idle)}")
            self.qdiscs = [subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                                          capture_output=True, text=True, timeout=30).stdout.strip()
                           for ns, dev in zip(self.ns, self.dev)]
        except BaseException:
            self.close()
            raise

    @staticmethod
    def available() -> Optional[str]:
        """None if namespaces can be made here, else why not."""
        if os.geteuid() != 0:
            return "not root"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"`{tool}` not found"
        return None

    def prefix(self, side: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side]]

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "namespaces": list(self.ns), "veth": list(self.dev), "addresses": list(self.ip),
                "qdisc": f"tbf rate {self.rate} burst {self.burst} latency {self.latency} on both ends",
                "tc_show": getattr(self, "qdiscs", []), "added_delay": "none (netem is not in this kernel)",
                "tcp_slow_start_after_idle": int(self.ssai)}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Deleting a namespace deletes the veth end inside it, and with it the pair.
        if "veth" in self._made:
            subprocess.run(["ip", "link", "del", self.dev[0]], capture_output=True, timeout=30)
            for ns, dev in zip(self.ns, self.dev):
                subprocess.run(["ip", "-n", ns, "link", "del", dev], capture_output=True, timeout=30)
        for ns in self.ns:
            if ns in self._made:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


class BucketLink:
    """No namespaces: both peers on 127.0.0.1, each process's sends through a token bucket."""

    kind = "bucket"

    def __init__(self, rate_bytes_s: float, burst: int, why: str) -> None:
        self.ip = ("127.0.0.1", "127.0.0.1")
        self.bucket = {"rate_bytes_s": rate_bytes_s, "burst": burst}
        self.why = why

    def prefix(self, side: int) -> list[str]:
        return []

    def describe(self) -> dict[str, Any]:
        try:
            ssai: Any = int(Path("/proc/sys/net/ipv4/tcp_slow_start_after_idle").read_text())
        except OSError:
            ssai = None
        return {"kind": self.kind, "addresses": list(self.ip), "why": self.why, "tcp_slow_start_after_idle": ssai,
                "shaping": f"in-process token bucket per peer process: {self.bucket['rate_bytes_s'] * 8 / 1e9:g} "
                           f"Gbit/s, burst {self.bucket['burst']} B, every send cut into 64 KiB pieces "
                           "that wait for their tokens before they are sent (loopback underneath)",
                "added_delay": "none"}

    def close(self) -> None:
        pass


def parse_rate(rate: str) -> float:
    """'10gbit' -> bytes per second."""
    r = rate.lower()
    for suf, mul in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if r.endswith(suf):
            return float(r[: -len(suf)]) * mul / 8
    raise ValueError(f"rate {rate!r}: use e.g. 10gbit")


def parse_size(s: str) -> int:
    s = s.lower()
    for suf, mul in (("kb", 1 << 10), ("mb", 1 << 20), ("k", 1 << 10), ("m", 1 << 20), ("b", 1)):
        if s.endswith(suf):
            return int(float(s[: -len(suf)]) * mul)
    return int(s)


# ============================================================================== peers

class Peer:
    """A ``bench._handoff_peer`` child process (JSON lines over its stdin/stdout)."""

    def __init__(self, role: str, prefix: list[str]) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        self.role = role
        self.proc = subprocess.Popen(prefix + [sys.executable, "-m", "bench._handoff_peer", role], cwd=str(ROOT),
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def send(self, cmd: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, "args": args}) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.role} peer exited (code {self.proc.poll()}); see its stderr above")
        msg = json.loads(line)
        if not msg["ok"]:
            raise RuntimeError(f"{self.role} peer: {msg['error']}\n{msg.get('traceback', '')}")
        return msg["result"]

    def call(self, cmd: str, **args: Any) -> Any:
        self.send(cmd, **args)
        return self.reply()

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("exit")
                self.proc.wait(timeout=20)
        except Exception:
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)


# ============================================================================== the benchmark

class Bench:
    def __init__(self, buckets: list[int], reps: int, model: str, link: str, rate: str, burst: str,
                 latency: str, threads: int, pings: int, layer_wait: float = 0.0,
                 slow_start_after_idle: bool = False) -> None:
        self.ssai = slow_start_after_idle
        self.layer_wait = layer_wait
        self.buckets, self.reps, self.model = buckets, reps, model
        self.link_arg, self.rate, self.burst, self.latency = link, rate, burst, latency
        self.threads, self.pings = threads, pings
        self.trials: list[dict[str, Any]] = []
        self.ceilings: list[dict[str, Any]] = []
        self.info: dict[str, Any] = {}

    def _make_link(self) -> Any:
        why = NetnsLink.available()
        if self.link_arg == "netns" and why:
            raise SystemExit(f"--link netns: cannot make namespaces here ({why})")
        if self.link_arg == "netns" or (self.link_arg == "auto" and why is None):
            return NetnsLink(self.rate, self.burst, self.latency, self.ssai)
        return BucketLink(parse_rate(self.rate), parse_size(self.burst),
                          why or "asked for with --link bucket")

    def run(self) -> None:
        t_start = time.perf_counter()
        self.info["loadavg_at_start"] = os.getloadavg()
        link = self._make_link()
        peers: list[Peer] = []
        old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}

        def on_signal(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt(f"signal {signum}")
        for s in old:
            signal.signal(s, on_signal)
        try:
            self.info["link"] = link.describe()
            log(f"[link] {link.kind}: " + (self.info["link"].get("qdisc") or self.info["link"].get("shaping")))
            bucket = getattr(link, "bucket", None)
            pre = Peer("prefill", link.prefix(0))
            peers.append(pre)
            dec = Peer("decode", link.prefix(1))
            peers.append(dec)
            maxtok = max(self.buckets)
            p = pre.call("setup", host=link.ip[0], model=self.model, max_tokens=maxtok, threads=self.threads,
                         bucket=bucket, layer_wait=self.layer_wait or None)
            d = dec.call("setup", host=link.ip[1], layout=p["layout"], max_tokens=maxtok, bucket=bucket)
            dec.send("accept")
            pre.call("connect", host=link.ip[1], port=d["ctl_port"])
            dec.reply()
            dec.call("plain", host=link.ip[0], port=p["plain_port"])
            self.L, self.bs, self.block_nbytes = p["num_layers"], p["block_size"], p["block_nbytes"]
            self.info.update(model=self.model, num_layers=self.L, block_size=self.bs,
                             kv_bytes_per_token=p["kv_bytes_per_token"], layout=p["layout"],
                             sender_url=p["url"], receiver_url=d["url"], prefill_threads=self.threads,
                             sender_layer_wait_s=p["layer_wait_s"],
                             sender_layer_wait_default_s=p["layer_wait_default_s"])
            if self.layer_wait:
                log(f"[workaround] kvbridge.sender.LAYER_WAIT {p['layer_wait_default_s']} s -> "
                    f"{p['layer_wait_s']} s in the prefill process (see --sender-layer-wait)")
            log(f"[model {self.model}] {self.L} layers, KV {p['kv_bytes_per_token']} B/token "
                f"({p['kv_bytes_per_token'] // self.L} B/token/layer)")
            # Warm-up: one trial of each mode and a ceiling per bucket, discarded.
            for n in self.buckets:
                log(f"[warm-up {n} tokens]")
                self._ceiling(dec, n, -1)
                for m in MODES:
                    self._trial(pre, dec, m, n, -1)
            for rep in range(self.reps):
                for n in self.buckets:
                    order = ["ceiling", *MODES]
                    k = rep % len(order)
                    order = order[k:] + order[:k]
                    msg = []
                    for m in order:
                        if m == "ceiling":
                            c = self._ceiling(dec, n, rep)
                            msg.append(f"link {c['whole_s'] * 1e3:.2f} ms")
                        else:
                            r = self._trial(pre, dec, m, n, rep)
                            msg.append(f"{m} {r['exposed_s'] * 1e3:.2f} ms")
                    log(f"  round {rep + 1}/{self.reps} {n:>5} tokens: " + ", ".join(msg))
        finally:
            for pe in peers:
                pe.close()
            link.close()
            for s, h in old.items():
                signal.signal(s, h)
        self.elapsed = time.perf_counter() - t_start

    def _nbytes(self, n: int) -> int:
        return -(-n // self.bs) * self.block_nbytes

    def _ceiling(self, dec: Peer, n: int, rep: int) -> dict[str, Any]:
        nb = self._nbytes(n)
        c = dec.call("ceiling", sizes=[nb, nb // self.L], pings=self.pings)
        out = {"tokens": n, "round": rep, "nbytes": nb, "whole_s": c["seconds"][0], "layer_s": c["seconds"][1],
               "rtt_s": c["rtt_s"], "rtt_min_s": c["rtt_min_s"]}
        if rep >= 0:
            self.ceilings.append(out)
        return out

    def _trial(self, pre: Peer, dec: Peer, mode: str, n: int, rep: int) -> dict[str, Any]:
        rid = f"{mode}-{n}-{rep}-{time.monotonic_ns()}"
        dec.send("trial", mode=mode, tokens=n, rid=rid)        # the decode side waits on the control link
        p = pre.call("trial", mode=mode, tokens=n, rid=rid)
        d = dec.reply()
        lossy = ":" in mode and not is_lossless(mode.partition(":")[2])
        if p["sums"] != d["sums"] and not lossy:    # a lossy codec's bytes differ by design
            raise RuntimeError(f"{mode} {n} tokens: the decode side's blocks differ from the prefill side's KV")
        t0 = p["kv_done"]
        out = {"mode": mode, "tokens": n, "round": rep, "nbytes": d["nbytes"],
               "exposed_s": d["done"] - t0, "landed_s": d["landed"] - t0,
               "prefill_s": p["prefill_end"] - p["prefill_start"],
               "layer_compute_s": [b - a for a, b in zip([p["prefill_start"]] + p["layer_done"][:-1],
                                                         p["layer_done"])],
               "layer_landed_after_computed_s": [b - a for a, b in zip(p["layer_done"], d["layer_landed"])],
               "publish_s": (p["published"] - t0) if "published" in p else None,
               "handle_recv_s": (d["handle_recv"] - t0) if "handle_recv" in d else None,
               # wait_layer(0) came back only after the next layer was computed, together with every other
               # layer: progress was not reported as it happened (see the module doc).
               "first_layer_reported_late": (len(d["layer_landed"]) > 1 and d["layer_landed"][0] > p["layer_done"][1]
                                             and d["layer_landed"][-1] - d["layer_landed"][0] < 1e-3)}
        if rep >= 0:
            self.trials.append(out)
        return out

    # -- summaries --------------------------------------------------------------------------
    def summary(self) -> list[dict[str, Any]]:
        rows = []
        for n in self.buckets:
            cs = {c["round"]: c for c in self.ceilings if c["tokens"] == n}
            ts = {(t["mode"], t["round"]): t for t in self.trials if t["tokens"] == n}
            rounds = sorted(cs)
            row: dict[str, Any] = {"tokens": n, "nbytes": self._nbytes(n), "rounds": len(rounds),
                                   "ceiling_whole_s": summarize([cs[r]["whole_s"] for r in rounds]),
                                   "ceiling_layer_s": summarize([cs[r]["layer_s"] for r in rounds]),
                                   "rtt_s": summarize([cs[r]["rtt_s"] for r in rounds]),
                                   "prefill_s": summarize([t["prefill_s"] for t in ts.values()]),
                                   "layer_compute_s": summarize([x for t in ts.values()
                                                                 for x in t["layer_compute_s"]])}
            for m in MODES:
                ex = [ts[(m, r)]["exposed_s"] for r in rounds]
                row[m] = {"exposed_s": summarize(ex),
                          "x_ceiling": summarize([e / cs[r]["whole_s"] for e, r in zip(ex, rounds)]),
                          "x_layer_ceiling": summarize([e / cs[r]["layer_s"] for e, r in zip(ex, rounds)])}
            row["first_layer_reported_late"] = {m: sum(ts[(m, r)]["first_layer_reported_late"] for r in rounds)
                                                for m in ("layerwise", "push")}
            sp = [ts[("whole", r)]["exposed_s"] / ts[("layerwise", r)]["exposed_s"] for r in rounds]
            row["whole_over_layerwise"] = summarize(sp)
            row["layerwise_target"] = LAYERWISE_TARGET if n >= LAYERWISE_MIN_TOKENS else None
            row["layerwise_pass"] = (row["whole_over_layerwise"]["median"] >= LAYERWISE_TARGET
                                     if n >= LAYERWISE_MIN_TOKENS else None)
            for ref in ("layerwise", "whole"):
                diff = [ts[("push", r)]["exposed_s"] - ts[(ref, r)]["exposed_s"] for r in rounds]
                rtts = [cs[r]["rtt_s"] for r in rounds]
                row[f"push_minus_{ref}_s"] = summarize(diff)
                row[f"push_minus_{ref}_in_rtt"] = summarize([a / b for a, b in zip(diff, rtts)])
                row[f"push_{ref}_pass"] = row[f"push_minus_{ref}_in_rtt"]["median"] <= 1.0
            rows.append(row)
        return rows

    def to_json(self) -> dict[str, Any]:
        import torch
        return {
            "benchmark": "kvbridge handoff over a shaped link",
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "elapsed_s": getattr(self, "elapsed", None),
            "reps": self.reps, "buckets": self.buckets,
            "machine": {"python": platform.python_version(), "platform": platform.platform(),
                        "cpus": os.cpu_count(), "torch": torch.__version__, "loadavg_at_end": os.getloadavg()},
            "setup": self.info,
            "method": {
                "exposed": "decode side's transfer returned ok (every layer landed and verified) minus the moment "
                           "the prefill's last decoder layer finished (forward hook); CLOCK_MONOTONIC on both sides",
                "whole": "publish() in the last layer's hook, handle over the control link, receiver.fetch()",
                "layerwise": "publish(layers_ready=0) and start_fetch() before the prefill; mark_ready(h, i+1) "
                             "in layer i's hook",
                "push": "reserve() before the prefill, push(reservation, layers_ready=0); mark_ready(push, i+1) "
                        "in layer i's hook; the decode side waits on the reservation's transfer",
                "ceiling": "plain socket sendall/recv_into of the whole KV's bytes and of one layer's bytes over "
                           "the same link, and a 1-byte round trip (median of several), interleaved with the modes",
                "order": "each round runs the ceiling and the three modes in an order that rotates per round",
                "leases": "off (leases=False) on both sides",
                "prefill": "one forward pass over the prompt (no chunking), torch threads as prefill_threads",
                "workaround": "kvbridge.sender.LAYER_WAIT set to setup.sender_layer_wait_s in the prefill process: "
                              "a tcp layer read that finds no layer ready within the library's value is answered "
                              "with an empty layer range, which the tcp client rejects (ProtocolError)",
                "known_issue": "Transfer.wait_layer() on a transfer no worker has picked up runs it whole on the "
                               "calling thread; trials where layer progress came back only at the end are flagged "
                               "first_layer_reported_late",
            },
            "summary": self.summary(), "ceilings": self.ceilings, "trials": self.trials,
        }

    def markdown(self) -> str:
        link = self.info.get("link", {})
        shaping = link.get("qdisc") or link.get("shaping")
        kvb = self.info.get("kv_bytes_per_token", 0)
        lines = [f"Link: **{link.get('kind')}** — {shaping}; added delay: {link.get('added_delay')}; "
                 f"tcp_slow_start_after_idle={link.get('tcp_slow_start_after_idle')}."
                 + (f" Namespaces could not be made: {link['why']}." if link.get("why") else ""),
                 f"Model `{self.model}`: {self.info.get('num_layers')} layers, KV {kvb} B/token "
                 f"({kvb // max(1, self.info.get('num_layers') or 1)} B/token/layer); {self.reps} rounds; "
                 f"medians [min–max]; leases off. Load average at start / end: "
                 f"{self.info.get('loadavg_at_start', (0,))[0]:.1f} / {os.getloadavg()[0]:.1f} "
                 f"on {os.cpu_count()} CPUs.", "",
                 "| prompt tokens | KV | prefill ms | link: whole KV ms | link: one layer ms | link RTT µs | "
                 + " | ".join(_MODE_TITLES.get(m, f"{m.replace(':', ' pull, ')} ms (× link)") for m in MODES) + " |",
                 "|---:|---:|---:|---:|---:|---:|" + "---|" * len(MODES)]
        rows = self.summary()
        for r in rows:
            cells = []
            for m in MODES:
                e, x = r[m]["exposed_s"], r[m]["x_ceiling"]
                cells.append(f"{e['median'] * 1e3:.2f} [{e['min'] * 1e3:.2f}–{e['max'] * 1e3:.2f}] "
                             f"({x['median']:.2f}×)")
            lines.append(f"| {r['tokens']} | {r['nbytes'] / (1 << 20):.2f} MiB | "
                         f"{r['prefill_s']['median'] * 1e3:.0f} | "
                         f"{r['ceiling_whole_s']['median'] * 1e3:.2f} | {r['ceiling_layer_s']['median'] * 1e3:.2f} | "
                         f"{r['rtt_s']['median'] * 1e6:.0f} | " + " | ".join(cells) + " |")
        lines += ["", "| prompt tokens | whole ÷ layer-wise (paired) | target | pass/fail | "
                  "push − layer-wise pull, µs | in link RTTs | push − whole pull, µs | "
                  "target (push within 1 RTT of layer-wise pull) |",
                  "|---:|---|---|---|---|---|---|---|"]
        for r in rows:
            s = r["whole_over_layerwise"]
            tgt = f"≥ {r['layerwise_target']:.0f}×" if r["layerwise_target"] else "— (short prompt)"
            pf = "—" if r["layerwise_pass"] is None else ("PASS" if r["layerwise_pass"] else "FAIL")
            d, dr, dw = r["push_minus_layerwise_s"], r["push_minus_layerwise_in_rtt"], r["push_minus_whole_s"]
            lines.append(f"| {r['tokens']} | {s['median']:.2f} [{s['min']:.2f}–{s['max']:.2f}] | {tgt} | {pf} | "
                         f"{d['median'] * 1e6:+.0f} [{d['min'] * 1e6:+.0f}–{d['max'] * 1e6:+.0f}] | "
                         f"{dr['median']:+.2f} | {dw['median'] * 1e6:+.0f} [{dw['min'] * 1e6:+.0f}–"
                         f"{dw['max'] * 1e6:+.0f}] | {'PASS' if r['push_layerwise_pass'] else 'FAIL'} |")
        late = sum(r["first_layer_reported_late"]["layerwise"] for r in rows)
        if late:
            lines += ["", f"In {late} of {sum(r['rounds'] for r in rows)} layer-wise pull trials `wait_layer(0)` "
                      "returned only at the end, with every other layer (layer progress reported late; the bytes "
                      "still moved layer by layer, so the exposed time is unaffected): see the module doc."]
        return "\n".join(lines) + "\n"




def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.handoff", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small prompts (256, 512 tokens), 1 round")
    ap.add_argument("--reps", type=int, default=None, help="rounds (default 7; quick 1)")
    ap.add_argument("--buckets", default=None, help="prompt lengths in tokens (default 256,2048,4096)")
    ap.add_argument("--model", default="bench", help="model preset (default bench, as bench.e2e)")
    ap.add_argument("--link", choices=("auto", "netns", "bucket"), default="auto",
                    help="netns: veth + tbf (root); bucket: in-process token bucket; auto: netns if possible")
    ap.add_argument("--rate", default="10gbit")
    ap.add_argument("--burst", default="256kb", help="tbf burst / token bucket depth")
    ap.add_argument("--latency", default="50ms", help="tbf latency (queue bound)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the prefill worker")
    ap.add_argument("--pings", type=int, default=21, help="1-byte round trips per ceiling measurement")
    ap.add_argument("--sender-layer-wait", type=float, default=LAYER_WAIT_WORKAROUND,
                    help="set kvbridge.sender.LAYER_WAIT in the prefill process (0: leave the library's value); "
                         "default: the library's value")
    ap.add_argument("--slow-start-after-idle", action="store_true",
                    help="leave TCP slow start after idle on in the namespaces (default: off, a warm link)")
    ap.add_argument("--codecs", default="", help="also run whole and layer-wise pulls with these codecs "
                    "(comma-separated, e.g. int8,lz4): handoff time with and without one")
    ap.add_argument("--out", default=SCRATCH, help=f"output path without extension (default {SCRATCH})")
    a = ap.parse_args(argv)
    global MODES
    codecs = [c for c in a.codecs.split(",") if c]
    for c in codecs:
        check_codec(c)
    MODES = MODES + tuple(f"{m}:{c}" for c in codecs for m in ("whole", "layerwise"))
    buckets = ([int(x) for x in a.buckets.split(",")] if a.buckets
               else [256, 512] if a.quick else [256, 2048, 4096])
    reps = a.reps or (1 if a.quick else 7)
    b = Bench(buckets, reps, a.model, a.link, a.rate, a.burst, a.latency, a.threads, a.pings,
              a.sender_layer_wait, a.slow_start_after_idle)
    b.run()
    emit(b.markdown(), b.to_json(), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
