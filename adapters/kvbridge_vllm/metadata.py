"""What the scheduler-side connector tells the worker-side one each step (plain data: it is
pickled across processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["KVBridgeMetadata"]


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    # producer: requests whose prefill completes this step -> (block ids, prompt tokens)
    publish: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    # producer: requests that ended without handing their KV off (aborted): end their handles
    revoke: list[str] = field(default_factory=list)
    # consumer: transfers to start -> (handle dict, destination block ids, handle block indices)
    load: dict[str, tuple[dict[str, Any], list[int], list[int]]] = field(default_factory=dict)
    # consumer: of those, the ones this step's forward reads (layer-wise loads: wait per layer)
    sync: list[str] = field(default_factory=list)
    # consumer: loads refused at first contact (layout/handle) -> destination block ids (all fail)
    refuse: dict[str, tuple[list[int], str]] = field(default_factory=dict)
    # consumer: requests finished (aborted) while their transfer runs: cancel it
    cancel: list[str] = field(default_factory=list)
