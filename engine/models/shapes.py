"""Timing stand-ins: randomly initialised models of published shapes, built from their configs with no download.

A forward's cost depends on the shapes (layers, widths, heads, vocabulary), not on the weights, so a random model of
Qwen2.5-7B's shape costs what Qwen2.5-7B costs on the same device. That is how the GPU numbers of
docs/experiments are measured on machines that cannot fetch weights, and how the app can be timed there:

    python -m engine bench --target shape:pythia-2.8b --draft shape:pythia-70m --device cuda ...
    python app.py --pair "shape:qwen2.5-1.5b + shape:qwen2.5-0.5b"

What they are NOT: language models. Their output is noise and a random draft agrees with a random target about as
often as chance, so L-bar is about 1 and acceptance near 0; strategies whose tree follows the draft's confidence
(DynaTree, DySpec) draft almost nothing. Time a fixed shape (`fixed` with tau 0) on them and take L-bar from real
weights. Every shape uses the tiny byte-level tokenizer (engine/models/tiny.py) and its head rows past the 256 byte
tokens are zeroed, so greedy output is printable bytes; the matrix sizes, and so the cost, are the real ones.
"""
from __future__ import annotations

import torch
from transformers import (AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig, PreTrainedTokenizerBase, Qwen2Config,
                          Qwen3Config)

from engine.models.pair import ModelLoadError

PREFIX = "shape:"
_BYTES = 256  # head rows kept: the byte tokens of the tiny tokenizer
_QWEN = dict(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)
_PYTHIA = dict(max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False)
_SMOL = dict(max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True, vocab_size=49152)
_QWEN3 = dict(max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, head_dim=128, vocab_size=151936)

# The config.json values of the published checkpoints that decide a forward's cost.
SHAPES: dict[str, tuple[type, dict]] = {
    "qwen2.5-0.5b": (Qwen2Config, dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                       num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                       tie_word_embeddings=True, **_QWEN)),
    "qwen2.5-1.5b": (Qwen2Config, dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                       num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                       tie_word_embeddings=True, **_QWEN)),
    "qwen2.5-7b": (Qwen2Config, dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                     tie_word_embeddings=False, **_QWEN)),
    "pythia-70m": (GPTNeoXConfig, dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6,
                                       num_attention_heads=8, vocab_size=50304, **_PYTHIA)),
    "pythia-2.8b": (GPTNeoXConfig, dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
                                        num_attention_heads=32, vocab_size=50304, **_PYTHIA)),
    "smollm2-135m": (LlamaConfig, dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                       num_attention_heads=9, num_key_value_heads=3, rope_theta=1e5, **_SMOL)),
    "smollm2-1.7b": (LlamaConfig, dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                       num_attention_heads=32, num_key_value_heads=32, rope_theta=1.3e5, **_SMOL)),
    "qwen3-0.6b": (Qwen3Config, dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                     num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True,
                                     **_QWEN3)),
    "qwen3-8b": (Qwen3Config, dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                   num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                                   **_QWEN3)),
}


def is_shape_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)


def shape_config(name: str, **overrides):
    """The published config of `name` (a SHAPES key), with the tiny tokenizer's special ids and sdpa attention."""
    if name not in SHAPES:
        raise ModelLoadError(f"Unknown model shape {name!r}; known shapes: {', '.join(SHAPES)}.")
    config_cls, values = SHAPES[name]
    return config_cls(**{**values, "bos_token_id": None, "eos_token_id": 256, "pad_token_id": 257,
                         "attn_implementation": "sdpa", **overrides})


def shape_model(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A randomly initialised model of shape `name`, built directly on `device` in `dtype` (seconds even for 8B on a
    GPU), with head rows past the byte tokens zeroed (see the module docstring)."""
    config = shape_config(name)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        model.get_output_embeddings().weight[_BYTES:].zero_()
    model.generation_config.eos_token_id = [256, 259]
    model.generation_config.pad_token_id = 257
    return model.eval()


def load_shape(spec: str, role: str, *, dtype: torch.dtype, device: torch.device,
               tokenizer: PreTrainedTokenizerBase | None = None):
    """One side of a pair from `shape:NAME`. Returns (model, tokenizer, display_name), like load_model; the target and
    the draft get different seeds (two shapes of one name are still two different random models)."""
    from engine.models.tiny import TINY_TOKENIZER_NAME, tiny_tokenizer

    name = spec.removeprefix(PREFIX).strip().lower()
    model = shape_model(name, dtype, device, seed=0 if role == "target" else 1)
    if getattr(tokenizer, "name_or_path", None) != TINY_TOKENIZER_NAME:
        tokenizer = tiny_tokenizer()
    return model, tokenizer, f"{name} shape, random weights (timing only)"
