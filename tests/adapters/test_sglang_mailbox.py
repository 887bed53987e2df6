"""The SGLang backend's bootstrap server (``kvbridge_sglang.mailbox``) under hostile clients: it
listens on every interface of the prefill host, so nothing is allocated, no thread started and
no work done for a client before its request fits -- a declared length within the cap and the
server's byte budget, a decimal room -- and slow or idle clients do not hold it. Real sockets,
the real server; no SGLang needed."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Iterator, Optional

import pytest
from waiting import wait_until as until

from kvbridge.workers.http import Deadlines

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def box() -> Iterator[Any]:
    from kvbridge_sglang.mailbox import Mailbox
    b = Mailbox("127.0.0.1", 0, max_body=4096, budget=16384, deadlines=Deadlines(idle=2.0, request=0.5))
    yield b
    b.close()


def _connect(box: Any) -> socket.socket:
    s = socket.create_connection((box.host, box.port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _answer(s: socket.socket) -> tuple[int, bytes]:
    """One whole answer (status, body) read off ``s``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            n = int(v)
    while len(body) < n:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split()[1]), body


def _call(box: Any, method: str, path: str, body: Optional[bytes] = None, length: Optional[int] = None,
          headers: str = "Content-Type: application/json\r\n") -> tuple[int, bytes]:
    with _connect(box) as s:
        h = f"{method} {path} HTTP/1.1\r\nHost: x\r\n{headers}"
        if body is not None or length is not None:
            h += f"Content-Length: {len(body or b'') if length is None else length}\r\n"
        s.sendall(h.encode() + b"\r\n" + (body or b""))
        return _answer(s)


def _put(box: Any, room: int, obj: Any, kind: str = "aux") -> int:
    return _call(box, "PUT", f"/kvbridge/{kind}/{room}", json.dumps(obj).encode())[0]


def test_entries_round_trip_and_a_room_is_dropped_whole(box: Any) -> None:
    from kvbridge_sglang.mailbox import MailboxClient
    c = MailboxClient(box.address)
    c.put("reservation", 12345678901234567, {"ticket": [1, 2, 3]})
    c.put("aux", 12345678901234567, {"aux": "x"})
    assert c.get("reservation", 12345678901234567) == {"ticket": [1, 2, 3]}
    assert c.get("fail", 12345678901234567) is None
    c.drop(12345678901234567)
    assert c.get("reservation", 12345678901234567) is None and c.get("aux", 12345678901234567) is None
    assert box._held == 0 and not box._data


def test_a_body_over_the_cap_is_refused_by_its_declared_length_before_any_of_it_is_read(box: Any) -> None:
    with _connect(box) as s:      # declares 1 GiB and sends none of it: answered at once
        s.sendall(b"PUT /kvbridge/aux/1 HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1073741824\r\n\r\n")
        t0 = time.monotonic()
        status, body = _answer(s)
        assert status == 413 and b"4096" in body and time.monotonic() - t0 < 0.4
    assert box._held == 0
    # no declared length (chunked): refused, nothing read
    status, _ = _call(box, "PUT", "/kvbridge/aux/1", None,
                      headers="Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n")
    assert status == 411 and box._held == 0 and not box._data


@pytest.mark.parametrize("path,status", [("/kvbridge/aux/-1", 400), ("/kvbridge/aux/1e5", 400),
                                         ("/kvbridge/aux/" + "9" * 21, 400), ("/kvbridge/aux/%D9%A1", 400),
                                         ("/kvbridge/other/1", 404), ("/kvbridge/room/1", 404),
                                         ("/elsewhere", 404)])
def test_rooms_are_decimal_integers_and_kinds_are_known(box: Any, path: str, status: int) -> None:
    assert _call(box, "PUT", path, b'{"a": 1}')[0] == status
    assert not box._data and box._held == 0


@pytest.mark.parametrize("body,status", [(b"[1, 2]", 400), (b"not json", 400), (b'"text"', 400)])
def test_a_body_that_is_not_a_json_object_is_refused_and_gives_its_budget_back(box: Any, body: bytes,
                                                                                status: int) -> None:
    assert _call(box, "PUT", "/kvbridge/aux/1", body)[0] == status
    assert not box._data and box._held == 0


def test_the_byte_budget_bounds_every_entry_kept_and_frees_with_them(box: Any) -> None:
    """16 KiB of budget, 2 KiB bodies (+256 counted per entry): full after a handful, a 503 with
    Retry-After then, nothing stored past it; a room dropped (or expired) makes room again."""
    blob = {"aux": "x" * 2000}
    stored = 0
    while (status := _put(box, 1000 + stored, blob)) == 204:
        stored += 1
        assert stored < 16
    assert status == 503 and 4 <= stored <= 8, stored
    assert box._held <= box.budget
    with _connect(box) as s:
        s.sendall(b"PUT /kvbridge/aux/1 HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 2000\r\n\r\n")              # does not fit: answered before its body
        s.settimeout(5)
        head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), head
    assert _put(box, 5, {"small": 1}) in (204, 503)
    for room in range(1000, 1000 + stored):
        _call(box, "DELETE", f"/kvbridge/room/{room}")
    assert until(lambda: box._held == (len(box._data) and sum(len(r) + 256 for _, r in box._data.values())), 2)
    assert _put(box, 2000, blob) == 204
    box.ttl = 0.0                                  # every entry expires: the next look sweeps them
    time.sleep(0.01)
    assert _call(box, "GET", "/kvbridge/aux/2000")[0] == 404 and box._held == 0 and not box._data


def test_a_body_being_received_holds_its_budget_until_it_ends(box: Any) -> None:
    """A client that declares 4 KiB holds that much while it sends; others past the budget are
    refused meanwhile; once it stops sending (dropped at the request deadline) or leaves, its
    share is given back."""
    filler = {"aux": "x" * 3000}
    for room in range(3):
        assert _put(box, room, filler) == 204
    held = box._held
    with _connect(box) as slow:                   # declares 4096, sends 10 bytes, then nothing
        slow.sendall(b"PUT /kvbridge/aux/99 HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 4096\r\n\r\n{\"aux\": \"x")
        assert until(lambda: box._held == held + 4096 + 256, 2)
        assert _put(box, 50, filler) == 503       # the slow client's share is taken
        slow.settimeout(5)
        assert slow.recv(4096).startswith(b"HTTP/1.1 408")     # dropped at the request deadline
    assert until(lambda: box._held == held, 3)
    with _connect(box) as gone:                   # one that leaves mid-body gives its share back too
        gone.sendall(b"PUT /kvbridge/aux/98 HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 4096\r\n\r\n{")
        assert until(lambda: box._held == held + 4096 + 256, 2)
    assert until(lambda: box._held == held, 3)
    assert _call(box, "GET", "/kvbridge/aux/99")[0] == 404


def test_idle_connections_take_no_thread_and_past_the_cap_are_refused() -> None:
    from kvbridge_sglang.mailbox import Mailbox, MailboxClient
    box = Mailbox("127.0.0.1", 0, max_connections=64)
    socks: list[socket.socket] = []
    try:
        threads = threading.active_count()
        socks = [_connect(box) for _ in range(60)]
        time.sleep(0.3)
        assert threading.active_count() <= threads + 1      # the old server started one per connection
        c = MailboxClient(box.address)
        c.put("fail", 7, {"reason": "r"})
        assert c.get("fail", 7) == {"reason": "r"}
        socks += [_connect(box) for _ in range(8)]
        refused = 0
        for s in socks[-8:]:
            s.settimeout(5)
            try:
                got = s.recv(4096)
            except OSError:
                continue
            refused += got.startswith(b"HTTP/1.1 503") and b"too_many_connections" in got
        assert refused >= 4, refused
    finally:
        for s in socks:
            s.close()
        box.close()
