"""The serving room on its own: it imports and serves a Run with gradio unimportable (the GPU machine has none); a pair
that fails to load leaves the working one serving; and what each request asks ZeroGPU for, exactly, with spaces' own
multiplier of the card read from the installed package."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from importlib.resources import files
from pathlib import Path

import pytest

from engine.recipe import WARM_UP_TOKENS, RunSpec
from treeviz.serving import gpu, work
from treeviz.serving.errors import UserError
from treeviz.serving.pairs import PairManager

ROOT = Path(__file__).resolve().parent.parent

WITHOUT_GRADIO = r'''
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("gradio", "gradio_client", "plotly"):
            raise ImportError(f"{name} is blocked: the room must not need it")
sys.meta_path.insert(0, Blocked())
from engine.recipe import RunSpec
from treeviz.serving.events import BaselineMeasured, Finished
from treeviz.serving.server import SERVER
from treeviz.serving.work import decode_events
SERVER.pairs.load("tiny-random")
spec = RunSpec(pair="tiny-random", prompt="def f(n):\n", strategy="linear", max_new_tokens=8)
events = list(SERVER.open("no-gradio", "run").events("go", spec.pair, decode_events, spec, baseline_for=spec))
assert isinstance(events[-1], (Finished, BaselineMeasured)), events[-1]
assert len(SERVER.ar_cache) == 1
print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] in ("gradio", "plotly")))
'''


def test_the_serving_room_runs_without_gradio():
    done = subprocess.run([sys.executable, "-c", WITHOUT_GRADIO], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded: []" in done.stdout


def test_a_failed_load_keeps_the_working_pair():
    manager = PairManager(capture="off")
    manager.load("tiny-random")
    pair = manager.held("tiny-random")
    manager.request("shape:no-such-model + shape:no-such-draft")
    deadline = time.monotonic() + 60
    while manager.status().loading and time.monotonic() < deadline:
        time.sleep(0.05)
    status = manager.status()
    assert "Unknown model shape 'no-such-model'" in status.error
    assert manager.held("tiny-random") is pair and status.loaded == "tiny-random"
    manager.request("tiny-random")  # back to it: served at once, nothing reloaded
    assert manager.ready("tiny-random", timeout=0) is pair and manager.status().error is None


def test_a_pinned_manager_refuses_other_pairs_in_words():
    manager = PairManager(capture="off")
    manager.load("tiny-random")
    manager.pin()
    with pytest.raises(UserError, match=r"serves only the model pair it loaded at start \(tiny-random\)"):
        manager.request("tiny-random-identical")
    assert manager.held("tiny-random") is not None and manager.status().loading is False


def test_a_precision_rides_in_the_pair_name_and_loads_that_dtype():
    """"tiny-random (fp32)" loads the pair in float32 on every CPU class; auto is the engine's own choice."""
    from treeviz.serving.pairs import auto_dtype_name, split_precision, with_precision
    assert split_precision("default (fp32)") == ("default", "fp32")
    assert split_precision(" a/b + c/d (fp32) ") == ("a/b + c/d", "fp32")
    assert split_precision("default") == ("default", "auto")
    assert with_precision("default (fp32)", "auto") == "default"
    fp32_is_auto = auto_dtype_name() == "float32"
    assert with_precision("default", "fp32") == ("default" if fp32_is_auto else "default (fp32)")
    with pytest.raises(UserError, match="precision must be one of auto, fp32"):
        with_precision("default", "int3")
    manager = PairManager(capture="off")
    manager.load("tiny-random (fp32)")
    assert str(manager.held("tiny-random (fp32)").dtype) == "torch.float32"
    manager.load("tiny-random")
    assert str(manager.held("tiny-random").dtype) == f"torch.{auto_dtype_name()}"
    manager.pin()
    with pytest.raises(UserError, match="serves only the model pair it loaded at start"):
        manager.request("tiny-random (fp32)")  # ZeroGPU: another precision is another load, refused in words


def test_each_request_asks_for_its_tokens_at_the_stated_cost(monkeypatch):
    """10 s + 1.5 x 2 steps x 40 ms per token decoded (no table applies to an eager pair), spaces' factor on top."""
    monkeypatch.setattr(gpu, "duration_factor", lambda: 1.0)
    monkeypatch.setattr(work, "duration_factor", lambda: 1.0)
    spec = RunSpec(pair="tiny-random", prompt="x", strategy="dynatree", max_new_tokens=48)
    ticket = work.Ticket("k", 0, 0)
    assert work.run_seconds(spec, ticket) == 22  # 96 tokens: the run and AR: 10 + 0.12 x 96 = 21.52
    assert work.compare_seconds(spec, ["linear", "dynatree"], ticket) == 28  # 144 tokens
    assert work.race_seconds([("AR", spec), ("dynatree", spec)], ticket) == 24  # 2 x (48 + 8 warm-up)
    assert WARM_UP_TOKENS == 8
    assert work.sweep_seconds(spec, [4, 8, 16], ticket) == 34  # 4 runs of 48
    monkeypatch.setattr(work, "duration_factor", lambda: 1.5)  # the Blackwell card: spaces asks 1.5x
    assert work.gpu_seconds("tiny-random", 583) == 80  # 80 x 1.5 = 120: the most one request asks
    with pytest.raises(UserError, match="about 122 s of GPU time; one request may ask for at most 120 s"):
        work.gpu_seconds("tiny-random", 584)  # 81 x 1.5


def test_spaces_factor_is_the_installed_packages():
    """configs.json of the installed spaces: 1.0 on the H200, 1.5 on the RTX PRO 6000 Blackwell; this machine has
    no NVIDIA driver, so spaces takes its default, the H200."""
    configs = {c["model"]: c["duration_factor"] for c in json.loads(files("spaces.zero").joinpath(
        "configs.json").read_text())}
    assert configs == {"NVIDIA H200": 1.0, "NVIDIA RTX PRO 6000 Blackwell Server Edition": 1.5}
    assert gpu.duration_factor() == 1.0
