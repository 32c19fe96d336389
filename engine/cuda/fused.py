"""A decoder forward with fused projections over the static cache: the GPU's step at a few kernels per layer.

    reason = unsupported(model)            # None for Llama, Qwen2 and Qwen3 families
    step = install(model, compile=True)    # fuses the weights once; StaticSteps then runs `step` for this model
    logits, hidden = step(embeds, positions, mask, start, keys, values)

transformers' modules launch ~47 kernels per decoder layer (three projections where one GEMM would do, the norms'
and rotary's element-wise ops one by one, a key/value repeat per grouped-query head). Here one layer is

    rmsnorm -> [q|k|v] GEMM (+bias) -> (q/k rmsnorm) -> rotary -> cache write -> attention -> o GEMM -> +residual
    -> rmsnorm -> [gate|up] GEMM -> silu*mul -> down GEMM -> +residual

and, compiled by inductor, the element-wise runs between GEMMs fuse into single kernels. The same compiled layer
serves every layer of the model (identical shapes), so a model compiles once in seconds. Attention folds a group's
query heads into rows, q [kv_heads, groups * n, D] against each key/value head read once: for the few query rows of a
decode or a tree this is two small batched GEMMs and one softmax, where a flash kernel pays a fixed cost per call.

The contract is aoti.Step's (engine/cpu/aoti.py): `embeds` [1, n, H], `positions` [1, n], additive `mask`
[1, 1, n, L], `start` (0-d long tensor: where the n new rows are written), `keys` / `values` one [1, kv_heads, L, D]
tensor per layer (transformers' StaticCache layout); returns logits [n, V] and the final norm's rows [n, H].
Fusing makes each fused weight once and turns the module's own weights into views of it: no second copy.
"""
from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn

FAMILIES = ("llama", "qwen2", "qwen3")
_INSTALLED: "weakref.WeakKeyDictionary[nn.Module, FusedStep]" = weakref.WeakKeyDictionary()


def unsupported(model) -> str | None:
    """Why `model` cannot take the fused step (None when it can)."""
    config = model.config.get_text_config()
    family = getattr(config, "model_type", "?")
    if family not in FAMILIES:
        return f"the fused step covers {', '.join(FAMILIES)}, not {family}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", False):
        return "sliding-window attention is not in the fused step"
    if any(not isinstance(getattr(m, name, None), nn.Linear) for m in _attentions(model)
           for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "the attention's projections are not plain linears (a CPU weight format?)"
    return None


def _attentions(model):
    return [layer.self_attn for layer in model.model.layers]


def _fuse(linears: list[nn.Linear], attr: str) -> torch.Tensor | None:
    """One tensor holding `attr` (weight or bias) of every linear stacked on dim 0; each linear's own `attr`
    becomes a view of its slice, so the memory is held once."""
    parts = [getattr(m, attr) for m in linears]
    if any(p is None for p in parts):
        return None
    fused = torch.cat([p.detach() for p in parts], dim=0)
    offset = 0
    for m, p in zip(linears, parts):
        size = p.shape[0]
        setattr(m, attr, nn.Parameter(fused[offset:offset + size], requires_grad=False))
        offset += size
    return fused


class FusedLayer:
    """One decoder layer's fused weights and sizes (plain tensors, so a compiled function takes them as inputs)."""

    def __init__(self, layer, config):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], "weight")
        self.qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], "bias")
        self.o = attn.o_proj.weight
        self.gate_up = _fuse([mlp.gate_proj, mlp.up_proj], "weight")
        self.down = mlp.down_proj.weight
        self.norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qk_norms = None if q_norm is None else (q_norm.weight, k_norm.weight)

    def tensors(self) -> tuple:
        return (self.qkv, self.qkv_bias, self.o, self.gate_up, self.down, *self.norms,
                *(self.qk_norms or (None, None)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: the statistics in fp32, the weight applied in the input's dtype."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves rotated (transformers' rotate_half convention); cos/sin [n, D] broadcast over heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def layer_forward(x, cos, sin, mask, rows, keys, values, qkv, qkv_bias, o, gate_up, down, norm1, norm2, q_norm,
                  k_norm, *, heads: int, kv_heads: int, head_dim: int, eps: float, scale: float):
    """One decoder layer over `x` [n, H] at rows `rows` of the cache (written in place); returns the new x."""
    n = x.shape[0]
    h = rms_norm(x, norm1, eps)
    qkv_out = F.linear(h, qkv, qkv_bias)
    q, k, v = qkv_out.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = rotate(q, cos[:, None], sin[:, None]), rotate(k, cos[:, None], sin[:, None])
    keys.index_copy_(2, rows, k.transpose(0, 1)[None])
    values.index_copy_(2, rows, v.transpose(0, 1)[None])
    groups = heads // kv_heads
    # query head kv * groups + j, row i -> row j * n + i of key/value head kv: each cached head read once
    folded = q.view(n, kv_heads, groups, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, groups * n, head_dim)
    scores = torch.matmul(folded, keys[0].transpose(1, 2)).to(mask.dtype) * scale + mask.repeat(groups, 1)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values[0])  # [kv_heads, groups * n, D]
    out = out.view(kv_heads, groups, n, head_dim).permute(2, 0, 1, 3).reshape(n, heads * head_dim)
    x = x + F.linear(out, o)
    h = rms_norm(x, norm2, eps)
    gate, up = F.linear(h, gate_up).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down)


class FusedStep:
    """The model's forward on fused weights (module docstring). `compiled`: the layer through torch.compile
    (inductor; dynamic shapes, so one compile serves every row count, cache length and layer)."""

    def __init__(self, model, compiled: bool = False):
        reason = unsupported(model)
        if reason:
            raise ValueError(reason)
        config = model.config.get_text_config()
        self.model = model
        self.layers = [FusedLayer(layer, config) for layer in model.model.layers]
        attention = model.model.layers[0].self_attn
        self.sizes = dict(heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                          head_dim=attention.head_dim, eps=config.rms_norm_eps, scale=attention.scaling)
        rotary = model.model.rotary_emb
        self.inv_freq, self.rope_scale = rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0))
        self.compiled = compiled
        self.compile_error: str | None = None
        self.ahead_of_time = False  # the layer is an AOTInductor package (engine/cuda/aot.py)
        self.calls = 0  # forwards run through this step (a graph replay runs none: it counts its capture's calls)
        if compiled:  # one entry per model shape and dtype (1 row and n rows apart): more than dynamo's default 8
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # scalar C++ on a CPU: inductor's vectorised C++ for this layer wrote outside its buffers
        # (docs/experiments/2026-11-29-inductor-heap.md); a CPU compiles it only in tests, never to serve
        options = {"cpp.simdlen": 1} if next(model.parameters()).device.type == "cpu" else None
        self.layer = (torch.compile(layer_forward, dynamic=True, fullgraph=True, options=options) if compiled
                      else layer_forward)

    def run_layer(self, *args):
        """One layer, compiled where asked; a compile that fails (no Triton, an unsupported GPU) falls back to the
        eager layer for good, its reason kept in `compile_error` (the pair's description and the GPU check show it)."""
        try:
            return self.layer(*args, **self.sizes)
        except Exception as err:  # noqa: BLE001 - inductor raises many kinds; the eager layer computes the same
            if not self.compiled:
                raise
            self.compiled, self.layer = False, layer_forward
            self.compile_error = f"{type(err).__name__}: {str(err)[:300]}"
            return self.layer(*args, **self.sizes)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, D] as transformers' rotary embedding computes them (fp32, scaled, cast to the model's dtype)."""
        freqs = positions.reshape(-1, 1).float() * self.inv_freq.to(positions.device, torch.float)[None]
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * self.rope_scale).to(dtype), (angles.sin() * self.rope_scale).to(dtype)

    def __call__(self, embeds, positions, mask, start, keys, values, last: int = 0):
        self.calls += 1
        x = embeds[0]
        n = x.shape[0]
        cos, sin = self.rotary(positions, x.dtype)
        rows = start + torch.arange(n, device=x.device)
        attend = mask[0, 0].to(torch.promote_types(x.dtype, torch.float32))  # softmax in fp32 at least
        for layer, k, v in zip(self.layers, keys, values):
            x = self.run_layer(x, cos, sin, attend, rows, k, v, *layer.tensors())
        hidden = self.model.model.norm(x[None])[0]
        head = hidden[-last:] if last else hidden
        return self.model.get_output_embeddings()(head[None])[0], hidden


def install(model, compiled: bool | None = None) -> FusedStep:
    """Fuse `model`'s weights and make StaticSteps run the fused step for it from now on. `compiled` None: compile
    where torch.compile may run: a CUDA device, not a ZeroGPU Space, TREEVIZ_CUDA_COMPILE not 0."""
    if compiled is None:
        device = next(model.parameters()).device
        compiled = device.type == "cuda" and os.environ.get("TREEVIZ_CUDA_COMPILE", "1") != "0" and not zero_gpu()
    step = _INSTALLED[model] = FusedStep(model, compiled)
    return step


def zero_gpu() -> bool:
    """A ZeroGPU Space (its `spaces` package sets SPACES_ZERO_GPU): torch.compile may not run there."""
    return os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "true")


def installed(model) -> FusedStep | None:
    """The fused step installed for `model`, if any."""
    return _INSTALLED.get(model)


def uninstall(model) -> None:
    """Back to transformers' forward (the fused weights stay: the modules read views of them)."""
    _INSTALLED.pop(model, None)
