"""The SGLang backend's own logic without SGLang (its base classes from ``_engine_stubs`` where it
is not installed; with SGLang installed these run against the real ones): real bootstrap server,
real kvbridge managers over buffers laid out as SGLang's MHA pool lays them out."""

from __future__ import annotations

import time
from types import SimpleNamespace as NS
from typing import Any, Iterator

import numpy as np
import pytest
from waiting import wait_until as until
import torch

from kvbridge.errors import ConfigError

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("engine_stubs")]

LAYERS, HEADS, DIM, PAGE, PAGES = 2, 1, 8, 4, 8


class Rank:
    def __init__(self, seed: int, rank: int = 0, dtype: str = "torch.float32") -> None:
        from sglang.srt.disaggregation.base.conn import KVArgs
        g = torch.Generator().manual_seed(seed)
        self.bufs = [torch.randn(PAGES * PAGE, HEADS, DIM, generator=g) for _ in range(2 * LAYERS)]
        a = KVArgs()
        a.kv_data_ptrs = [b.data_ptr() for b in self.bufs]
        a.kv_data_lens = [b.nbytes for b in self.bufs]
        a.kv_item_lens = [b[0].nbytes * PAGE for b in self.bufs]
        a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [], [], []
        a.kv_head_num, a.page_size, a.engine_rank, a.kv_cache_dtype_str = HEADS, PAGE, rank, dtype
        self.args = a




@pytest.fixture
def boot() -> Iterator[Any]:
    from kvbridge_sglang.conn import KVBridgeKVBootstrapServer
    b = KVBridgeKVBootstrapServer("127.0.0.1", 0)
    yield b
    b.close()


def manager(rank: Rank, mode: str, server_args: Any = None) -> Any:
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from kvbridge_sglang.conn import KVBridgeKVManager
    return KVBridgeKVManager(rank.args, getattr(DisaggregationMode, mode), server_args)


def test_tensor_parallelism_is_refused_when_the_manager_is_built() -> None:
    with pytest.raises(ConfigError, match="tp-size"):
        manager(Rank(1), "PREFILL", NS(tp_size=2, host="127.0.0.1"))
    with pytest.raises(ConfigError, match="engine_rank=1"):
        manager(Rank(1, rank=1), "DECODE")


def test_prefill_without_a_reservation_fails_at_the_bootstrap_timeout(boot: Any, monkeypatch: Any) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from kvbridge_sglang.conn import KVBridgeKVSender
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "0.3")
    pm = manager(Rank(1), "PREFILL")
    try:
        s = KVBridgeKVSender(pm, boot.address, 1)          # the decode side never reserves
        s.init(1, None)
        assert s.poll() == KVPoll.Bootstrapping
        assert until(lambda: s.poll() == KVPoll.Failed, 5.0)
        assert "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT" in (s.failed or "")
    finally:
        pm.close()


def test_a_prefill_failure_fails_the_decode_side_with_its_reason(boot: Any) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from kvbridge_sglang.conn import KVBridgeKVReceiver, KVBridgeKVSender
    pm, dm = manager(Rank(1), "PREFILL"), manager(Rank(2, dtype="torch.bfloat16"), "DECODE")
    try:
        s, r = KVBridgeKVSender(pm, boot.address, 2), KVBridgeKVReceiver(dm, boot.address, 2)
        r.init(0)
        r.send_metadata(np.array([3], dtype=np.int32), None)
        s.init(1, None)
        assert until(lambda: s.poll() == KVPoll.Failed, 5.0)
        t0 = time.monotonic()
        assert until(lambda: r.poll() == KVPoll.Failed, 5.0)
        assert time.monotonic() - t0 < 2.0                       # not at the reservation's ttl
        assert r.failed is not None and r.failed.startswith("prefill side: ") and "dtype" in r.failed
        assert r.transfer is not None and r.transfer.done()      # the reservation is cancelled
    finally:
        pm.close()
        dm.close()


def test_reservation_ttl_is_a_setting(monkeypatch: Any) -> None:
    monkeypatch.setenv("KVBRIDGE_SGLANG_RESERVATION_TTL", "7.5")
    dm = manager(Rank(2), "DECODE")
    try:
        assert dm.receiver.reservation_ttl == 7.5
    finally:
        dm.close()
    monkeypatch.setenv("KVBRIDGE_SGLANG_RESERVATION_TTL", "soon")
    with pytest.raises(ConfigError, match="RESERVATION_TTL"):
        manager(Rank(2), "DECODE")
