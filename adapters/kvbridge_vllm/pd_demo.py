"""Prefill/decode disaggregation with two real vLLM instances and kvbridge, checked token for token.

    python -m kvbridge_vllm.pd_demo --prompts 50            # equality run + both kill tests

What it does (each vLLM instance is its own process, ``LLM`` in-process engine, CPU):

1. **reference**: one plain vLLM instance generates every prompt (greedy).
2. **PD**: a producer (``kv_role="kv_producer"``) and a consumer (``"kv_consumer"``), both with
   ``kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge_vllm"``. The proxy
   (this process, in the pattern of vLLM's disaggregated-serving examples) sends each prompt
   to the producer with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": True}``,
   then sends it to the consumer with the ``kv_transfer_params`` the producer returned. The
   consumer's tokens must equal the reference's.
3. **kill the consumer** while it fetches: the producer's free-block count (vLLM's own
   ``BlockPool.get_num_free_blocks()``) must return to its starting value and its requests end.
4. **kill the producer** after it published: a consumer with ``kv_load_failure_policy="recompute"``
   re-prefills (tokens still equal the reference); one with ``"fail"`` ends the requests with an error.

The model is a tiny random Llama written by :func:`kvbridge_vllm.tiny_model.build_tiny_llama`.
Prints a table and writes JSON with ``--out``. Exit status 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from typing import Any, Optional

CONNECTOR = {"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge_vllm"}


# -- one vLLM instance per process --------------------------------------------------------------

def _engine_main(conn: Any, model: str, kv_config: Optional[dict[str, Any]], max_model_len: int) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"      # scheduler + worker in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {}
    if kv_config is not None:
        from vllm.config import KVTransferConfig
        kw["kv_transfer_config"] = KVTransferConfig(**kv_config)
    llm = LLM(model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=max_model_len, seed=0,
              **kw)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    scheduler = core.scheduler

    def free_blocks() -> int:
        return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def connector_stats() -> dict[str, Any]:
        if kv_config is None:
            return {}
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        return get_kv_transfer_group().transfer_stats()

    conn.send(("ready", free_blocks()))
    while True:
        if not conn.poll(0.005):
            if scheduler.has_requests():        # delayed frees, transfers in flight: keep stepping
                engine.step()
            continue
        cmd, arg = conn.recv()
        if cmd == "stop":
            conn.send(("stopped", None))
            return
        if cmd == "free_blocks":
            conn.send(("free_blocks", {"free": free_blocks(), "requests": len(scheduler.requests),
                                       "stats": connector_stats()}))
            continue
        if cmd == "generate":
            todo: dict[str, Any] = {}
            for rid, ids, max_tokens, params in arg:
                extra = {"kv_transfer_params": params} if params is not None else None
                sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
                engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), sp)
                todo[rid] = None
            out: dict[str, Any] = {}
            while len(out) < len(todo):
                for o in engine.step():
                    if o.finished and o.request_id in todo:
                        c = o.outputs[0]
                        out[o.request_id] = {"tokens": list(c.token_ids), "finish_reason": c.finish_reason,
                                             "kv_transfer_params": o.kv_transfer_params}
            conn.send(("generated", out))


class Instance:
    """A vLLM instance in a child process, driven over a pipe."""

    def __init__(self, name: str, model: str, kv_config: Optional[dict[str, Any]], max_model_len: int) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_main, args=(child, model, kv_config, max_model_len),
                                name=f"vllm-{name}", daemon=True)
        self.proc.start()
        self.free_at_start: Optional[int] = None

    def wait_ready(self, timeout: float = 300) -> None:
        kind, free = self._recv(timeout)
        assert kind == "ready", kind
        self.free_at_start = free

    def _recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"vLLM instance {self.name} did not answer within {timeout} s")
        return self.conn.recv()

    def generate(self, reqs: list[tuple[str, list[int], int, Optional[dict[str, Any]]]],
                 timeout: float = 600) -> dict[str, Any]:
        self.conn.send(("generate", reqs))
        kind, out = self._recv(timeout)
        return out  # type: ignore[no-any-return]

    def send_generate(self, reqs: list[tuple[str, list[int], int, Optional[dict[str, Any]]]]) -> None:
        self.conn.send(("generate", reqs))

    def status(self, timeout: float = 60) -> dict[str, Any]:
        self.conn.send(("free_blocks", None))
        kind, st = self._recv(timeout)
        return st  # type: ignore[no-any-return]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", None))
                self._recv(30)
            except (OSError, EOFError, TimeoutError):
                pass
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)


# -- the proof --------------------------------------------------------------------------------

def make_prompts(n: int, seed: int, vocab: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def kv_config(role: str, policy: str = "recompute", **extra: Any) -> dict[str, Any]:
    return {**CONNECTOR, "kv_role": role, "kv_load_failure_policy": policy, "kv_connector_extra_config": extra}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from .tiny_model import build_tiny_llama

    model = build_tiny_llama(args.model_dir)
    prompts = make_prompts(args.prompts, args.seed, 512, args.min_len, args.max_len)
    kill_prompts = make_prompts(args.kill_prompts, args.seed + 1, 512, args.min_len, args.max_len)
    mml = args.max_len + args.max_tokens + 8
    report: dict[str, Any] = {"prompts": len(prompts), "max_tokens": args.max_tokens,
                              "prompt_lengths": [min(map(len, prompts)), max(map(len, prompts))]}
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    # 1. reference
    log("reference: starting one plain vLLM instance")
    ref_inst = Instance("reference", model, None, mml)
    ref_inst.wait_ready()
    everything = [(f"p{i}", p) for i, p in enumerate(prompts)] + [(f"k{i}", p) for i, p in enumerate(kill_prompts)]
    ref = ref_inst.generate([(rid, p, args.max_tokens, None) for rid, p in everything])
    ref_inst.stop()
    ref_tokens = {rid: ref[rid]["tokens"] for rid, _ in everything}
    log(f"reference: {len(ref_tokens)} prompts done")

    # 2. PD equality
    fast = {"ttl": args.ttl, "claim_ttl": args.claim_ttl, "transfer_timeout": 10.0}
    cfast = {**fast, "load": args.consumer_load}
    report["consumer_load"] = args.consumer_load
    producer = Instance("producer", model, kv_config("kv_producer", **fast), mml)
    consumer = Instance("consumer", model, kv_config("kv_consumer", "recompute", **cfast), mml)
    producer.wait_ready()
    consumer.wait_ready()
    log(f"PD: producer and consumer up (free blocks {producer.free_at_start}, {consumer.free_at_start})")
    tp = time.monotonic()
    pre = producer.generate([(f"p{i}", p, 1, {"do_remote_decode": True}) for i, p in enumerate(prompts)])
    tp = time.monotonic() - tp
    missing = [rid for rid, o in pre.items() if not (o["kv_transfer_params"] or {}).get("kvbridge_handle")]
    td = time.monotonic()
    dec = consumer.generate([(f"p{i}", p, args.max_tokens, pre[f"p{i}"]["kv_transfer_params"])
                             for i, p in enumerate(prompts)])
    td = time.monotonic() - td
    same = sum(dec[f"p{i}"]["tokens"] == ref_tokens[f"p{i}"] for i in range(len(prompts)))
    first_ok = sum(pre[f"p{i}"]["tokens"][:1] == ref_tokens[f"p{i}"][:1] for i in range(len(prompts)))
    cstats = consumer.status()["stats"]
    deadline = time.monotonic() + 60
    pst = producer.status()
    while pst["free"] != producer.free_at_start and time.monotonic() < deadline:
        time.sleep(0.2)
        pst = producer.status()
    secs = sorted(cstats.get("seconds") or [0.0])
    # one request at a time: the handoff of a lone request (claim, read, verify, release)
    fresh = make_prompts(args.single, args.seed + 2, 512, 100, args.max_len)   # nothing cached anywhere
    for i, p in enumerate(fresh):
        rid = f"s{i}"
        one = producer.generate([(rid, p, 1, {"do_remote_decode": True})])
        consumer.generate([(rid, p, 2, one[rid]["kv_transfer_params"])])
    single = sorted((consumer.status()["stats"].get("seconds") or [])[len(secs):]) or [0.0]
    report["pd"] = {"identical": same, "of": len(prompts), "producer_first_token_identical": first_ok,
                    "handles_missing": len(missing), "loads": cstats.get("loads"),
                    "load_failures": cstats.get("load_failures"), "bytes": cstats.get("bytes"),
                    "batch_handoff_ms_p50": round(1000 * statistics.median(secs), 1),
                    "batch_handoff_ms_max": round(1000 * secs[-1], 1),
                    "single_handoff_ms_p50": round(1000 * statistics.median(single), 1),
                    "single_handoff_ms_max": round(1000 * single[-1], 1),
                    "prefill_phase_s": round(tp, 2), "decode_phase_s": round(td, 2),
                    "producer_free_blocks_start": producer.free_at_start, "producer_free_blocks_after": pst["free"],
                    "producer_requests_left": pst["requests"]}
    log(f"PD: {same}/{len(prompts)} identical; handoff p50 {report['pd']['batch_handoff_ms_p50']} ms "
        f"({len(prompts)} at once), {report['pd']['single_handoff_ms_p50']} ms (one at a time); "
        f"producer free blocks {pst['free']}/{producer.free_at_start}")

    # 3. kill the consumer while it fetches
    kp = [(f"k{i}", p) for i, p in enumerate(kill_prompts)]
    pre = producer.generate([(rid, p, 1, {"do_remote_decode": True}) for rid, p in kp])
    during = producer.status()["free"]
    consumer.send_generate([(rid, p, args.max_tokens, pre[rid]["kv_transfer_params"]) for rid, p in kp])
    time.sleep(args.kill_after)
    consumer.kill()
    tk = time.monotonic()
    pst = producer.status()
    held_at_kill = (producer.free_at_start or 0) - pst["free"]
    while (pst["free"] != producer.free_at_start or pst["requests"]) and time.monotonic() - tk < args.ttl + 60:
        time.sleep(0.5)
        pst = producer.status()
    report["kill_consumer"] = {"requests": len(kp), "producer_free_blocks_start": producer.free_at_start,
                               "producer_free_blocks_while_held": during, "blocks_held_at_kill": held_at_kill,
                               "producer_free_blocks_after": pst["free"], "producer_requests_left": pst["requests"],
                               "blocks_leaked": (producer.free_at_start or 0) - pst["free"],
                               "reclaimed_after_s": round(time.monotonic() - tk, 1)}
    log(f"kill consumer: producer free blocks {during} -> {pst['free']} (start {producer.free_at_start}), "
        f"{pst['requests']} requests left, after {report['kill_consumer']['reclaimed_after_s']} s")

    # 4. kill the producer after it published
    c_re = Instance("consumer-recompute", model, kv_config("kv_consumer", "recompute", **cfast), mml)
    c_fail = Instance("consumer-fail", model, kv_config("kv_consumer", "fail", **cfast), mml)
    c_re.wait_ready()
    c_fail.wait_ready()
    half = len(kp) // 2
    pre = producer.generate([(rid, p, 1, {"do_remote_decode": True}) for rid, p in kp])
    producer.kill()
    log("kill producer: producer killed after publishing")
    out_re = c_re.generate([(rid, p, args.max_tokens, pre[rid]["kv_transfer_params"]) for rid, p in kp[:half]])
    out_fail = c_fail.generate([(rid, p, args.max_tokens, pre[rid]["kv_transfer_params"]) for rid, p in kp[half:]])
    re_same = sum(out_re[rid]["tokens"] == ref_tokens[rid] for rid, _ in kp[:half])
    fail_reasons = sorted({str(o["finish_reason"]) for o in out_fail.values()})
    st_re, st_fail = c_re.status(), c_fail.status()
    report["kill_producer"] = {
        "recompute": {"requests": half, "identical_after_reprefill": re_same,
                      "load_failures": st_re["stats"].get("load_failures"),
                      "free_blocks_back": st_re["free"] == c_re.free_at_start},
        "fail": {"requests": len(kp) - half, "finish_reasons": fail_reasons,
                 "tokens_generated": sum(len(o["tokens"]) for o in out_fail.values()),
                 "load_failures": st_fail["stats"].get("load_failures"),
                 "free_blocks_back": st_fail["free"] == c_fail.free_at_start}}
    log(f"kill producer: recompute {re_same}/{half} identical; fail: finish reasons {fail_reasons}")
    c_re.stop()
    c_fail.stop()
    report["seconds"] = round(time.monotonic() - t0, 1)
    k, kr = report["kill_consumer"], report["kill_producer"]
    report["passed"] = bool(
        report["pd"]["identical"] == len(prompts) and not missing and report["pd"]["load_failures"] == 0
        and k["blocks_leaked"] == 0 and k["producer_requests_left"] == 0
        and kr["recompute"]["identical_after_reprefill"] == half and fail_reasons == ["error"]
        and kr["recompute"]["free_blocks_back"] and kr["fail"]["free_blocks_back"])
    return report


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--kill-prompts", type=int, default=8)
    ap.add_argument("--single", type=int, default=5, help="requests handed off one at a time (latency)")
    ap.add_argument("--min-len", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttl", type=float, default=15.0, help="handle TTL: when a dead consumer's blocks come back")
    ap.add_argument("--claim-ttl", type=float, default=5.0)
    ap.add_argument("--kill-after", type=float, default=0.0,
                    help="seconds after sending the requests to the consumer before killing it")
    ap.add_argument("--consumer-load", choices=["async", "layerwise"], default="async",
                    help="consumer loads: async (wait for the KV) or layerwise (forward waits per layer)")
    ap.add_argument("--model-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "kvbridge-tiny-llama"))
    ap.add_argument("--out", help="write the report as JSON here")
    args = ap.parse_args(argv)
    report = run(args)
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
