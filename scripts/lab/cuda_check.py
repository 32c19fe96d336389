"""Lab probe behind docs/experiments/cuda.md; the GPU check (scripts/gpu_check) has since taken its place.

The engine on a CUDA device: greedy exactness in fp32, bf16 agreement, seeded sampling, synchronised timings.

    python -m scripts.lab.cuda_check [--device cuda] [--tokens 40] [--json OUT]

Runs every strategy on the tiny random pairs (built in memory: no download, so it runs on a machine with no network)
and prints, per strategy: how many runs equal target-only greedy decoding token for token in fp32 (must be all),
the same in bf16 (near-tie flips are expected there, ARCHITECTURE.md) with the first divergence, whether two runs at
temperature 0.8 with the same seed agree (seeded sampling on the device), and the median draft / verify seconds per
iteration from the records (the decoder synchronises the device around each stage). The verification rules'
exact-enumeration tests run on the device too: `TREEVIZ_TEST_DEVICE=cuda python -m pytest tests/test_verify_exact.py`.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path


import torch

from engine.core.sampling import Sampling
from engine.models import tiny_random_pair
from engine.recipe import RunSpec, generate
from engine.strategies import STRATEGIES

PROMPTS = ["hello world", "def f(x):\n    return", "The quick brown fox jumps over"]
KINDS = ("related", "identical", "unrelated")


def ids(pair, name, prompt, tokens, sampling=None):
    spec = RunSpec(pair=pair.target_name, prompt=prompt, strategy=name, max_new_tokens=tokens, stop_on_eos=False,
                   **(sampling or Sampling()).as_dict())
    return generate(pair, spec)


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def check(device: str, tokens: int) -> dict:
    rows = {name: {"fp32_exact": 0, "bf16_exact": 0, "runs": 0, "bf16_first_divergence": [], "seeded": True,
                   "draft_s": [], "verify_s": []} for name in STRATEGIES if name != "ar"}
    for dtype in (torch.float32, torch.bfloat16):
        key = "fp32" if dtype == torch.float32 else "bf16"
        for kind in KINDS:
            for seed in (0, 1):
                pair = tiny_random_pair(kind, seed=seed, dtype=dtype, device=device)
                for prompt in PROMPTS:
                    reference = ids(pair, "ar", prompt, tokens).output_ids
                    for name, row in rows.items():
                        run = ids(pair, name, prompt, tokens)
                        same = run.output_ids == reference
                        row[f"{key}_exact"] += same
                        row["runs"] += key == "fp32"
                        if key == "bf16" and not same:
                            row["bf16_first_divergence"].append(first_divergence(run.output_ids, reference))
                        if key == "fp32":
                            row["draft_s"] += [it.times.draft for it in run.iterations]
                            row["verify_s"] += [it.times.verify for it in run.iterations]
    pair = tiny_random_pair("related", seed=0, dtype=torch.float32, device=device)
    for name, row in rows.items():
        sampling = Sampling(temperature=0.8, seed=7)
        row["seeded"] = (ids(pair, name, PROMPTS[0], tokens, sampling).output_ids
                         == ids(pair, name, PROMPTS[0], tokens, sampling).output_ids)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device here")
    rows = check(args.device, args.tokens)
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device
    print(f"device: {name}, torch {torch.__version__}, {args.tokens} tokens, "
          f"{len(KINDS) * 2 * len(PROMPTS)} runs per strategy and dtype")
    print(f"{'strategy':10s} {'fp32 exact':>10s} {'bf16 exact':>10s} {'bf16 first div.':>16s} {'seeded':>6s} "
          f"{'draft ms':>8s} {'verify ms':>9s}")
    ok = True
    for strategy, r in rows.items():
        div = ",".join(str(d) for d in r["bf16_first_divergence"][:4]) or "-"
        print(f"{strategy:10s} {r['fp32_exact']:>5d}/{r['runs']:<4d} {r['bf16_exact']:>5d}/{r['runs']:<4d} "
              f"{div:>16s} {str(r['seeded']):>6s} {1e3 * statistics.median(r['draft_s'] or [0]):8.2f} "
              f"{1e3 * statistics.median(r['verify_s'] or [0]):9.2f}")
        ok &= r["fp32_exact"] == r["runs"] and r["seeded"]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
