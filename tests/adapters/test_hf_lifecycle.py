"""Who owns which blocks when an HF hand-off does not finish: a cancelled ``aload`` and a sender
that closes while a cache is being published. Real senders, receivers and TCP."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from kvbridge import KVPool, KVReceiver, KVSender, Transfer
from kvbridge.errors import ConfigError
from kvbridge_hf import HFKVExporter, HFKVImporter, layout_for_config

pytestmark = pytest.mark.timeout(60)


def small_layout() -> Any:
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2)
    return cfg, layout_for_config(cfg, block_size=4)


class RecordingReceiver(KVReceiver):
    """A real receiver that keeps the transfers it starts, to look at them afterwards."""

    transfers: list[Transfer]

    def start_fetch(self, *a: Any, **k: Any) -> Transfer:
        t = super().start_fetch(*a, **k)
        self.transfers = getattr(self, "transfers", []) + [t]
        return t


def test_cancelled_aload_frees_its_landing_blocks_only_once_the_transfer_ended() -> None:
    cfg, layout = small_layout()
    src = KVPool.allocate(layout, 16)
    dst = KVPool.allocate(layout, 16)
    snd = KVSender(src, "tcp://127.0.0.1:0", leases=False)
    rcv = RecordingReceiver(dst, leases=False)
    freed_while_running: list[bool] = []
    dst.on_free.append(lambda ids: freed_while_running.append(not rcv.transfers[-1].done()))
    try:
        ids = src.alloc(3)
        h = snd.publish("r", ids, 12, layers_ready=0)       # its layers never come: the read waits

        async def main() -> None:
            task = asyncio.ensure_future(HFKVImporter(rcv, cfg).aload(h))
            deadline = time.monotonic() + 5
            while not getattr(rcv, "transfers", None) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        asyncio.run(main())
        t = rcv.transfers[-1]
        assert t.result(10) is not None and t.done()
        deadline = time.monotonic() + 5
        while dst.num_free != 16 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert dst.num_free == 16                      # given back ...
        assert freed_while_running == [False]          # ... once, after the transfer had ended
    finally:
        rcv.close()
        snd.close()


class ClosingSender(KVSender):
    """A real sender that another thread closes while ``publish`` runs (here: at a fixed point
    inside it, so the race is hit every time)."""

    close_inside_publish = False

    @property
    def urls(self) -> tuple[str, ...]:
        if self.close_inside_publish:
            self.close_inside_publish = False
            self.close()
        return super().urls


@pytest.mark.parametrize("when", ["before", "during"])
def test_publish_through_a_closed_sender_frees_the_blocks_once(when: str) -> None:
    cfg, layout = small_layout()
    pool = KVPool.allocate(layout, 16)
    snd = ClosingSender(pool, "tcp://127.0.0.1:0", leases=False)
    cache_layers = [(torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)) for _ in range(2)]
    from kvbridge_hf import build_cache
    cache = build_cache(cache_layers, cfg)
    if when == "before":
        snd.close()
    else:
        snd.close_inside_publish = True
    with pytest.raises(ConfigError, match="closed"):
        HFKVExporter(snd).publish("r", cache)
    assert pool.num_free == 16 and all(pool.refcount(b) == 0 for b in range(16))
    snd.close()
