"""How close two fp32 paths must be, from what fp32 kernels guarantee rather than from what one CPU showed.

Kernels of other row counts (a padded bucket, a compiled package, another ISA's GEMM blocking) sum in another order,
so fp32 results differ by rounding whose size depends on the problem's conditioning, not on the code under test.
The honest yardstick is the answer itself: the same weights and inputs in float64 (rounding ~1e-16, exact for these
purposes). A path under test is then required to be as accurate as the reference path on the same machine's kernels,
`FACTOR` times over, never tighter than fp32's unit roundoff over the longest reduction allows. A real defect (a mask
leak, a wrong position, a stale row) is wrong by O(1) of the logits' spread, orders of magnitude past this bound:
`assert_caught` checks that for the defect class a test guards against, so the bound cannot silently grow too loose.
"""
from __future__ import annotations

import torch

FACTOR = 4.0  # reordered sums of the same length: each path's error is the same order; 4x leaves room for either
UNIT_ROUNDOFF = 2.0 ** -24  # fp32


def floor_bound(exact: list[torch.Tensor], reduction: int) -> float:
    """The smallest error any fp32 ordering may show: sqrt(K) * u of the largest magnitude (a random-walk sum of K
    terms), so a reference path that happens to round exactly does not make the bound zero."""
    largest = max(float(x.detach().abs().max()) for x in exact)
    return reduction ** 0.5 * UNIT_ROUNDOFF * largest


def accuracy_bound(reference: list[torch.Tensor], exact: list[torch.Tensor], reduction: int) -> float:
    """FACTOR x the reference path's largest error against float64, floored by `floor_bound`."""
    error = max(float((r.detach().double() - e.detach().double()).abs().max()) for r, e in zip(reference, exact))
    return max(FACTOR * error, floor_bound(exact, reduction))


def assert_as_accurate(got: list[torch.Tensor], reference: list[torch.Tensor], exact: list[torch.Tensor],
                       reduction: int) -> float:
    """Every tensor of `got` within `accuracy_bound` of float64's answer; and wherever float64's top two logits are
    further apart than twice the bound, the same argmax (greedy decoding reads only that). Returns the bound."""
    bound = accuracy_bound(reference, exact, reduction)
    assert len(got) == len(exact)
    for i, (g, e) in enumerate(zip(got, exact)):
        error = float((g.detach().double() - e.detach().double()).abs().max())
        assert error <= bound, f"forward {i}: off float64 by {error:.3g}, the reference path's rounding allows {bound:.3g}"
        top = e.double().topk(2, dim=-1)
        clear = (top.values[..., 0] - top.values[..., 1]) > 2 * bound
        assert torch.equal(g.argmax(-1)[clear], top.indices[..., 0][clear]), f"forward {i}: argmax differs"
    return bound


def assert_caught(wrong: list[torch.Tensor], exact: list[torch.Tensor], bound: float) -> None:
    """A deliberately broken run is off by far more than the bound: the test can fail for the defect it guards."""
    error = max(float((w.detach().double() - e.detach().double()).abs().max()) for w, e in zip(wrong, exact))
    assert error > 10 * bound, f"a broken run is off by only {error:.3g} against a bound of {bound:.3g}"
