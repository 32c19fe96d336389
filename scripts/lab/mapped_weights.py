"""Does a plain weight stream slower as a view of the checkpoint's file than as the process's own memory?

    python -m scripts.lab.mapped_weights [--rounds 5] [--steps 5]      # on a machine of 24 GiB or more

Loads the default pair in the app's configuration (with room for `plain` beside the trees' format, so one-row AR
reads plain weights), then times the target's one-row eager forward over a 300-token cache with its plain weights
as loaded (views of the converted checkpoint's file, page cache) and as the process's own copies (what load_pair
makes them: engine/cpu/kernels.py `own_plain_weights`), swapping the two under the same Parameters, interleaved
round by round.
Prints each round's median and the ratio. The tied head (the embedding's tensor) stays the process's copy in both.
"""
from __future__ import annotations

import argparse
import statistics

import torch
from safetensors import safe_open

from engine.cpu.kernels import _file_mapped, named_routed_linears
from engine.measure.costs import PREFIX, filled_cache, probe_ids, timed_forward
from engine.models import load_pair
from engine.models.checkpoint import checkpoint_files


def file_views(model) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """The target's routed plain weights and, for each, a view of the same tensor in the checkpoint's file (load_pair
    made the weights the process's own copies; a tied head is left out: its tensor is the embedding's)."""
    files, params, views = checkpoint_files(model), [], []
    for name, layer in named_routed_linears(model):
        key = f"{name}.weight"
        if "plain" in layer.paths and key in files:
            with safe_open(files[key], "pt") as handle:
                view = handle.get_tensor(key)
            assert _file_mapped(view.data_ptr(), view.data_ptr() + view.nbytes) and torch.equal(view, layer.weight)
            params.append(layer.weight)
            views.append(view)
    return params, views


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    pair = load_pair("default", "default", dtype="auto", draft_vocab="auto", draft_quant="auto", capture="off")
    model = pair.target
    mapped, views = file_views(model)
    print(f"{len(mapped)} plain weights, {sum(w.nbytes for w in mapped) / 1e9:.2f} GB; routing: {pair.describe()}")
    copies = [w.data for w in mapped]
    ids = probe_ids(model, PREFIX + 1)
    with torch.inference_mode():
        cache = filled_cache(model, ids, PREFIX)
        results = {"file-mapped": [], "own memory": []}
        for _ in range(args.rounds):
            for name, tensors in (("file-mapped", views), ("own memory", copies)):
                for w, t in zip(mapped, tensors):
                    w.data = t
                timed_forward(model, ids, PREFIX, 1, cache)  # one untimed step after the swap
                ms = statistics.median(timed_forward(model, ids, PREFIX, 1, cache) for _ in range(args.steps)) * 1e3
                results[name].append(ms)
                print(f"  {name:<12} {ms:6.1f} ms", flush=True)
    a, b = (statistics.median(v) for v in results.values())
    print(f"median one-row step: file-mapped {a:.1f} ms, own memory {b:.1f} ms, own/mapped {b / a:.3f}")


if __name__ == "__main__":
    main()
