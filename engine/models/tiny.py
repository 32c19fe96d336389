"""Tiny randomly initialised Qwen2 pairs with a byte-level tokenizer, built in memory in milliseconds.

For tests and demos: nothing is downloaded or cached. As the target every tiny-random-* spec gives the same tiny
target; as the draft the suffix picks it: related (plain "tiny-random") = the target plus small noise, identical = a
copy (accepts everything), unrelated = another seed.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from engine.core.attention import use_tree_sdpa
from engine.cpu.fusion import fuse_projections
from engine.cpu.kernels import pack_linears
from engine.models.devices import capture_backend, resolve_device, resolve_dtype
from engine.models.pair import ModelLoadError, ModelPair, install_fused_steps

_TINY_SPECIALS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
_TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Random init with the usual std 0.02 gives near-uniform logits (argmax near-ties, flaky exactness tests) and a model
# that ignores its context. std 0.5 gives logits with std ~4: top-2 gaps are typically ~1, top-1 probability spreads
# over 0.2..0.8, and greedy text does not collapse into a loop.
_TINY_INIT_STD = 0.5
# Related draft = target + N(0, (0.01 * std)^2) per weight: ~75% greedy top-1 agreement, ~95% top-4.
_TINY_DRAFT_NOISE = 0.01
_TINY_KINDS = ("related", "identical", "unrelated")
TINY_TOKENIZER_NAME = "<treeviz tiny byte-level tokenizer>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-char map, so a byte-level BPE can hold every byte as one token."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tiny_tokenizer(extra_specials: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: id i < 256 is byte i, then the specials. Any text round-trips losslessly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    eos, pad, *rest = _TINY_SPECIALS
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad,
                                   additional_special_tokens=[*rest, *extra_specials])
    if not extra_specials:
        fast.name_or_path = TINY_TOKENIZER_NAME  # lets a tiny draft reuse the tiny target's tokenizer
    fast.chat_template = _TINY_CHAT_TEMPLATE
    return fast


def tiny_config(vocab_size: int = 256 + len(_TINY_SPECIALS), num_layers: int = 2, **overrides) -> Qwen2Config:
    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
              initializer_range=_TINY_INIT_STD, bos_token_id=None, eos_token_id=256, pad_token_id=257,
              attn_implementation="sdpa")
    kw.update(overrides)
    return Qwen2Config(**kw)


def tiny_random_model(seed: int = 0, num_layers: int = 2, config: Qwen2Config | None = None) -> Qwen2ForCausalLM:
    """A tiny Qwen2 in fp32 on cpu with every weight ~ N(0, std^2) from `seed` (norms 1, biases 0)."""
    config = config or tiny_config(num_layers=num_layers)
    # construction runs transformers' own init; keep the caller's RNG untouched. The CPU's alone: forking every CUDA
    # device's generator initialises CUDA, which a ZeroGPU Space's main process must never do (seen on an H100: a
    # forked GPU worker then cannot start CUDA)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    n_bytes = 256
    with torch.no_grad():
        for name, p in model.named_parameters():  # our own init: explicit, independent of transformers' defaults
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, config.initializer_range, generator=g)
        # Specials never win: random text should not stop early at a random <|endoftext|>. Tests that need EOS
        # pass their own eos ids.
        model.lm_head.weight[n_bytes:].zero_()
    model.generation_config.eos_token_id = [256, 259]  # <|endoftext|>, <|im_end|>
    model.generation_config.pad_token_id = 257
    return model.eval()


def _tiny_draft(target: Qwen2ForCausalLM, kind: str, seed: int) -> Qwen2ForCausalLM:
    if kind == "identical":
        return copy.deepcopy(target)
    if kind == "unrelated":
        return tiny_random_model(seed + 1, config=copy.deepcopy(target.config))
    if kind != "related":
        raise ModelLoadError(f"Unknown tiny draft kind {kind!r}; use one of {', '.join(_TINY_KINDS)}.")
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed + 2)
    std = _TINY_DRAFT_NOISE * target.config.initializer_range
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" not in name and not name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
        draft.lm_head.weight[256:].zero_()
    return draft


def _tiny_name(kind: str | None, seed: int, num_layers: int) -> str:
    if kind is None:
        return f"tiny-random (Qwen2, {num_layers} layers, seed {seed})"
    return f"tiny-random-{kind} (draft)"


def tiny_random_pair(draft_kind: str | None = "related", seed: int = 0, dtype: torch.dtype | str = torch.float32,
                     device: torch.device | str = "cpu", num_layers: int = 2, packed: bool = False,
                     capture: str | None = None, fused: bool = False) -> ModelPair:
    """Tiny target + draft in memory (milliseconds). draft_kind: related, identical, unrelated, or None (AR only).

    packed=True gives both models pre-packed CPU weights (engine/cpu/kernels.py), to test that path cheaply. `capture`:
    the pair's capture switch (engine/cpu/packages.py); default: CUDA graphs on a CUDA device, eager elsewhere.
    fused=True stacks the draft's sibling projections as a CPU load does (engine/cpu/fusion.py); off by default, so
    an `identical` draft computes its target's numbers bit for bit."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    tokenizer = tiny_tokenizer()
    target = tiny_random_model(seed, num_layers)
    draft = _tiny_draft(target, draft_kind, seed) if draft_kind not in (None, "none") else None
    target = target.to(device=device, dtype=dtype)
    if draft is not None:
        draft = draft.to(device=device, dtype=dtype)
        if fused:
            fuse_projections(draft)
    for model in (target, draft):
        if model is not None:
            use_tree_sdpa(model)
            if packed:
                pack_linears(model)
    mode = capture if capture is not None else ("on" if device.type == "cuda" else "off")
    pair = ModelPair(target, draft, tokenizer, device, dtype, _tiny_name(None, seed, num_layers),
                     _tiny_name(draft_kind, seed, num_layers) if draft is not None else "none", packed=packed,
                     capture=capture_backend(mode, device))
    install_fused_steps(pair)  # what load_pair does on CUDA: the tests then check the path users run
    return pair




def is_tiny_spec(spec: str) -> bool:
    return spec == "tiny-random" or spec.startswith("tiny-random-")


def load_tiny(spec: str, role: str, *, dtype: torch.dtype, device: torch.device,
              tokenizer: PreTrainedTokenizerBase | None = None):
    """One side of a tiny pair from its spec. Returns (model, tokenizer, display_name), like load_model.

    `tokenizer`: the target's, reused when it is the tiny tokenizer (a draft then shares the target's object)."""
    kind = spec.removeprefix("tiny-random").removeprefix("-") or "related"
    if kind not in _TINY_KINDS:
        raise ModelLoadError(f"Unknown model {spec!r}. Tiny models are tiny-random, "
                             + ", ".join(f"tiny-random-{k}" for k in _TINY_KINDS) + ".")
    model, name = tiny_random_model(0), _tiny_name(None, 0, 2)
    if role == "draft":
        model, name = _tiny_draft(model, kind, 0), _tiny_name(kind, 0, 2)
    if getattr(tokenizer, "name_or_path", None) != TINY_TOKENIZER_NAME:
        tokenizer = tiny_tokenizer()
    return model.to(device=device, dtype=dtype), tokenizer, name
