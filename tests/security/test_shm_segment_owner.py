"""shm:// maps only a segment whose descriptor the peer passed (SEGFD) and that the peer's own
user (``SO_PEERCRED``) owns (README, Hostile peers): a peer can pass only descriptors it holds,
and one of another user's segments is refused besides. Names, links, files and unsealed
memfds are attacked in ``test_push_defenses.py``; this file holds the owner check, for
reading and for a push's writes.

Another user cannot be made on a test machine, so the peer's credentials are shifted by one
uid where the transport asks the kernel for them; the same transfers with the real
credentials are the control."""

from __future__ import annotations

import os

import pytest
import torch

import kvbridge.transports.shm as shm
import kvbridge.transports.shm_onesided as shm_onesided
from kvbridge import KVLayout, KVPool, KVReceiver, KVSender, ProtocolError, Timeout
from kvbridge.segments import SharedSegment

pytestmark = pytest.mark.timeout(60)
L = KVLayout.vllm_flash(2, 1, 8, block_size=2, dtype="float16")


def _pool(fill: int, shared: bool) -> KVPool:
    p = KVPool.allocate(L, 4, shared=shared)
    for b in p.buffers:
        b.view(-1).view(torch.uint8).fill_(fill)
    return p


def _filled(pool: KVPool, ids: list[int], fill: int) -> bool:
    return all(bool((pool.block(layer, b)[part].view(torch.uint8) == fill).all())
               for layer in range(L.num_layers) for b in ids for part in (0, 1))


def _as_another_user(monkeypatch: pytest.MonkeyPatch) -> None:
    real = shm.peer_cred
    for mod in (shm, shm_onesided):       # the MAP path's and the OPEN path's
        monkeypatch.setattr(mod, "peer_cred", lambda sock: (real(sock)[0], real(sock)[1] + 1))


def test_a_segment_passed_by_a_peer_of_another_user_is_refused() -> None:
    pool = KVPool.allocate(L, 4, shared=True)
    try:
        assert pool.segment is not None
        for writable in (False, True):
            fd = pool.segment.peer_fd(writable)
            SharedSegment.adopt(fd, pool.segment.name, writable, os.getuid()).close()      # the owner's: mapped
            n = len(os.listdir("/proc/self/fd"))
            with pytest.raises(ProtocolError, match="not the peer's own"):
                SharedSegment.adopt(pool.segment.peer_fd(writable), pool.segment.name, writable,
                                    os.getuid() + 1)
            assert len(os.listdir("/proc/self/fd")) == n          # the descriptor closed on refusal too
    finally:
        pool.close()


@pytest.mark.parametrize("other_user", [False, True], ids=["same user", "another user"])
def test_an_shm_read_maps_only_the_peers_own_segments(other_user: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if other_user:
        _as_another_user(monkeypatch)
    src = _pool(0x5A, shared=True)
    with KVSender(src, "shm://", leases=False) as snd:
        h = snd.publish("r", src.alloc(2), 4)
        with KVReceiver(_pool(0, shared=False), leases=False, timeout=Timeout(transfer=3.0)) as rcv:
            ids = rcv.pool.alloc(2)
            res = rcv.fetch(h, ids, release=False)
            if other_user:
                assert not res.ok and isinstance(res.error, ProtocolError), repr(res.error)
                assert "not the peer's own" in str(res.error)
                assert _filled(rcv.pool, ids, 0)                       # nothing landed
            else:
                assert res.ok, res.error
                assert _filled(rcv.pool, ids, 0x5A)


@pytest.mark.parametrize("other_user", [False, True], ids=["same user", "another user"])
def test_an_shm_push_writes_only_into_the_peers_own_segment(other_user: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if other_user:
        _as_another_user(monkeypatch)
    freed: list[str] = []
    dst = _pool(0, shared=True)
    with KVReceiver(dst, listen="shm://", leases=False, timeout=Timeout(transfer=3.0)) as rcv:
        ids = dst.alloc(2)
        rt = rcv.reserve(ids, "r")
        src = _pool(0x42, shared=False)
        with KVSender(src, "inproc://", leases=False, timeout=Timeout(transfer=3.0),
                      on_free=lambda _h, why: freed.append(why)) as snd:
            r = snd.push(rt.reservation, src.alloc(2)).result(20)
        if other_user:
            assert not r.ok and isinstance(r.error, ProtocolError), repr(r.error)
            assert "not the peer's own" in str(r.error)
            assert freed == ["aborted"]
            assert _filled(dst, ids, 0)                                # no byte written
        else:
            assert r.ok, r.error
            assert rt.result(10).ok
            assert _filled(dst, ids, 0x42)
