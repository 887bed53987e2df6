"""The reference engine and workers: a paged Llama-architecture model over a KVPool.

``prefill``, ``decode`` and ``proxy`` (the worker processes) are separate modules.
"""

from .engine import DecodeItem, Engine, FinishReason, Request, RequestState, Scheduler
from .model import PRESETS, CausalLM, ModelConfig, SeqPiece, load_hf_checkpoint, save_hf_checkpoint
from .sampling import SamplingParams, sample_token
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "Engine", "Scheduler", "Request", "RequestState", "FinishReason", "DecodeItem",
    "CausalLM", "ModelConfig", "PRESETS", "SeqPiece", "load_hf_checkpoint", "save_hf_checkpoint",
    "SamplingParams", "sample_token", "Tokenizer", "ByteTokenizer", "HFTokenizer", "load_tokenizer",
]
