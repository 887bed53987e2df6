"""Comparisons and report of the end-to-end benchmark (:mod:`bench.e2e`): disaggregated /
colocated ratios, token agreement, pass/fail of the targets, the Markdown report and the
TTFT/TPOT CDF plots."""

from __future__ import annotations

import math
from typing import Any, Optional

from bench._e2e_trace import MODES

# Targets of issue 4 (long-prompt mix, headline rate).
TARGET_GOODPUT_RATIO = 1.5
TARGET_KV_FRACTION = 0.10
KV_PROMPT_MIN = 1024
LOSS_MARGIN = 0.10   # "PD lost" on a figure: worse than colocated by more than this


# ============================================================================== comparisons

def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def _num(r: Any) -> Optional[float]:
    """A ratio as stored: a float, None, or "inf" (after a JSON round trip)."""
    return math.inf if r == "inf" else r


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None:
        return None
    if b == 0:
        return math.inf if a > 0 else None
    return a / b


def compare(colo: dict[str, Any], pd: dict[str, Any]) -> dict[str, Any]:
    """Ratios disaggregated / colocated (goodput: higher is better; latencies: lower is better)."""
    c, d = colo["summary"], pd["summary"]
    out: dict[str, Any] = {
        "goodput_requests": _ratio(d["good_requests"], c["good_requests"]),
        "goodput_req_s": _ratio(d["goodput_req_s"], c["goodput_req_s"]),
        "throughput_tok_s": _ratio(d["throughput_tok_s"], c["throughput_tok_s"]),
    }
    for k in ("ttft", "tpot", "e2e"):
        for q in ("p50", "p95", "p99"):
            out[f"{k}_{q}"] = _ratio(d[k][q], c[k][q])
    # token agreement (greedy, same trace): per request, identical output ids?
    by_idx = {r["idx"]: r for r in colo["records"]}
    same = diff = 0
    first_div: list[int] = []
    for r in pd["records"]:
        o = by_idx.get(r["idx"])
        if o is None or not (r["ok"] and o["ok"]):
            continue
        if r["tokens"] == o["tokens"]:
            same += 1
        else:
            diff += 1
            first_div.append(next(i for i, (a, b) in enumerate(zip(r["tokens"], o["tokens"])) if a != b))
    out["tokens_identical"] = same
    out["tokens_different"] = diff
    out["first_divergence_positions"] = first_div
    return out


def targets(results: dict[str, Any], transport: str) -> list[dict[str, Any]]:
    """Pass/fail of the issue's targets at the long mix's headline rate (all rates in the tables)."""
    out: list[dict[str, Any]] = []
    long_ = results["mixes"].get("long")
    if long_:
        head = long_["cells"][0]
        cmp_ = head["compare"]
        colo, pd = head["colocated"]["summary"], head["disaggregated"]["summary"]
        g = cmp_["goodput_requests"]
        out.append({"target": f"long mix: goodput >= {TARGET_GOODPUT_RATIO}x colocated (rate {head['rate']:g} req/s)",
                    "measured": f"{pd['good_requests']}/{pd['requests']} vs {colo['good_requests']}/{colo['requests']}"
                                f" = {_fmt_ratio(g)}",
                    "met": g is not None and g >= TARGET_GOODPUT_RATIO})
        t99 = (pd["tpot"]["p99"], colo["tpot"]["p99"])
        out.append({"target": "long mix: disaggregated TPOT P99 below colocated",
                    "measured": f"{_ms(t99[0])} vs {_ms(t99[1])} ({_fmt_ratio(cmp_['tpot_p99'])})",
                    "met": None not in t99 and t99[0] < t99[1]})
        kv = head["disaggregated"]["extra"]["kv_over_ttft_long_prompts"]
        if transport == "tcp" and kv["count"]:
            out.append({"target": f"KV transfer <= {TARGET_KV_FRACTION:.0%} of TTFT, prompts >= {KV_PROMPT_MIN} "
                                  f"tokens, tcp (median; P95 also shown)",
                        "measured": f"median {kv['p50'] * 100:.1f}%, P95 {kv['p95'] * 100:.1f}%, "
                                    f"max-ish P99 {kv['p99'] * 100:.1f}% ({kv['count']} requests)",
                        "met": kv["p50"] <= TARGET_KV_FRACTION})
        else:
            out.append({"target": f"KV transfer <= {TARGET_KV_FRACTION:.0%} of TTFT over tcp",
                        "measured": f"not measured (transport {transport})", "met": None})
    short = results["mixes"].get("short")
    if short:
        rows = []
        for cell in short["cells"]:
            lost = pd_losses(cell["compare"])
            rows.append(f"{cell['rate']:g} req/s: " + (", ".join(lost) if lost else "none"))
        out.append({"target": f"short mix shows where PD does not pay (figures where PD is worse by "
                              f"> {LOSS_MARGIN:.0%})",
                    "measured": "; ".join(rows),
                    "met": any(pd_losses(c["compare"]) for c in short["cells"])})
    return out


def pd_losses(cmp_: dict[str, Any]) -> list[str]:
    """Figures where disaggregated is worse than colocated by more than LOSS_MARGIN."""
    out = []
    g = _num(cmp_.get("goodput_requests"))
    if g is not None and g < 1 - LOSS_MARGIN:
        out.append(f"goodput {_fmt_ratio(g)}")
    for k, lab in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E")):
        for q in ("p50", "p95", "p99"):
            r = _num(cmp_.get(f"{k}_{q}"))
            if r is not None and r > 1 + LOSS_MARGIN:
                out.append(f"{lab} {q.upper()} {_fmt_ratio(r)}")
    return out


def _fmt_ratio(r: Optional[float]) -> str:
    r = _num(r)
    if r is None:
        return "-"
    if math.isinf(r):
        return "inf"
    return f"{r:.2f}x"


# ============================================================================== report

def _s(v: Optional[float], unit: str = "ms") -> str:
    if v is None:
        return "-"
    if unit != "ms":
        return f"{v:.2f}"
    return f"{v * 1000:.1f}" if abs(v) < 0.01 else f"{v * 1000:.0f}"


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    L: list[str] = []
    L.append("# kvbridge end-to-end: disaggregated vs colocated, equal cores\n")
    L.append(f"- model `{meta['model']}` (seeded weights), chunk {meta['chunk_size']} tokens in both modes, "
             f"{meta['num_blocks']} KV blocks per worker, transport `{meta['transport']}`, trace seed {meta['seed']}")
    L.append(f"- **colocated**: `kvbridge up --colocated --threads {meta['cores']}` (decode first, chunked "
             f"prefill, continuous batching); **disaggregated**: `kvbridge up --threads {max(1, meta['cores'] // 2)}` "
             f"(1 prefill + 1 decode worker) -- {meta['cores']} cores each")
    L.append(f"- machine: {meta['machine']}; started {meta['started']}; wall {meta['wall_s']:.0f} s"
             f"{' (quick)' if meta['quick'] else ''}")
    L.append("- client-side times (one thread per request, streaming, each token timestamped on arrival); "
             "TPOT = mean gap after the first token; ratios are disaggregated / colocated "
             "(goodput: > 1 favours PD; latencies: < 1 favours PD)")
    L.append("- the machine is shared: `other load` is CPU used by processes outside this benchmark "
             "during the run, in cores\n")
    if results.get("targets"):
        L.append("## Targets (long mix at its headline rate; short mix at every rate)\n")
        L.append("| target | measured | met |\n|---|---|---|")
        for t in results["targets"]:
            met = "n/a" if t["met"] is None else ("**yes**" if t["met"] else "**no**")
            L.append(f"| {t['target']} | {t['measured']} | {met} |")
        L.append("")
    cal = results.get("calibration")
    if cal:
        th = cal["threads"]
        L.append("## Engine calibration: one engine's operations at 1 vs "
                 f"{th[-1]} torch threads (same run, median of 5)\n")
        L.append("| operation | " + " | ".join(f"{t} thread{'s' if t > 1 else ''}, ms" for t in th)
                 + f" | speed-up {th[-1]} vs 1 |")
        L.append("|---|" + "---:|" * (len(th) + 1))
        for name, v in cal["ops"].items():
            sp = v[str(th[0])] / v[str(th[-1])] if v[str(th[-1])] else 0.0
            L.append(f"| {name} | " + " | ".join(_s(v[str(t)]) for t in th) + f" | {sp:.2f}x |")
        L.append("")
    for name, mx in results["mixes"].items():
        mix = mx["mix"]
        L.append(f"## {name} mix -- {mix['note']}\n")
        L.append(f"prompts {mix['prompt'][0]}-{mix['prompt'][1]} tokens, outputs {mix['output'][0]}-"
                 f"{mix['output'][1]} tokens (uniform), {mx['requests']} requests per rate, Poisson arrivals; "
                 f"SLOs: TTFT <= {mix['ttft_slo']:g} s, TPOT <= {mix['tpot_slo'] * 1000:g} ms. "
                 f"Headline rate: {mx['cells'][0]['rate']:g} req/s.\n")
        for ci, cell in enumerate(mx["cells"]):
            L.extend(_cell_table(cell, headline=ci == 0))
            L.extend(_bucket_tables(cell))
    return "\n".join(L) + "\n"


def _cell_table(cell: dict[str, Any], headline: bool) -> list[str]:
    c, d = cell["colocated"], cell["disaggregated"]
    cs, ds, cm = c["summary"], d["summary"], cell["compare"]
    ce, de = c["extra"], d["extra"]
    L = [f"### {cell['rate']:g} req/s{' (headline)' if headline else ''}\n",
         "| metric | colocated | disaggregated | PD / colo |", "|---|---:|---:|---:|"]

    def row(name: str, a: str, b: str, r: str = "") -> None:
        L.append(f"| {name} | {a} | {b} | {r} |")

    row("requests ok / sent", f"{cs['ok']}/{cs['requests']}", f"{ds['ok']}/{ds['requests']}")
    row("goodput: requests within both SLOs", f"{cs['good_requests']} ({cs['goodput_fraction']:.0%})",
        f"{ds['good_requests']} ({ds['goodput_fraction']:.0%})", _fmt_ratio(cm["goodput_requests"]))
    row("goodput, req/s", f"{cs['goodput_req_s']:.2f}", f"{ds['goodput_req_s']:.2f}", _fmt_ratio(cm["goodput_req_s"]))
    for k, lab in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "end-to-end")):
        for q in ("p50", "p95", "p99"):
            row(f"{lab} {q.upper()}, ms", _s(cs[k][q]), _s(ds[k][q]), _fmt_ratio(cm[f"{k}_{q}"]))
    row("throughput, output tok/s", f"{cs['throughput_tok_s']:.0f}", f"{ds['throughput_tok_s']:.0f}",
        _fmt_ratio(cm["throughput_tok_s"]))
    row("server queueing P50 / P95, ms", f"{_s(ce['queue_s']['p50'])} / {_s(ce['queue_s']['p95'])}",
        f"{_s(de['queue_s']['p50'])} / {_s(de['queue_s']['p95'])}")
    row("admission to 1st token (prefill, incl. waiting behind earlier prompts) P50 / P95, ms",
        f"{_s(ce['prefill_s']['p50'])} / {_s(ce['prefill_s']['p95'])}",
        f"{_s(de['prefill_s']['p50'])} / {_s(de['prefill_s']['p95'])}")
    row("TTFT - queueing - prefill (HTTP, publish, proxy) P50, ms", _s(ce["ttft_overhead_s"]["p50"]),
        _s(de["ttft_overhead_s"]["p50"]))
    row("gap 1st -> 2nd token P50 / P95, ms", f"{_s(ce['second_token_gap_s']['p50'])} / "
        f"{_s(ce['second_token_gap_s']['p95'])}",
        f"{_s(de['second_token_gap_s']['p50'])} / {_s(de['second_token_gap_s']['p95'])}")
    row("inter-token gap after the 2nd P50 / P99, ms", f"{_s(ce['itl_after_2nd_s']['p50'])} / "
        f"{_s(ce['itl_after_2nd_s']['p99'])}",
        f"{_s(de['itl_after_2nd_s']['p50'])} / {_s(de['itl_after_2nd_s']['p99'])}")
    kv = de["kv_transfer_s"]
    row("KV transfer P50 / P99, ms (fetch: claim, read, verify, release)", "-",
        f"{_s(kv['p50'])} / {_s(kv['p99'])}")
    row("KV per request P50, MiB; effective GiB/s", "-",
        f"{de['kv_mib']['p50']:.1f}; {de['kv_gib_s']:.2f}" if de["kv_mib"]["p50"] is not None else "-")
    kf = de["kv_over_ttft_long_prompts"]
    row(f"KV transfer / TTFT, prompts >= {KV_PROMPT_MIN} P50 / P95", "-",
        f"{kf['p50'] * 100:.1f}% / {kf['p95'] * 100:.1f}%" if kf["count"] else "-")
    cu, du = c["cpu"], d["cpu"]
    row("CPU, cores: engine(s)", f"colocated {cu.get('colocated_cores', 0):.2f}",
        f"prefill {du.get('prefill_cores', 0):.2f} + decode {du.get('decode_cores', 0):.2f}")
    row("CPU, cores: proxy / lease server / client", f"{cu['proxy_cores']:.2f} / - / {cu['bench_client_cores']:.2f}",
        f"{du['proxy_cores']:.2f} / {du['lease_server_cores']:.2f} / {du['bench_client_cores']:.2f}")
    row("other load on the machine, cores", f"{cu['other_cores']:.2f}", f"{du['other_cores']:.2f}")
    row("client dispatch lag P99, ms", _s(ce["client_late_s"]["p99"]), _s(de["client_late_s"]["p99"]))
    lost = pd_losses(cm)
    row(f"where PD is worse by > {LOSS_MARGIN:.0%}", "", ", ".join(lost) if lost else "nowhere")
    row("greedy tokens identical (same request)", "", f"{cm['tokens_identical']}/"
        f"{cm['tokens_identical'] + cm['tokens_different']}")
    L.append("")
    return L


def _bucket_tables(cell: dict[str, Any]) -> list[str]:
    c, d = cell["colocated"]["summary"], cell["disaggregated"]["summary"]
    L: list[str] = []
    for kind in ("prompt", "output"):
        L.append(f"by {kind} length ({cell['rate']:g} req/s): colocated | disaggregated\n")
        L.append("| bucket | n | TTFT P50, ms | TTFT P99, ms | TPOT P50, ms | TPOT P99, ms | goodput |")
        L.append("|---|---:|---:|---:|---:|---:|---:|")
        for b in sorted(set(c["buckets"][kind]) | set(d["buckets"][kind]),
                        key=lambda x: int(x.split("-")[0].rstrip("+"))):
            a, z = c["buckets"][kind].get(b), d["buckets"][kind].get(b)

            def pair(k: str, q: str) -> str:
                return f"{_s(a[k][q]) if a else '-'} \\| {_s(z[k][q]) if z else '-'}"
            n = (a or z)["requests"]  # type: ignore[index]
            good = f"{a['good_requests'] if a else '-'} \\| {z['good_requests'] if z else '-'}"
            L.append(f"| {b} | {n} | {pair('ttft', 'p50')} | {pair('ttft', 'p99')} | {pair('tpot', 'p50')} | "
                     f"{pair('tpot', 'p99')} | {good} |")
        L.append("")
    return L


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    mixes = list(results["mixes"].items())
    fig, axes = plt.subplots(len(mixes), 2, figsize=(12, 4.2 * len(mixes)), squeeze=False)
    colors = {"colocated": "tab:blue", "disaggregated": "tab:red"}
    styles = ["-", "--", ":", "-."]
    for row, (name, mx) in enumerate(mixes):
        mix = mx["mix"]
        for col, (key, slo, lab) in enumerate((("ttft", mix["ttft_slo"], "TTFT (s)"),
                                               ("tpot", mix["tpot_slo"], "TPOT (ms)"))):
            ax = axes[row][col]
            scale = 1000.0 if key == "tpot" else 1.0
            for ci, cell in enumerate(mx["cells"]):
                for mode in MODES:
                    vals = sorted(r[key] * scale for r in cell[mode]["records"] if r["ok"] and r[key] is not None)
                    if not vals:
                        continue
                    ys = [(i + 1) / len(vals) for i in range(len(vals))]
                    ax.step(vals, ys, where="post", color=colors[mode], linestyle=styles[ci % len(styles)],
                            label=f"{mode}, {cell['rate']:g} req/s")
            ax.axvline(slo * scale, color="gray", linewidth=1, linestyle="--", label="SLO")
            ax.set_xscale("log")
            fmt = FuncFormatter(lambda v, _: f"{v:g}")
            ax.xaxis.set_major_formatter(fmt)
            ax.xaxis.set_minor_formatter(FuncFormatter(
                lambda v, _: f"{v:g}" if f"{v:.1e}"[0] in "25" else ""))
            ax.set_xlabel(lab)
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"{name} mix: {key.upper()} CDF")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"kvbridge e2e, model {results['meta']['model']}, {results['meta']['cores']} cores per mode "
                 f"(colocated {results['meta']['cores']} threads vs prefill 1 + decode 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
