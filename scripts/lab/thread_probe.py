"""Lab probe behind docs/experiments/design-measurements.md and 2026-11-25-compare-threads-labels.md.

How much slower torch's CPU kernels run on a second thread once the main thread has run parallel work.

GNU OpenMP keeps one pool of worker threads per thread that starts parallel work; with two pools on a small machine
it stops spinning idle workers, and every parallel region wakes them from sleep (treeviz/serving/compute_thread.py says
why the app therefore does all its model work on one thread). This prints the time of a one-row and an 8-row linear of
the default draft's MLP shape in three places: a first thread (before the main thread has run any parallel work),
the main thread, and a thread started after that. With --pair it also decodes one prompt on the main thread and on a
second thread, alternately.

    python -m scripts.lab.thread_probe
    python -m scripts.lab.thread_probe --pair default --strategy dynatree --max-new-tokens 48
"""
from __future__ import annotations

import argparse
import threading
import time

import torch

SHAPE = (4864, 896)  # the 0.5B draft's MLP up-projection: out, in features


def per_call_ms(fn, calls: int = 300) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def linear_times(tag: str) -> None:
    weight = torch.randn(*SHAPE, dtype=torch.bfloat16)
    with torch.inference_mode():
        for rows in (1, 8):
            x = torch.randn(rows, SHAPE[1], dtype=torch.bfloat16)
            best = min(per_call_ms(lambda: torch.nn.functional.linear(x, weight)) for _ in range(3))
            print(f"{tag:34s} {rows} row{'s' if rows > 1 else ' '}  {best:.3f} ms", flush=True)


def on_thread(fn, *args):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn(*args)))
    thread.start()
    thread.join()
    return out.get("value")


def decode_rate(pair, spec) -> float:
    from engine.recipe import generate
    start = time.perf_counter()
    result = generate(pair, spec)
    return result.metrics.new_tokens / (time.perf_counter() - start)


def decode_times(name: str, strategy: str, max_new_tokens: int, rounds: int) -> None:
    from engine.core.prompts import load_prompt_set
    from engine.recipe import RunSpec
    from treeviz.serving.pairs import PairManager
    manager = PairManager()
    manager.load(name)
    pair = manager.ready(name)
    spec = RunSpec(pair=name, prompt=load_prompt_set("code")[0]["prompt"], strategy=strategy,
                   max_new_tokens=max_new_tokens)
    decode_rate(pair, spec.warm_up())
    for r in range(rounds):
        main, second = decode_rate(pair, spec), on_thread(decode_rate, pair, spec)
        print(f"{strategy} round {r}: main thread {main:.2f} tokens/s, second thread {second:.2f} tokens/s",
              flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", help="also decode a code prompt on this pair, main thread against a second one")
    parser.add_argument("--strategy", default="dynatree")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    on_thread(linear_times, "first thread (main not yet parallel)")
    linear_times("main thread")
    on_thread(linear_times, "a thread started after")
    if args.pair:
        decode_times(args.pair, args.strategy, args.max_new_tokens, args.rounds)


if __name__ == "__main__":
    main()
