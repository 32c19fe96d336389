"""Lab probe behind docs/experiments/2026-11-28-second-start.md: where a warm start's seconds go, in one process.

The app's own calls in the app's order, without the page's launch: imports, `load_pair` as the app asks it (its
progress messages and each model's load and `make_whole` timestamped), the captured steps, the warm-up, then one run
as the page's Run starts it (DynaTree, `auto`, 48 tokens, the first code prompt): its first iteration and its end.
Seconds from the process start. Run it on a cache where everything was built (a second start):

    TREEVIZ_CACHE=DIR python -m scripts.lab.start_phases [--profile]

--profile prints cProfile's top calls inside each model's `make_whole`.
"""
import sys
import time

T0 = time.perf_counter()


def stamp(what: str) -> None:
    print(f"{time.perf_counter() - T0:6.2f}  {what}", flush=True)


import torch  # noqa: E402

stamp("torch imported")
import gradio  # noqa: E402,F401 - the page's import, timed where the app pays it

stamp("gradio imported")
from treeviz.page.ui import build_demo  # noqa: E402,F401

stamp("the page and the engine imported")
from engine.core.prompts import load_prompt_set  # noqa: E402
from engine.cpu.packages import missing, prepare_capture  # noqa: E402
import engine.models.loading as loading  # noqa: E402
from engine.recipe import RunSpec, start_run  # noqa: E402
from treeviz.serving.pairs import split_pair, warm_up  # noqa: E402


def timed(fn, label):
    """`fn`, stamping how long each call took (with cProfile's top calls under --profile)."""
    def call(*args, **kwargs):
        started = time.perf_counter()
        profile = None
        if "--profile" in sys.argv:
            import cProfile
            profile = cProfile.Profile()
            profile.enable()
        out = fn(*args, **kwargs)
        if profile is not None:
            import pstats
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(8)
        stamp(f"  {label(args, kwargs)}: {time.perf_counter() - started:.2f} s")
        return out
    return call


def params(model) -> str:
    return f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters"


loading.make_whole = timed(loading.make_whole, lambda a, k: f"make_whole, {params(a[0])}")
loading.load_model = timed(loading.load_model, lambda a, k: f"load_model {k.get('role')}")
target, draft = split_pair("default")
pair = loading.load_pair(target, draft, progress=lambda f=0.0, m="": stamp(f"  load: {m[:140]}"),
                         draft_quant="auto", draft_vocab="auto", capture="auto")
stamp("load_pair done")
if pair.capture == "aoti" and not missing(pair):
    prepare_capture(pair, None, build_missing=False)
stamp("captured steps loaded")
warm_up("default", pair)
stamp("warm-up done")
prompt = next(p["prompt"] for p in load_prompt_set("code") if isinstance(p["prompt"], str))
run = start_run(pair, RunSpec(pair="default", prompt=prompt, strategy="dynatree", preset="auto",
                              max_new_tokens=48))
steps = iter(run)
next(steps)
stamp("the run's first iteration")
for _ in steps:
    pass
metrics = run.result.metrics
stamp(f"run done: {len(run.result.prompt_ids)} prompt tokens, time to first token {metrics.ttft_s:.2f} s")
