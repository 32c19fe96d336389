"""The cost table (engine/costs.py) for the real model shapes on any device, with no download.

    python scripts/device_costs.py --device cuda                  # Qwen2.5 1.5B/0.5B and Pythia 2.8B/70M pairs
    python scripts/device_costs.py --device cpu --pairs pythia --dtype fp32

Models are randomly initialised from hand-written configs of the published shapes (forward cost depends on the
shapes, not on the weights), measured with engine.costs.measure (the calibration the engine runs at load: a
300-token prefix, rows 1..64, synchronised on CUDA), and reported as c = draft step / target step and
t(n) = verify n rows / target step.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.costs import LADDER, ModelCosts, PairCosts, measure  # noqa: E402

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--pairs", default="qwen,pythia")
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
