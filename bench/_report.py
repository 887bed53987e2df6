"""What every benchmark here shares: progress lines on stderr, medians with their spread,
and results written as JSON plus a Markdown table (scratch unless ``--out`` names a path)."""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def summarize(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "n": len(s)}


def emit(md: str, data: Any, out: str) -> None:
    """Print ``md`` and write ``<out>.json`` (``data``) and ``<out>.md``."""
    sys.stdout.write(md)
    base = out[:-5] if out.endswith(".json") else out
    os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
    for path, text in ((base + ".json", json.dumps(data, indent=1)), (base + ".md", md)):
        with open(path, "w") as f:
            f.write(text)
        log(f"wrote {path}")
