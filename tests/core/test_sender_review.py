"""The sender's lifecycle under races: close() against publish and reads, handles in bulk."""

from __future__ import annotations

from typing import Any

import pytest

import kvbridge.sender as sender_mod
from kvbridge import ConfigError, KVLayout, KVPool, KVSender

pytestmark = pytest.mark.timeout(60)

L = KVLayout.vllm_flash(1, 1, 8, block_size=4, dtype="float16")


@pytest.mark.parametrize("allocator", ["kvbridge", "engine"])
def test_a_publish_that_close_overtakes_is_refused_and_the_blocks_stay_the_callers(
        allocator: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() landing while a publish runs (here: while it hashes the blocks) makes the publish
    refuse, as on a sender already closed: nothing freed, no on_free for a handle the caller never
    got. It used to end the handle -- freeing the caller's reference, telling on_free "closed" --
    and then raise, so the caller freed the blocks again (double free, or a free of blocks
    another request had meanwhile been given)."""
    pool = KVPool.allocate(L, 8, allocator=allocator)
    freed: list[str] = []
    snd = KVSender(pool, "tcp://127.0.0.1:0", leases=False, on_free=lambda h, why: freed.append(why))
    ids = pool.alloc(2) if allocator == "kvbridge" else [0, 1]
    real = sender_mod.block_checksums

    def closing(*a: Any) -> Any:
        snd.close()
        return real(*a)
    monkeypatch.setattr(sender_mod, "block_checksums", closing)
    with pytest.raises(ConfigError, match="closed"):
        snd.publish("r", ids, 8)
    assert freed == []
    assert [pool.refcount(b) for b in ids] == ([1, 1] if allocator == "kvbridge" else [0, 0])
    if allocator == "kvbridge":
        pool.free(ids)                      # the caller's own free, as after any refusal
        assert pool.num_free == 8
