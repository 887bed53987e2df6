"""Request ids on a decode worker: one already in use is refused before the KV is fetched."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvbridge.workers.decode import DecodeWorker
from kvbridge.workers.model import CausalLM
from kvbridge.workers.prefill import PrefillWorker
from kvbridge.workers.server import WorkerConfig

from .conftest import post


@pytest.mark.timeout(60)
def test_a_request_id_in_use_is_refused_before_its_handle_is_fetched(tiny_model: CausalLM, lease_url: str) -> None:
    """A second ``/generate`` under an id that is decoding was refused (400) only after its KV
    fetch, which used its handle up: sent again under a fresh id, the same handle then got 410
    (re-prefill). Now the id is checked as the request arrives: 400, nothing fetched, and the
    handle still serves a request under another id."""
    cfg = WorkerConfig(model="tiny", num_blocks=256, chunk_size=64, request_timeout=20.0)
    pw = PrefillWorker(cfg, "tcp", leases=lease_url, model=tiny_model)
    dw = DecodeWorker(WorkerConfig(model="tiny", num_blocks=256, chunk_size=64, request_timeout=20.0,
                                   step_delay=0.005), leases=lease_url, model=tiny_model)
    purl, durl = pw.serve().url, dw.serve().url
    sampling = {"max_tokens": 150, "ignore_eos": True}
    prompt = [65] * 20

    def job(n: int) -> dict[str, Any]:
        st, pr = post(purl + "/prefill", {"prompt_ids": prompt, "sampling": sampling, "request_id": f"p{n}"})
        assert st == 200 and pr["handle"], pr
        return {"handle": pr["handle"], "prompt_ids": prompt, "output_ids": [pr["first_token"]],
                "sampling": sampling, "stream": False}
    first_job, second_job = job(1), job(2)
    first: dict[str, Any] = {}
    t = threading.Thread(target=lambda: first.update(zip(("status", "body"), post(
        durl + "/generate", {**first_job, "request_id": "same"}, timeout=30))))
    try:
        t.start()
        deadline = time.monotonic() + 10
        while dw.loop.load["running"] != 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert dw.loop.load["running"] == 1
        fetched = dict(dw.fetches)
        st, err = post(durl + "/generate", {**second_job, "request_id": "same"})
        assert st == 400 and "already in use" in err["error"]["message"], err
        assert dw.fetches == fetched, (fetched, dw.fetches)  # refused before any fetch
        st, ok = post(durl + "/generate", {**second_job, "request_id": "other"})  # its handle still serves
        assert st == 200 and len(ok["token_ids"]) == 149, (st, ok)
        t.join(20)
        assert first.get("status") == 200 and len(first["body"]["token_ids"]) == 149, first
    finally:
        t.join(5)
        pw.close()
        dw.close()
