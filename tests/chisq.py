"""Pearson chi-square goodness of fit shared by the losslessness tests."""
import numpy as np
import torch


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; cells expecting < 5 are pooled. A count in a zero-probability cell is a
    certain failure."""
    n = counts.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat, dof = float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
