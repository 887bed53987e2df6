"""Front-door overhead at low load: what a request pays beyond queueing and prefill compute.

Both deployments of :mod:`bench.e2e` (``kvbridge up --colocated`` and ``kvbridge up``,
started the same way, equal cores) get the same requests ONE AT A TIME (no queueing,
no batching): a fixed-length prompt, a few output tokens, streamed over
``POST /v1/completions`` by the e2e bench's client (a thread, ``http.client``, each
token timestamped on arrival). Per request:

    overhead = client TTFT - server queueing - prefill compute

(queueing and prefill come from the proxy's per-request record, as in the e2e bench's
"TTFT - queueing - prefill" row). The modes alternate round by round (A B A B ...,
which one goes first alternates too) so machine noise hits both; each round reports the
median of its requests, and the table gives the median and the range over rounds.

Where the time goes: the proxy's record carries ``hops``, wall-clock stamps (seconds
after the proxy received the request) taken along the path -- proxy parsed the request,
sent it to the worker, worker received it, engine took it, first token sampled, KV
published, worker answered, proxy got the answer, proxy wrote the first event. The
report gives each segment's median (the client's own send and receive are the first and
last segments, measured against the proxy's arrival and first write; all processes run
on this machine and share its clock).

Run::

    python -m bench.frontdoor [--rounds 6] [--requests 20] [--prompt 128] [--max-tokens 4]
                              [--out PATH.json]

Prints a Markdown table; the JSON (every request, every round) goes to ``--out``
(default: a scratch file under the temp directory).
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
from typing import Any, Optional, Sequence

from bench.e2e import VOCAB, DeployConfig, Deployment, TraceReq, _machine, _machine_busy, log, run_trace

MODES = ("colocated", "disaggregated")
# (label, start stamp, end stamp): the path of the first token, in order
SEGMENTS = {
    "disaggregated": [
        ("client send -> proxy handler", "client_sent", "arrival"),
        ("proxy: read, validate, tokenize", "arrival", "parsed"),
        ("proxy -> prefill POST sent", "parsed", "prefill_sent"),
        ("HTTP to prefill worker handler", "prefill_sent", "w_received"),
        ("prefill worker: read body -> engine queue", "w_received", "w_submitted"),
        ("queue + prefill compute (excluded)", "w_submitted", "w_first_token"),
        ("first token -> publish done", "w_first_token", "w_published"),
        ("worker answer built", "w_published", "w_answered"),
        ("HTTP answer -> proxy", "w_answered", "answered"),
        ("proxy: first event written", "answered", "first_sent"),
        ("proxy -> client first token", "first_sent", "client_first"),
    ],
    "colocated": [
        ("client send -> proxy handler", "client_sent", "arrival"),
        ("proxy: read, validate, tokenize", "arrival", "parsed"),
        ("proxy -> worker POST sent", "parsed", "prefill_sent"),
        ("HTTP to worker handler", "prefill_sent", "w_received"),
        ("worker: read body -> engine queue", "w_received", "w_submitted"),
        ("queue + prefill compute (excluded)", "w_submitted", "w_first_token"),
        ("first token -> worker event written", "w_first_token", "w_answered"),
        ("HTTP event -> proxy", "w_answered", "answered"),
        ("proxy: first event written", "answered", "first_sent"),
        ("proxy -> client first token", "first_sent", "client_first"),
    ],
}


def one_round(dep: Deployment, reqs: Sequence[TraceReq]) -> list[dict[str, Any]]:
    """Send ``reqs`` one after another (each waits for the previous answer)."""
    recs = []
    for r in reqs:
        recs.extend(run_trace(dep.url, [r], "frontdoor", progress_every=1e9))
    server = dep.records()
    rows = []
    for rec in recs:
        s = server.get(rec.request_id or "") or {}
        if not rec.ok or rec.first_token_at is None or s.get("queue_s") is None:
            rows.append({"ok": False, "error": rec.error})
            continue
        ttft = rec.first_token_at - rec.sent
        hops = dict(s.get("hops") or {})
        if hops:  # stamps relative to the proxy's arrival; add the client's own
            hops["arrival"] = 0.0
            hops["client_sent"] = rec.sent - s["arrival"]
            hops["client_first"] = rec.first_token_at - s["arrival"]
        rows.append({"ok": True, "ttft": ttft, "queue_s": s["queue_s"], "prefill_s": s["prefill_s"],
                     "overhead": ttft - s["queue_s"] - (s["prefill_s"] or 0.0), "hops": hops})
    return rows


def segments(mode: str, rows: Sequence[dict[str, Any]]) -> list[tuple[str, Optional[float]]]:
    out = []
    for label, a, b in SEGMENTS[mode]:
        d = [r["hops"][b] - r["hops"][a] for r in rows if r["ok"] and a in r["hops"] and b in r["hops"]]
        out.append((label, statistics.median(d) if d else None))
    return out


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1e3:.2f}"


def markdown(res: dict[str, Any]) -> str:
    L = ["# Front-door overhead at low load (one request at a time)", "",
         f"- {res['machine']}; {res['rounds']} rounds x {res['requests']} requests per mode, prompt "
         f"{res['prompt']} tokens, {res['max_tokens']} output tokens, model `{res['model']}`",
         f"- machine busy during the timed rounds: {res['other_cores']:.2f} cores (this benchmark included)", "",
         "| figure | colocated | disaggregated |", "|---|---:|---:|"]
    for key, name in (("overhead", "TTFT - queueing - prefill P50, ms"), ("ttft", "TTFT P50, ms"),
                      ("prefill_s", "prefill compute P50, ms"), ("queue_s", "queueing P50, ms")):
        cells = []
        for mode in MODES:
            per_round = [statistics.median([r[key] for r in rows if r["ok"]]) for rows in res["runs"][mode]]
            cells.append(f"{_ms(statistics.median(per_round))} ({_ms(min(per_round))}-{_ms(max(per_round))})")
        L.append(f"| {name} (median of rounds, range) | {cells[0]} | {cells[1]} |")
    L += ["", "Where the first token's time goes (median over all requests, ms):", ""]
    for mode in MODES:
        rows = [r for rr in res["runs"][mode] for r in rr]
        seg = segments(mode, rows)
        if all(v is None for _, v in seg):
            continue
        L += [f"**{mode}**", "", "| segment | ms |", "|---|---:|"]
        L += [f"| {label} | {_ms(v)} |" for label, v in seg]
        L.append("")
    return "\n".join(L)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--requests", type=int, default=20, help="sequential requests per round and mode")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--model", default="bench")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "kvbridge-bench", "frontdoor.json"))
    a = p.parse_args(argv)
    rng = random.Random("kvbridge-frontdoor")
    reqs = [TraceReq(i, 0.0, [rng.randrange(VOCAB) for _ in range(a.prompt)], a.max_tokens)
            for i in range(a.requests)]
    cfg = DeployConfig(model=a.model, cores=a.cores)
    log_dir = tempfile.mkdtemp(prefix="kvbridge-frontdoor-")
    deps = {m: Deployment(m, cfg, log_dir) for m in MODES}
    runs: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in MODES}
    try:
        for d in deps.values():
            log(f"starting {d.mode}: kvbridge {' '.join(d.argv)}")
            d.start()
            for _ in range(2):  # warm-up (untimed)
                one_round(d, reqs[:5])
        t0, m0 = time.monotonic(), _machine_busy()
        for i in range(a.rounds):
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                rows = one_round(deps[mode], reqs)
                runs[mode].append(rows)
                ok = [r for r in rows if r["ok"]]
                log(f"round {i + 1} {mode}: {len(ok)}/{len(rows)} ok, overhead P50 "
                    f"{_ms(statistics.median([r['overhead'] for r in ok]) if ok else None)} ms")
        busy = (_machine_busy() - m0) / (time.monotonic() - t0)
    finally:
        for d in deps.values():
            d.stop()
    res = {"machine": _machine(), "rounds": a.rounds, "requests": a.requests, "prompt": a.prompt,
           "max_tokens": a.max_tokens, "model": a.model, "other_cores": busy, "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f)
    print(markdown(res))
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
