"""Stand-in for ``sglang.srt.disaggregation.base.conn``: the names the kvbridge backend imports."""

import dataclasses
import enum
from typing import Optional


@dataclasses.dataclass
class KVTransferMetric:
    transfer_latency_s: Optional[float] = None
    alloc_latency_s: Optional[float] = None
    transfer_total_bytes: Optional[int] = None


class KVArgs:
    pass


class KVPoll(enum.IntEnum):      # SGLang's values
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class BaseKVManager:
    pass


class BaseKVSender:
    pass


class BaseKVReceiver:
    pass


class BaseKVBootstrapServer:
    pass
