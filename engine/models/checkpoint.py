"""A loaded model's plain weights, mapped back from its checkpoint after a weight format replaced them.

    mapped = map_plain_weights(pair.target)   # every routed linear whose plain weight was freed has it again

The memory plan (engine/cpu/formats.py) may free a plain weight for the trees' sake, keeping a packed copy in its
place; AR alone would keep the plain one where it streams faster at one row. A baseline that wants it back reads it
from the checkpoint the model was loaded from: safetensors maps each tensor as a view of the file, so the weight
costs page cache, which the kernel can reclaim, and no copy (unless the checkpoint's dtype differs from the model's).
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from engine.cpu.kernels import named_routed_linears

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(RuntimeError):
    """The model's plain weights cannot be read back: no safetensors checkpoint, or one without a weight it needs."""


def checkpoint_files(model) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for the folder `model` was loaded from."""
    folder = Path(str(getattr(model, "name_or_path", "") or ""))
    if (folder / INDEX).is_file():
        index = json.loads((folder / INDEX).read_text())["weight_map"]
        return {name: folder / file for name, file in index.items()}
    if (folder / SINGLE).is_file():
        with safe_open(folder / SINGLE, "pt") as handle:
            return {name: folder / SINGLE for name in handle.keys()}
    raise CheckpointError(f"{folder or 'this model'} has no safetensors checkpoint to read plain weights back from "
                          "(a model built in memory or loaded from a .gguf file)")


def map_plain_weights(model) -> int:
    """Give every routed linear of `model` that lacks its plain weight that weight again, read from the checkpoint
    (a view of the file where its dtype is the model's); returns how many linears got one."""
    missing = [(name, layer) for name, layer in named_routed_linears(model) if "plain" not in layer.paths]
    if not missing:
        return 0
    files = checkpoint_files(model)
    absent = [name for name, _ in missing if f"{name}.weight" not in files]
    if absent:
        raise CheckpointError(f"the checkpoint has no weight for {len(absent)} linears, e.g. {absent[0]} (a head "
                              "trimmed or projections stacked after loading)")
    by_file: dict[Path, list] = {}
    for name, layer in missing:
        by_file.setdefault(files[f"{name}.weight"], []).append((name, layer))
    for file, layers in by_file.items():
        with safe_open(file, "pt") as handle:
            for name, layer in layers:
                layer.restore_plain(handle.get_tensor(f"{name}.weight").to(layer.weight.dtype))
    return len(missing)

