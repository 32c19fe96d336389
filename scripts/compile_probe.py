"""Would compiling the tree's forwards pay? One target forward of B tree rows, eager against torch.compile.

The bench's `ar-compiled` baseline compiles the single-row step (engine/compiled.py). A speculative iteration
instead verifies B rows under a tree mask, and B changes every iteration. This probe times, for each B asked for, one
forward of B rows after a `--prefix`-token cache, on a static cache (a compiled graph needs fixed shapes):

  eager     the engine's routed kernels (the path every strategy runs today)
  compiled  torch.compile(dynamic=False) of the same forward with frozen weights and plain linears, as `ar-compiled`
            does; with `--mode max-autotune` inductor also times its own C++ GEMMs against oneDNN per weight shape

Each B is compiled and timed in its own process: a graph is specialised to its row count, every frozen graph keeps
its own copy of the weights, and an inductor failure (a crash inside generated code is possible) costs only that row
count. Result: docs/experiments/compiled-ar.md, "Compiling the tree's forwards".

    python scripts/compile_probe.py --pair default --rows 4,16,32
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def probe(pair_spec: str, dtype: str, rows: int, prefix: int, repeats: int, mode: str) -> dict:
    """{"rows", "eager_ms", "compiled_ms", "compile_s", "max_abs_diff"}: fastest of `repeats` calls each."""
    import torch
    import torch._inductor.config as inductor_config
    from transformers import StaticCache

    from engine import kv
    from engine.costs import probe_ids
    from engine.kernels import forcing
    from engine.models import load_pair

    model = load_pair(pair_spec, None, dtype=dtype).target
    cache = StaticCache(config=model.config, max_cache_len=prefix + rows)
    ids = probe_ids(model, prefix + rows)
    # a chain is a tree: every row sees the prefix and the rows before it (the cache holds exactly prefix + rows)
    visible = kv.tree_visibility(prefix, torch.tril(torch.ones(rows, rows, dtype=torch.bool)))
    inputs = {"input_ids": ids[None, prefix:], "position_ids": torch.arange(prefix, prefix + rows)[None],
              "cache_position": torch.arange(prefix, prefix + rows), "past_key_values": cache, "use_cache": True,
              "attention_mask": kv.additive_mask(visible, model.dtype)}

    def rewind() -> None:
        # transformers' static layers write at their own running length (ignoring cache_position) and advance it
        # in place; setting it back makes every call write the same rows after the same prefix
        for layer in cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(prefix)

    def timed(forward) -> tuple[float, torch.Tensor]:
        best, logits = float("inf"), None
        for _ in range(repeats):
            rewind()
            start = time.perf_counter()
            logits = forward(**inputs).logits
            best = min(best, time.perf_counter() - start)
        return best, logits

    with torch.inference_mode():
        model(input_ids=ids[None, :prefix], cache_position=torch.arange(prefix), past_key_values=cache,
              use_cache=True, logits_to_keep=1)
        timed(model)  # warm-up: the first calls allocate and pick kernels
        eager_s, eager_logits = timed(model)
        inductor_config.freezing = True
        step = torch.compile(model, dynamic=False, mode=None if mode == "default" else mode)
        with forcing(model, "plain"):
            rewind()
            start = time.perf_counter()
            step(**inputs)
            compile_s = time.perf_counter() - start
            compiled_s, compiled_logits = timed(step)
    return {"rows": rows, "eager_ms": eager_s * 1e3, "compiled_ms": compiled_s * 1e3, "compile_s": compile_s,
            "max_abs_diff": float((compiled_logits.float() - eager_logits.float()).abs().max())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="default", help="the pair whose target is probed (tiny-random works)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rows", default="4,16,32", help="comma-separated row counts B")
    parser.add_argument("--prefix", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mode", default="max-autotune", choices=("max-autotune", "default"))
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process: probe one B, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(probe(args.pair, args.dtype, args.one, args.prefix, args.repeats, args.mode)))
        return 0
    results = []
    print(f"{'rows':>5s} {'eager ms':>9s} {'compiled ms':>12s} {'speedup':>8s} {'compile s':>10s} {'max |diff|':>11s}")
    for rows in (int(r) for r in args.rows.split(",")):
        child = [sys.executable, __file__, "--one", str(rows), "--pair", args.pair, "--dtype", args.dtype,
                 "--prefix", str(args.prefix), "--repeats", str(args.repeats), "--mode", args.mode]
        proc = subprocess.run(child, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            reason = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1][:200]
            results.append({"rows": rows, "error": reason})
            print(f"{rows:5d} failed: {reason}")
            continue
        row = json.loads(lines[-1])
        results.append(row)
        print(f"{rows:5d} {row['eager_ms']:9.1f} {row['compiled_ms']:12.1f} "
              f"{row['eager_ms'] / row['compiled_ms']:7.2f}× {row['compile_s']:10.0f} {row['max_abs_diff']:11.3g}")
    if args.json:
        Path(args.json).write_text(json.dumps({"pair": args.pair, "mode": args.mode, "prefix": args.prefix,
                                               "rows": results}, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
