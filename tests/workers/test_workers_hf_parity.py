"""The reference engine against HF transformers on the same weights.

Tolerance: float32 logits agree within max abs diff < 1e-4 (observed ~1e-6; the
seeded tiny model's logits have std ~2), and greedy tokens are identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from kvbridge.errors import ConfigError
from kvbridge.workers.engine import Engine
from kvbridge.workers.model import (CausalLM, ModelConfig, hf_config_dict, load_hf_checkpoint,
                                    save_hf_checkpoint)
from kvbridge.workers.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ATOL = 1e-4
NEW_TOKENS = 6


def hf_model(model: CausalLM) -> Any:
    """An HF model of the same architecture with ``model``'s weights (via state dict)."""
    d = hf_config_dict(model.config)
    arch = d.pop("architectures")[0]
    for k in ("model_type", "torch_dtype"):
        d.pop(k)
    cfg_cls = transformers.Qwen2Config if arch.startswith("Qwen2") else transformers.LlamaConfig
    hf = getattr(transformers, arch)(cfg_cls(**d)).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf


def check_greedy(engine: Engine, hf: Any, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> float:
    """Greedy-decode each prompt with the engine, teacher-force HF on prompt+output,
    require identical argmax at every generated position and logits within ATOL."""
    worst = 0.0
    for p in prompts:
        blocks = engine.pool.alloc(engine.blocks_needed(len(p) + new_tokens))
        ours = [engine.prefill(p, blocks)]
        toks = [int(ours[-1].argmax())]
        for i in range(new_tokens - 1):
            ours.append(engine.decode_step([(blocks, len(p) + i, toks[-1])])[0])
            toks.append(int(ours[-1].argmax()))
        engine.pool.free(blocks)
        with torch.no_grad():
            ref = hf(torch.tensor([p + toks[:-1]])).logits[0, len(p) - 1:].float()
        assert ref.argmax(-1).tolist() == toks, f"greedy tokens differ for prompt {p}"
        diff = float((torch.stack(ours) - ref).abs().max())
        assert diff < ATOL, f"max abs logit diff {diff} for prompt {p}"
        worst = max(worst, diff)
    return worst


@pytest.mark.timeout(60)
def test_llama_state_dict_parity_many_prompts(tiny: CausalLM, make_engine: Callable[..., Engine],
                                              random_prompts: Callable[..., list[list[int]]]) -> None:
    engine = make_engine(num_blocks=32, block_size=4, model=tiny)
    check_greedy(engine, hf_model(tiny), random_prompts(80, seed=1))


@pytest.mark.timeout(60)
def test_hf_generate_matches_engine_generate(tiny: CausalLM, make_engine: Callable[..., Engine],
                                             random_prompts: Callable[..., list[list[int]]]) -> None:
    engine = make_engine(num_blocks=32, block_size=4, model=tiny)
    hf = hf_model(tiny)
    for p in random_prompts(8, seed=2, lo=2, hi=20):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, len(p):].tolist() == engine.generate(p, SamplingParams(max_tokens=10))


@pytest.mark.timeout(60)
def test_checkpoint_roundtrip_and_hf_from_pretrained(tmp_path: Path, make_engine: Callable[..., Engine],
                                                     random_prompts: Callable[..., list[list[int]]]) -> None:
    cfg = ModelConfig.preset("tiny", rope_theta=500000.0, num_layers=3)
    src = CausalLM.from_seed(cfg, seed=7)
    save_hf_checkpoint(src, tmp_path)
    loaded = load_hf_checkpoint(tmp_path)
    assert loaded.config.rope_theta == 500000.0 and loaded.config.num_layers == 3
    for k, v in src.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), local_files_only=True).float().eval()
    check_greedy(make_engine(num_blocks=32, block_size=8, model=loaded), hf, random_prompts(12, seed=3))


@pytest.mark.timeout(60)
def test_tied_embeddings_and_llama3_rope(tmp_path: Path, make_engine: Callable[..., Engine],
                                         random_prompts: Callable[..., list[list[int]]]) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    cfg = ModelConfig.preset("tiny", tie_word_embeddings=True, rope_scaling=scaling)
    src = CausalLM.from_seed(cfg, seed=11)
    assert src.lm_head.weight is src.model.embed_tokens.weight
    save_hf_checkpoint(src, tmp_path)
    loaded = load_hf_checkpoint(tmp_path)
    assert loaded.config.tie_word_embeddings and loaded.config.rope_scaling is not None
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), local_files_only=True).float().eval()
    # long enough prompts that positions pass original_max_position_embeddings
    check_greedy(make_engine(num_blocks=32, block_size=4, model=loaded), hf,
                 random_prompts(8, seed=4, lo=10, hi=40))


@pytest.mark.timeout(60)
def test_qwen2_biases_state_dict_and_checkpoint(tmp_path: Path, make_engine: Callable[..., Engine],
                                                random_prompts: Callable[..., list[list[int]]]) -> None:
    cfg = ModelConfig.preset("tiny", model_type="qwen2", qkv_bias=True, rope_theta=1000000.0)
    src = CausalLM.from_seed(cfg, seed=5)
    assert src.model.layers[0].self_attn.q_proj.bias is not None
    assert src.model.layers[0].self_attn.o_proj.bias is None
    check_greedy(make_engine(num_blocks=32, block_size=4, model=src), hf_model(src), random_prompts(10, seed=5))
    save_hf_checkpoint(src, tmp_path)
    loaded = load_hf_checkpoint(tmp_path)
    assert loaded.config.qkv_bias and not loaded.config.o_bias
    b0 = loaded.model.layers[1].self_attn.k_proj.bias
    assert b0 is not None and torch.equal(b0, src.model.layers[1].self_attn.k_proj.bias)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(tmp_path), local_files_only=True).float().eval()
    check_greedy(make_engine(num_blocks=32, block_size=4, model=loaded), hf, random_prompts(10, seed=6))


@pytest.mark.timeout(60)
def test_hf_saved_qwen2_checkpoint_loads(tmp_path: Path, make_engine: Callable[..., Engine],
                                         random_prompts: Callable[..., list[list[int]]]) -> None:
    """A checkpoint written by transformers itself (its own init, its own config.json)."""
    torch.manual_seed(3)
    hcfg = transformers.Qwen2Config(vocab_size=300, hidden_size=48, intermediate_size=96,
                                    num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                    max_position_embeddings=256, tie_word_embeddings=False,
                                    initializer_range=0.2)
    hf = transformers.Qwen2ForCausalLM(hcfg).eval()
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    loaded = load_hf_checkpoint(tmp_path)
    c = loaded.config
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.qkv_bias) == (6, 2, 8, True)
    check_greedy(make_engine(num_blocks=32, block_size=4, model=loaded), hf, random_prompts(6, seed=7, vocab=300))


@pytest.mark.timeout(30)
def test_checkpoint_errors(tmp_path: Path, tiny: CausalLM) -> None:
    with pytest.raises(ConfigError):
        load_hf_checkpoint(tmp_path)  # no config.json
    save_hf_checkpoint(tiny, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="safetensors"):
        load_hf_checkpoint(tmp_path)
