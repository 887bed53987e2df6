"""kvbridge for vLLM: ``KVBridgeConnector``, a KV connector (``KVConnectorBase_V1``) that hands
prefill KV to decode instances through kvbridge.

``kv_transfer_config={"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge_vllm",
"kv_role": "kv_producer" | "kv_consumer"}``. See ``README.md`` here.

Importing this package needs vLLM (``pip install 'kvbridge[vllm]'``); :mod:`kvbridge_vllm.tiny_model`
needs only transformers.
"""

from __future__ import annotations

__all__ = ["KVBridgeConnector"]


def __getattr__(name: str) -> object:
    # vLLM imports this module by path and then asks for the class: load vLLM only then, so
    # the package (and kvbridge_vllm.tiny_model) imports without vLLM installed.
    if name == "KVBridgeConnector":
        from .connector import KVBridgeConnector
        return KVBridgeConnector
    raise AttributeError(f"module 'kvbridge_vllm' has no attribute {name!r}")
