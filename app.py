"""treeviz: a live explorer of speculative decoding draft trees (Gradio + Plotly).

    python app.py                       # offline default pair (Qwen2.5-Coder 1.5B + 0.5B), loads in the background
    python app.py --pair tiny-random    # tiny random models: instant, for play and tests
    python app.py --port 7860 --host 0.0.0.0

TREEVIZ_PAIR=tiny-random works like --pair. The gallery traces and trace uploads work before any model loads.
On a ZeroGPU Space (SPACES_ZERO_GPU set) the pair is loaded at import time and placed on `cuda`, as ZeroGPU requires;
decoding then runs inside `spaces.GPU` (treeviz/serving/work.py).
"""
from __future__ import annotations

from treeviz.serving.gpu import on_zero_gpu  # first: on a Space, `spaces` must be imported before torch

import argparse
import logging
import os

from treeviz.serving.pairs import GPU_PRESET
from treeviz.serving.server import SERVER


def parse_args(argv=None):
    default_pair = GPU_PRESET if on_zero_gpu() else "default"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default=os.environ.get("TREEVIZ_PAIR", default_pair),
                        help="model pair to load first: default, tiny-random, or 'target + draft' hub ids")
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    parser.add_argument("--no-preload", action="store_true", help="load the models only when a run needs them")
    parser.add_argument("--capture", default=os.environ.get("TREEVIZ_CAPTURE", "auto"), choices=("auto", "on", "off"),
                        help="captured steps (docs/capture.md): on a CPU, the models' forwards compiled ahead of time "
                             "once per machine, in the background on the first start (runs decode eagerly until "
                             "they are ready); off: always eager")
    return parser.parse_args(argv)


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    SERVER.pairs.capture_mode = args.capture
    if on_zero_gpu():  # ZeroGPU moves what is on `cuda` at startup into each GPU worker: load before launching,
        SERVER.pairs.load(args.pair, device="cuda")  # on this (the main) thread, the only one ZeroGPU emulates CUDA for
        SERVER.pairs.pin()  # and serve that pair alone: another could only load on another thread
        if SERVER.pairs.error:
            logging.getLogger("treeviz").error("the start pair did not load: %s", SERVER.pairs.error)
    preload = not args.no_preload and not on_zero_gpu()
    if preload:  # before the page's imports: gradio's seconds of imports overlap the load, the critical path of a
        SERVER.pairs.request(args.pair)  # warm start (docs/experiments/2026-11-29-warm-start.md)
    from treeviz.page.ui import build_demo, launch_kwargs  # imported here: once the load is under way

    demo = build_demo(initial_pair=args.pair, load_on_start=preload)
    demo.queue(default_concurrency_limit=4)
    demo.launch(server_name=args.host, server_port=args.port, **launch_kwargs())


if __name__ == "__main__":
    main()
