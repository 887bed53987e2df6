"""The parts of the vLLM connector that run without vLLM: cache layouts, settings, the
worker -> scheduler channel. Real kvbridge transfers between caches shaped as vLLM shapes
them (the engine itself runs in ``test_vllm_pd.py``)."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvbridge import KVReceiver, KVSender
from kvbridge.errors import ConfigError, LayoutMismatch
from kvbridge_vllm.channel import HandleInbox, HandleOutbox
from kvbridge_vllm.config import ConnectorConfig
from kvbridge_vllm.layout import compare, layer_index, pool_from_kv_caches

pytestmark = pytest.mark.timeout(60)


def vllm_config(block_size: int) -> Any:
    return SimpleNamespace(cache_config=SimpleNamespace(block_size=block_size),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1))


def caches(shape: tuple[int, ...], layers: int = 2, fill: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"model.layers.{i}.self_attn.attn": (torch.randn(shape, generator=g) if fill else torch.zeros(shape))
            for i in reversed(range(layers))}       # vLLM's dict order is not relied on


@pytest.mark.parametrize("backend,shape", [
    ("cpu", (24, 2, 32, 128)),         # CPU_ATTN: (blocks, kv heads, block_size, 2 * head_dim)
    ("flash", (2, 24, 32, 2, 64)),     # (2, blocks, block_size, kv heads, head_dim)
    ("flashinfer", (24, 2, 32, 2, 64)),
])
def test_blocks_cross_between_vllm_shaped_caches(backend: str, shape: tuple[int, ...]) -> None:
    src_c, dst_c = caches(shape), caches(shape, fill=False)
    src, names, g_src = pool_from_kv_caches(src_c, vllm_config(32), cpu_backend=backend == "cpu")
    dst, _, g_dst = pool_from_kv_caches(dst_c, vllm_config(32), cpu_backend=backend == "cpu")
    assert names == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert (g_src["kv_heads"], g_src["head_dim"], g_src["block_size"], g_src["layers"]) == (2, 64, 32, 2)
    assert compare(g_src, g_dst) == []
    blocks, dst_ids = [3, 5, 17], [20, 0, 9]
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        h = snd.publish("r", blocks, num_tokens=80, layers_ready=0)
        t = rcv.start_fetch(h.to_dict(), dst_ids)
        for i in range(2):                           # as save_kv_layer marks each layer
            snd.mark_ready(h, i + 1)
            assert t.wait_layer(i, 10)
        assert t.result(10).ok
    for name in src_c:
        s, d = src_c[name], dst_c[name]
        for a, b in zip(blocks, dst_ids):
            if backend == "flash":
                assert torch.equal(s[:, a], d[:, b])
            else:
                assert torch.equal(s[a], d[b])
        untouched = [b for b in range(24) if b not in dst_ids]
        assert not (d[:, untouched] if backend == "flash" else d[untouched]).any()


def test_geometry_tells_what_the_bytes_mean() -> None:
    # 2 heads x 64 and 4 heads x 32 have the same bytes per CPU block: the geometry tells them apart
    _, _, a = pool_from_kv_caches(caches((8, 2, 32, 128)), vllm_config(32), cpu_backend=True)
    _, _, b = pool_from_kv_caches(caches((8, 4, 32, 64)), vllm_config(32), cpu_backend=True)
    diff = compare(a, b)
    assert any(d.startswith("kv_heads") for d in diff) and any(d.startswith("head_dim") for d in diff)


def test_refuses_caches_it_cannot_describe() -> None:
    with pytest.raises(LayoutMismatch, match="block_size"):
        pool_from_kv_caches(caches((8, 2, 16, 128)), vllm_config(32), cpu_backend=True)
    with pytest.raises(LayoutMismatch, match="K/V axis"):
        pool_from_kv_caches(caches((8, 3, 32, 2, 64)), vllm_config(32), cpu_backend=False)
    mixed = caches((8, 2, 32, 128))
    mixed["model.layers.1.self_attn.attn"] = torch.zeros(8, 2, 32, 64)
    with pytest.raises(LayoutMismatch, match="one shape"):
        pool_from_kv_caches(mixed, vllm_config(32), cpu_backend=True)
    assert layer_index("model.layers.12.self_attn.attn") == 12


def test_settings() -> None:
    c = ConnectorConfig.from_extra({"listen": "shm://", "ttl": 5, "secret": "00ff"})
    assert c.listen == ("shm://",) and c.ttl == 5.0 and c.secret == b"\x00\xff"
    assert ConnectorConfig.from_extra(None).listen == ("tcp://127.0.0.1:0",)
    with pytest.raises(ConfigError, match="unknown"):
        ConnectorConfig.from_extra({"lsten": "tcp://x:1"})
    with pytest.raises(ConfigError, match="> 0"):
        ConnectorConfig.from_extra({"ttl": 0})
    # nan and inf passed (nan raised ValueError inside the scheduler's request_finished; inf waited for
    # good), True was 1 s, "abc" a ValueError, 5 for listen a TypeError, 123 for leases taken
    for k, bad in [("handle_wait", float("nan")), ("handle_wait", float("inf")), ("ttl", True), ("ttl", "abc"),
                   ("claim_ttl", -1), ("listen", 5), ("listen", ["tcp://x:1", 7]), ("leases", 123)]:
        with pytest.raises(ConfigError, match=k):
            ConnectorConfig.from_extra({k: bad})
    assert ConnectorConfig.from_extra({"leases": False, "listen": ["tcp://a:1", "shm://"]}).listen == ("tcp://a:1",
                                                                                                    "shm://")
    assert ConnectorConfig.from_extra({"load": "layerwise"}).load == "layerwise"
    assert ConnectorConfig.from_extra({}).load == "async"
    with pytest.raises(ConfigError, match="load"):
        ConnectorConfig.from_extra({"load": "eager"})


def test_channel_never_blocks_the_worker() -> None:
    """More messages than a unix datagram queue holds, sent from the thread that will read them
    (vLLM's in-process engine runs scheduler and worker on one thread)."""
    name = f"\0kvbridge-test-{os.getpid()}-{threading.get_ident()}".encode()
    inbox, outbox = HandleInbox(name), HandleOutbox(name)
    try:
        t0 = time.monotonic()
        for i in range(300):
            outbox.send(f"r{i}", handle={"i": i})
        assert time.monotonic() - t0 < 1.0
        for i in range(300):
            msg = inbox.take(f"r{i}", 5.0)
            assert msg is not None and msg["handle"] == {"i": i}
        assert inbox.take("nobody", 0.05) is None
    finally:
        outbox.close()
        inbox.close()
