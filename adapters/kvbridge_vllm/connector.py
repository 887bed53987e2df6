"""``KVBridgeConnector``: vLLM's KV connector (``KVConnectorBase_V1``) on kvbridge.

The whole setup is one config line on each instance::

    kv_transfer_config={"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge_vllm",
                        "kv_role": "kv_producer"}        # prefill; "kv_consumer" on decode

Pull mode, as vLLM's own disaggregated examples drive it: the proxy sends the prompt to the
producer with ``kv_transfer_params={"do_remote_decode": True}`` and ``max_tokens=1``; the
producer's response carries ``kv_transfer_params`` with the kvbridge handle; the proxy
sends the prompt with those params to the consumer, which fetches the KV instead of
recomputing it. vLLM builds one connector per process role: the scheduler's
(:mod:`kvbridge_vllm.scheduler`) and the worker's (:mod:`kvbridge_vllm.worker`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole)

from kvbridge.errors import ConfigError

from .config import ConnectorConfig
from .metadata import KVBridgeMetadata
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVBridgeConnector"]

log = logging.getLogger("kvbridge_vllm")


def _is_cpu() -> bool:
    from vllm.platforms import current_platform
    return bool(current_platform.is_cpu())


class KVBridgeConnector(KVConnectorBase_V1):
    """vLLM KV connector moving prefill KV to decode instances through kvbridge (pull mode)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Optional["KVCacheConfig"] = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.cfg = ConnectorConfig.from_extra(getattr(ktc, "kv_connector_extra_config", None))
        producer = bool(ktc.is_kv_producer)
        consumer = bool(ktc.is_kv_consumer)
        par = vllm_config.parallel_config
        if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
            raise ConfigError("kvbridge's vLLM connector supports tensor_parallel_size=1 and "
                              f"pipeline_parallel_size=1 in this release (got {par.tensor_parallel_size}, "
                              f"{par.pipeline_parallel_size})")
        dp = int(getattr(par, "data_parallel_rank", 0) or 0)
        engine_key = (str(ktc.engine_id), dp)
        claimer = f"vllm-{ktc.engine_id}-dp{dp}"
        self._sched: Optional[SchedulerSide] = None
        self._worker: Optional[WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(vllm_config, kv_cache_config, self.cfg, claimer, producer, consumer,
                                        engine_key)
        else:
            self._worker = WorkerSide(vllm_config, self.cfg, claimer, producer, consumer, engine_key, _is_cpu())

    # -- scheduler side ------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._sched is not None
        self._sched.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: "Request") -> None:
        assert self._sched is not None
        self._sched.on_new_request(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: Any) -> tuple[bool, Optional[dict[str, Any]]]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self._sched is not None
        self._sched.update_connector_output(connector_output)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        return (0,)

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVBridgeMetadata):
            self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    def transfer_stats(self) -> dict[str, Any]:
        """Worker side: handles published; loads done and failed, bytes moved, seconds per load."""
        assert self._worker is not None
        return dict(self._worker.stats)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()
