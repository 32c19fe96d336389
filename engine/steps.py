"""One object per model for its forwards and its KV cache ("model steps"), so the decoder and the drafter never touch
a cache themselves:

    steps = make_steps(pair.target, kind="auto", cuda_graphs="auto", max_len=..., buckets=...)
    logits = steps.prefill(prompt_ids)                     # [1, V]: the prompt's last row
    logits = steps.forward(tokens, positions, visible)     # [n, V]; visible: bool [n, steps.length + n]
    steps.keep(start, rows)                                # rollback: rows (absolute, >= start) copied to start..

`visible[i, j]`: row i attends to cache column j (the first `length` columns are the cache, the last n the new rows);
None means causal (every row sees the cache and the rows before it). After `forward` the n rows are cached
(`length` grew by n) until `keep` rolls back: rows `rows` are copied to positions start.., length = start + len(rows).

DynamicSteps is the engine's path: a transformers DynamicCache that grows by concatenation, an additive mask over
exactly the cached columns, rollback by row copy then crop (engine/kv.py).

StaticSteps preallocates the cache once (transformers' StaticCache, `max_len` positions) and never reallocates: a
forward of n rows runs at the smallest bucket b >= n of its ladder, the b - n padded rows masked out, so every
forward of one bucket has the same shapes and reads its inputs from the same tensors -- which is what a CUDA graph
needs (one graph per bucket, replayed after copying the inputs in). Rollback copies the accepted rows into place and
moves `length`; rows past it are stale but never seen (the mask hides them). The price: every forward attends over
all `max_len` columns, filled or not, so `max_len` should be what the run needs (`capacity`), not more.
A forward larger than every bucket (the draft's first forward over the whole prompt, a prefill) runs at its own size,
eagerly. Buckets come from the measured cost table (`choose_buckets`); docs/gpu.md explains the rule.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine import kv

WARMUP_CALLS = 2  # eager calls on a side stream before a capture: first calls pick kernels and allocate workspaces
BUCKET_SLACK = 0.10  # a row count may pay up to 10 % over its own measured cost for padding to a shared bucket
# Captured steps are reused across runs while their cache is long enough, so a graphed cache is sized in whole steps
# of this many positions: runs of similar length share one capture. On a GPU the unused columns cost little: one
# single-row step of the 1.5B target attends over them in the same kernels (docs/experiments: 1,024 vs 8,192).
GRAPH_CAPACITY_STEP = 1024
_POOL = None  # the CUDA graph memory pool every StaticSteps shares (one per process)


class StepsError(ValueError):
    """Steps that cannot run here: CUDA graphs without CUDA, a forward that does not fit the static cache."""


# ---- bucket ladders -----------------------------------------------------------------------------------------------

def default_buckets(max_rows: int) -> tuple[int, ...]:
    """Without a cost table: powers of two below `max_rows`, then `max_rows` (padding at most doubles the rows)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}")
    ladder, b = [], 1
    while b < max_rows:
        ladder.append(b)
        b *= 2
    return tuple(ladder + [max_rows])


def choose_buckets(costs, max_rows: int, role: str = "target", slack: float = BUCKET_SLACK) -> tuple[int, ...]:
    """The bucket ladder for one model from its measured t(n) table (`costs`: a PairCosts, or None for the default).

    Candidates are the row counts the table measured (below `max_rows`), 1 and `max_rows`. From the top down, a
    candidate r becomes a bucket only if padding it up to the next bucket kept so far would cost more than `slack`
    of r's own cost: where t(n) is flat (a GPU below its compute bound) neighbouring rungs collapse into one bucket,
    fewer graphs to capture and hold; where it climbs (a CPU) every rung stays. 1 always stays: it is the AR step
    and the most frequent forward, and the speed-up is measured against it.
    """
    table = None if costs is None else (costs.target if role == "target" else costs.draft)
    if table is None:
        return default_buckets(max_rows)
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}")
    measured = {r for points in table.seconds.values() for r in points if r < max_rows}
    kept = [max_rows]
    for r in sorted(measured | {1}, reverse=True):
        if r == max_rows:
            continue
        if r == 1 or table.time(kept[-1]) > (1 + slack) * table.time(r):
            kept.append(r)
    return tuple(sorted(kept))


def capacity(prompt_len: int, max_new_tokens: int, extra_rows: int) -> int:
    """Static cache positions a run needs: its whole sequence, plus `extra_rows` uncommitted rows on top (the target:
    its largest tree, padded; the draft: every row it expands in one iteration, padded). Too small is correct but
    slow (the cache grows, graphs are captured again); too large makes every forward attend over unused columns."""
    return int(prompt_len) + int(max_new_tokens) + int(extra_rows)


def graph_capacity(positions: int) -> int:
    """`positions` rounded up to whole GRAPH_CAPACITY_STEPs: the length of a cache whose graphs are kept."""
    return -(-int(positions) // GRAPH_CAPACITY_STEP) * GRAPH_CAPACITY_STEP


def causal_visibility(length: int, n: int) -> torch.Tensor:
    """Bool [n, length + n]: every row sees the cache and the rows up to itself."""
    return kv.tree_visibility(length, torch.tril(torch.ones(n, n, dtype=torch.bool)))


def _positions(positions, n: int) -> torch.Tensor:
    out = torch.as_tensor(positions, dtype=torch.long).reshape(-1).cpu()
    if len(out) != n:
        raise ValueError(f"{n} tokens but {len(out)} positions")
    return out


# ---- the engine's path --------------------------------------------------------------------------------------------

class DynamicSteps:
    """The engine's path, unchanged: DynamicCache, an additive mask over exactly the cached columns, keep_rows."""
    kind = "dynamic"
    graphs = False

    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = kv.new_cache(model)

    @property
    def length(self) -> int:
        return kv.cache_length(self.cache)

    def reset(self) -> None:
        self.cache = kv.new_cache(self.model)

    def prefill(self, ids: list[int]) -> torch.Tensor:
        return self.model(input_ids=torch.tensor([ids], device=self.device), past_key_values=self.cache,
                          use_cache=True, logits_to_keep=1).logits[0]

    def forward(self, tokens: list[int], positions, visible: torch.Tensor | None = None,
                last: int = 0) -> torch.Tensor:
        """Logits [n, V] of the n rows (only the last `last` of them when last > 0: the LM head skips the rest)."""
        n = len(tokens)
        mask = None if visible is None else kv.additive_mask(visible.to(self.device), self.model.dtype)
        return self.model(input_ids=torch.tensor([tokens], device=self.device),
                          position_ids=_positions(positions, n).to(self.device)[None], attention_mask=mask,
                          past_key_values=self.cache, use_cache=True, logits_to_keep=last).logits[0]

    def keep(self, start: int, rows: list[int]) -> None:
        kv.keep_rows(self.cache, start, rows)


# ---- preallocated cache, bucketed shapes, optional CUDA graphs ------------------------------------------------------

@dataclass
class _Inputs:
    """The tensors one bucket's forward reads, allocated once: a CUDA graph replays on exactly these addresses."""
    ids: torch.Tensor        # long [1, b]
    positions: torch.Tensor  # long [1, b]
    mask: torch.Tensor       # model dtype [1, 1, b, max_len], additive

    @classmethod
    def allocate(cls, rows: int, max_len: int, device, dtype) -> "_Inputs":
        return cls(torch.zeros(1, rows, dtype=torch.long, device=device),
                   torch.zeros(1, rows, dtype=torch.long, device=device),
                   torch.zeros(1, 1, rows, max_len, dtype=dtype, device=device))


class StaticSteps:
    """A preallocated cache of `max_len` positions; forwards padded to `buckets`; CUDA graphs per bucket if `graphs`.

    A forward that would not fit grows the cache (double, or what it needs): a new allocation, the valid rows
    copied over, the graphs captured again -- correct but slow, so size `max_len` for the run (`capacity`)."""
    kind = "static"

    def __init__(self, model, max_len: int, buckets: tuple[int, ...], graphs: bool = False, pool=None):
        self.model, self.max_len = model, int(max_len)
        self.device, self.dtype = next(model.parameters()).device, model.dtype
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        if not self.buckets or self.buckets[0] < 1 or self.buckets[-1] > self.max_len:
            raise ValueError(f"buckets {buckets} must be positive and fit max_len {self.max_len}")
        self.graphs, self.pool = bool(graphs), (pool if pool is not None or not graphs else shared_pool())
        self.length = 0
        self.capture_info: dict = {"seconds": {}, "allocated_bytes": 0, "reserved_bytes": 0, "grown": 0}
        self._allocate(self.max_len)

    def _allocate(self, max_len: int) -> None:
        """The cache and every bucket's input tensors at `max_len` positions, then the graphs (if any)."""
        from transformers import StaticCache
        self.max_len, self._graphs = max_len, {}
        self.cache = StaticCache(config=self.model.config, max_cache_len=max_len)
        length, self.length = self.length, 0
        with torch.inference_mode():
            # the per-layer write offset is copied from here inside the forward, so a graph replays it too
            self._start = torch.zeros((), dtype=torch.long, device=self.device)
            self._inputs = {b: _Inputs.allocate(b, max_len, self.device, self.dtype) for b in self.buckets}
            # StaticCache allocates on its first write; one forward now puts it at its final addresses before any
            # capture (the row it writes is past `length`: never seen)
            self.forward([0], [0])
            self.length = 0
            if self.graphs:  # at length 0: the capture's padded rows land where the valid rows are copied next
                self.capture(self.pool)
        self.length = length

    def _grow(self, needed: int) -> None:
        old, rows = self.cache, self.length
        self._allocate(max(needed, 2 * self.max_len))
        with torch.inference_mode():
            for mine, theirs in zip(self.cache.layers, old.layers):
                mine.keys[:, :, :rows] = theirs.keys[:, :, :rows]
                mine.values[:, :, :rows] = theirs.values[:, :, :rows]
        self.capture_info["grown"] += 1

    def reset(self) -> None:
        self.length = 0  # stale rows stay: masked out until overwritten

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding n rows; None when n exceeds them all (the forward then runs at its own size)."""
        return next((b for b in self.buckets if b >= n), None)

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        return self.forward(ids, list(range(self.length, self.length + len(ids))), last=1)

    @torch.inference_mode()
    def forward(self, tokens: list[int], positions, visible: torch.Tensor | None = None,
                last: int = 0) -> torch.Tensor:
        """Logits [n, V] of the n rows (the last `last` only when last > 0); the padded rows' never leave here."""
        n, start = len(tokens), self.length
        visible = causal_visibility(start, n) if visible is None else visible.cpu()
        if visible.shape != (n, start + n):
            raise ValueError(f"visible must be [{n}, {start + n}], got {list(visible.shape)}")
        b = self.bucket(n)
        rows = b if b is not None else n
        if start + rows > self.max_len:
            self._grow(start + rows)
        inputs = self._inputs[b] if b is not None else _Inputs.allocate(n, self.max_len, self.device, self.dtype)
        self._write(inputs, tokens, _positions(positions, n), visible)
        if b is None:  # larger than every bucket: its own size, eagerly, the LM head only over the rows asked for
            logits = self._run(inputs, last)
        elif b in self._graphs:
            logits = self._replay(b, n)
        else:
            logits = self._run(inputs)[:n]
        self.length = start + n
        return logits[n - last:] if last and b is not None else logits

    def _write(self, inputs: _Inputs, tokens: list[int], positions: torch.Tensor, visible: torch.Tensor) -> None:
        """Copy one forward's inputs into the bucket's tensors; rows n.. are padding: the last token again at the
        last position, each seeing only its own column (a row that sees nothing would give NaN, and its NaN key and
        value would poison every later forward through a masked-out but still multiplied column)."""
        rows, n, start = inputs.ids.shape[1], len(tokens), self.length
        pad = rows - n
        ids = torch.tensor(list(tokens) + [tokens[-1] if tokens else 0] * pad, dtype=torch.long)
        last_pos = int(positions[-1]) if n else start
        pos = torch.cat([positions, torch.full((pad,), last_pos, dtype=torch.long)])
        seen = torch.zeros(rows, start + rows, dtype=torch.bool)
        seen[:n, : start + n] = visible
        seen[torch.arange(n, rows), start + torch.arange(n, rows)] = True
        inputs.ids.copy_(ids[None])
        inputs.positions.copy_(pos[None])
        inputs.mask.fill_(torch.finfo(self.dtype).min)
        inputs.mask[0, 0, :, : start + rows].masked_fill_(seen.to(self.device), 0.0)
        self._start.fill_(start)

    def _run(self, inputs: _Inputs, keep: int = 0) -> torch.Tensor:
        """The forward itself (what a graph captures): every layer writes its rows from `_start` on."""
        for layer in self.cache.layers:
            if layer.is_initialized:  # StaticLayer writes at its own `cumulative_length`, which it advances
                layer.cumulative_length.copy_(self._start)
        return self.model(input_ids=inputs.ids, position_ids=inputs.positions, attention_mask=inputs.mask,
                          past_key_values=self.cache, use_cache=True, logits_to_keep=keep).logits[0]

    @torch.inference_mode()
    def keep(self, start: int, rows: list[int]) -> None:
        """Roll back to `start` rows, then append cached rows `rows` (absolute indices in [start, length))."""
        end = start + len(rows)
        if not 0 <= start <= self.length or any(not start <= r < self.length for r in rows):
            raise ValueError(f"keep({start}, {rows}) outside the {self.length} cached rows")
        if rows and rows != list(range(start, end)):
            index = torch.tensor(rows, device=self.device)
            for layer in self.cache.layers:
                layer.keys[:, :, start:end] = layer.keys.index_select(2, index)
                layer.values[:, :, start:end] = layer.values.index_select(2, index)
        self.length = end

    # -- CUDA graphs ---------------------------------------------------------------------------------------------
    def capture(self, pool) -> None:
        """One graph per bucket, largest first (smaller ones then reuse its blocks of the shared pool); each after
        WARMUP_CALLS eager calls on a side stream. Records seconds per bucket and the memory the graphs hold."""
        torch.cuda.synchronize(self.device)
        allocated, reserved = torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
        with torch.inference_mode():
            for b in reversed(self.buckets):
                t0 = time.perf_counter()
                inputs = self._inputs[b]
                self._write(inputs, [], torch.zeros(0, dtype=torch.long), torch.zeros(0, self.length, dtype=torch.bool))
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_CALLS):
                        self._run(inputs)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._run(inputs)
                torch.cuda.synchronize(self.device)
                self._graphs[b] = (graph, out)
                self.capture_info["seconds"][b] = time.perf_counter() - t0
        self.capture_info["allocated_bytes"] = torch.cuda.memory_allocated(self.device) - allocated
        self.capture_info["reserved_bytes"] = torch.cuda.memory_reserved(self.device) - reserved

    def _replay(self, b: int, n: int) -> torch.Tensor:
        graph, out = self._graphs[b]
        graph.replay()
        return out[:n].clone()  # the next replay of any graph sharing the pool may overwrite `out`


def shared_pool():
    """The one CUDA graph memory pool of the process: graphs of both models and every bucket draw from it."""
    global _POOL
    if _POOL is None:
        _POOL = torch.cuda.graph_pool_handle()
    return _POOL


def use_graphs(cuda_graphs: str, device: torch.device) -> bool:
    """--cuda-graphs auto|on|off: auto = on for CUDA devices, off elsewhere; on without CUDA is an error."""
    if cuda_graphs not in ("auto", "on", "off"):
        raise ValueError(f"cuda_graphs must be auto, on or off, not {cuda_graphs!r}")
    if cuda_graphs == "on" and device.type != "cuda":
        raise StepsError(f"--cuda-graphs on needs a CUDA device; this model runs on {device.type}")
    return cuda_graphs == "on" or (cuda_graphs == "auto" and device.type == "cuda")


def wants_static(kind: str, cuda_graphs: str, device: torch.device) -> bool:
    """Whether steps of `kind` ("auto" | "static" | "dynamic") are static: "auto" is static exactly when CUDA graphs
    are on (see use_graphs), so a CPU run keeps the dynamic path unless static is asked for."""
    if kind not in ("auto", "static", "dynamic"):
        raise ValueError(f"steps kind must be auto, static or dynamic, not {kind!r}")
    if kind == "dynamic" and cuda_graphs == "on":
        raise StepsError("CUDA graphs need static steps (fixed shapes); use --steps static (or auto) with --cuda-graphs on")
    graphs = use_graphs(cuda_graphs, device)
    return kind == "static" or (kind == "auto" and graphs)


def make_steps(model, kind: str = "auto", cuda_graphs: str = "auto", *, max_len: int | None = None,
               buckets: tuple[int, ...] | None = None, pool=None):
    """DynamicSteps or StaticSteps (see wants_static); static steps need `max_len` (see `capacity`) and `buckets`
    (see `choose_buckets`), and capture CUDA graphs when use_graphs says so."""
    device = next(model.parameters()).device
    if not wants_static(kind, cuda_graphs, device):
        return DynamicSteps(model)
    if max_len is None or not buckets:
        raise ValueError("static steps need max_len (steps.capacity) and buckets (steps.choose_buckets)")
    return StaticSteps(model, max_len, buckets, graphs=use_graphs(cuda_graphs, device), pool=pool)


def reuse_static(kept: dict, role: str, model, need: int, buckets: tuple[int, ...], cuda_graphs: str):
    """The static steps of `role` from `kept` (one dict per pair: role -> StaticSteps), reset for a new run, or new
    ones when there are none, or they are too short for `need` positions, or their ladder or graph mode differ.
    Capturing graphs takes seconds, so a pair keeps its steps across runs (the app's, the bench's): graphed caches are
    sized in whole GRAPH_CAPACITY_STEPs so that runs of similar length share them. Runs on one pair are sequential
    (the app holds the pair's lock while decoding), so one set of steps per role is enough."""
    device = next(model.parameters()).device
    graphs = use_graphs(cuda_graphs, device)
    steps = kept.get(role)
    if steps is None or steps.max_len < need or steps.buckets != tuple(buckets) or steps.graphs != graphs:
        kept.pop(role, None)  # release the old graphs before capturing new ones
        length = graph_capacity(need) if graphs else need
        steps = kept[role] = make_steps(model, "static", cuda_graphs, max_len=length, buckets=buckets)
    steps.reset()
    return steps


def pair_static_steps(pair, role: str, prompt_len: int, max_new_tokens: int, cuda_graphs: str):
    """`role`'s static steps on `pair` (a ModelPair) for a run of `prompt_len` + `max_new_tokens` tokens, through
    `reuse_static`: buckets from the pair's cost table; the target's cache holds the run plus its top bucket, the
    draft's twice its top bucket (a whole iteration's expansions on top of its sequence; it grows if a tree needs
    more)."""
    model = pair.target if role == "target" else pair.draft
    buckets = choose_buckets(pair.costs, largest_rung(pair.costs, role), role)
    need = capacity(prompt_len, max_new_tokens, buckets[-1] * (1 if role == "target" else 2))
    return reuse_static(pair.static_steps, role, model, need, buckets, cuda_graphs)


def largest_rung(costs, role: str = "target") -> int:
    """The largest row count the cost table measured for `role` (without a table: the calibration ladder's top):
    the top bucket, since the table says nothing about larger forwards."""
    from engine.costs import LADDER
    table = None if costs is None else (costs.target if role == "target" else costs.draft)
    if table is None:
        return LADDER[-1]
    return max(r for points in table.seconds.values() for r in points)
