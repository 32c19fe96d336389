"""How much of a tree iteration is the engine's own host work: everything outside the models' steps calls.

    python -m scripts.host_time                       # tiny identical pair, DynaTree at ~16 nodes, captured and eager
    python -m scripts.host_time --strategy fixed --budget 16 --iterations 200 --json host.json

Two measurements on the tiny identical pair (its draft accepts everything, so trees stay at their budget):
  stubbed   the model steps replaced by a lookup of fixed logits (a forward costs ~10 us): an iteration's wall time
            (`times.total`: drafting through commit, the record's light part and the cost model included) is
            then the engine's own host work;
  in situ   the real steps, captured and eager: the iteration's wall time minus the wall time of every steps call it
            made (forward with its input staging, keep); what remains also holds the draft's softmax and top-k on
            real tensors.
Medians over the iterations after a warm-up run. The record's reader-only part (`complete`) runs after the
iteration's clock stops and is reported apart.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.core.steps import DynamicSteps, StaticSteps
from engine.cpu.packages import prepare_capture
from engine.decoder import Decoder, DecodeRun
from engine.models import tiny_random_pair
from engine.models.loading import calibrate_pair
from engine.strategies import make_strategy

PROMPT = "the host's share of a tree iteration, measured on a pair whose forwards cost almost nothing: "


class Clock:
    """Wraps methods (class, name) so that the seconds spent inside them add up in `seconds[name]`."""

    def __init__(self, methods):
        self.methods, self.seconds, self.originals = methods, {}, {}

    def __enter__(self):
        for cls, name in self.methods:
            original = getattr(cls, name)
            self.originals[(cls, name)] = original
            setattr(cls, name, self._timed(name, original))
        return self

    def _timed(self, name, original):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return timed

    def __exit__(self, *exc):
        for (cls, name), original in self.originals.items():
            setattr(cls, name, original)

    def inside(self, *names) -> float:
        return sum(self.seconds.get(n, 0.0) for n in names)


STEPS = [(cls, name) for cls in (StaticSteps, DynamicSteps) for name in ("forward", "keep")]


def measure(pair, strategy: str, params: dict, iterations: int, capture: str) -> dict:
    decoder = Decoder(pair, make_strategy(strategy, "cpu", **params), capture=capture)
    decoder.generate(PROMPT, max_new_tokens=16, stop_on_eos=False)  # warm-up
    host, total, nodes, complete = [], [], [], []
    run = decoder.run(PROMPT, max_new_tokens=iterations * 4, stop_on_eos=False)
    with Clock(STEPS + [(DecodeRun, "complete")]) as clock:
        steps, done = 0.0, 0.0
        for record in run:
            total.append(record.times.total)
            host.append(record.times.total - (clock.inside("forward", "keep") - steps))
            complete.append(clock.inside("complete") - done)
            nodes.append(len(record.nodes) - 1)
            steps, done = clock.inside("forward", "keep"), clock.inside("complete")
            if len(total) >= iterations:
                break
    ms = lambda values: 1e3 * statistics.median(values)  # noqa: E731
    return {"capture": decoder.steps_label(), "iterations": len(total), "median_nodes": statistics.median(nodes),
            "median_iteration_ms": ms(total), "median_host_ms": ms(host), "median_complete_ms": ms(complete)}


class Stubbed:
    """DynamicSteps whose forward returns fixed logits (a row per token id) and whose cache is only a length."""

    def __init__(self, width: int):
        self.bank = torch.randn(64, width, generator=torch.Generator().manual_seed(0)) * 4
        self.originals = {}

    def __enter__(self):
        bank = self.bank

        def forward(steps, tokens, positions, visible=None, last=0):
            steps.stub_length = getattr(steps, "stub_length", 0) + len(tokens)
            out = bank[torch.tensor(tokens) % len(bank)]
            return out[len(tokens) - last:] if last else out

        def keep(steps, start, rows):
            steps.stub_length = start + len(rows)

        for name, value in (("forward", forward), ("keep", keep),
                            ("length", property(lambda steps: getattr(steps, "stub_length", 0)))):
            self.originals[name] = DynamicSteps.__dict__[name]
            setattr(DynamicSteps, name, value)
        return self

    def __exit__(self, *exc):
        for name, value in self.originals.items():
            setattr(DynamicSteps, name, value)


def stubbed(pair, strategy: str, params: dict, iterations: int) -> dict:
    with Stubbed(pair.target.config.vocab_size):
        return measure(pair, strategy, params, iterations, "off")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="dynatree")
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny models: extra threads only add contention
    pair = tiny_random_pair("identical", dtype=torch.float32, capture="auto")
    pair.costs = calibrate_pair(pair)
    prepare_capture(pair)
    params = {"budget": args.budget}
    if args.strategy == "dynatree":
        params.update(tau=0.0, rho_stop=0.0, history=False)  # an identical draft: keep the tree at its budget
    stub = stubbed(pair, args.strategy, params, args.iterations)
    print(f"{args.strategy}, model steps stubbed: {stub['median_nodes']:.0f} nodes, host work per iteration "
          f"{stub['median_iteration_ms']:.3f} ms (the record's reader-only part after the clock "
          f"{stub['median_complete_ms']:.3f} ms)")
    rows = [measure(pair, args.strategy, params, args.iterations, capture) for capture in ("auto", "off")]
    for row in rows:
        print(f"{args.strategy} ({row['capture']}): {row['median_nodes']:.0f} nodes, iteration "
              f"{row['median_iteration_ms']:.3f} ms, host outside the steps {row['median_host_ms']:.3f} ms; the "
              f"record's reader-only part after the clock {row['median_complete_ms']:.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"strategy": args.strategy, "params": params, "stubbed": stub,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
