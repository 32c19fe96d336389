"""The neural selector for delayed trees (delayed-tree-expansion paper §6, Appendix E), at this machine's scale.

Before each iteration the selector picks the delayed tree's shape a = (K, L1, L2) from what is known at the root, to
maximise expected tokens per second.

Action space (reduced from the paper's {1..4} x {0..8}^2, whose data set is far beyond 2 cores): K in 1..4,
L1 in 0..4, L2 in 0..4, with L1 + L2 >= 1 (a (K, 0, 0) tree drafts nothing) and L2 = 0 only with K = 1 (without
branches K changes nothing): 84 actions, every one legal for `delayed`.

Features (Appendix E), all available at the root without an extra forward:
- the target's final hidden state at the previous position (the row of the last verification forward, or of the
  prefill, whose distribution drew the root) and the draft's final hidden state at the root (the drafter's root
  forward, which every action begins with); both are the final norm's rows each model's steps return with their
  logits (`last_hidden`, engine/core/steps.py: a captured or graphed forward runs no Python hooks);
- entropies H(p_prev), H(q_prev), H(q_root), KL(p_prev || q_prev), KL(q_prev || p_prev), ||p_prev - q_prev||_1;
- log context length, temperature, top-p.
The draft's hidden state at the previous token (the paper's h_prev^q) is left out: the previous token's draft row was
often made in an earlier iteration. The per-action latencies are not features: our cost table does not depend on the
context length, so they would be constants; they enter the objective instead. Each hidden state is reduced to
D = 16 whitened principal components fitted on the training roots (stored with the weights), then, as in Eq. 10, a
learned linear map and LayerNorm per block; with the standardised scalars that feeds an MLP (64, 32; GELU, dropout)
with two heads over the actions: policy logits (the paper's) and the predicted block efficiency E[tau + 1] per
action, which is only used to report the chosen action's predicted tokens/s.

Targets, objective and training: engine/training/selector_train.py (offline; nothing at decode time needs them).

One selector per rule family: SpecInfer (draws tried in order with the residual updated after each rejection) and
SpecTr (K-SEQ); the other rules that check i.i.d. trees use the SpecInfer selector (`FAMILY`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from engine.core.drafter import DREW_ROOT
from engine.core.reports import SelectorChoice

K_MAX, L1_MAX, L2_MAX = 4, 4, 4
ACTIONS: tuple[tuple[int, int, int], ...] = tuple(
    (k, l1, l2) for l1 in range(L1_MAX + 1) for l2 in range(L2_MAX + 1)
    for k in (range(1, K_MAX + 1) if l2 else (1,)) if l1 + l2 >= 1)
BASELINE = (4, 2, 1)  # delayed's cpu preset: the static configuration Eq. 5 compares with
SCALARS = ("entropy_p_prev", "entropy_q_prev", "entropy_q_root", "kl_p_q", "kl_q_p", "l1_p_q", "log_context",
           "temperature", "top_p")
RULES = ("specinfer", "spectr")
FAMILY = {"spectr": "spectr"}  # every other rule: the SpecInfer selector
WEIGHTS_DIR = Path(__file__).resolve().parents[2] / "assets" / "selector"
EPS = 1e-12


class SelectorError(ValueError):
    """No selector fits this pair or rule (or the model cannot expose its hidden states)."""


# -- actions and their cost ---------------------------------------------------------------------------------------
def draft_rows(action: tuple[int, int, int], first_rows: int = 1) -> tuple[list[int], int]:
    """(rows of each draft forward, rows of the verification forward) of a (K, L1, L2) tree, as `delayed` drafts it:
    the root forward (carrying the pending tokens), one row per further trunk node, then one row at the branching
    point and K rows per further branch level (fewer if paths merge; the nominal count is Eq. 11's)."""
    k, l1, l2 = action
    rows = ([first_rows] + [1] * (l1 - 1)) if l1 else []
    for level in range(l2):
        rows.append(first_rows if (level == 0 and l1 == 0) else (1 if level == 0 else k))
    return rows, 1 + l1 + k * l2


def action_seconds(costs, first_rows: int = 1) -> torch.Tensor:
    """Eq. 11 per action from the measured cost table (engine/measure/costs.py): every draft forward + one verification."""
    return torch.tensor([costs.predict(*draft_rows(a, first_rows))["total_s"] for a in ACTIONS], dtype=torch.float64)


# -- features -----------------------------------------------------------------------------------------------------
def entropy(d: torch.Tensor) -> float:
    d = d.double()
    return float(-(d * d.clamp(min=EPS).log()).sum())


def kl(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a * (a.clamp(min=EPS).log() - b.clamp(min=EPS).log())).sum())


@dataclass
class RootFeatures:
    target_hidden: torch.Tensor  # [H_target] float32
    draft_hidden: torch.Tensor   # [H_draft] float32
    scalars: torch.Tensor        # [len(SCALARS)] float32


def scalar_features(p_prev, q_prev, q_root, context: int, temperature: float, top_p: float) -> torch.Tensor:
    values = (entropy(p_prev), entropy(q_prev), entropy(q_root), kl(p_prev, q_prev), kl(q_prev, p_prev),
              float((p_prev.double() - q_prev.double()).abs().sum()), math.log(context), temperature, top_p)
    return torch.tensor(values, dtype=torch.float32)


class FeatureTaps:
    """The features at the root, gathered through the run's hooks: the target's state at the previous position (handed
    over after every target forward, `after_target`), the q that drew the root (the drafter's rows, `see_rows`, from
    its strategy's `drafted` hook), and the draft's root row, read from both models' steps (`last_hidden`)."""

    def __init__(self, pair, sampling, rule: str, target_steps, draft_steps, costs=None):
        for model in (pair.target, pair.draft):
            if not isinstance(getattr(getattr(model, "base_model", None), "norm", None), nn.Module):
                raise SelectorError(f"{type(model).__name__} has no final norm at .base_model.norm: the neural "
                                    "selector's hidden-state features cannot be read from it")
        self.target, self.draft = target_steps, draft_steps
        self.sampling, self.rule, self.costs = sampling, rule, costs
        # p as a distribution even when decoding greedily (the one-hot would carry no uncertainty)
        self.process = (lambda x: torch.softmax(x.float(), dim=-1)) if sampling.greedy else sampling.process
        self.target_hidden = self.target_dist = None
        # the q that drew the current root: from this iteration's root forward when the previous token was pending,
        # else from the node the last iteration expanded there (`dists`: this iteration's rows, per node)
        self.prev_dist: torch.Tensor | None = None
        self.dists: dict[int, torch.Tensor] = {}

    @classmethod
    def of_run(cls, run) -> "FeatureTaps":
        """The taps of a run that began (engine/strategies/base.py RunInfo); its strategy hands them the drafter's
        rows (`see_rows`) from its `drafted` hook."""
        return cls(run.pair, run.sampling, run.rule, run.target, run.drafter.steps, run.costs)

    def see_rows(self, nodes: list[int], dists: torch.Tensor) -> None:
        """The draft's rows as its strategy's `drafted` hook hears them: each expanded node's q, and the q that drew
        the root."""
        if nodes == [DREW_ROOT]:
            self.prev_dist = dists[0]
            return
        self.dists.update(zip(nodes, dists))

    def after_target(self, logits: torch.Tensor, row: int) -> None:
        """Keep the target's hidden state and processed distribution at `row`: the position before the next root; and
        the q the draft had there, if it expanded that node (the q that drew the next root)."""
        self.target_hidden = self.target.last_hidden[row].float()
        self.target_dist = self.process(logits[row].float()[None])[0]
        self.prev_dist, self.dists = self.dists.get(row, self.prev_dist), {}

    def features(self, drafter, root_dist: torch.Tensor) -> RootFeatures:
        """Right after the drafter's root forward: its root row and the q that drew the root's predecessor."""
        s = self.sampling
        scalars = scalar_features(self.target_dist, self.prev_dist, root_dist, drafter.root_pos + 1,
                                  s.temperature, s.top_p)
        return RootFeatures(self.target_hidden, self.draft.last_hidden[-1].float(), scalars)


# -- the model ----------------------------------------------------------------------------------------------------
class Selector(nn.Module):
    """Eq. 10 at this scale: per hidden block, PCA (fixed, whitened) -> Linear -> LayerNorm; with the standardised
    scalars -> MLP (64, 32) -> policy logits and predicted block efficiency per action."""

    def __init__(self, target_dim: int, draft_dim: int, pcs: int = 16, hidden: tuple[int, int] = (64, 32),
                 dropout: float = 0.1, meta: dict | None = None):
        super().__init__()
        self.meta = dict(meta or {})
        self.meta.update(target_dim=target_dim, draft_dim=draft_dim, pcs=pcs, hidden=list(hidden), dropout=dropout)
        n = len(ACTIONS)
        for name, dim in (("target", target_dim), ("draft", draft_dim)):
            self.register_buffer(f"{name}_mean", torch.zeros(dim))
            self.register_buffer(f"{name}_basis", torch.zeros(dim, pcs))
        self.register_buffer("scalar_mean", torch.zeros(len(SCALARS)))
        self.register_buffer("scalar_std", torch.ones(len(SCALARS)))
        self.project_target = nn.Sequential(nn.Linear(pcs, pcs), nn.LayerNorm(pcs))
        self.project_draft = nn.Sequential(nn.Linear(pcs, pcs), nn.LayerNorm(pcs))
        self.mlp = nn.Sequential(nn.Linear(2 * pcs + len(SCALARS), hidden[0]), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(hidden[0], hidden[1]), nn.GELU(), nn.Dropout(dropout))
        self.policy = nn.Linear(hidden[1], n)
        self.efficiency = nn.Linear(hidden[1], n)

    def fit_inputs(self, target_hidden: torch.Tensor, draft_hidden: torch.Tensor, scalars: torch.Tensor) -> None:
        """Set the fixed input maps from training data: whitened principal components, scalar standardisation."""
        pcs = self.meta["pcs"]
        for name, x in (("target", target_hidden), ("draft", draft_hidden)):
            mean = x.mean(0)
            _, s, v = torch.linalg.svd(x - mean, full_matrices=False)
            scale = (s[:pcs] / math.sqrt(max(len(x) - 1, 1))).clamp(min=1e-6)
            basis = torch.zeros(x.shape[1], pcs)
            basis[:, : min(pcs, v.shape[0])] = (v[:pcs] / scale[:, None]).T
            getattr(self, f"{name}_mean").copy_(mean)
            getattr(self, f"{name}_basis").copy_(basis)
        self.scalar_mean.copy_(scalars.mean(0))
        self.scalar_std.copy_(scalars.std(0).clamp(min=1e-6))

    def forward(self, target_hidden, draft_hidden, scalars) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.project_target((target_hidden - self.target_mean) @ self.target_basis)
        d = self.project_draft((draft_hidden - self.draft_mean) @ self.draft_basis)
        s = (scalars - self.scalar_mean) / self.scalar_std
        h = self.mlp(torch.cat([t, d, s], dim=-1))
        return self.policy(h), 1 + nn.functional.softplus(self.efficiency(h))  # E[tau + 1] >= 1

    @torch.no_grad()
    def choose(self, features: RootFeatures, seconds: torch.Tensor | None) -> SelectorChoice:
        """argmax of the policy (as the paper does at inference); the predicted tokens/s is the efficiency head's
        E[tau + 1] of that action over its Eq. 11 seconds on this machine (None without a cost table)."""
        if features.target_hidden.shape[-1] != self.meta["target_dim"] or \
                features.draft_hidden.shape[-1] != self.meta["draft_dim"]:
            raise SelectorError(f"this selector was trained for hidden sizes {self.meta['target_dim']} / "
                                f"{self.meta['draft_dim']}, the pair has {features.target_hidden.shape[-1]} / "
                                f"{features.draft_hidden.shape[-1]}: train one for it (scripts/selector_data.py)")
        self.eval()
        logits, efficiency = self(features.target_hidden[None], features.draft_hidden[None], features.scalars[None])
        index = int(logits[0].argmax())
        k, l1, l2 = ACTIONS[index]
        be = float(efficiency[0, index])
        s = float(seconds[index]) if seconds is not None else None
        return SelectorChoice(k, l1, l2, predicted_block_efficiency=be, predicted_s=s,
                              predicted_tokens_per_s=be / s if s else None, rule=self.meta.get("rule"))

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file
        tensors = {k: v.detach().contiguous().float() for k, v in self.state_dict().items()}
        save_file(tensors, str(path), metadata={"selector": json.dumps(self.meta)})

    @classmethod
    def load(cls, path: Path) -> "Selector":
        from safetensors import safe_open
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["selector"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if [tuple(a) for a in meta.get("actions", ACTIONS)] != list(ACTIONS):
            raise SelectorError(f"{path} was trained for another action space; retrain it")
        net = cls(meta["target_dim"], meta["draft_dim"], meta["pcs"], tuple(meta["hidden"]), meta["dropout"], meta)
        net.load_state_dict(tensors)
        return net.eval()


def weights_path(rule: str) -> Path:
    return WEIGHTS_DIR / f"{FAMILY.get(rule, 'specinfer')}.safetensors"


@lru_cache(maxsize=4)
def shipped(rule: str) -> Selector:
    """The trained selector of this rule's family shipped in assets/selector/."""
    path = weights_path(rule)
    if not path.exists():
        raise SelectorError(f"no trained selector at {path}: run scripts/selector_data.py collect, then train")
    return Selector.load(path)
