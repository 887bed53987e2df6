"""kvbridge: move and keep the KV cache of LLM requests between prefill and decode workers."""

from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .handle import KVHandle
from .layout import KVLayout, KVOrder, TokenOrder
from .lease.base import Claim
from .policy import Backoff, Retry, Timeout
from .pool import KVPool
from .receiver import KVReceiver
from .sender import KVSender
from .transfer import FetchResult, Transfer, TransferState

__version__ = "0.1.0"

__all__ = ["KVLayout", "KVOrder", "TokenOrder", "KVPool", "KVHandle", "KVSender", "KVReceiver",
           "FetchResult", "Transfer", "TransferState", "Claim", "Retry", "Backoff", "Timeout", "__version__", *_errors_all]
