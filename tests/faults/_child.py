"""Child process of the fault suite: hosts one sender or one receiver, driven by JSON lines.

Each request ``{"op": name, "kw": {...}}`` gets one reply line, ``{"result": ...}`` or
``{"error": "Type: message"}``. The test SIGKILLs this process to play a dying peer.
"""

import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/: jsonchild
_out = os.fdopen(os.dup(1), "w", buffering=1)
sys.stdout = sys.stderr

from _util import LAYOUT, FaultSender, handle_from_b64, handle_to_b64, publish_fresh  # noqa: E402

from kvbridge import KVPool, KVReceiver, Retry, Timeout  # noqa: E402
from kvbridge.policy import Backoff  # noqa: E402


class Host:
    def __init__(self) -> None:
        self.sender = None
        self.receiver = None
        self.results: list = []

    def op_sender(self, num_blocks: int, leases: str, ns: str, ttl: float = 60.0,
                  clock_margin: float = 0.2, hold_after: bool = False) -> dict:
        pool = KVPool.allocate(LAYOUT, num_blocks)
        self.sender = FaultSender(pool, "tcp://127.0.0.1:0", ttl=ttl, leases=leases,
                                  lease_namespace=ns, clock_margin=clock_margin)
        self.sender.hold_after = hold_after
        return {"url": self.sender.url, "pid": os.getpid()}

    def op_publish(self, n: int, request_id: str, ttl=None) -> dict:
        h, data = publish_fresh(self.sender, n, request_id, ttl=ttl)
        return {"handle": handle_to_b64(h), "data": [d.hex() for d in data]}

    def op_wait_entered(self, timeout: float) -> bool:
        return self.sender.entered.wait(timeout)

    def op_receiver(self, num_blocks: int, leases: str, ns: str, claim_ttl: float, claimer: str) -> dict:
        pool = KVPool.allocate(LAYOUT, num_blocks)
        self.receiver = KVReceiver(pool, leases=leases, lease_namespace=ns, claim_ttl=claim_ttl,
                                   claimer=claimer, timeout=Timeout(connect=2.0, transfer=20.0),
                                   retry=Retry(attempts=2, backoff=Backoff(0.01, 0.05), deadline=20.0))
        return {"pid": os.getpid()}

    def op_claim(self, handle: str) -> dict:
        h = handle_from_b64(handle)
        r = self.receiver
        lease = r.lease_store(h).claim(h.lease_id, r.claimer, r.claim_ttl)
        return {"epoch": lease.fence.epoch, "counter": lease.fence.counter}

    def op_fetch_bg(self, handle: str) -> None:
        h = handle_from_b64(handle)

        def run() -> None:
            self.results.append(self.receiver.fetch(h, list(range(h.num_blocks))).ok)
        threading.Thread(target=run, daemon=True).start()


def main() -> None:
    host = Host()
    _out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        try:
            req = json.loads(line)
            reply = {"result": getattr(host, "op_" + req["op"])(**req.get("kw", {}))}
        except Exception as exc:  # report, keep serving
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        _out.write(json.dumps(reply) + "\n")
    os._exit(0)   # the tests kill or abandon this process: no slow interpreter teardown


if __name__ == "__main__":
    main()
