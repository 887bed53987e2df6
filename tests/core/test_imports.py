"""Every kvbridge module imports on its own, whichever an engine or a tool imports first: an
import cycle (module A importing B, which imports A half-initialised) shows only in the order
that reaches it, which the suite's own order may never take."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r'''
import importlib, pkgutil, sys
import torch  # noqa: F401  (loaded once; kvbridge's modules are dropped before each import)
import kvbridge
names = sorted(m.name for m in pkgutil.walk_packages(kvbridge.__path__, "kvbridge.")
               if not m.name.endswith("__main__"))
bad = []
for name in names:
    for k in [k for k in sys.modules if (k == "kvbridge" or k.startswith("kvbridge.")) and k != "kvbridge._kvcopy"]:
        del sys.modules[k]
    try:
        importlib.import_module(name)
    except ImportError as exc:
        if "pip install" not in str(exc):      # an optional extra not installed says how to get it
            bad.append(f"{name}: {exc!r}")
    except Exception as exc:
        bad.append(f"{name}: {exc!r}")
print(len(names))
print("\n".join(bad))
'''


def test_every_module_imports_first() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    count, *bad = out.stdout.splitlines()
    assert int(count) > 50                     # the walk found the package
    assert not [b for b in bad if b], "\n".join(bad)
