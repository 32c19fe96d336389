"""TALF (engine/training/talf.py) against plain distillation, at this machine's scale; and a LoRA run on the real draft.

    python -m scripts.train_talf tiny --out runs/talf      # small models trained here: OUT/talf.md + OUT/talf.html
    python -m scripts.train_talf lora --minutes 5 --out ~/talf-lora   # LoRA (peft) on the default pair's 0.5B draft

`tiny`: a 4-layer target (hidden 128) learns byte-level text from the Python install (pydoc topics + stdlib
sources; every 10th file is held out), then a 2-layer draft (hidden 64) learns the same text briefly. From that
shared start the draft is trained for the same number of steps on the same target sequences (real-text prompt +
the target's greedy continuation) either by TALF (target beam trees, k = 4, depth 3) or by plain token-level
distillation (depth 1: the sequence only). A TALF step reads (1 + (depth-1)k) times the rows of a plain step, so
--equal-rows adds plain distillation trained for that many times the steps (equal compute). Each trained draft then
decodes held-out prompts with the project's Decoder (greedy, fp32) under DynaTree, SALF and EAGLE-2 trees (cpu
presets); L-bar = committed tokens per target pass, pooled over the prompts.

`lora`: the default target (bf16) labels short sequences of the same training text with beam trees during at most
the first 40 % of --minutes (at least one sequence), then a LoRA adapter (peft, rank 16 on every attention and MLP
projection) on the fp32 0.5B draft is trained with TALF, cycling over them, until --minutes of wall time are spent
(the step in progress is finished), and saved with peft's save_pretrained to --out, which must lie outside the repo.
--resume PATH continues an earlier adapter instead of starting one (give another --seed for other sequences); the
saved talf_run.json keeps every run's steps and wall time, so a budget spread over several sittings adds up.
Load it as a draft with engine.training.talf.load_adapter(draft, PATH) before kernel preparation.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import sys
import time
from pathlib import Path


import torch

from engine.core import kv
from engine.models import ModelPair, tiny_config, tiny_random_model, tiny_tokenizer
from engine.models.vocab import corpus_files
from engine.recipe import RunSpec, generate
from engine.training.talf import add_lora, load_adapter, target_tree_batch, tree_loss

EVAL_STRATEGIES = ("dynatree", "salf", "eagle2")


# -- text ---------------------------------------------------------------------------------------------------------
def corpus_text(held_out: bool, max_chars: int) -> str:
    """Train text: files whose index is not a multiple of 10; held-out text: the others. Never mixed."""
    parts, total = [], 0
    for i, path in enumerate(corpus_files()):
        if (i % 10 == 0) != held_out:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "\n".join(parts)[:max_chars]


def windows(data: torch.Tensor, n: int, length: int, rng: random.Random) -> torch.Tensor:
    starts = [rng.randrange(0, len(data) - length) for _ in range(n)]
    return torch.stack([data[s:s + length] for s in starts])


def train_on_text(model, data: torch.Tensor, steps: int, batch: int, length: int, lr: float, seed: int) -> float:
    """Next-token training on random windows of `data`; returns the mean loss of the last 20 steps."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        x = windows(data, batch, length + 1, rng)
        loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss  # transformers shifts the labels itself
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    tail = losses[-20:]
    return sum(tail) / len(tail)


@torch.no_grad()
def greedy_continue(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[B, P] -> [B, P + new_tokens]: the model's greedy continuation, batched, with a KV cache."""
    cache = kv.new_cache(model)
    out = model(input_ids=prompts, past_key_values=cache, use_cache=True)
    seqs = [prompts]
    for _ in range(new_tokens):
        token = out.logits[:, -1:].argmax(-1)
        seqs.append(token)
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
    return torch.cat(seqs, dim=1)


# -- draft training -----------------------------------------------------------------------------------------------
def train_draft(draft, batches, steps: int, lr: float) -> list[float]:
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    draft.train()
    losses = []
    for step in range(steps):
        loss = tree_loss(draft, batches[step % len(batches)])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    draft.eval()
    return losses


def held_out_loss(draft, batches) -> float:
    with torch.no_grad():
        return sum(tree_loss(draft, b).item() for b in batches) / len(batches)


def tree_acceptance(target, draft, tokenizer, prompts: list[str], tokens: int) -> dict[str, float]:
    """L-bar per strategy (cpu preset, greedy, fp32): committed tokens / target passes over all prompts."""
    pair = ModelPair(target, draft, tokenizer, torch.device("cpu"), torch.float32, "tiny text target", "tiny draft")
    out = {}
    for name in EVAL_STRATEGIES:
        committed = iterations = 0
        for prompt in prompts:
            result = generate(pair, RunSpec(pair=pair.target_name, prompt=prompt, strategy=name, preset="cpu",
                                            max_new_tokens=tokens, stop_on_eos=False))
            committed += sum(it.committed for it in result.iterations)
            iterations += len(result.iterations)
        out[name] = committed / iterations
    return out


# -- tiny: TALF vs plain distillation -----------------------------------------------------------------------------
def tiny(args) -> int:
    t0 = time.perf_counter()
    # Tiny models are all per-call overhead: on a shared CPU a second thread mostly adds contention.
    torch.set_num_threads(args.threads)
    tokenizer = tiny_tokenizer()

    def encode(text: str) -> torch.Tensor:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    train, held = encode(corpus_text(False, args.train_chars)), encode(corpus_text(True, args.train_chars // 4))
    target_config = tiny_config(num_layers=args.target_layers, hidden_size=128, intermediate_size=384)
    target = tiny_random_model(0, config=target_config)
    target_loss = train_on_text(target, train, args.target_steps, 16, 64, 3e-3, seed=0)
    print(f"target: {args.target_layers} layers, text loss {target_loss:.3f} nats/byte "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)

    rng = random.Random(1)
    half = args.seq_len // 2
    seqs = greedy_continue(target, windows(train, args.sequences, half, rng), args.seq_len - half)
    held_seqs = greedy_continue(target, windows(held, 8, half, rng), args.seq_len - half)
    chunks = seqs.split(args.batch)
    talf_batches = [target_tree_batch(target, c, k=args.k, depth=args.depth) for c in chunks]
    plain_batches = [target_tree_batch(target, c, k=args.k, depth=1) for c in chunks]
    held_talf = [target_tree_batch(target, held_seqs, k=args.k, depth=args.depth)]
    held_plain = [target_tree_batch(target, held_seqs, k=args.k, depth=1)]
    print(f"labelled {len(seqs)} sequences of {args.seq_len} tokens: {talf_batches[0].input_ids.shape[1]} rows each "
          f"under TALF ({time.perf_counter() - t0:.0f} s)", flush=True)
    prompts = [held[s:s + args.prompt_bytes].numpy().tobytes().decode("utf-8", "replace")
               for s in random.Random(2).sample(range(len(held) - args.prompt_bytes), args.prompts)]

    # TALF's step reads T rows per sequence, plain distillation's L: a third draft gets plain distillation with as
    # many rows in all (more steps over the same sequences), so equal compute is compared too, not only equal steps.
    ratio = talf_batches[0].input_ids.shape[1] // args.seq_len
    runs = [("plain distillation", plain_batches, args.steps), ("TALF", talf_batches, args.steps)]
    if args.equal_rows:
        runs.insert(1, (f"plain distillation, {ratio}x steps", plain_batches, args.steps * ratio))
    rows = []
    for seed in range(args.seeds):
        start = tiny_random_model(100 + seed, config=tiny_config(num_layers=2))
        train_on_text(start, train, args.draft_pretrain, 16, 64, 3e-3, seed=100 + seed)
        drafts = {"text only (start)": start}
        for label, batches, steps in runs:
            draft = copy.deepcopy(start)
            torch.manual_seed(seed)
            train_draft(draft, batches, steps, args.lr)
            drafts[label] = draft
            print(f"seed {seed}: {label} trained ({time.perf_counter() - t0:.0f} s)", flush=True)
        for label, draft in drafts.items():
            row = {"seed": seed, "draft": label, "plain_loss": held_out_loss(draft, held_plain),
                   "tree_loss": held_out_loss(draft, held_talf),
                   **tree_acceptance(target, draft, tokenizer, prompts, args.tokens)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    seconds = time.perf_counter() - t0
    write_tiny_report(args, rows, target_loss, seconds)
    return 0


def write_tiny_report(args, rows, target_loss: float, seconds: float) -> None:
    import plotly.graph_objects as go
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    labels = list(dict.fromkeys(r["draft"] for r in rows))
    keys = [("plain_loss", "held-out seq CE"), ("tree_loss", "held-out tree CE")] + [(s, f"L̄ {s}")
                                                                                      for s in EVAL_STRATEGIES]

    def mean_std(label, key):
        vals = [r[key] for r in rows if r["draft"] == label]
        mean = sum(vals) / len(vals)
        return mean, (sum((v - mean) ** 2 for v in vals) / max(1, len(vals) - 1)) ** 0.5

    head = "| draft | " + " | ".join(t for _, t in keys) + " |\n|" + "---|" * (len(keys) + 1)
    body = ["| " + label + " | " + " | ".join("{:.3f} ± {:.3f}".format(*mean_std(label, k)) for k, _ in keys) + " |"
            for label in labels]
    per_seed = ["| " + f"{r['seed']} | {r['draft']} | " + " | ".join(f"{r[k]:.3f}" for k, _ in keys) + " |"
                for r in rows]
    settings = (f"`python -m scripts.train_talf tiny {' '.join(sys.argv[2:])}`\n\n"
                f"target {args.target_layers} layers (hidden 128), text loss {target_loss:.3f} nats/byte after "
                f"{args.target_steps} steps; draft 2 layers (hidden 64), {args.draft_pretrain} text steps, then "
                f"{args.steps} steps (lr {args.lr}, batches of {args.batch}) on {args.sequences} target sequences of "
                f"{args.seq_len} tokens (real-text prompt of {args.seq_len // 2} + greedy continuation); "
                f"TALF k = {args.k}, depth {args.depth}; {args.seeds} seeds (mean ± std); {args.prompts} held-out "
                f"prompts of {args.prompt_bytes} bytes, {args.tokens} new tokens, greedy fp32, cpu presets; "
                f"{seconds:.0f} s in all.\n\n")
    text = ("# TALF vs plain distillation (tiny models trained here)\n\n" + settings + head + "\n" + "\n".join(body)
            + "\n\n## per seed\n\n| seed | draft | " + " | ".join(t for _, t in keys) + " |\n|"
            + "---|" * (len(keys) + 2) + "\n" + "\n".join(per_seed) + "\n")
    (out / "talf.md").write_text(text)
    fig = go.Figure([go.Bar(name=label, x=[s for s in EVAL_STRATEGIES],
                            y=[mean_std(label, s)[0] for s in EVAL_STRATEGIES],
                            error_y=dict(type="data", array=[mean_std(label, s)[1] for s in EVAL_STRATEGIES]))
                     for label in labels])
    fig.update_layout(title="Tree acceptance length L̄ on held-out text: TALF vs plain distillation (tiny models)",
                      barmode="group", template="plotly_white", yaxis_title="L̄ (tokens / target pass)")
    fig.write_html(out / "talf.html", include_plotlyjs=True)
    print(f"wrote {out / 'talf.md'} and {out / 'talf.html'}")


# -- lora: the real draft -----------------------------------------------------------------------------------------
def lora(args) -> int:
    from engine.models import load_model
    t0 = time.perf_counter()
    deadline = t0 + args.minutes * 60
    out = Path(args.out).expanduser().resolve()
    repo = Path(__file__).resolve().parent.parent
    if out == repo or repo in out.parents:
        print(f"--out {out} is inside the repository; save adapters outside it (e.g. ~/talf-lora)")
        return 2
    target, tokenizer, target_name = load_model("default-target", dtype=args.target_dtype, device="cpu")
    draft, _, draft_name = load_model("default-draft", dtype="fp32", device="cpu", role="draft",
                                      tokenizer=tokenizer)
    print(f"loaded {target_name} and {draft_name} ({time.perf_counter() - t0:.0f} s)", flush=True)
    ids = tokenizer(corpus_text(False, 400_000), add_special_tokens=False)["input_ids"]
    data = torch.tensor(ids, dtype=torch.long)
    rng = random.Random(args.seed)
    batches = []
    while len(batches) < args.sequences and time.perf_counter() < t0 + args.minutes * 60 * 0.4:
        t = time.perf_counter()
        batches.append(target_tree_batch(target, windows(data, 1, args.seq_len, rng), k=args.k, depth=args.depth))
        print(f"labelled sequence {len(batches)}: {batches[-1].input_ids.shape[1]} rows in "
              f"{time.perf_counter() - t:.1f} s", flush=True)
    del target  # free its memory before the draft's training activations
    gc.collect()
    model, earlier = with_adapter(draft, args)
    model.print_trainable_parameters()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    step = 0
    while step == 0 or time.perf_counter() < deadline:
        t = time.perf_counter()
        loss = tree_loss(model, batches[step % len(batches)])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        print(f"step {step}: TALF loss {loss.item():.4f} ({time.perf_counter() - t:.1f} s)", flush=True)
    model.save_pretrained(str(out))
    run = {"base": draft_name, "target": target_name, "steps": step, "sequences": len(batches),
           "seq_len": args.seq_len, "k": args.k, "depth": args.depth, "rank": args.rank, "lr": args.lr,
           "seed": args.seed, "wall_s": round(time.perf_counter() - t0, 1)}
    runs = earlier + [run]
    (out / "talf_run.json").write_text(json.dumps({
        **run, "runs": runs, "total_steps": sum(r["steps"] for r in runs),
        "total_wall_s": round(sum(r["wall_s"] for r in runs), 1)}, indent=1))
    print(f"saved the adapter to {out} after {step} steps, {time.perf_counter() - t0:.0f} s in all "
          f"({len(runs)} run(s), {sum(r['steps'] for r in runs)} steps); load it with "
          f"engine.training.talf.load_adapter(draft, {str(out)!r})")
    return 0


def with_adapter(draft, args):
    """A fresh LoRA on the draft, or (--resume) the saved adapter made trainable again, with its earlier runs."""
    if not args.resume:
        return add_lora(draft, rank=args.rank), []
    folder = Path(args.resume).expanduser()
    model = load_adapter(draft, folder, merge=False, trainable=True)
    record = folder / "talf_run.json"
    info = json.loads(record.read_text()) if record.is_file() else {}
    earlier = info.get("runs") or ([info] if info else [])  # a record from before --resume existed: one run
    args.rank = model.peft_config["default"].r  # the adapter's rank, whatever --rank says
    return model, earlier


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tiny", help="TALF vs plain distillation on small models trained here")
    t.add_argument("--out", required=True, help="folder for talf.md and talf.html")
    t.add_argument("--seeds", type=int, default=3)
    t.add_argument("--steps", type=int, default=120, help="draft training steps, equal for both methods")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--equal-rows", action="store_true",
                   help="also train plain distillation for as many rows as TALF reads (more steps)")
    t.add_argument("--threads", type=int, default=1, help="torch threads (tiny models gain nothing from more)")
    t.add_argument("--k", type=int, default=4)
    t.add_argument("--depth", type=int, default=3)
    t.add_argument("--target-layers", type=int, default=4, choices=range(4, 7))
    t.add_argument("--target-steps", type=int, default=300)
    t.add_argument("--draft-pretrain", type=int, default=50, help="text steps of the draft before either method")
    t.add_argument("--train-chars", type=int, default=2_000_000)
    t.add_argument("--sequences", type=int, default=32)
    t.add_argument("--seq-len", type=int, default=64)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--prompts", type=int, default=6)
    t.add_argument("--prompt-bytes", type=int, default=64)
    t.add_argument("--tokens", type=int, default=40)
    r = sub.add_parser("lora", help="a LoRA adapter on the default pair's 0.5B draft, trained with TALF")
    r.add_argument("--out", required=True, help="adapter folder, outside the repository")
    r.add_argument("--minutes", type=float, required=True, help="wall-time budget, labelling included")
    r.add_argument("--sequences", type=int, default=4)
    r.add_argument("--seq-len", type=int, default=32)
    r.add_argument("--k", type=int, default=4)
    r.add_argument("--depth", type=int, default=3)
    r.add_argument("--rank", type=int, default=16)
    r.add_argument("--lr", type=float, default=2e-4)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--target-dtype", default="bf16", help="dtype the target labels in (the draft trains in fp32)")
    r.add_argument("--resume", help="an adapter folder from an earlier run: keep training it (new sequences, labelled "
                   "with --seed; a fresh optimiser) and save to --out, its talf_run.json listing every run")
    args = ap.parse_args(argv)
    if getattr(args, "minutes", 1) <= 0:
        ap.error("--minutes must be positive")
    return tiny(args) if args.command == "tiny" else lora(args)


if __name__ == "__main__":
    raise SystemExit(main())
