"""Loading one model from a spec, and a pair the decoder can trust.

`load_pair(target, draft)` turns two model specs into a `ModelPair`: both models in eval mode with `sdpa` attention
(tree masks need sdpa or eager, never flash attention), on one device, in one dtype, sharing one vocabulary, and with
KV caches that can be rolled back by copying rows and cropping; then gives their linears kernel paths and measures
their forward costs.

Model specs (either side):
  default                  offline Qwen2.5-Coder pair: 1.5B-Instruct as target, 0.5B-Instruct as draft
                           (engine/models/packaged.py).
  default-target / -draft  one side of the default pair, explicitly.
  tiny-random[-related | -identical | -unrelated]
                           tiny random Qwen2 with a byte-level tokenizer, built in memory (engine/models/tiny.py).
  shape:NAME               a random model of a published shape (engine/models/shapes.py): timing only.
  a directory              a saved Hugging Face causal LM (config.json, weights, tokenizer).
  a path ending in .gguf   loaded (dequantised) through transformers' GGUF support.
  a hub id                 e.g. "EleutherAI/pythia-70m"; needs network access.
  SPEC+talf:PATH           SPEC with the TALF LoRA adapter in folder PATH merged in (engine/training/talf.py), e.g.
                           --draft default+talf:~/talf-adapter.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedTokenizerBase

from engine.capture.packages import capture_backend, measure_graphed
from engine.core.attention import use_tree_sdpa
from engine.core.kernels import (PackingError, check_quant_mode, pack_linears, packed_dtype, quantize_linears,
                                 route_linears, should_pack)
from engine.measure.costs import calibrate_pair, measure
from engine.models.devices import cpu_has_fast_bf16, resolve_device, resolve_dtype
from engine.models.packaged import (LOAD_WORK, PACKAGED, preparation_work, prepared_model_dir,
                                    require_gguf_support)
from engine.models.pair import ModelLoadError, ModelPair, check_rollbackable, check_same_vocab, short_error
from engine.models.progress import Progress, say, span
from engine.models.shapes import is_shape_spec, load_shape
from engine.models.tiny import is_tiny_spec, load_tiny
from engine.models.vocab import VocabError, draft_vocab_ids, parse_draft_vocab, trim_head
from engine.models.widths import match_draft_width


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
        return ModelLoadError(f"Could not load the {role} model {spec!r} ({stage} failed: {short_error(err)}). {hint}")

    kw = dict(trust_remote_code=trust_remote_code)
    if gguf_file:
        kw["gguf_file"] = gguf_file
    say(progress, 0.0, f"loading {display} config")
    try:
        config = AutoConfig.from_pretrained(source, **kw)
    except Exception as err:
        raise refuse("reading the config", err) from err
    check_rollbackable(config, display)  # refuse before spending time on weights

    if (reuse_tokenizer is not None and not gguf_file
            and _same_tokenizer_files(getattr(reuse_tokenizer, "name_or_path", ""), source)):
        tokenizer = reuse_tokenizer  # same files as the target's: skip a second multi-second load
    else:
        say(progress, 0.05, f"loading {display} tokenizer")
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, **kw)
        except Exception as err:
            raise refuse("loading the tokenizer", err) from err

    say(progress, 0.2, f"loading {display} weights ({str(dtype).removeprefix('torch.')})")
    if gguf_file:
        kw["quantization_config"] = GgufConfig(dequantize=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa", **kw)
    except Exception as err:
        raise refuse("loading the weights", err) from err
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        raise ModelLoadError(f"{display} runs with attention '{model.config._attn_implementation}', which cannot take "
                             "tree masks; only sdpa or eager attention work.")
    say(progress, 0.9, f"moving {display} to {device}")
    model = model.to(device).eval()
    say(progress, 1.0, f"loaded {display}")
    return model, tokenizer


TALF_SUFFIX = "+talf:"  # "default+talf:PATH": a draft with a LoRA adapter trained by scripts/talf.py


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
    base, talf, adapter = spec.partition(TALF_SUFFIX)
    if talf:
        return _load_with_adapter(base, adapter, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                  progress=progress, role=role, tokenizer=tokenizer)
    if spec == "default":
        spec = f"default-{role}"

    if spec in PACKAGED:
        work = preparation_work(spec, dtype)
        cut = work / (work + LOAD_WORK)
        folder = prepared_model_dir(spec, dtype, span(progress, 0.0, cut))
        display = f"{PACKAGED[spec].name} (GGUF, offline)"
        model, tok = _load_pretrained(folder, gguf_file=None, display=display, spec=spec, role=role, dtype=dtype,
                                      device=device, trust_remote_code=False, hub=False,
                                      progress=span(progress, cut, 1.0), reuse_tokenizer=tokenizer)
        return model, tok, display

    if is_tiny_spec(spec) or is_shape_spec(spec):
        build = load_tiny if is_tiny_spec(spec) else load_shape
        model, tok, name = build(spec, role, dtype=dtype, device=device, tokenizer=tokenizer)
        say(progress, 1.0, f"built {name}")
        return model, tok, name

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


def _load_with_adapter(base: str, adapter: str, *, role: str, **load):
    """`SPEC+talf:PATH`: the model SPEC with a TALF LoRA adapter (scripts/talf.py) merged into its weights. The
    merge happens here, before kernel preparation wraps the linears (peft can only wrap plain nn.Linear)."""
    if not adapter.strip():
        raise ModelLoadError(f"'{base}{TALF_SUFFIX}' names no adapter folder: write {base}{TALF_SUFFIX}PATH")
    model, tok, name = load_model(base, role=role, **load)
    from engine.training.talf import TalfError, load_adapter
    try:
        model = load_adapter(model, adapter.strip())
    except ImportError as err:
        raise ModelLoadError(f"loading a TALF adapter needs the peft package ({err}); pip install -r "
                             "requirements.txt") from None
    except TalfError as err:
        raise ModelLoadError(str(err)) from None
    return model, tok, f"{name} + TALF LoRA ({Path(adapter).expanduser().name})"


PAIRS: dict[str, tuple[str, str]] = {
    "default": ("default-target", "default-draft"),
    "tiny-random": ("tiny-random", "tiny-random"),
    "tiny-random-unrelated": ("tiny-random", "tiny-random-unrelated"),
    "tiny-random-identical": ("tiny-random", "tiny-random-identical"),
}


def load_pair(target: str, draft: str | None, *, dtype: torch.dtype | str = "auto",
              device: torch.device | str = "auto", trust_remote_code: bool = False,
              packed: str = "auto", progress: Progress | None = None, draft_vocab: int | str | None = None,
              draft_quant: str = "none", calibrate: bool = True, recalibrate: bool = False,
              capture: str = "off") -> ModelPair:
    """Load target (+ optional draft) and refuse pairs the decoder cannot run exactly.

    packed: "auto" | "on" | "off" -- give CPU linears a pre-packed oneDNN path (engine/core/kernels.py); "auto" does it
    on CPU in fp32 (or bf16 with native bf16) when the extra copy of the weights fits in free memory.
    draft_vocab: None / "full" or N -- the draft scores only the N most frequent tokens (engine/models/vocab.py).
    draft_quant: "none" | "int8" | "int4" | "auto" -- give the draft's linears weight-only quantised paths (CPU;
    "auto": both, and nothing on other devices), used at the row counts where the cost table measured them faster.
    calibrate: measure (or read from the disk cache) each model's forward cost per row count and path, and route
    every call to its fastest path (engine/measure/costs.py); recalibrate measures again.
    capture: "auto" | "on" | "off" -- whether runs on this pair take captured steps (engine/capture/packages.py): CPU
    packages compiled ahead of time (built and measured by `prepare_capture`, which the caller runs when it suits it:
    the app in the background), or CUDA graphs (only with "on" until a GPU run validates them; the cost table is then
    measured on the graphed steps). Default "off".
    """
    t0 = time.perf_counter()
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if draft is not None and str(draft).strip().lower() in ("", "none"):
        draft = None
    # The target usually dominates: give it most of the bar.
    split = 0.7 if draft is not None else 1.0
    t_model, t_tok, t_name = load_model(target, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                        progress=span(progress, 0.0, split), role="target")
    check_rollbackable(t_model.config, t_name)
    d_model, d_name = None, "none"
    if draft is not None:
        d_model, d_tok, d_name = load_model(draft, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                            progress=span(progress, split, 1.0), role="draft", tokenizer=t_tok)
        check_rollbackable(d_model.config, d_name)
        check_same_vocab(t_model, t_tok, t_name, d_model, d_tok, d_name)
    for model in (t_model, d_model):
        if model is not None:
            use_tree_sdpa(model)  # tree masks without repeating grouped key/value heads (engine/core/attention.py)
    pair = ModelPair(t_model, d_model, t_tok, device, dtype, t_name, d_name, capture=capture_backend(capture, device))
    try:
        prepare_kernels(pair, packed, draft_vocab, draft_quant, progress)
        if d_model is not None:  # a draft whose table differs by padding rows: the target's width (after trimming)
            fallback = next((i for i in (t_tok.pad_token_id, t_tok.eos_token_id) if i is not None), 0)
            match_draft_width(d_model, t_model.config.get_text_config().vocab_size, fallback)
        if calibrate:
            measure_fn = measure_graphed if pair.graphs else measure
            pair.costs = calibrate_pair(pair, recalibrate, progress=lambda f, m: say(progress, 1.0, m),
                                        measure_fn=measure_fn)
    except (PackingError, VocabError) as err:
        raise ModelLoadError(str(err)) from None
    say(progress, 1.0, f"ready in {time.perf_counter() - t0:.1f} s: {pair.describe()}")
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
    native_bf16 = cpu_has_fast_bf16()
    pack, why = should_pack(packed, models, pair.device, pair.dtype, native_bf16=native_bf16)
    say(progress, 1.0, f"packing weights: {why}" if pack else why)  # the loads already reported 1.0
    if pack:
        for m in models:
            pack_linears(m, packed_dtype(pair.dtype, native_bf16))
    pair.packed = pack
    if quant != "none":
        say(progress, 1.0, f"quantising the draft's weights ({'int8 and int4' if quant == 'auto' else quant})")
        if quantize_linears(pair.draft, quant):
            pair.draft_quant = quant  # "auto" on a GPU adds nothing and stays "none"
