"""Lab probe behind docs/experiments/compiled-ar.md (compile-probe.json, compile-probe-attention.json).

Would compiling the tree's forwards pay? One target forward of B tree rows, eager against torch.compile.

The bench's `ar-compiled` baseline compiles the single-row step (engine/bench/compiled.py). A speculative iteration
instead verifies B rows under a tree mask, and B changes every iteration. This probe times, for each B asked for, one
forward of B rows after a `--prefix`-token cache, both ways (a compiled graph needs fixed shapes, so a static cache):

  eager     the engine's own verification forward: routed kernels on a dynamic cache, rolled back by row copy
  compiled  torch.compile(dynamic=False) of the same forward as `ar-compiled` builds its step: frozen weights, plain
            linears, the query heads folded onto their key/value head, a static cache sized in `CACHE_STEP`s with its
            unfilled positions masked; with `--mode max-autotune` inductor also times its own C++ GEMMs against
            oneDNN per weight shape

`--variants` times several compiled forms in one process beside eager: the attention (`shipped`, the compiled AR's;
`sdpa`, the model's own as loaded; `gqa`, SDPA's math backend with grouped-query heads, which the compiled AR ran until
2026-12-07) and the static cache's length, e.g. `shipped:384,gqa:385`.

Each B is compiled and timed in its own process: a graph is specialised to its row count, every frozen graph keeps
its own copy of the weights, and an inductor failure (a crash inside generated code is possible) costs only that row
count. Within a process, eager and every compiled variant are called in turn, so the machine's drift hits them all.
Results: docs/experiments/compiled-ar.md.

    python -m scripts.lab.compile_probe --pair default --rows 4,8,16
    python -m scripts.lab.compile_probe --pair default --rows 1 --prefix 150 --variants shipped:384,sdpa:640
    python -m scripts.lab.compile_probe --pair default --rows 2,4,8,16 --dynamic   # one graph for every count
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from unittest.mock import patch

ROOT = Path(__file__).resolve().parents[2]  # the repository root, where `python -m scripts.lab.compile_probe` runs


GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"  # transformers' switch: grouped-query heads in SDPA even with a mask


@contextmanager
def gqa_attention(model):
    """`model` on transformers' sdpa with grouped-query heads unexpanded (`enable_gqa`) on SDPA's math backend inside
    the block, as the compiled AR traced it until 2026-12-07; back afterwards."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    implementation = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with patch.dict(os.environ, {GQA_SWITCH: "1"}), sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        model.set_attn_implementation(implementation)


def probe(pair_spec: str, dtype: str, rows: int, prefix: int, repeats: int, mode: str,
          variants: list[tuple[str, int | None]]) -> dict:
    """{"rows", "eager_ms", "variants": [{"attention", "cache_len", "compiled_ms", "compile_s", "max_abs_diff"}]}:
    the fastest of `repeats` calls of each, eager and every compiled variant taken in turn."""
    import contextlib

    import torch
    import torch._inductor.config as inductor_config
    from transformers import StaticCache

    from engine.core import kv
    from engine.core.attention import folded_attention
    from engine.bench.compiled import round_to_step
    from engine.measure.costs import probe_ids
    from engine.runtime import forcing
    from engine.models import load_pair

    model = load_pair(pair_spec, None, dtype=dtype).target
    ids = probe_ids(model, prefix + rows)
    chain = torch.tril(torch.ones(rows, rows, dtype=torch.bool))  # a chain is a tree: each row sees those before
    new = {"input_ids": ids[None, prefix:], "position_ids": torch.arange(prefix, prefix + rows)[None],
           "use_cache": True}

    # eager: exactly the engine's verification (dynamic cache, routed kernels, no mask for a lone row, row rollback)
    dynamic = kv.new_cache(model)
    eager_mask = kv.additive_mask(kv.tree_visibility(prefix, chain), model.dtype) if rows > 1 else None

    def eager():
        out = model(**new, attention_mask=eager_mask, past_key_values=dynamic)
        kv.keep_rows(dynamic, prefix, [])
        return out

    inductor_config.freezing = True
    step = torch.compile(model, dynamic=False, mode=None if mode == "default" else mode)

    def compiled_variant(attention: str, cache_len: int):
        """A compiled forward on its own static cache of `cache_len` positions, the unfilled ones masked out."""
        cache = StaticCache(config=model.config, max_cache_len=cache_len)
        model(input_ids=ids[None, :prefix], cache_position=torch.arange(prefix), past_key_values=cache,
              use_cache=True, logits_to_keep=1)
        visible = torch.zeros(rows, cache_len, dtype=torch.bool)
        visible[:, : prefix + rows] = kv.tree_visibility(prefix, chain)
        mask = kv.additive_mask(visible, model.dtype)
        attend = {"shipped": lambda: folded_attention(model), "gqa": lambda: gqa_attention(model)}.get(
            attention, contextlib.nullcontext)  # sdpa: the model's own

        def forward():
            with forcing(model, "plain"), attend():
                out = step(**new, attention_mask=mask, past_key_values=cache,
                           cache_position=torch.arange(prefix, prefix + rows))
            # transformers' static layers write at their own running length (ignoring cache_position) and advance
            # it in place; setting it back makes every call write the same rows after the same prefix
            for layer in cache.layers:
                layer.cumulative_length.fill_(prefix)
            return out
        return forward

    def timed(forwards) -> list[tuple[float, torch.Tensor]]:
        """Fastest of `repeats` calls of each forward, the forwards taken in turn so the machine's drift hits all."""
        best = [(float("inf"), None)] * len(forwards)
        for _ in range(repeats):
            for i, forward in enumerate(forwards):
                start = time.perf_counter()
                logits = forward().logits
                best[i] = (min(best[i][0], time.perf_counter() - start), logits)
        return best

    results, forwards = [], [eager]
    with torch.inference_mode():
        model(input_ids=ids[None, :prefix], past_key_values=dynamic, use_cache=True, logits_to_keep=1)
        timed([eager])  # warm-up: the first calls allocate and pick kernels
        for attention, cache_len in variants:
            cache_len = cache_len or round_to_step(prefix + rows)
            forward = compiled_variant(attention, cache_len)
            start = time.perf_counter()
            forward()
            results.append({"attention": attention, "cache_len": cache_len,
                            "compile_s": time.perf_counter() - start})
            forwards.append(forward)
        timings = timed(forwards)
    eager_s, eager_logits = timings[0]
    for row, (seconds, logits) in zip(results, timings[1:]):
        row.update(compiled_ms=seconds * 1e3, max_abs_diff=float((logits.float() - eager_logits.float()).abs().max()))
    return {"rows": rows, "eager_ms": eager_s * 1e3, "variants": results}


def probe_dynamic(pair_spec: str, dtype: str, rows_list: list[int], prefix: int, repeats: int, mode: str) -> dict:
    """{"rows": [{"rows", "eager_ms", "compiled_ms", "max_abs_diff"}], "compile_s"}: ONE compiled graph with the row
    count dynamic (one frozen copy of the weights serves every count, as one package would) against the engine's
    eager verification, at each count in `rows_list` (all >= 2: torch specialises a size of 1), taken in turn."""
    import torch
    import torch._inductor.config as inductor_config
    from transformers import StaticCache

    from engine.bench.compiled import round_to_step
    from engine.core import kv
    from engine.core.attention import folded_attention
    from engine.measure.costs import probe_ids
    from engine.models import load_pair
    from engine.runtime import forcing

    if min(rows_list) < 2:
        raise SystemExit("--dynamic: every row count must be at least 2 (torch specialises a size of 1)")
    model = load_pair(pair_spec, None, dtype=dtype).target
    top = max(rows_list)
    ids = probe_ids(model, prefix + top)
    cache_len = round_to_step(prefix + top)
    dynamic = kv.new_cache(model)
    static = StaticCache(config=model.config, max_cache_len=cache_len)
    inductor_config.freezing = True
    step = torch.compile(model, dynamic=None, mode=None if mode == "default" else mode)

    def inputs(rows: int, mask_len: int | None) -> dict:
        chain = torch.tril(torch.ones(rows, rows, dtype=torch.bool))
        visible = torch.zeros(rows, mask_len or prefix + rows, dtype=torch.bool)
        visible[:, : prefix + rows] = kv.tree_visibility(prefix, chain)
        return {"input_ids": ids[None, prefix:prefix + rows], "position_ids": torch.arange(prefix, prefix + rows)[None],
                "attention_mask": kv.additive_mask(visible, model.dtype), "use_cache": True}

    def eager(rows: int):
        new = inputs(rows, None)

        def forward():
            out = model(**new, past_key_values=dynamic)
            kv.keep_rows(dynamic, prefix, [])
            return out
        return forward

    def compiled(rows: int):
        new = inputs(rows, cache_len)
        position = torch.arange(prefix, prefix + rows)
        for name, dim in (("input_ids", 1), ("position_ids", 1), ("attention_mask", 2)):
            torch._dynamo.mark_dynamic(new[name], dim, min=2, max=64)
        torch._dynamo.mark_dynamic(position, 0, min=2, max=64)

        def forward():
            with forcing(model, "plain"), folded_attention(model):
                out = step(**new, past_key_values=static, cache_position=position)
            for layer in static.layers:  # write the same rows after the same prefix on every call
                layer.cumulative_length.fill_(prefix)
            return out
        return forward

    with torch.inference_mode():
        model(input_ids=ids[None, :prefix], past_key_values=dynamic, use_cache=True, logits_to_keep=1)
        model(input_ids=ids[None, :prefix], cache_position=torch.arange(prefix), past_key_values=static,
              use_cache=True, logits_to_keep=1)
        pairs = [(eager(rows), compiled(rows)) for rows in rows_list]
        start = time.perf_counter()
        pairs[rows_list.index(top)][1]()  # traced at the largest count: a boundary value would specialise
        compile_s = time.perf_counter() - start
        for e, c in pairs:  # warm-up; a recompile here would show as a slow first count
            e(), c()
        best = [[float("inf"), float("inf"), None, None] for _ in rows_list]
        for _ in range(repeats):
            for slot, (e, c) in zip(best, pairs):
                for k, forward in enumerate((e, c)):
                    begin = time.perf_counter()
                    logits = forward().logits
                    seconds = time.perf_counter() - begin
                    if seconds < slot[k]:
                        slot[k], slot[2 + k] = seconds, logits
    rows_out = [{"rows": rows, "eager_ms": s[0] * 1e3, "compiled_ms": s[1] * 1e3,
                 "max_abs_diff": float((s[2].float() - s[3].float()).abs().max())} for rows, s in zip(rows_list, best)]
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])  # more than 1: some count recompiled
    return {"compile_s": compile_s, "cache_len": cache_len, "graphs": graphs, "rows": rows_out}


def parse_variants(text: str) -> list[tuple[str, int | None]]:
    """"shipped,sdpa:640" -> [("shipped", None), ("sdpa", 640)]. A compiled graph is bound to the cache it was
    traced with and cannot tell two same-sized caches apart, so the variants' cache lengths must all differ."""
    variants = []
    for item in text.split(","):
        attention, _, length = item.partition(":")
        if attention not in ("shipped", "sdpa", "gqa"):
            raise SystemExit(f"--variants: attention must be shipped, sdpa or gqa, got {attention!r}")
        variants.append((attention, int(length) if length else None))
    lengths = [length for _, length in variants]
    if len(variants) > 1 and (None in lengths or len(set(lengths)) < len(lengths)):
        raise SystemExit("--variants: with several variants give each its own cache length (shipped:384,sdpa:640)")
    return variants


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="default", help="the pair whose target is probed (tiny-random works)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rows", default="4,16,32", help="comma-separated row counts B")
    parser.add_argument("--prefix", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mode", default="max-autotune", choices=("max-autotune", "default"))
    parser.add_argument("--variants", default="shipped",
                        help="compiled variants timed in one process beside eager, as ATTENTION[:CACHE_LEN],...: "
                             "shipped = the compiled AR's and the captured steps' attention "
                             "(engine.core.attention.folded_attention), sdpa = the model's own as loaded, gqa = SDPA's "
                             "math backend with grouped-query heads (the compiled AR's until 2026-12-07); the cache "
                             "length defaults to what the compiled AR would use")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--dynamic", action="store_true",
                        help="one compiled graph with the row count dynamic, timed at every --rows count (each >= 2) "
                             "in one process, instead of a graph per count")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process: probe one B, print JSON
    parser.add_argument("--one-dynamic", action="store_true", help=argparse.SUPPRESS)  # the --dynamic child
    args = parser.parse_args()
    if args.one:
        print(json.dumps(probe(args.pair, args.dtype, args.one, args.prefix, args.repeats, args.mode,
                               parse_variants(args.variants))))
        return 0
    if args.dynamic:
        return dynamic_main(args)
    parse_variants(args.variants)
    results = []
    print(f"{'rows':>5s} {'eager ms':>9s} {'variant':>12s} {'compiled ms':>12s} {'speedup':>8s} {'compile s':>10s} "
          f"{'max |diff|':>11s}")
    for rows in (int(r) for r in args.rows.split(",")):
        child = [sys.executable, "-m", "scripts.lab.compile_probe", "--one", str(rows), "--pair", args.pair,
                 "--dtype", args.dtype,
                 "--prefix", str(args.prefix), "--repeats", str(args.repeats), "--mode", args.mode,
                 "--variants", args.variants]
        row, reason = child_result(child)
        if row is None:
            results.append({"rows": rows, "error": reason})
            print(f"{rows:5d} failed: {reason}")
            continue
        results.append(row)
        for v in row["variants"]:
            name = f"{v['attention']}:{v['cache_len']}"
            print(f"{rows:5d} {row['eager_ms']:9.1f} {name:>12s} {v['compiled_ms']:12.1f} "
                  f"{row['eager_ms'] / v['compiled_ms']:7.2f}× {v['compile_s']:10.0f} {v['max_abs_diff']:11.3g}")
    if args.json:
        Path(args.json).write_text(json.dumps({"pair": args.pair, "mode": args.mode, "prefix": args.prefix,
                                               "variants": args.variants, "rows": results}, indent=1))
    return 0 if all("error" not in r for r in results) else 1


def child_result(child: list[str]) -> tuple[dict | None, str]:
    """(the JSON line a child probe printed last, "") or (None, why it failed: its last error line)."""
    proc = subprocess.run(child, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return None, (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1][:200]
    return json.loads(lines[-1]), ""


def dynamic_main(args) -> int:
    """--dynamic: one child process, one graph, every row count."""
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.one_dynamic:
        print(json.dumps(probe_dynamic(args.pair, args.dtype, rows_list, args.prefix, args.repeats, args.mode)))
        return 0
    child = [sys.executable, "-m", "scripts.lab.compile_probe", "--dynamic", "--one-dynamic", "--rows", args.rows,
             "--pair", args.pair, "--dtype", args.dtype, "--prefix", str(args.prefix), "--repeats", str(args.repeats),
             "--mode", args.mode]
    result, reason = child_result(child)
    if result is None:
        print("failed:", reason)
        return 1
    print(f"rows dynamic: {result['graphs']} graph(s) (1 = every count served by one), first compiled in "
          f"{result['compile_s']:.0f} s, on a {result['cache_len']}-position cache")
    print(f"{'rows':>5s} {'eager ms':>9s} {'compiled ms':>12s} {'speedup':>8s} {'max |diff|':>11s}")
    for row in result["rows"]:
        print(f"{row['rows']:5d} {row['eager_ms']:9.1f} {row['compiled_ms']:12.1f} "
              f"{row['eager_ms'] / row['compiled_ms']:7.2f}× {row['max_abs_diff']:11.3g}")
    if args.json:
        Path(args.json).write_text(json.dumps({"pair": args.pair, "mode": args.mode, "prefix": args.prefix,
                                               "dynamic": True, **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
