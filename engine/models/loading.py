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

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedTokenizerBase

from engine.core.attention import use_tree_sdpa
from engine.cpu.aoti import check_isa_ahead
from engine.cpu.formats import (choose_formats, drop_unrouted, make_whole, plan_memory, untouched_by_make_whole,
                                weights_budget)
from engine.cpu.fusion import fuse_projections
from engine.cpu.kernels import (MODES, PACKED, QUANTISED, PackingError, check_quant_mode, format_unavailable,
                                linear_bytes, own_plain_weights, packed_dtype, return_freed_memory, route_linears,
                                router_of, step_bytes)
from engine.cpu.packages import remember_fingerprint
from engine.measure.costs import PairCosts, machine_bandwidth, measure, model_costs
from engine.measure.graphed import measure_graphed
from engine.models.devices import capture_backend, cpu_has_fast_bf16, resolve_device, resolve_dtype
from engine.models.packaged import (LOAD_WORK, PACKAGED, one_parse_per_gguf, prepare_ahead, preparation_work,
                                    prepared_model_dir, require_gguf_support)
from engine.models.pair import (ModelLoadError, ModelPair, check_rollbackable, check_same_vocab, install_fused_steps,
                                short_error)
from engine.models.progress import Progress, say, span
from engine.models.shapes import is_shape_spec, load_shape
from engine.models.tiny import is_tiny_spec, load_tiny
from engine.models.vocab import VocabError, auto_draft_vocab, draft_vocab_ids, parse_draft_vocab, trim_head
from engine.models.widths import match_draft_width

log = logging.getLogger(__name__)


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


TALF_SUFFIX = "+talf:"  # "default+talf:PATH": a draft with a LoRA adapter trained by scripts/train_talf.py


def _looks_like_path(spec: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything else path-like is a local path that does not exist.
    return spec.startswith(("/", ".", "~")) or "\\" in spec or spec.count("/") > 1


def model_key(spec, role: str) -> str:
    """A model spec as loading names it: "default" is the packaged model of its role ("default-target" /
    "default-draft"), anything else as given, stripped. One mapping for loading and for converting ahead."""
    spec = str(spec).strip()
    return f"default-{role}" if spec == "default" else spec


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
    spec = model_key(spec, role)
    base, talf, adapter = spec.partition(TALF_SUFFIX)
    if talf:
        return _load_with_adapter(base, adapter, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                  progress=progress, role=role, tokenizer=tokenizer)

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
        with one_parse_per_gguf():
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
    """`SPEC+talf:PATH`: the model SPEC with a TALF LoRA adapter (scripts/train_talf.py) merged into its weights. The
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


def wait_quietly(future) -> None:
    """Wait for a background preparation; a failure is logged, not raised: loading the model prepares it again in
    this process and reports what went wrong there."""
    try:
        future.result()
    except Exception as err:  # noqa: BLE001 - any failure: the in-process retry gives the user's message
        log.warning("preparing the draft in the background failed (%s); preparing it here", err)


def load_pair(target: str, draft: str | None, *, dtype: torch.dtype | str = "auto",
              device: torch.device | str = "auto", trust_remote_code: bool = False,
              packed: str = "auto", progress: Progress | None = None, draft_vocab: int | str | None = None,
              draft_quant: str = "none", calibrate: bool = True, recalibrate: bool = False,
              capture: str = "off", fuse_draft: bool = True, own_weights: bool = True) -> ModelPair:
    """Load target (+ optional draft) and refuse pairs the decoder cannot run exactly.

    packed: "auto" | "on" | "off" -- whether CPU linears may be re-laid out once for MKL's or oneDNN's packed GEMMs
    (engine/cpu/kernels.py); "auto": where the format probe (engine/cpu/formats.py) finds them faster, "on":
    always one of them, "off": never.
    draft_vocab: None / "full" or N -- the draft scores only the N most frequent tokens (engine/models/vocab.py).
    draft_quant: "none" | "int8" | "int4" | "dyn8" | "auto" -- quantised formats the draft's linears may take (CPU;
    "auto": all this CPU has), kept where the probe measures them faster; only those the routing uses stay in memory.
    calibrate: measure (or read from the disk cache) each model's forward cost per row count and path, and route
    every call to its fastest path (engine/measure/costs.py); recalibrate measures again.
    capture: "auto" | "on" | "off" -- whether runs on this pair take captured steps (engine/cpu/packages.py): CPU
    packages compiled ahead of time (built and measured by `prepare_capture`, which the caller runs when it suits it:
    the app in the background), or CUDA graphs (`auto` and `on`; validated on an H100, docs/gpu.md; the cost table is
    then measured on the graphed steps). Default "off".
    fuse_draft: on a CPU, the draft's q|k|v and gate|up become one linear each (engine/cpu/fusion.py); never the target.
    own_weights: copy the routed plain weights out of the checkpoint's file into this process's memory
    (kernels.own_plain_weights: they stream faster); a process that drops its weights unread says False (the
    package builder, whose copy would sit beside the app's: docs/experiments/2026-11-29-probe-streams.md).
    """
    t0 = time.perf_counter()
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if capture_backend(capture, device) == "aoti":
        check_isa_ahead()  # what the first package load would wait for, done beside the load
    if draft is not None and str(draft).strip().lower() in ("", "none"):
        draft = None
    # The target usually dominates: give it most of the bar.
    split = 0.7 if draft is not None else 1.0
    ahead = prepare_ahead(model_key(draft, "draft"), dtype) if draft else None
    t_model, t_tok, t_name = load_model(target, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                        progress=span(progress, 0.0, split), role="target")
    check_rollbackable(t_model.config, t_name)
    d_model, d_name = None, "none"
    if draft is not None:
        if ahead is not None:
            say(progress, split, "waiting for the draft's conversion (it ran beside the target's)")
            wait_quietly(ahead)
        d_model, d_tok, d_name = load_model(draft, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                            progress=span(progress, split, 1.0), role="draft", tokenizer=t_tok)
        check_rollbackable(d_model.config, d_name)
        check_same_vocab(t_model, t_tok, t_name, d_model, d_tok, d_name)
    for model in (t_model, d_model):
        if model is not None:
            use_tree_sdpa(model)  # tree masks without repeating grouped key/value heads (engine/core/attention.py)
    pair = ModelPair(t_model, d_model, t_tok, device, dtype, t_name, d_name, capture=capture_backend(capture, device))
    try:
        prepare_kernels(pair, packed, draft_vocab, draft_quant, progress, recalibrate, fuse_draft, own_weights)
        if d_model is not None:  # a draft whose table differs by padding rows: the target's width (after trimming)
            fallback = next((i for i in (t_tok.pad_token_id, t_tok.eos_token_id) if i is not None), 0)
            match_draft_width(d_model, t_model.config.get_text_config().vocab_size, fallback)
        install_fused_steps(pair)  # CUDA: fused, compiled steps, before the table is measured on them
        if calibrate:
            measure_fn = measure_graphed if pair.graphs else measure
            pair.costs = calibrate_pair(pair, recalibrate, progress=lambda f, m: say(progress, 1.0, m),
                                        measure_fn=measure_fn)
    except (PackingError, VocabError) as err:
        raise ModelLoadError(str(err)) from None
    return_freed_memory()
    say(progress, 1.0, f"ready in {time.perf_counter() - t0:.1f} s: {pair.describe()}")
    return pair


def prepare_kernels(pair: ModelPair, packed: str = "auto", draft_vocab: int | str | None = None,
                    draft_quant: str = "none", progress: Progress | None = None, recalibrate: bool = False,
                    fuse_draft: bool = True, own_weights: bool = True) -> None:
    """Trim the draft's head and (on a CPU, `fuse_draft`) stack its sibling projections, then give each model's
    linears the weight formats this CPU runs fastest, per shape group, and only those that fit the memory plan
    (engine/cpu/formats.py: a short probe, then `plan_memory`; the others are never made whole). Trim and fusion
    come first, so the trimmed head and the stacked projections get their formats like every other linear."""
    vocab, quant = parse_draft_vocab(draft_vocab), check_quant_mode(draft_quant)
    if pair.draft is None and vocab not in (None, "auto") or pair.draft is None and quant not in ("none", "auto"):
        raise VocabError("--draft-vocab and --draft-quant need a draft model")
    if vocab == "auto":
        vocab = None if pair.draft is None else auto_draft_vocab(
            pair.tokenizer, pair.draft.get_output_embeddings().out_features)
    if vocab:
        always = [*pair.eos_token_ids, *pair.tokenizer.get_added_vocab().values()]
        trim_head(pair.draft, draft_vocab_ids(pair.tokenizer, vocab, always))
        pair.draft_vocab = pair.draft.get_output_embeddings().vocab_rows
    if fuse_draft and pair.draft is not None and pair.device.type == "cpu":
        fuse_projections(pair.draft)  # fewer, wider GEMMs (docs/experiments/2026-11-28-fused-projections-cpu.md)
    for _, model, _ in pair.models():
        remember_fingerprint(model)  # a package's key, taken before a format replaces a plain weight
    if pair.device.type != "cpu":
        return
    compute = packed_dtype(pair.dtype, cpu_has_fast_bf16())
    for role, model, name in pair.models():
        route_linears(model)
        candidates = candidate_formats(packed, quant if role == "draft" else "none", pair.device, pair.dtype)
        if candidates != ["plain"]:
            say(progress, 1.0, f"probing the {role}'s weight formats ({', '.join(candidates)}; cached after the "
                               "first time)")
            pair.formats[role] = choose_formats(model, name, candidates, compute, recalibrate)
            if pair.formats[role].disturbed:
                say(progress, 1.0, f"the {role}'s format probe shared the CPU with other work "
                                   f"({pair.formats[role].disturbed}): used for this start, probed again at the next")
    loaded = sum(linear_bytes(model) for _, model, _ in pair.models())
    pair.memory_notes = plan_memory(list(pair.formats.values()), weights_budget(loaded))
    make_formats(pair, compute, own_weights, progress)
    kept = [p for choice in pair.formats.values() for p in choice.kept]
    pair.packed = any(p in PACKED for p in kept)
    pair.draft_quant = quant if pair.draft is not None else "none"  # asked for; what was kept: pair.formats


def make_formats(pair: ModelPair, compute: torch.dtype | None, own_weights: bool, progress: Progress | None) -> None:
    """Make each model's kept formats whole, both models at once (first touches of the checkpoints' pages, reorders
    and quantisations overlap: docs/experiments/2026-11-28-first-start-float32.md), and where `own_weights`, copy the
    routed plain weights into this process's memory (`own_plain_weights`: they stream faster), a task per weight on
    the same two workers: a weight no format is made from is copied beside the making, the rest after it. On a warm
    start the copy was 5 s of the critical path, after the making (docs/experiments/2026-11-29-warm-start.md)."""
    made = [(role, model) for role, model, _ in pair.models() if role in pair.formats]
    with ThreadPoolExecutor(2, thread_name_prefix="formats") as pool:
        making = [pool.submit(make_whole, model, pair.formats[role], compute) for role, model in made]
        copying = [pool.submit(own_plain_weights, model, [layer]) for role, model, _ in pair.models() if own_weights
                   for layer in untouched_by_make_whole(model, pair.formats.get(role))]
    for (role, model), done in zip(made, making):
        done.result()  # a PackingError raised in its thread is raised here
        say(progress, 1.0, f"{role} weights: {router_of(model).describe()}")
    for done in copying:
        done.result()
    for _, model, _ in pair.models() if own_weights else ():
        own_plain_weights(model)  # the rest: weights a format was made from


def candidate_formats(packed: str, quant: str, device, dtype) -> list[str]:
    """The formats a model may be probed on: plain unless packing is forced, the packed formats this CPU has unless
    packing is off, and the draft's quantised formats (for "auto" all of them: int8, int4, dyn8; the probe notes and
    skips one this CPU cannot make). `packed="on"` where no packed format can be made is an error that says why."""
    packed = str(packed or "auto").strip().lower()
    if packed not in MODES:
        raise PackingError(f"packed weights must be one of {', '.join(MODES)}, got {packed!r}")
    have = [p for p in PACKED if format_unavailable(p, device, dtype) is None]
    if packed == "on" and not have:
        reasons = "; ".join(f"{p}: {format_unavailable(p, device, dtype)}" for p in PACKED)
        raise PackingError(f"cannot pack weights here ({reasons})")
    out = ([] if packed == "on" else ["plain"]) + ([] if packed == "off" else have)
    return out + ([] if quant == "none" else list(QUANTISED) if quant == "auto" else [quant])


def calibrate_pair(pair, recalibrate: bool = False, progress=None, measure_fn=measure) -> PairCosts:
    """Measure (or read) both models' tables, install each model's routing from its table, and return the costs.
    On replayed CUDA graphs where the pair runs them (`pair.graphs`)."""
    say = progress or (lambda fraction, message: None)
    tables = {}
    for role, model, name in (("target", pair.target, pair.target_name), ("draft", pair.draft, pair.draft_name)):
        if model is None:
            tables[role] = None
            continue
        say(0.0 if role == "target" else 0.6, f"measuring {role} forward costs (cached after the first time)")
        costs = model_costs(model, name, pair.dtype, pair.device, recalibrate, measure_fn, graphs=pair.graphs)
        router = router_of(model)
        if router is not None and not router.by_group:  # a probe's per-group routing is already installed
            router.install(costs.routing())
            drop_unrouted(model, costs)
        costs.step_bytes = step_bytes(model)
        tables[role] = costs
        if costs.disturbed:
            say(1.0, f"the {role}'s cost table was measured beside other work ({costs.disturbed}): used for this "
                     "start, measured again at the next")
    bandwidth = machine_bandwidth(pair.device, recalibrate)
    return PairCosts(tables["target"], tables["draft"], bandwidth)
