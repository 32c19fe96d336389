"""One object per model for its forwards and its KV cache ("model steps"), so the decoder and the drafter never touch
a cache themselves:

    steps = make_steps(model, "static", max_len=..., buckets=..., captured=...)
    logits = steps.prefill(prompt_ids)                     # [1, V]: the prompt's last row
    logits = steps.forward(tokens, positions, visible)     # [n, V]; visible: bool [n, steps.length + n]
    hidden = steps.last_hidden                             # [n, H]: the final norm's rows of that forward
    steps.keep(start, rows)                                # rollback: rows (absolute, >= start) copied to start..

`visible[i, j]`: row i attends to cache column j (the first `length` columns are the cache, the last n the new rows);
None means causal. After `forward` the n rows are cached (`length` grew by n) until `keep` rolls back: rows `rows`
are copied to positions start.., length = start + len(rows).

DynamicSteps is the eager path: a transformers DynamicCache that grows by concatenation, an additive mask over
exactly the cached columns, rollback by row copy then crop (engine/core/kv.py).

StaticSteps preallocates the cache (`max_len` positions) and runs each forward on one of three routes:
  captured  a CPU package compiled ahead of time (engine/cpu/aoti.py, through `captured`, the model's
            CapturedModel): exactly n rows, or padded to its bucket;
  graphed   a CUDA graph of the bucket's forward (engine/cuda/graphs.py), replayed after the inputs are copied in;
  eager     the model called on the static cache (or the fused step installed for it, engine/cuda/fused.py),
            padded to its bucket where one holds it (so CPU tests exercise what graphs replay), at its own size
            beyond every bucket (a prefill, the draft's first forward).
Padded rows repeat the last token at the last position and each sees only its own column; their outputs never leave.
Rollback copies the accepted rows into place and moves `length`; rows past it are stale but masked. Every forward
attends over all `max_len` columns, filled or not, so `max_len` should be what the run needs (`capacity`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.core import kv
from engine.cuda.fused import installed as installed_step
from engine.cuda.graphs import CudaGraphs, clear_workspaces

LADDER = (1, 2, 4, 8, 16, 32, 64)  # the row counts forwards are measured and captured at (buckets come from it)

BUCKET_SLACK = 0.10  # a row count may pay up to 10 % over its own measured cost for padding to a shared bucket
# Graphed caches are reused across runs while long enough, so they are sized in whole steps of this many positions:
# runs of similar length share one capture. (Captured CPU packages take any cache length.)
GRAPH_CAPACITY_STEP = 1024
# A reused cache may be this many positions longer than the run needs: every step attends over all of them.
REUSE_SLACK = 256


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
    fewer graphs to capture and hold; where it climbs (a CPU) every rung stays. 1 always stays: it is the AR step.
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
    slow (the cache grows); too large makes every forward attend over unused columns."""
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


# ---- the eager path -------------------------------------------------------------------------------------------------

class DynamicSteps:
    """The eager path: DynamicCache, an additive mask over exactly the cached columns, keep_rows."""
    kind = "dynamic"
    graphs = False
    captured = None

    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = kv.new_cache(model)
        self.last_hidden: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return kv.cache_length(self.cache)

    def reset(self) -> None:
        self.cache = kv.new_cache(self.model)

    def prefill(self, ids: list[int]) -> torch.Tensor:
        return self.forward(ids, list(range(self.length, self.length + len(ids))), last=1)

    def forward(self, tokens: list[int], positions, visible: torch.Tensor | None = None,
                last: int = 0) -> torch.Tensor:
        """Logits [n, V] of the n rows (only the last `last` of them when last > 0: the LM head skips the rest)."""
        n = len(tokens)
        mask = None if visible is None else kv.additive_mask(visible.to(self.device), self.model.dtype)
        out = self.model(input_ids=torch.tensor([tokens], device=self.device),
                         position_ids=_positions(positions, n).to(self.device)[None], attention_mask=mask,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=last, output_hidden_states=True)
        self.last_hidden = out.hidden_states[-1][0]
        return out.logits[0]

    def forward_tensors(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """`forward` from device tensors (tokens and positions [n], visible [n, length + n]): nothing read back."""
        out = self.model(input_ids=tokens[None], position_ids=positions[None],
                         attention_mask=kv.additive_mask(visible, self.model.dtype), past_key_values=self.cache,
                         use_cache=True, output_hidden_states=True)
        self.last_hidden = out.hidden_states[-1][0]
        return out.logits[0]

    def keep(self, start: int, rows: list[int]) -> None:
        kv.keep_rows(self.cache, start, rows)


# ---- preallocated cache, bucketed shapes, captured forwards ----------------------------------------------------------

@dataclass
class Route:
    """How a forward of some rows runs: at `rows` rows (>= the real ones: the rest are padding), through `runner`
    (a captured package: called with the embedded rows) or a graph (`graphed`), else eagerly."""
    rows: int
    runner: object = None
    graphed: bool = False


class StaticSteps:
    """A preallocated cache of `max_len` positions; forwards routed as the module docstring says.

    `captured`: the model's CapturedModel (engine/cpu/packages.py), whose packages take any cache; `graphs`: capture
    a CUDA graph per bucket on this object's own tensors. A forward that would not fit grows the cache (double, or
    what it needs): a new allocation, the valid rows copied over, graphs captured again -- correct but slow, so size
    `max_len` for the run (`capacity`)."""
    kind = "static"

    def __init__(self, model, max_len: int, buckets: tuple[int, ...] = (1,), graphs: bool = False, captured=None,
                 pool=None):
        self.model, self.max_len = model, int(max_len)
        self.device, self.dtype = next(model.parameters()).device, model.dtype
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        if not self.buckets or self.buckets[0] < 1 or self.buckets[-1] > self.max_len:
            raise ValueError(f"buckets {buckets} must be positive and fit max_len {self.max_len}")
        if graphs and self.device.type != "cuda":
            raise StepsError(f"CUDA graphs need a CUDA device; this model runs on {self.device.type}")
        self.captured = captured
        self.graphs = CudaGraphs(self.device, pool) if graphs else None
        self._pinned: dict[str, torch.Tensor] = {}  # CUDA: pinned host staging per input (`_upload`)
        self.length = 0
        self.last_hidden: torch.Tensor | None = None
        self.capture_info: dict = {"seconds": {}, "allocated_bytes": 0, "reserved_bytes": 0, "grown": 0,
                                   "grow_s": 0.0}
        self._top = max(self.buckets[-1], captured.max_rows if captured is not None else 1)
        self._allocate(self.max_len)

    # -- allocation ----------------------------------------------------------------------------------------------
    def _allocate(self, max_len: int) -> None:
        """The cache and the staging tensors at `max_len` positions, then the graphs (if any)."""
        from transformers import StaticCache
        self.max_len = max_len
        if self.graphs is not None:
            self.graphs.release()  # before capturing new ones: the old graphs' outputs pin the pool
        self.cache = StaticCache(config=self.model.config, max_cache_len=max_len)
        length, self.length = self.length, 0
        with torch.inference_mode():
            # the per-layer write offset is copied from here inside the forward, so a replay sets it too
            self._start = torch.zeros((), dtype=torch.long, device=self.device)
            self._ids = torch.zeros(1, self._top, dtype=torch.long, device=self.device)
            self._pos = torch.zeros(1, self._top, dtype=torch.long, device=self.device)
            self._mask = torch.full((1, 1, self._top, max_len), torch.finfo(self.dtype).min, dtype=self.dtype,
                                    device=self.device)
            # StaticCache allocates on its first write: one forward puts it at its final addresses (the row it
            # writes is past `length`: never seen)
            self._eager(self._staged([0], torch.zeros(1, dtype=torch.long), None, 1), 1, 0)
            self.keys = [layer.keys for layer in self.cache.layers]
            self.values = [layer.values for layer in self.cache.layers]
            if self.graphs is not None:  # at length 0: a capture's padded rows land where valid rows are copied next
                self._capture()
        self.length = length

    def _grow(self, needed: int) -> None:
        start = time.perf_counter()
        old, rows = self.cache, self.length
        self._allocate(max(needed, 2 * self.max_len))
        with torch.inference_mode():
            for mine, theirs in zip(self.cache.layers, old.layers):
                mine.keys[:, :, :rows] = theirs.keys[:, :, :rows]
                mine.values[:, :, :rows] = theirs.values[:, :, :rows]
        self.capture_info["grown"] += 1
        self.capture_info["grow_s"] += time.perf_counter() - start

    def reset(self) -> None:
        self.length = 0  # stale rows stay: masked out until overwritten

    # -- routing ---------------------------------------------------------------------------------------------------
    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding n rows; None when n exceeds them all (the forward then runs at its own size)."""
        return next((b for b in self.buckets if b >= n), None)

    def route(self, n: int) -> Route:
        if self.captured is not None:
            rows, runner = self.captured.route(n)
            if runner is not None:
                return Route(rows, runner=runner)
            return Route(n)  # no package for n: eagerly at its own size (the CPU gains nothing from padding)
        b = self.bucket(n)
        if b is None:
            return Route(n)
        return Route(b, graphed=self.graphs is not None and b in self.graphs.graphs)

    # -- forwards ----------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        return self.forward(ids, list(range(self.length, self.length + len(ids))), last=1)

    @torch.inference_mode()
    def forward(self, tokens: list[int], positions, visible: torch.Tensor | None = None,
                last: int = 0) -> torch.Tensor:
        """Logits [n, V] of the n rows (the last `last` only when last > 0); the padded rows' never leave here."""
        n, start = len(tokens), self.length
        if visible is not None and tuple(visible.shape) != (n, start + n):
            raise ValueError(f"visible must be [{n}, {start + n}], got {list(visible.shape)}")
        route = self.route(n)
        if start + route.rows > self.max_len:
            self._grow(start + route.rows)
        inputs = self._staged(tokens, _positions(positions, n), visible, route.rows)
        return self._run(inputs, route, n, last)

    @torch.inference_mode()
    def forward_tensors(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """`forward` from device tensors (tokens and positions [n], visible [n, length + n]) copied into the staging
        tensors on the device: no host read, no host-to-device copy, so a graph replays without waiting."""
        n, start = len(tokens), self.length
        route = self.route(n)
        if start + route.rows > self.max_len:
            self._grow(start + route.rows)
        ids, pos, mask = self._buffers(route.rows)
        ids[0, :n], pos[0, :n] = tokens, positions
        ids[0, n:], pos[0, n:] = tokens[-1], positions[-1]
        mask.fill_(torch.finfo(self.dtype).min)
        mask[0, 0, :n, :start + n].masked_fill_(visible, 0.0)
        self._pad_and_start(mask, n, start)
        return self._run((ids, pos, mask), route, n, 0)

    def _run(self, inputs, route: Route, n: int, last: int) -> torch.Tensor:
        """The staged forward on its route; the n real rows' logits (the last `last` only when last > 0)."""
        start = self.length
        keep = last if route.rows == n and not route.graphed and route.runner is None else 0
        if route.graphed:
            logits, hidden = self.graphs.replay(route.rows, n)
        elif route.runner is not None:
            ids, pos, mask = inputs
            logits, hidden = route.runner(self.model.get_input_embeddings()(ids), pos, mask, self._start,
                                          self.keys, self.values)
        else:
            logits, hidden = self._eager(inputs, route.rows, keep)
        self.last_hidden = hidden[:n]
        self.length = start + n
        if keep:
            return logits
        return logits[n - last:n] if last else logits[:n]

    def _staged(self, tokens: list[int], positions: torch.Tensor, visible: torch.Tensor | None, rows: int):
        """The forward's inputs written into the staging tensors (views of their first `rows` rows; fresh tensors
        beyond them). Rows n.. are padding: the last token again at the last position, each seeing only its own
        column (a row that sees nothing would give NaN, and its NaN key and value would poison every later forward
        through a masked-out but still multiplied column). The mask is rewritten only over the rows used; the
        columns every real row sees (the prefix) are set in one fill, the rest from the host's visibility."""
        n, start = len(tokens), self.length
        pad = rows - n
        ids, pos, mask = self._buffers(rows)
        last_pos = int(positions[-1]) if n else start
        ids.copy_(self._upload(torch.tensor(list(tokens) + [tokens[-1] if tokens else 0] * pad,
                                            dtype=torch.long)[None], "ids"), non_blocking=True)
        pos.copy_(self._upload(torch.cat([positions, torch.full((pad,), last_pos, dtype=torch.long)])[None], "pos"),
                  non_blocking=True)
        m = mask[0, 0]
        m.fill_(torch.finfo(self.dtype).min)
        if visible is None:
            visible = causal_visibility(start, n)
        shared = int(visible.all(dim=0).int().cumprod(0).sum()) if n else 0  # columns every real row sees
        m[:n, :shared] = 0
        block = self._upload(visible[:, shared:], "visible").to(self.device, non_blocking=True)
        m[:n, shared:start + n].masked_fill_(block, 0.0)
        self._pad_and_start(mask, n, start)
        return ids, pos, mask

    def _pad_and_start(self, mask: torch.Tensor, n: int, start: int) -> None:
        """The staging's last step: padded rows n.. see their own column only, and the layers write from `start`."""
        own = torch.arange(n, mask.shape[2], device=self.device)
        mask[0, 0, own, start + own] = 0
        self._start.fill_(start)

    def _buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The staging tensors' first `rows` rows (ids, positions, mask): fresh tensors beyond them."""
        if rows > self._top:
            return (torch.empty(1, rows, dtype=torch.long, device=self.device),
                    torch.empty(1, rows, dtype=torch.long, device=self.device),
                    torch.empty(1, 1, rows, self.max_len, dtype=self.dtype, device=self.device))
        return self._ids[:, :rows], self._pos[:, :rows], self._mask[:, :, :rows]

    def _upload(self, host: torch.Tensor, name: str) -> torch.Tensor:
        """`host` as a tensor an asynchronous host-to-device copy can read: on CUDA, copied into this object's pinned
        staging buffer `name` (grown when too small; each is read by one copy per forward, finished before the next
        forward's staging, which follows a read of the previous logits); elsewhere `host` itself."""
        if self.device.type != "cuda":
            return host
        buffer = self._pinned.get(name)
        if buffer is None or buffer.numel() < host.numel():
            buffer = self._pinned[name] = torch.empty(max(host.numel(), 1024), dtype=host.dtype, pin_memory=True)
        staged = buffer[: host.numel()].view(host.shape)
        staged.copy_(host)
        return staged

    def _eager(self, inputs, rows: int, keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward itself on the static cache (what a graph captures): every layer writes from `_start` on."""
        ids, pos, mask = inputs
        fused = installed_step(self.model)
        if fused is not None and self.cache.layers[0].is_initialized:  # the fused step (engine/cuda) writes the cache
            # transformers allocates; so the first forward on a new cache is transformers' own
            return fused(self.model.get_input_embeddings()(ids), pos, mask, self._start, self.keys, self.values, keep)
        for layer in self.cache.layers:
            if layer.is_initialized:  # StaticLayer writes at its own `cumulative_length`, which it advances
                layer.cumulative_length.copy_(self._start)
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=self.cache,
                         use_cache=True, logits_to_keep=keep, output_hidden_states=True)
        return out.logits[0], out.hidden_states[-1][0]

    @torch.inference_mode()
    def keep(self, start: int, rows: list[int]) -> None:
        """Roll back to `start` rows, then append cached rows `rows` (absolute indices in [start, length))."""
        end = start + len(rows)
        if not 0 <= start <= self.length or any(not start <= r < self.length for r in rows):
            raise ValueError(f"keep({start}, {rows}) outside the {self.length} cached rows")
        if rows and rows != list(range(start, end)):  # the index goes up without a wait (pinned, asynchronous)
            index = self._upload(torch.tensor(rows), "keep").to(self.device, non_blocking=True)
            for keys, values in zip(self.keys, self.values):
                keys[:, :, start:end] = keys.index_select(2, index)
                values[:, :, start:end] = values.index_select(2, index)
        self.length = end

    # -- CUDA graphs ---------------------------------------------------------------------------------------------
    def _capture(self) -> None:
        """One graph per bucket, largest first (smaller ones then reuse its blocks of the shared pool). Records
        seconds per bucket and the memory the graphs hold."""
        torch.cuda.synchronize(self.device)
        clear_workspaces()  # every capture clears them: measured before, their release would count as a saving
        allocated, reserved = torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
        for b in reversed(self.buckets):
            inputs = self._staged([], torch.zeros(0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.bool), b)
            self.graphs.capture(b, lambda inputs=inputs, b=b: self._eager(inputs, b))
        self.capture_info["seconds"] = dict(self.graphs.seconds)
        self.capture_info["allocated_bytes"] = torch.cuda.memory_allocated(self.device) - allocated
        self.capture_info["reserved_bytes"] = torch.cuda.memory_reserved(self.device) - reserved


def make_steps(model, kind: str = "dynamic", *, max_len: int | None = None, buckets: tuple[int, ...] | None = None,
               graphs: bool = False, captured=None, pool=None):
    """DynamicSteps, or StaticSteps of `max_len` positions (see `capacity`) and `buckets` (see `choose_buckets`)."""
    if kind not in ("static", "dynamic"):
        raise ValueError(f"steps kind must be static or dynamic, not {kind!r}")
    if kind == "dynamic":
        if graphs or captured is not None:
            raise StepsError("captured forwards need static steps (fixed shapes)")
        return DynamicSteps(model)
    if max_len is None or not buckets:
        raise ValueError("static steps need max_len (steps.capacity) and buckets (steps.choose_buckets)")
    return StaticSteps(model, max_len, buckets, graphs=graphs, captured=captured, pool=pool)


def reuse_static(kept: dict, role: str, model, need: int, buckets: tuple[int, ...], graphs: bool = False,
                 captured=None):
    """The static steps of `role` from `kept` (one dict per pair: role -> StaticSteps), reset for a new run, or new
    ones when there are none, they are too short for `need` positions (or, without graphs, far longer: every forward
    attends over every position), or their ladder or route differ. Capturing graphs takes seconds, so graphed
    caches are sized in whole GRAPH_CAPACITY_STEPs and kept while they fit. Runs on one pair are sequential (the app
    holds the pair's lock while decoding), so one set of steps per role is enough."""
    steps = kept.get(role)
    too_long = steps is not None and not graphs and steps.max_len > need + REUSE_SLACK
    if (steps is None or steps.max_len < need or too_long or steps.buckets != tuple(buckets)
            or (steps.graphs is not None) != graphs or steps.captured is not captured):
        kept.pop(role, None)  # release the old graphs before capturing new ones
        length = graph_capacity(need) if graphs else need
        steps = kept[role] = make_steps(model, "static", max_len=length, buckets=buckets, graphs=graphs,
                                        captured=captured)
    steps.reset()
    return steps


def pair_static_steps(pair, role: str, prompt_len: int, max_new_tokens: int, captured: bool = True):
    """`role`'s static steps on `pair` (a ModelPair) for a run of `prompt_len` + `max_new_tokens` tokens, through
    `reuse_static`: routed through the pair's captured steps when `captured` (its CPU packages, or CUDA graphs per
    bucket from its cost table's ladder), eager otherwise. The target's cache holds the run plus its largest
    forward, the draft's plus twice that (a whole iteration's expansions; it grows if a tree needs more)."""
    model = pair.target if role == "target" else pair.draft
    packages = pair.captured.get(role) if captured and pair.capture == "aoti" else None
    graphs = captured and pair.graphs
    buckets = choose_buckets(pair.costs, largest_rung(pair.costs, role), role) if packages is None else (1,)
    top = packages.max_rows if packages is not None else buckets[-1]
    need = capacity(prompt_len, max_new_tokens, top * (1 if role == "target" else 2))
    return reuse_static(pair.static_steps, role, model, need, buckets, graphs, packages)


def largest_rung(costs, role: str = "target") -> int:
    """The largest row count the cost table measured for `role` (without a table: the calibration ladder's top):
    the top bucket, since the table says nothing about larger forwards."""
    table = None if costs is None else (costs.target if role == "target" else costs.draft)
    if table is None:
        return LADDER[-1]
    return max(r for path, points in table.seconds.items() for r in points)
