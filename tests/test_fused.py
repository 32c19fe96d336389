"""The fused step (engine/cuda/fused.py) computes what transformers' forward computes, through the production path
(StaticSteps with the step installed), on tiny random models in fp32 of each covered family.

Exactness is judged against float64's answer (tests/rounding.py): fused GEMMs and the folded attention sum in another
order, so the fused path must be as accurate as transformers' own path on this machine's kernels. Greedy decoding,
which reads only argmax, must then give AR's tokens for every strategy.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from engine.core.steps import DynamicSteps, StaticSteps, capacity
from engine.cuda import fused
from engine.models import tiny_config, tiny_random_model
from engine.strategies import STRATEGIES
from rounding import assert_as_accurate, assert_caught
from test_static_steps import PROMPT, LeakySteps, run_iterations


def randomised(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Every parameter random (biases and norms too: a fused bias or norm that is dropped must show)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 + 0.1 * torch.randn(p.shape, generator=g)) if "norm" in name
                    else 0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def family_model(family: str) -> torch.nn.Module:
    """A two-layer model of `family` with grouped-query heads (4 query heads per key/value head)."""
    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=512)
    if family == "qwen2":
        model = tiny_random_model(0, config=tiny_config(**{k: v for k, v in shape.items() if k != "num_hidden_layers"},
                                                         num_layers=2))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=16, attn_implementation="sdpa"))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa"))
    return randomised(model)


def fused_run(model, compiled: bool = False, steps_cls=StaticSteps):
    fused.install(model, compiled=compiled)
    try:
        return run_iterations(steps_cls(model, capacity(len(PROMPT), 40, 8), (1, 2, 4, 8)))[0]
    finally:
        fused.uninstall(model)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_fused_step_is_as_accurate_as_transformers(family):
    model = family_model(family)
    reference = run_iterations(DynamicSteps(model))[0]
    exact = run_iterations(DynamicSteps(copy.deepcopy(model).double()))[0]
    got = fused_run(model)
    bound = assert_as_accurate(got, reference, exact, reduction=model.config.intermediate_size)
    assert_caught(run_iterations(LeakySteps(model))[0], exact, bound)


def test_fusing_keeps_one_copy_and_the_modules_read_it():
    model = family_model("qwen2")
    before = sum(p.numel() for p in model.parameters())
    step = fused.FusedStep(model)
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.data_ptr() == step.layers[0].qkv.data_ptr()  # a view of the fused weight
    assert attention.v_proj.bias.data_ptr() == step.layers[0].qkv_bias[-attention.v_proj.out_features:].data_ptr()
    assert sum(p.numel() for p in model.parameters()) == before


def test_the_fused_projections_equal_the_unfused_ones():
    """One GEMM over [q|k|v] equals the three projections (the same products, concatenated), bias included."""
    model = family_model("qwen2")
    attention, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    x = torch.randn(5, 64, dtype=torch.float64)
    unfused = [copy.deepcopy(m).double() for m in (attention.q_proj, attention.k_proj, attention.v_proj,
                                                   mlp.gate_proj, mlp.up_proj)]
    layer = fused.FusedStep(copy.deepcopy(model).double()).layers[1]
    qkv = torch.nn.functional.linear(x, layer.qkv, layer.qkv_bias)
    torch.testing.assert_close(qkv, torch.cat([m(x) for m in unfused[:3]], -1), rtol=1e-12, atol=1e-12)
    gate_up = torch.nn.functional.linear(x, layer.gate_up)
    torch.testing.assert_close(gate_up, torch.cat([m(x) for m in unfused[3:]], -1), rtol=1e-12, atol=1e-12)


def test_a_row_alone_equals_the_row_in_a_batch_of_16():
    """Each row's output is independent of the rows beside it (float64: no rounding to hide a cross-row leak)."""
    model = copy.deepcopy(family_model("qwen3")).double()
    step = fused.install(model, compiled=False)
    try:
        batch = StaticSteps(model, 64, (16,))
        batch.prefill(PROMPT)
        base = batch.length
        tokens = list(range(10, 26))
        diagonal = torch.zeros(16, base + 16, dtype=torch.bool)
        diagonal[:, :base] = True
        diagonal[:, base:] = torch.eye(16, dtype=torch.bool)
        together = batch.forward(tokens, [base] * 16, diagonal)
        for i in (0, 7, 15):
            alone = StaticSteps(model, 64, (1,))
            alone.prefill(PROMPT)
            torch.testing.assert_close(alone.forward([tokens[i]], [base])[0], together[i], rtol=1e-10, atol=1e-10)
    finally:
        fused.uninstall(model)
    assert step.compiled is False


def test_unsupported_families_say_why():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                             num_attention_heads=4, intermediate_size=64))
    assert "gpt_neox" in fused.unsupported(model)
    with pytest.raises(ValueError, match="gpt_neox"):
        fused.install(model)


def test_compiled_layer_equals_the_eager_fused_step():
    """torch.compile (inductor, dynamic shapes) of the fused layer: the same answer to float64 as eager, through
    every bucket and acceptance length, from one compile."""
    model = family_model("qwen2")
    reference = fused_run(model)
    exact = run_iterations(DynamicSteps(copy.deepcopy(model).double()))[0]
    torch._dynamo.reset()
    got = fused_run(model, compiled=True)
    assert_as_accurate(got, reference, exact, reduction=model.config.intermediate_size)


def test_the_compiled_layer_stays_inside_its_buffers():
    """The compiled layer as a fresh process first meets it (compiled from the first forward, no eager run before it
    to lay out the heap): every logit finite and the process ends cleanly. Compiled to vectorised C++ (inductor on
    a CPU), the layer wrote outside its buffers: here an abort in every native run; NaN under emulated AVX2 after an
    eager run (test_compiled_layer_equals_the_eager_fused_step)."""
    code = ("import torch\nfrom test_fused import family_model, fused_run\n"
            "got = fused_run(family_model('qwen2'), compiled=True)\n"
            "print('finite' if all(bool(torch.isfinite(g).all()) for g in got) else 'not finite')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1:] == ["finite"], done.stdout[-2000:]


# ---- every strategy through the decoder on the fused step ----------------------------------------------------------

DEVICE = os.environ.get("TREEVIZ_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def fused_pair():
    """The tiny related pair with the fused step installed on both models (on CUDA: what load_pair installs, compiled
    and graphed; on a CPU: eager, on static steps)."""
    from engine.models import tiny_random_pair
    from engine.models.pair import install_fused_steps
    pair = tiny_random_pair("related", seed=0, dtype=torch.float32, device=DEVICE)
    if not install_fused_steps(pair):
        for _, model, _ in pair.models():
            fused.install(model, compiled=False)
    yield pair
    for _, model, _ in pair.models():
        fused.uninstall(model)


def strategy_names():
    return list(STRATEGIES)


STRATEGY_USES_DRAFT = {name: cls.uses_draft for name, cls in STRATEGIES.items()}


@pytest.mark.parametrize("name", strategy_names())
def test_every_strategy_on_the_fused_step_emits_what_transformers_emits(fused_pair, name):
    """Greedy, fp32: static steps on the fused step and the dynamic path on transformers' forward give the same
    tokens and the same acceptance per iteration."""
    from engine.recipe import RunSpec, generate
    spec = RunSpec(pair="tiny", prompt="def fib(n):\n    return", strategy=name, max_new_tokens=24,
                   stop_on_eos=False, steps="static")
    before = {role: fused.installed(model).calls for role, model, _ in fused_pair.models()}
    on_fused = generate(fused_pair, spec)
    ran = {role: fused.installed(model).calls - before[role] for role, model, _ in fused_pair.models()}
    assert ran["target"] > 0 and (ran["draft"] > 0 or not STRATEGY_USES_DRAFT[name] or DEVICE == "cuda")
    saved = {role: fused.installed(model) for role, model, _ in fused_pair.models()}
    for _, model, _ in fused_pair.models():
        fused.uninstall(model)
    try:
        reference = generate(fused_pair, RunSpec(**{**spec.__dict__, "capture": "off", "steps": "dynamic"}))
    finally:
        for role, model, _ in fused_pair.models():
            fused._INSTALLED[model] = saved[role]
    assert on_fused.output_ids == reference.output_ids
    assert [it.accepted for it in on_fused.iterations] == [it.accepted for it in reference.iterations]


# ---- the layer compiled ahead of time (engine/cuda/aot.py): ZeroGPU's compiled step ----------------------------------

def test_layer_packages_compute_what_the_eager_layer_computes(tmp_path):
    """Both AOTInductor packages (one row; 2..MAX_ROWS rows) through the production path: static steps through every
    bucket and acceptance length, the cache written in place by the package, as accurate as the eager fused step
    against float64; a second load reuses the files (nothing rebuilt)."""
    from engine.cuda import aot
    model = family_model("qwen2")
    reference = fused_run(model)
    exact = run_iterations(DynamicSteps(copy.deepcopy(model).double()))[0]
    step = fused.install(model, compiled=False)
    try:
        built = aot.build(step, tmp_path)
        assert len(built) == 2 and aot.build(step, tmp_path) == {}
        aot.load(step, tmp_path)
        assert step.compiled and step.ahead_of_time
        got = run_iterations(StaticSteps(model, capacity(len(PROMPT), 40, 8), (1, 2, 4, 8)))[0]
    finally:
        fused.uninstall(model)
    assert_as_accurate(got, reference, exact, reduction=model.config.intermediate_size)


def test_a_missing_package_says_to_build_it(tmp_path):
    from engine.cuda import aot
    step = fused.FusedStep(family_model("llama"))
    with pytest.raises(FileNotFoundError, match="build it first"):
        aot.load(step, tmp_path)
