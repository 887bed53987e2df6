"""The SGLang transfer backend with SGLang's own classes (``KVArgs``, ``KVPoll``,
``DisaggregationMode``, the plugin loader and ``get_kv_class``): a prefill rank and a decode
rank over buffers laid out as SGLang's MHA pool lays them out (per layer K and V,
``(pages * page_size, heads, head_dim)``), handshaking through the bootstrap server.

Marker ``sglang``; skipped where SGLang is not importable. SGLang 0.5.23 pins torch 2.14.1 and
CUDA packages: install it here with ``pip install --no-deps sglang==0.5.23`` plus its pure-Python
imports, as the README of ``adapters/kvbridge_sglang`` shows; where ``torchvision`` is missing
(its wheels here are CUDA builds) the stand-in in ``_torchvision_standin`` goes on ``sys.path``
(``KVBRIDGE_SGLANG_STUBS`` names another).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from typing import Any, Iterator

import pytest
import torch

if os.environ.get("KVBRIDGE_SGLANG_STUBS"):
    sys.path.insert(0, os.environ["KVBRIDGE_SGLANG_STUBS"])
elif importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("torchvision") is None:
    # SGLang's engine modules import torchvision; where only CUDA builds of it install, the
    # stand-in here (image preprocessing fails loudly; the KV transfer never uses it)
    os.environ["KVBRIDGE_SGLANG_STUBS"] = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                       "_torchvision_standin")
    sys.path.insert(0, os.environ["KVBRIDGE_SGLANG_STUBS"])

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(120),
              pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                 reason="needs SGLang: pip install 'kvbridge[sglang]' (see adapters/kvbridge_sglang)")]

LAYERS, HEADS, DIM, PAGE, PAGES = 2, 2, 16, 4, 32


class Rank:
    """One SGLang rank's KV buffers and metadata buffers, and the KVArgs describing them."""

    def __init__(self, seed: int, heads: int = HEADS, dtype: torch.dtype = torch.float32) -> None:
        from sglang.srt.disaggregation.base.conn import KVArgs
        g = torch.Generator().manual_seed(seed)
        shape = (PAGES * PAGE, heads, DIM)
        self.k = [torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS)]
        self.v = [torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS)]
        self.aux = [torch.zeros(64, 16, dtype=torch.int32), torch.zeros(64, 8, dtype=torch.float32)]
        a = KVArgs()
        bufs = self.k + self.v
        a.kv_data_ptrs = [b.data_ptr() for b in bufs]
        a.kv_data_lens = [b.nbytes for b in bufs]
        a.kv_item_lens = [b[0].nbytes * PAGE for b in bufs]
        a.aux_data_ptrs = [b.data_ptr() for b in self.aux]
        a.aux_data_lens = [b.nbytes for b in self.aux]
        a.aux_item_lens = [b[0].nbytes for b in self.aux]
        a.kv_head_num, a.page_size, a.engine_rank = heads, PAGE, 0
        a.kv_cache_dtype_str = str(dtype)
        self.args = a

    def page(self, layer: int, kv: str, p: int) -> torch.Tensor:
        return (self.k if kv == "k" else self.v)[layer][p * PAGE:(p + 1) * PAGE]


@pytest.fixture(scope="module")
def sgl() -> Any:
    from sglang.srt.plugins import load_plugins
    load_plugins()                       # runs kvbridge_sglang.plugin:register via the entry point
    from sglang.srt.disaggregation import utils
    return utils


@pytest.fixture
def bootstrap(sgl: Any) -> Iterator[Any]:
    cls = sgl.get_kv_class(sgl.TransferBackend("kvbridge"), sgl.KVClassType.BOOTSTRAP_SERVER)
    server = cls("127.0.0.1", 0)
    yield server
    server.close()


def managers(sgl: Any, prefill: Rank, decode: Rank, listen: str) -> tuple[Any, Any]:
    os.environ["KVBRIDGE_SGLANG_LISTEN"] = listen
    try:
        mcls = sgl.get_kv_class(sgl.TransferBackend("kvbridge"), sgl.KVClassType.MANAGER)
        pm = mcls(prefill.args, sgl.DisaggregationMode.PREFILL, None, False)
        dm = mcls(decode.args, sgl.DisaggregationMode.DECODE, None, False)
    finally:
        del os.environ["KVBRIDGE_SGLANG_LISTEN"]
    return pm, dm


def drive(sgl: Any, pm: Any, dm: Any, addr: str, room: int, src_pages: list[int], dst_pages: list[int],
          aux_index: int = 3, chunks: int = 2, decode_first: bool = True) -> tuple[Any, Any, list[Any]]:
    """What SGLang's queues do: decode bootstraps and sends metadata; prefill inits, polls,
    sends its pages chunk by chunk; both poll until Success or Failed."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    scls = sgl.get_kv_class(sgl.TransferBackend("kvbridge"), sgl.KVClassType.SENDER)
    rcls = sgl.get_kv_class(sgl.TransferBackend("kvbridge"), sgl.KVClassType.RECEIVER)
    snd, rcv = scls(pm, addr, room), rcls(dm, addr, room)
    seen: list[Any] = [rcv.poll()]
    rcv.init(0)
    seen.append(rcv.poll())
    snd.init(len(src_pages), aux_index)
    seen.append(snd.poll())                                  # no reservation yet
    rcv.send_metadata(torch.tensor(dst_pages, dtype=torch.int32).numpy(), aux_index)
    deadline = time.monotonic() + 10
    while snd.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(0.005)
    seen.append(snd.poll())
    step = -(-len(src_pages) // chunks)
    for i in range(0, len(src_pages), step):
        snd.send(torch.tensor(src_pages[i:i + step], dtype=torch.int32).numpy())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        s, r = snd.poll(), rcv.poll()
        if s in (KVPoll.Success, KVPoll.Failed) and r in (KVPoll.Success, KVPoll.Failed):
            break
        time.sleep(0.005)
    return snd, rcv, seen


@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "inproc://"])
def test_push_reaches_success_with_equal_bytes(sgl: Any, bootstrap: Any, listen: str) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    prefill, decode = Rank(1), Rank(2)
    prefill.aux[0][3] = torch.arange(16, dtype=torch.int32) + 100      # the first output token & co.
    prefill.aux[1][3] = 0.5
    pm, dm = managers(sgl, prefill, decode, listen)
    src, dst = [5, 6, 9, 20, 21], [1, 30, 2, 3, 17]
    before = {(l, kv, p): decode.page(l, kv, p).clone() for l in range(LAYERS) for kv in "kv" for p in range(PAGES)}
    try:
        snd, rcv, seen = drive(sgl, pm, dm, bootstrap.address, room=7, src_pages=src, dst_pages=dst)
        assert seen == [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Bootstrapping, KVPoll.WaitingForInput]
        assert snd.poll() == KVPoll.Success and rcv.poll() == KVPoll.Success, (snd.failed, rcv.failed)
        for layer in range(LAYERS):
            for kv in "kv":
                for s, d in zip(src, dst):
                    assert torch.equal(prefill.page(layer, kv, s), decode.page(layer, kv, d))
                for p in set(range(PAGES)) - set(dst):               # nothing else was written
                    assert torch.equal(decode.page(layer, kv, p), before[(layer, kv, p)])
        assert torch.equal(decode.aux[0][3], prefill.aux[0][3]) and torch.equal(decode.aux[1][3], prefill.aux[1][3])
        assert not decode.aux[0][4].any()
        m = snd.get_transfer_metric()
        assert m.transfer_total_bytes == len(src) * LAYERS * 2 * PAGE * HEADS * DIM * 4
    finally:
        pm.close()
        dm.close()


def test_decode_abort_fails_both_sides_with_the_reason(sgl: Any, bootstrap: Any) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    prefill, decode = Rank(1), Rank(2)
    pm, dm = managers(sgl, prefill, decode, "tcp://127.0.0.1:0")
    try:
        scls = sgl.get_kv_class(sgl.TransferBackend("kvbridge"), sgl.KVClassType.SENDER)
        rcls = sgl.get_kv_class(sgl.TransferBackend("kvbridge"), sgl.KVClassType.RECEIVER)
        snd, rcv = scls(pm, bootstrap.address, 8), rcls(dm, bootstrap.address, 8)
        rcv.init(0)
        snd.init(2, None)
        rcv.send_metadata(torch.tensor([1, 2], dtype=torch.int32).numpy(), None)
        rcv.abort()                                             # e.g. the client went away
        assert rcv.poll() == KVPoll.Failed
        deadline = time.monotonic() + 5
        while snd.poll() != KVPoll.Failed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert snd.poll() == KVPoll.Failed
        with pytest.raises(Exception, match="aborted on the decode side"):
            snd.failure_exception()
    finally:
        pm.close()
        dm.close()


def test_foreign_layout_and_dtype_fail_with_the_reason(sgl: Any, bootstrap: Any) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    prefill = Rank(1)
    for decode, why in ((Rank(2, heads=4, dtype=torch.float32), "Layout"),
                        (Rank(2, dtype=torch.bfloat16), "dtype")):
        pm, dm = managers(sgl, prefill, decode, "tcp://127.0.0.1:0")
        try:
            room = 20 if why == "Layout" else 21
            snd, rcv, _ = drive(sgl, pm, dm, bootstrap.address, room=room, src_pages=[1, 2], dst_pages=[3, 4],
                                aux_index=None)
            assert snd.poll() == KVPoll.Failed, why
            assert why.lower() in (snd.failed or "").lower()
        finally:
            pm.close()
            dm.close()


def test_prefill_that_finishes_before_the_reservation_never_blocks(sgl: Any, bootstrap: Any) -> None:
    """SGLang may prefill a request while it still bootstraps: the last chunk's send must return at
    once, and the push starts from poll() when the decode side's reservation arrives."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    prefill, decode = Rank(3), Rank(4)
    pm, dm = managers(sgl, prefill, decode, "tcp://127.0.0.1:0")
    try:
        scls = sgl.get_kv_class(sgl.TransferBackend("kvbridge"), sgl.KVClassType.SENDER)
        rcls = sgl.get_kv_class(sgl.TransferBackend("kvbridge"), sgl.KVClassType.RECEIVER)
        snd, rcv = scls(pm, bootstrap.address, 30), rcls(dm, bootstrap.address, 30)
        snd.init(3, None)
        t0 = time.monotonic()
        snd.send(torch.tensor([7, 8, 9], dtype=torch.int32).numpy())
        assert time.monotonic() - t0 < 0.5 and snd.poll() == KVPoll.Bootstrapping
        rcv.init(0)
        rcv.send_metadata(torch.tensor([10, 11, 12], dtype=torch.int32).numpy(), None)
        deadline = time.monotonic() + 10
        while (snd.poll(), rcv.poll()) != (KVPoll.Success, KVPoll.Success) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert (snd.poll(), rcv.poll()) == (KVPoll.Success, KVPoll.Success), (snd.failed, rcv.failed)
        for layer in range(LAYERS):
            for s, d in zip([7, 8, 9], [10, 11, 12]):
                assert torch.equal(prefill.page(layer, "k", s), decode.page(layer, "k", d))
                assert torch.equal(prefill.page(layer, "v", s), decode.page(layer, "v", d))
    finally:
        pm.close()
        dm.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "inproc://"])
def test_real_prefill_bootstrap_queue(tmp_path: Any, listen: str) -> None:
    """SGLang's own PrefillBootstrapQueue, MHATokenToKVPool, MetadataBuffers and Req objects drive
    the backend (``_sglang_queue_child.py``, in its own process): both requests reach
    KVPoll.Success on both sides, decode pages equal prefill pages, the first token arrives."""
    import json
    import subprocess

    from kvbridge_vllm.tiny_model import build_tiny_llama
    model = build_tiny_llama(str(tmp_path / "model"))
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sglang_queue_child.py")
    p = subprocess.run([sys.executable, child, model, listen], capture_output=True, text=True, timeout=220,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, p.stdout[-2000:] + p.stderr[-4000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["equal"] == r["aux_equal"] == r["requests"] == 2 and r["bootstrap_failures"] == 0, r
    for seen in r["polls"].values():                  # Transferring -> prefill Success -> both Success
        assert seen[-1] == [4, 4], seen
