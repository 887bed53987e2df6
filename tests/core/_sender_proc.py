"""Child process of the conformance suite: a SenderHost driven by JSON lines on stdin.

Each request is ``{"op": name, "kw": {...}}``; each reply one line, ``{"result": ...}`` or
``{"error": "Type: message"}``. It serves until stdin closes or it is killed.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/: jsonchild

# Replies go to the real stdout; anything else that prints goes to stderr.
_out = os.fdopen(os.dup(1), "w", buffering=1)
sys.stdout = sys.stderr

from _peer import SenderHost  # noqa: E402


def main() -> None:
    host = SenderHost()
    _out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        try:
            req = json.loads(line)
            reply = {"result": host.op(req["op"], **req.get("kw", {}))}
        except Exception as exc:  # report, keep serving
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        _out.write(json.dumps(reply) + "\n")
    host.close()


if __name__ == "__main__":
    main()
