"""Shared model builder, and the prefill process of the cross-process HF adapter test.

The child (started with multiprocessing *spawn*, so it shares nothing with the parent
but this file) builds the same seeded model, runs each prompt, publishes its cache
through a KVSender on tcp://127.0.0.1:0 with this process's embedded lease server,
sends the handle bytes back through the pipe, and serves until told to stop.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import kvbridge_hf  # noqa: F401
except ImportError:             # an editable install that predates the adapters (see conftest.py)
    sys.path.insert(0, os.path.join(ROOT, "adapters"))

SEED = 1234
NEW_TOKENS = 8
CHILD_WAIT_S = 50.0   # the child never outlives a lost parent by more than this


def build_hf_model(seed: int = SEED, **overrides: Any) -> Any:
    """A tiny random-weight LlamaForCausalLM: kvbridge's seeded ``tiny`` weights (logits std ~2,
    so greedy output does not collapse into one repeated token) loaded into transformers."""
    import transformers

    from kvbridge.workers.model import CausalLM, ModelConfig, hf_config_dict

    ours = CausalLM.from_seed(ModelConfig.preset("tiny", **overrides), seed=seed)
    d = hf_config_dict(ours.config)
    for k in ("architectures", "model_type", "torch_dtype"):
        d.pop(k)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**d)).eval()
    model.load_state_dict(ours.state_dict(), strict=True)
    return model


def serve(conn: Any, prompts: list[list[int]], block_size: int, include_last: bool) -> None:
    """Child entry point: publish one handle per prompt, send them, serve until "stop"."""
    import torch

    from kvbridge_hf import layout_for_model, prefill_for_handoff, publish_cache
    from kvbridge import KVPool, KVSender

    torch.set_num_threads(1)
    sender = None
    try:
        model = build_hf_model()
        layout = layout_for_model(model, block_size=block_size)
        pool = KVPool.allocate(layout, 256)
        sender = KVSender(pool, "tcp://127.0.0.1:0", ttl=60.0)
        items = []
        for i, p in enumerate(prompts):
            pre = prefill_for_handoff(model, p, include_last=include_last)
            first = int(pre.next_token_logits.argmax()) if pre.next_token_logits is not None else None
            handle = publish_cache(sender, f"req-{i}", pre.cache)
            items.append((handle.to_bytes(), first))
        conn.send(("ready", {"pid": os.getpid(), "url": sender.url, "items": items}))
        if not conn.poll(CHILD_WAIT_S):
            return
        conn.recv()   # "stop"
        deadline = time.monotonic() + 5.0   # releases arrive through the lease event stream
        while sender.num_live and time.monotonic() < deadline:
            time.sleep(0.02)
        conn.send(("stats", {"live": sender.num_live, "released": sender.stats.released,
                             "free": pool.num_free, "total": pool.num_blocks}))
    except BaseException as exc:   # report instead of leaving the parent waiting
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except Exception:
            pass
        raise
    finally:
        if sender is not None:
            sender.close()
        conn.close()
