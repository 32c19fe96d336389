"""The model pair the decoder runs, and the checks that make it safe to run.

`ModelPair` holds target, draft and their shared tokenizer on one device in one dtype. The checks refuse pairs the
decoder cannot decode exactly: caches that cannot be rolled back by copying rows and cropping
(`check_rollbackable`), and drafts whose token ids mean something else to the target (`check_same_vocab`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.measure.costs import PairCosts
from engine.runtime import router_of


class ModelLoadError(ValueError):
    """A model or pair we cannot (or must not) use; the message says what to do instead."""


def short_error(err: BaseException, limit: int = 400) -> str:
    """One line naming an exception and its message, cut at `limit` characters, for ModelLoadError texts."""
    kind = type(err).__name__ if type(err).__module__ == "builtins" else f"{type(err).__module__}.{type(err).__name__}"
    text = " ".join(str(err).split()) or kind
    return f"{kind}: {text[:limit]}{'…' if len(text) > limit else ''}"


@dataclass
class ModelPair:
    target: PreTrainedModel
    draft: PreTrainedModel | None  # None: autoregressive decoding only
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    target_name: str
    draft_name: str
    packed: bool = False  # some linears keep a packed format, MKL's or oneDNN's (engine/cpu/kernels.py)
    costs: PairCosts | None = None  # measured forward costs (engine/measure/costs.py); None: not calibrated
    draft_vocab: int | None = None  # the draft scores only this many frequent tokens (engine/models/vocab.py)
    draft_quant: str = "none"  # the draft's quantised formats asked for (kernels.QUANT_MODES); kept: `formats`
    # role -> FormatChoice: the weight formats each model kept and the probe that chose them (engine/cpu/formats.py)
    formats: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    memory_notes: list[str] = field(default_factory=list, repr=False, compare=False)  # formats the memory plan dropped
    # How runs capture their forwards (engine/cpu/packages.py): "aoti" (CPU packages), "cuda-graphs", or None
    # (eager)
    capture: str | None = None
    # role -> CapturedModel: the CPU packages loaded and the row counts they serve (set by prepare_capture)
    captured: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    capture_info: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # seconds, bytes per role
    # role -> StaticSteps kept across runs on this pair (engine/core/steps.py `reuse_static`): captured graphs live here
    static_steps: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def models(self) -> list[tuple[str, PreTrainedModel, str]]:
        """(role, model, name) of the target and, when there is one, the draft."""
        out = [("target", self.target, self.target_name)]
        return out + ([("draft", self.draft, self.draft_name)] if self.draft is not None else [])

    @property
    def graphs(self) -> bool:
        """Runs replay CUDA graphs (and the cost table was measured on them)."""
        return self.capture == "cuda-graphs"

    @property
    def capture_ready(self) -> bool:
        """Runs can take captured steps now: graphs (captured per cache as runs need them), or CPU packages loaded
        for the target (prepare_capture)."""
        return self.graphs or (self.capture == "aoti" and any(c.serves for c in self.captured.values()))

    def describe_capture(self) -> str:
        """e.g. "captured (AOTInductor): target 1-64 rows; draft 1-8 rows", "CUDA graphs", "eager"."""
        if self.graphs:
            fused = self.capture_info.get("fused", {})
            steps = ", ".join(f"{role} {how}" for role, how in fused.items())
            return "CUDA graphs per row-count bucket" + (f" over fused steps ({steps})" if steps else "")
        if self.capture == "aoti" and self.captured:
            parts = [f"{role} rows {c.info()['serves']}" for role, c in self.captured.items()]
            return "captured (AOTInductor): " + "; ".join(parts)
        if self.capture == "aoti":
            return "eager (captured steps not prepared yet)"
        return "eager"

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
        if self.draft is not None and self.draft_vocab:
            text += f" | draft vocabulary {self.draft_vocab}"
        routers = [router_of(m) for m in (self.target, self.draft) if m is not None]
        if any(r is not None and r.paths != ["plain"] for r in routers):  # a format was chosen: show it
            text += " | routing " + "; ".join(f"{role}: {r}" for role, r in self.routing().items())
        if self.capture is not None:
            text += f" | {self.describe_capture()}"
        if self.costs is not None and self.costs.c is not None:
            text += f" | c = {self.costs.c:.2f}, t(16) = {self.costs.t(16):.2f}"
        if disturbed := self.disturbed():
            text += f" | measured beside other work ({', '.join(disturbed)}): measured again at the next start"
        return text

    def disturbed(self) -> list[str]:
        """The measurements of this load made beside other work (engine/measure/quiet.py), which were not cached."""
        probes = [f"{role}'s format probe" for role, choice in self.formats.items() if choice.disturbed]
        tables = [f"{role}'s cost table" for role, t in (("target", self.costs.target), ("draft", self.costs.draft))
                  if t is not None and t.disturbed] if self.costs is not None else []
        return probes + tables

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


# ---- refusals -----------------------------------------------------------------------------------------------------

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
    """Refuse pairs whose token ids mean different things: the target verifies the draft's ids as its own.

    Embedding tables of different sizes are allowed when they differ only by padding rows no token reaches
    (Qwen2.5-7B has 152,064 rows, 0.5B 151,936, one tokenizer of 151,665 ids): the tokenizers must be identical and
    every id they produce below both sizes. The draft's logits are then brought to the target's width
    (engine/models/widths.py)."""
    vt, vd = target.config.get_text_config().vocab_size, draft.config.get_text_config().vocab_size
    if vt != vd:
        same = target_tok is draft_tok or target_tok.get_vocab() == draft_tok.get_vocab()
        if same and len(target_tok) <= min(vt, vd):
            return
        raise ModelLoadError(
            f"The draft's vocabulary does not match the target's: {target_name} has vocab_size {vt}, {draft_name} has "
            f"{vd}, and " + ("their tokenizers differ" if not same else
                             f"the tokenizer's {len(target_tok)} ids do not fit both") +
            ". Speculative decoding needs a draft whose token ids mean the same thing as the target's (tables may "
            "differ only by padding rows past the tokenizer); pick a draft from the same model family (same "
            "tokenizer), e.g. Qwen2.5-0.5B for Qwen2.5-1.5B.")
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


def install_fused_steps(pair: ModelPair) -> dict[str, str]:
    """On a graphed (CUDA) pair, give each model the fused step (engine/cuda/fused.py: fused projections, the layer
    compiled where torch.compile may run), which its static steps then run and graph; a model of a family it does not
    cover keeps transformers' forward, and so does a ZeroGPU Space (no torch.compile there; its ahead-of-time
    packages are not loadable yet: docs/gpu.md). TREEVIZ_CUDA_FUSED=0 keeps transformers' forward everywhere.
    Returns, and records in capture_info["fused"], role -> "compiled", "eager" or why not."""
    import os

    from engine.cuda import fused
    if not pair.graphs or os.environ.get("TREEVIZ_CUDA_FUSED", "1") == "0" or fused.zero_gpu():
        return {}  # on ZeroGPU uncompiled fusion saves ~3 % (docs/gpu.md) and would concatenate emulated CUDA weights
    done = {}
    for role, model, _ in pair.models():
        reason = fused.unsupported(model)
        done[role] = reason or ("compiled" if fused.install(model).compiled else "eager (no torch.compile here)")
    pair.capture_info["fused"] = done
    return done
