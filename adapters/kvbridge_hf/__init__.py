"""kvbridge adapter for Hugging Face ``transformers``: publish a model's KV cache as a
kvbridge handle, and load a fetched handle into a ``DynamicCache`` that ``generate``
continues from. See :mod:`kvbridge_hf.cache` and ``README.md`` here."""

from .cache import (HFKVExporter, HFKVImporter, PrefillOutput, aload_cache, blocks_needed, build_cache,
                          cache_kwarg, cache_layers, generate_from_cache, layout_for_config, layout_for_model,
                          load_cache, prefill_for_handoff, publish_cache, read_blocks, write_blocks)

__all__ = ["HFKVExporter", "HFKVImporter", "PrefillOutput", "aload_cache", "blocks_needed", "build_cache",
           "cache_kwarg", "cache_layers", "generate_from_cache", "layout_for_config", "layout_for_model",
           "load_cache", "prefill_for_handoff", "publish_cache", "read_blocks", "write_blocks"]
