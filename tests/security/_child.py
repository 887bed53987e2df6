"""A kvbridge process for the hostile-peer tests: a tcp (or shm) sender, optionally with the
embedded lease server; prints one JSON line (url, handle, pid) and serves until stdin closes."""

import base64
import json
import sys

from kvbridge import KVLayout, KVPool, KVSender, Timeout

cfg = json.loads(sys.argv[1])
layout = KVLayout.vllm_flash(2, 8, 64, block_size=16, dtype="float16")    # 64 KiB a block
pool = KVPool.allocate(layout, cfg.get("blocks", 8), shared=cfg["listen"].startswith("shm"))
ids = pool.alloc(cfg.get("blocks", 8))
snd = KVSender(pool, cfg["listen"], leases=None if cfg.get("leases") else False,
               timeout=Timeout(transfer=cfg.get("transfer", 2.0)))
h = snd.publish("victim", ids, len(ids) * 16)
print(json.dumps({"url": snd.url, "handle": base64.b64encode(h.to_bytes()).decode(), "pid": __import__("os").getpid()}),
      flush=True)
sys.stdin.read()
snd.close()
