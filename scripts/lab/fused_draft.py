"""Lab probe behind docs/experiments/2026-11-28-fused-projections-cpu.md ("Built"): the default draft's whole forward
with its projections fused and without, interleaved in one process.

Both copies are the app's draft: its 32,768-token head, then each copy's formats chosen by the probe and made as a
load makes them (`--draft-quant auto`); one copy's q|k|v and gate|up stacked first (engine/cpu/fusion.py). Forwards
of 1, 4 and 8 rows over a 300-token cache, the copies alternating call by call, medians of `--repeats` calls after
20 warm-ups each. Also the bytes one single-row step reads, and that time at this machine's streaming bandwidth.

    python -m scripts.lab.fused_draft [--repeats 60]
"""
import argparse
import copy
import statistics

import torch

from engine.cpu.formats import choose_formats, make_whole
from engine.cpu.fusion import fuse_projections
from engine.cpu.kernels import packed_dtype, route_linears, step_bytes
from engine.measure.costs import PREFIX, filled_cache, machine_bandwidth, probe_ids, timed_forward
from engine.models import load_model
from engine.models.devices import cpu_has_fast_bf16, resolve_dtype
from engine.models.loading import candidate_formats
from engine.models.vocab import auto_draft_vocab, draft_vocab_ids, trim_head

ROWS = (1, 4, 8)


def app_draft():
    """(model, tokenizer, name), in load_model's order: the default draft in the app's dtype on this CPU (`auto`:
    bf16 where it has native bf16, else float32) with the app's trimmed head, before any format is made."""
    dtype = resolve_dtype("auto", torch.device("cpu"))
    model, tokenizer, name = load_model("default-draft", dtype=dtype, device="cpu", role="draft")
    vocab = auto_draft_vocab(tokenizer, model.get_output_embeddings().out_features)
    if vocab:
        trim_head(model, draft_vocab_ids(tokenizer, vocab, [*tokenizer.get_added_vocab().values()]))
    return model.eval(), tokenizer, name


def with_formats(model, name: str):
    route_linears(model)
    compute = packed_dtype(model.dtype, cpu_has_fast_bf16())  # as engine/models/loading.py prepare_kernels
    candidates = candidate_formats("auto", "auto", torch.device("cpu"), model.dtype)
    choice = choose_formats(model, name, candidates, compute)
    make_whole(model, choice, compute)
    return choice.summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    plain, _, name = app_draft()
    fused = copy.deepcopy(plain)
    fuse_projections(fused)
    models = {"separate": plain, "fused": fused}
    for label, model in models.items():
        print(f"{label}: {with_formats(model, name)}")
    bandwidth = machine_bandwidth(torch.device("cpu"))
    with torch.inference_mode():
        ids = probe_ids(plain, PREFIX + max(ROWS))
        caches = {label: filled_cache(model, ids, PREFIX) for label, model in models.items()}
        for rows in ROWS:
            samples = {label: [] for label in models}
            for i in range(20 + args.repeats):
                for label, model in models.items():
                    seconds = timed_forward(model, ids, PREFIX, rows, caches[label])
                    if i >= 20:
                        samples[label].append(seconds)
            medians = {label: statistics.median(s) * 1000 for label, s in samples.items()}
            print(f"{rows:2d} rows: " + ", ".join(f"{label} {ms:.2f} ms" for label, ms in medians.items())
                  + f"; fused/separate {medians['fused'] / medians['separate']:.3f}")
    for label, model in models.items():
        nbytes = step_bytes(model)
        print(f"{label}: {nbytes / 1e9:.3f} GB per one-row step = {nbytes / bandwidth * 1000:.1f} ms at "
              f"{bandwidth / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
