"""The cost table (engine/costs.py) for the real model shapes on any device, with no download.

    python -m scripts.device_costs --device cuda                  # Qwen2.5 1.5B/0.5B and Pythia 2.8B/70M pairs
    python -m scripts.device_costs --device cpu --pairs pythia --dtype fp32
    python -m scripts.device_costs --device cuda --breakdown      # also: where a 1-row step's time goes
    python -m scripts.device_costs --device cuda --graphs         # also: a 1-row step from a CUDA graph

Models are randomly initialised from hand-written configs of the published shapes (forward cost depends on the
shapes, not on the weights), measured with engine.costs.measure (the calibration the engine runs at load: a
300-token prefix, rows 1..64, synchronised on CUDA), and reported as c = draft step / target step and
t(n) = verify n rows / target step. `--breakdown` profiles one single-row step of each model on CUDA: its wall
time against the time the GPU spent in kernels and the number of kernels launched. Wall far above kernel time means
the step is bound by the host (Python and kernel launches), not by the GPU: a draft step then costs nearly as much as
a target step however small the draft, and verifying many rows costs little more than one.
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, Qwen2Config, Qwen2ForCausalLM


from engine import kv
from engine.costs import LADDER, PREFIX, ModelCosts, PairCosts, timed_forward, measure, probe_ids

QWEN = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
            attn_implementation="sdpa")
PYTHIA = dict(vocab_size=50304, max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True,
              attn_implementation="sdpa")
SHAPES = {  # the published config.json values that decide cost
    "qwen2.5-1.5b": (Qwen2Config, Qwen2ForCausalLM, dict(hidden_size=1536, intermediate_size=8960,
                                                         num_hidden_layers=28, num_attention_heads=12,
                                                         num_key_value_heads=2, tie_word_embeddings=True, **QWEN)),
    "qwen2.5-0.5b": (Qwen2Config, Qwen2ForCausalLM, dict(hidden_size=896, intermediate_size=4864,
                                                         num_hidden_layers=24, num_attention_heads=14,
                                                         num_key_value_heads=2, tie_word_embeddings=True, **QWEN)),
    "pythia-2.8b": (GPTNeoXConfig, GPTNeoXForCausalLM, dict(hidden_size=2560, intermediate_size=10240,
                                                            num_hidden_layers=32, num_attention_heads=32,
                                                            tie_word_embeddings=False, **PYTHIA)),
    "pythia-70m": (GPTNeoXConfig, GPTNeoXForCausalLM, dict(hidden_size=512, intermediate_size=2048,
                                                           num_hidden_layers=6, num_attention_heads=8,
                                                           tie_word_embeddings=False, **PYTHIA)),
}
PAIRS = {"qwen": ("qwen2.5-1.5b", "qwen2.5-0.5b"), "pythia": ("pythia-2.8b", "pythia-70m")}


def build(name: str, dtype: torch.dtype, device: torch.device):
    config_cls, model_cls, kw = SHAPES[name]
    with torch.device(device):
        model = model_cls(config_cls(**kw)).to(dtype).eval()
    return model


def breakdown(model, repeats: int = 5) -> tuple[float, float, int]:
    """Single-row step after a PREFIX-token cache: (wall ms, GPU kernel ms, kernels launched), medians of `repeats`."""
    from torch.profiler import ProfilerActivity, profile

    ids = probe_ids(model, PREFIX + 1)
    cache = kv.new_cache(model)
    rows = []
    with torch.inference_mode():
        model(input_ids=ids[None, :PREFIX], past_key_values=cache, use_cache=True, logits_to_keep=1)
        timed_forward(model, ids, PREFIX, 1, cache)  # warm-up
        for _ in range(repeats):
            wall = timed_forward(model, ids, PREFIX, 1, cache)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                timed_forward(model, ids, PREFIX, 1, cache)
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            rows.append((wall * 1e3, sum(e.device_time for e in kernels) / 1e3, len(kernels)))
    return tuple(sorted(r[i] for r in rows)[repeats // 2] for i in range(3))


def graph_step(model, repeats: int = 20) -> tuple[float, float, float, bool]:
    """A single-row decode step on a static cache (transformers' StaticCache), eager and replayed from a CUDA graph
    captured by hand (torch.cuda.graph; no torch.compile): (eager ms, graph ms, max |logit difference| between a
    replay and an eager step on the same input, whether their argmax agrees), times the medians of `repeats`. How
    much of a step's wall time is launch overhead a graph removes. Measurement only: the engine does not use graphs
    yet."""
    from transformers import StaticCache

    device = next(model.parameters()).device
    # Room for every call below: some transformers versions advance the write position on each call of the same
    # token instead of taking cache_position (a step past the end would fail with an index error on the device).
    cache = StaticCache(config=model.config, max_cache_len=PREFIX + 4 * repeats + 16)
    ids = probe_ids(model, PREFIX + 1)
    token, position = ids[None, PREFIX:PREFIX + 1].clone(), torch.tensor([PREFIX], device=device)

    def step():
        return model(input_ids=token, cache_position=position, past_key_values=cache, use_cache=True).logits

    def timed(fn) -> float:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[repeats // 2]

    with torch.inference_mode():
        model(input_ids=ids[None, :PREFIX], cache_position=torch.arange(PREFIX, device=device),
              past_key_values=cache, use_cache=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph requires
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        eager = timed(step)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = step()  # the graph's output buffer: every replay writes it
        graphed = timed(graph.replay)
        # Every call writes the same token at the same position, so an eager step and a replay see the same cache.
        reference = step()[0, -1].float()
        graph.replay()
        torch.cuda.synchronize()
        out = replayed[0, -1].float()
        return eager, graphed, float((out - reference).abs().max()), bool(out.argmax() == reference.argmax())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--pairs", default="qwen,pythia")
    parser.add_argument("--breakdown", action="store_true", help="profile a 1-row step of each model (CUDA)")
    parser.add_argument("--graphs", action="store_true",
                        help="time a 1-row static-cache step eager and from a hand-captured CUDA graph (CUDA)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"device: {where} | torch {torch.__version__} | dtype {args.dtype} | prefix 300 | min of 3")
    for key in args.pairs.split(","):
        tables = {}
        for role, name in zip(("target", "draft"), PAIRS[key]):
            start = time.perf_counter()
            model = build(name, dtype, device)
            tables[role] = ModelCosts(name, measure(model, ["plain"]))
            print(f"  measured {name} in {time.perf_counter() - start:.1f} s")
            if args.breakdown and device.type == "cuda":
                wall, gpu, launched = breakdown(model)
                print(f"  {name} 1-row step: wall {wall:.2f} ms, GPU kernels {gpu:.2f} ms "
                      f"({100 * gpu / wall:.0f} % busy), {launched} kernels")
            if args.graphs and device.type == "cuda":
                try:
                    eager, graphed, diff, same = graph_step(model)
                    print(f"  {name} 1-row static-cache step: eager {eager:.2f} ms, CUDA graph {graphed:.2f} ms; "
                          f"replay vs eager logits: max |diff| {diff:.3g}, argmax {'equal' if same else 'DIFFERS'}")
                except Exception as err:  # noqa: BLE001 - a capture the model's code does not allow is a result too
                    print(f"  {name}: CUDA graph capture failed: {type(err).__name__}: {str(err)[:300]}")
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        costs = PairCosts(tables["target"], tables["draft"])
        print(f"\n{PAIRS[key][0]} / {PAIRS[key][1]}")
        for role, table in tables.items():
            print(f"  {role:6s} ms: " + "  ".join(f"{r}:{table.time(r) * 1000:.2f}" for r in LADDER))
        print(f"  c = {costs.c:.3f}   t(n): " + "  ".join(f"t({r})={costs.t(r):.2f}" for r in LADDER))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
