"""The neural selector's training (engine/strategies/selector.py is what runs at decode time): its targets and
objective.

Targets (`scripts/selector_data.py`): at each root of real runs, one cover tree (`grow_cover`) holds an exact
(K, L1, L2) delayed tree for every action by prefix sharing, and each action's block efficiency is Eq. 3's inner sum
(Appendix D branching probabilities, `branching`), computed from the target's p and the draft's q at every node: the
verification randomness is integrated out exactly, the drafting randomness is one sample per root (s = 1). Seconds
per action are Eq. 11 from this machine's measured cost table (`action_seconds`).

Objective: Eq. 4 (the policy's expected tokens over its expected seconds), Eq. 5 (minus its log ratio to the
baseline action, `delayed`'s cpu preset (4, 2, 1)), plus Eq. 12's penalty on the worst alpha fraction of regressions
below the baseline in each minibatch. lambda = 1 and alpha = 0.1: with minibatches of 64 the penalty looks at the ~6
worst roots, and a 30 % regression on them costs 0.09, as much as the log-ratio gain a good choice brings on average,
so the selector may not buy a small mean gain with a few large losses; a larger lambda pins it to the baseline. The
paper does not give its values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.strategies.selector import ACTIONS, BASELINE, EPS, K_MAX, L1_MAX, L2_MAX, RULES, Selector, SelectorError
from engine.verify.spectr import division_factor, overlap

PENALTY_WEIGHT, PENALTY_FRACTION = 1.0, 0.1  # lambda, alpha of Eq. 12


# -- the estimator (Eq. 3, Appendix D) ----------------------------------------------------------------------------
def branching(rule: str, p: torch.Tensor, q: torch.Tensor, tokens: list[int]) -> dict[int, float]:
    """B(f_{p,q,k}, X, t) for every child token t: the probability the rule's step at a node with i.i.d. draws
    `tokens` (in draw order, from q) emits t, as our verifiers run it: try the draws in order, accept draw j with a_j,
    else emit a residual sample. SpecInfer: a_j = min(1, p_j(x)/q(x)) with p_{j+1} = norm((p_j - q)+); SpecTr:
    a_j = min(1, p(x)/(rho* q(x))) and the residual norm((p - gamma min(p/rho*, q))+) (Algorithms 13-14)."""
    p, q = p.double(), q.double()
    out = {t: 0.0 for t in tokens}
    reach = 1.0  # probability every earlier draw was rejected
    if rule == "specinfer":
        for x in tokens:
            a = 1.0 if p[x] >= q[x] else float(p[x] / q[x])
            out[x] += reach * a
            reach *= 1 - a
            rest = (p - q).clip(min=0.0)
            mass = float(rest.sum())
            p = rest / mass if mass > EPS else p
        final = p
    elif rule == "spectr":
        rho = division_factor(p, q, len(tokens))
        for x in tokens:
            a = 1.0 if p[x] >= rho * q[x] else float(p[x] / (rho * q[x]))
            out[x] += reach * a
            reach *= 1 - a
        common = overlap(p, q, rho)
        beta = float(common.sum())
        gamma = (1 - (1 - beta) ** len(tokens)) / beta if beta > 0 else 0.0
        rest = (p - gamma * common).clip(min=0.0)
        mass = float(rest.sum())
        final = rest / mass if mass > 0 else p
    else:
        raise SelectorError(f"no branching probabilities for rule {rule!r}; choose from {RULES}")
    for t in out:
        out[t] += reach * float(final[t])
    return out


def block_efficiency(rule: str, draws: dict[int, list[int]], tokens: list[int], p, q,
                     memo: dict | None = None) -> float:
    """Eq. 3's inner sum for one tree: sum over its nodes of the probability the rule's walk reaches them (the root
    with probability 1). `draws[node]` = child node ids in draw order (a merged child once per draw), `tokens[node]`
    its token, `p[node]` / `q[node]` the target's / draft's distributions after it. `memo` shares branching
    probabilities between the trees of one cover (most nodes see the same draws under many actions)."""
    memo = {} if memo is None else memo
    total, frontier = 1.0, [(0, 1.0)]
    while frontier:
        node, reach = frontier.pop()
        children = draws.get(node)
        if not children or reach == 0.0:
            continue
        key = (rule, node, tuple(children))
        if key not in memo:
            memo[key] = branching(rule, p[node], q[node], [tokens[c] for c in children])
        b = memo[key]
        for child in dict.fromkeys(children):
            r = reach * b[tokens[child]]
            total += r
            frontier.append((child, r))
    return total


@dataclass
class Cover:
    """One tree holding an exact (K, L1, L2) delayed tree for every action: a trunk of L1_MAX i.i.d. draws, and at
    every trunk depth d, K_MAX i.i.d. branches of L2_MAX draws. Action (K, L1, L2) takes the trunk's first L1 nodes
    and the first K branches at depth L1, each cut to L2 draws; the branches are independent of the trunk beyond
    depth L1, so each action's tree has exactly the law `delayed` draws from. Nodes with equal token paths are one
    node (the same p and q), so the whole cover is one i.i.d. tree any i.i.d. rule verifies."""
    trunk: list[int]                    # node ids at depth 0..L1_MAX (trunk[0] = root)
    branches: list[list[list[int]]]     # branches[d][b] = node ids of branch b at trunk depth d, in draw order

    def draws(self, action: tuple[int, int, int]) -> dict[int, list[int]]:
        k, l1, l2 = action
        draws: dict[int, list[int]] = {}
        for d in range(l1):
            draws[self.trunk[d]] = [self.trunk[d + 1]]
        for branch in self.branches[l1][:k]:
            parent = self.trunk[l1]
            for node in branch[:l2]:
                draws.setdefault(parent, []).append(node)
                parent = node
        return draws


def grow_cover(drafter, tree, draw) -> Cover:
    """Grow the cover tree with `drafter` (one draft forward per level over every distinct path end); `draw(dist,
    count)` returns `count` i.i.d. tokens from the node's q. Records q and the draw order on `tree` (child mode
    "iid"), so the decoder's own rule verifies it."""
    def add(parent: int, token: int) -> int:
        dist = tree.child_dist[parent]
        return tree.add_draw(parent, token, float(dist[token]), int((dist > dist[token]).sum()))

    def expand(nodes: list[int]) -> None:
        fresh = [n for n in dict.fromkeys(nodes) if n not in tree.child_dist]
        if fresh:
            for node, dist in zip(fresh, drafter.expand(fresh)):
                tree.child_dist[node], tree.child_mode[node] = dist, "iid"

    trunk = [0]
    for _ in range(L1_MAX):
        expand([trunk[-1]])
        trunk.append(add(trunk[-1], draw(tree.child_dist[trunk[-1]], 1)[0]))
    branches = [[[] for _ in range(K_MAX)] for _ in trunk]
    for _ in range(L2_MAX):
        ends = [(d, b, (branches[d][b] or [trunk[d]])[-1]) for d in range(len(trunk)) for b in range(K_MAX)]
        expand([end for _, _, end in ends])
        for d, b, end in ends:
            branches[d][b].append(add(end, draw(tree.child_dist[end], 1)[0]))
    return Cover(trunk, branches)


# -- training (Eq. 4, 5, 12) --------------------------------------------------------------------------------------
def objective(logits, efficiency, seconds, base: int, lam: float = PENALTY_WEIGHT,
              alpha: float = PENALTY_FRACTION) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-root TPS ratio to the baseline). Eq. 4: TPS_pi = sum pi E / sum pi T; Eq. 5: -log(TPS_pi /
    TPS_base); Eq. 12: + lambda * mean of the largest alpha fraction of max(1 - ratio, 0)^2 in the batch."""
    pi = torch.softmax(logits, dim=-1)
    tps = (pi * efficiency).sum(-1) / (pi * seconds).sum(-1)
    ratio = tps / (efficiency[:, base] / seconds[:, base])
    penalty = (1 - ratio).clamp(min=0) ** 2
    worst = penalty.topk(max(1, math.ceil(alpha * len(penalty)))).values
    return -ratio.log().mean() + lam * worst.mean(), ratio


def train(data: dict, meta: dict | None = None, epochs: int = 300, batch: int = 64, lr: float = 3e-3,
          seed: int = 0, efficiency_weight: float = 0.1, log=None) -> Selector:
    """data: target_hidden [N, Ht], draft_hidden [N, Hd], scalars [N, S], efficiency [N, A] (estimated E[tau + 1]),
    seconds [N, A] (Eq. 11). Minibatch Adam on Eq. 5 + Eq. 12, plus a small squared error for the efficiency head."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: thread barriers cost more than they save, badly on a busy machine
    try:
        return _train(data, meta, epochs, batch, lr, seed, efficiency_weight, log)
    finally:
        torch.set_num_threads(threads)


def _train(data, meta, epochs, batch, lr, seed, efficiency_weight, log) -> Selector:
    torch.manual_seed(seed)
    th, dh, sc = data["target_hidden"].float(), data["draft_hidden"].float(), data["scalars"].float()
    be, secs = data["efficiency"].float(), data["seconds"].float()
    net = Selector(th.shape[1], dh.shape[1], meta=meta)
    net.fit_inputs(th, dh, sc)
    net.meta.update(actions=[list(a) for a in ACTIONS], baseline=list(BASELINE), penalty_weight=PENALTY_WEIGHT,
                    penalty_fraction=PENALTY_FRACTION, epochs=epochs, roots=len(th))
    base = ACTIONS.index(BASELINE)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-3)
    generator = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        net.train()
        order = torch.randperm(len(th), generator=generator)
        for start in range(0, len(th), batch):
            idx = order[start: start + batch]
            logits, eff = net(th[idx], dh[idx], sc[idx])
            loss, _ = objective(logits, be[idx], secs[idx], base)
            loss = loss + efficiency_weight * ((eff - be[idx]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        if log and (epoch + 1) % max(1, epochs // 5) == 0:
            log(f"epoch {epoch + 1}: loss {float(loss.detach()):.4f}")
    return net.eval()


@torch.no_grad()
def evaluate(net: Selector, data: dict) -> dict:
    """Offline, by the same estimator: mean E[tau + 1] / T of the selector's argmax choices against the baseline and
    the best single fixed action over the same roots (sums over roots, like tokens/s over a run)."""
    net.eval()
    logits, _ = net(data["target_hidden"].float(), data["draft_hidden"].float(), data["scalars"].float())
    be, secs = data["efficiency"].double(), data["seconds"].double()
    rows = torch.arange(len(be))
    chosen = logits.argmax(-1)
    fixed = be.sum(0) / secs.sum(0)  # tokens/s of each single fixed action over all roots
    best = int(fixed.argmax())
    base = ACTIONS.index(BASELINE)
    return {"selector_tps": float(be[rows, chosen].sum() / secs[rows, chosen].sum()),
            "selector_block_efficiency": float(be[rows, chosen].mean()),
            "best_fixed": ACTIONS[best], "best_fixed_tps": float(fixed[best]),
            "best_fixed_block_efficiency": float(be[:, best].mean()),
            "baseline_tps": float(fixed[base]), "baseline_block_efficiency": float(be[:, base].mean()),
            "oracle_tps": float((be / secs).max(-1).values.mean()),
            "distinct_choices": len(set(chosen.tolist()))}
