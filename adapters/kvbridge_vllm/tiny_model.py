"""A tiny random-weight Llama checkpoint (config, weights, tokenizer) for tests and demos.

Built locally with ``transformers`` and ``tokenizers``: nothing is downloaded. The weights
are seeded and scaled so greedy decoding does not collapse into one repeated token.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["build_tiny_llama"]


def _tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    # Byte-level: every byte is a token, so any text round-trips; ids >= 259 are plain tokens.
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    for b in range(256):
        vocab[_byte_char(b)] = 3 + b
    for i in range(len(vocab), vocab_size):
        vocab[f"<t{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)


def _byte_char(b: int) -> str:
    """GPT-2's printable stand-in for byte ``b`` (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for x in range(256):
        if x not in bs:
            bs.append(x)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))[b]


def build_tiny_llama(path: str, *, seed: int = 0, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                     head_dim: int = 64, vocab_size: int = 512, max_positions: int = 2048,
                     weight_std: float = 0.15) -> str:
    """Write a seeded random ``LlamaForCausalLM`` (float32) and a byte-level tokenizer to ``path``.
    Returns ``path``. Idempotent: an existing checkpoint built with the same arguments is reused."""
    import torch
    import transformers

    args: dict[str, Any] = dict(seed=seed, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                head_dim=head_dim, vocab_size=vocab_size, max_positions=max_positions,
                                weight_std=weight_std)
    stamp = os.path.join(path, "kvbridge_tiny.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == args:
                return path
    os.makedirs(path, exist_ok=True)
    hidden = num_heads * head_dim
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_positions, initializer_range=weight_std, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, dtype="float32")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(path, vocab_size)
    with open(stamp, "w") as f:
        json.dump(args, f)
    return path
