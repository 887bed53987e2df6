"""kvbridge: move and keep the KV cache of LLM requests between prefill and decode workers.

The public names are imported on first use (PEP 562), so ``kvbridge --help`` and other
tools that only need the errors or the version do not pay for importing torch.
"""

from typing import TYPE_CHECKING, Any

from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time they come from __getattr__
    from .handle import KVHandle
    from .layout import KVLayout, KVOrder, TokenOrder
    from .lease.base import Claim
    from .policy import Backoff, Retry, Timeout
    from .pool import KVPool
    from .receiver import KVReceiver
    from .sender import KVSender
    from .transfer import FetchResult, Transfer, TransferState

__version__ = "0.1.0"

_LAZY = {
    "KVHandle": ".handle", "KVLayout": ".layout", "KVOrder": ".layout", "TokenOrder": ".layout",
    "Backoff": ".policy", "Retry": ".policy", "Timeout": ".policy", "KVPool": ".pool",
    "KVReceiver": ".receiver", "KVSender": ".sender", "Claim": ".lease.base",
    "FetchResult": ".transfer", "Transfer": ".transfer", "TransferState": ".transfer",
}

__all__ = ["KVLayout", "KVOrder", "TokenOrder", "KVPool", "KVHandle", "KVSender", "KVReceiver",
           "FetchResult", "Transfer", "TransferState", "Claim", "Retry", "Backoff", "Timeout", "__version__",
           *_errors_all]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvbridge' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
