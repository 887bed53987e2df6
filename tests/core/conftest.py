"""Fixtures of the core suite: one ``scheme`` parameter every transport passes.

For ``inproc`` the sender lives in this process; for ``tcp`` and ``shm`` it lives in a
child process (``_sender_proc.py``), one per scheme per module, so bytes cross a real
process boundary.
"""

from __future__ import annotations

import base64
import importlib.util
import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import pytest
import torch

from kvbridge import KVHandle, KVLayout, KVPool, KVReceiver, Retry, Timeout
from kvbridge.policy import Backoff

from ._peer import LISTEN, LocalPeer, RemotePeer, fill_pool

try:
    _HAVE_UCXX = importlib.util.find_spec("ucxx") is not None
except (ImportError, ValueError):   # blocked (sys.modules["ucxx"] = None) counts as missing
    _HAVE_UCXX = False
_NO_UCX = "" if _HAVE_UCXX else "ucx:// needs ucxx: pip install 'kvbridge[ucx]'"
try:
    _HAVE_CUPY = importlib.util.find_spec("cupy") is not None
except (ImportError, ValueError):
    _HAVE_CUPY = False
_NO_NVLINK = ("" if _HAVE_CUPY and torch.cuda.is_available() else
              "nvlink:// needs " + " and ".join(w for w, ok in [("a CUDA device", torch.cuda.is_available()),
                                                             ("CuPy (pip install 'kvbridge[cupy]')", _HAVE_CUPY)]
                                                 if not ok))
SCHEMES = ["inproc", "tcp", "shm", pytest.param("ucx", marks=pytest.mark.skipif(bool(_NO_UCX), reason=_NO_UCX)),
           pytest.param("nvlink", marks=[pytest.mark.gpu, pytest.mark.skipif(bool(_NO_NVLINK), reason=_NO_NVLINK)])]


FAST_RETRY = Retry(attempts=2, backoff=Backoff(base=0.01, cap=0.05), deadline=10.0)
RECV_TIMEOUT = Timeout(connect=2.0, transfer=10.0)
_seeds = itertools.count(1000)


@dataclass
class PeerSender:
    """A KVSender living in a peer (this process or the child), seen from the test."""

    peer: Any
    sid: str
    url: str
    layout: KVLayout
    num_blocks: int
    seed: int

    def publish(self, block_ids: list[int], request_id: str = "req", num_tokens: Optional[int] = None,
                ttl: Optional[float] = None, layers_ready: Optional[int] = None,
                codec: Optional[str] = None) -> KVHandle:
        n = len(block_ids) * self.layout.block_size if num_tokens is None else num_tokens
        raw = self.peer.publish(sid=self.sid, request_id=request_id, block_ids=list(block_ids),
                                num_tokens=n, ttl=ttl, layers_ready=layers_ready, codec=codec)
        return KVHandle.from_bytes(base64.b64decode(raw))

    def mark_ready(self, handle_id: str, layers: int) -> None:
        """``handle_id``: a published handle's id, or a push's id."""
        self.peer.mark_ready(sid=self.sid, handle_id=handle_id, layers=layers)

    def push(self, reservation: KVHandle, block_ids: list[int], layers_ready: Optional[int] = None) -> str:
        return self.peer.push(sid=self.sid, reservation=base64.b64encode(reservation.to_bytes()).decode(),
                              block_ids=list(block_ids), layers_ready=layers_ready)

    def push_result(self, push_id: str, timeout: float = 10.0) -> dict:
        return self.peer.push_result(push_id=push_id, timeout=timeout)

    def retire(self, block_ids: list[int]) -> list[int]:
        return self.peer.retire(sid=self.sid, block_ids=list(block_ids))

    def alloc(self, n: int) -> list[int]:
        return self.peer.alloc(sid=self.sid, n=n)

    def revoke(self, h: KVHandle) -> bool:
        return self.peer.revoke(sid=self.sid, handle_id=h.id)

    def corrupt(self, block_ids: list[int]) -> None:
        self.peer.corrupt(sid=self.sid, block_ids=list(block_ids))

    def state(self) -> dict:
        return self.peer.state(sid=self.sid)

    def close(self, wait: bool = True) -> None:
        self.peer.close_sender(sid=self.sid, wait=wait)


@pytest.fixture(scope="module", params=SCHEMES)
def scheme(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def peer(scheme: str) -> Iterator[Any]:
    p = LocalPeer() if scheme == "inproc" else RemotePeer()
    yield p
    p.close()


@pytest.fixture
def make_sender(peer: Any, scheme: str) -> Iterator[Any]:
    made: list[PeerSender] = []

    def make(layout: KVLayout, num_blocks: int, *, ttl: float = 60.0, secret: Optional[bytes] = None,
             reserve_all: bool = True, timeout: Optional[dict] = None, allocator: str = "kvbridge",
             normal: bool = False) -> PeerSender:
        seed = next(_seeds)
        info = peer.new_sender(layout=layout.to_dict(), num_blocks=num_blocks, listen=LISTEN[scheme],
                               seed=seed, ttl=ttl, secret=secret.hex() if secret else None,
                               reserve_all=reserve_all, timeout=timeout, allocator=allocator, normal=normal)
        s = PeerSender(peer, info["sid"], info["url"], layout, num_blocks, seed)
        made.append(s)
        return s
    yield make
    for s in made:
        try:
            s.close(wait=False)
        except Exception:
            pass


@pytest.fixture
def make_receiver() -> Iterator[Any]:
    made: list[KVReceiver] = []

    def make(layout: KVLayout, num_blocks: int, *, seed: int = 7, retry: Retry = FAST_RETRY,
             timeout: Timeout = RECV_TIMEOUT, secret: Optional[bytes] = None, listen: Optional[str] = None,
             allocator: str = "kvbridge", **kw: Any) -> tuple[KVReceiver, KVPool]:
        pool = KVPool.allocate(layout, num_blocks, shared=bool(listen and listen.startswith("shm:")),
                               allocator=allocator)
        fill_pool(pool, seed)
        r = KVReceiver(pool, retry=retry, timeout=timeout, secret=secret, listen=listen, **kw)
        made.append(r)
        return r, pool
    yield make
    for r in made:
        r.close()
