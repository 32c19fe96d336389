"""Verification rules, one module each, all behind `engine.verify.base.Verifier`.

greedy (temperature 0) | token_matching / nss | naive (chain), naive_tree | specinfer | spectr | khisti |
block (chain) | traversal. `default_verifier` picks greedy at temperature 0, token matching for deterministic children
and SpecInfer for sampled ones. May import: the core (contract `engine-rooms`).
"""
from engine.verify.base import TargetDists, Verdict, VerificationError, Verifier
from engine.verify.block import BlockVerification
from engine.verify.greedy import Greedy
from engine.verify.khisti import Khisti
from engine.verify.naive import Naive, NaiveTree
from engine.verify.nss import NSS, TokenMatching
from engine.verify.specinfer import SpecInfer
from engine.verify.spectr import SpecTr
from engine.verify.traversal import Traversal

VERIFIERS: dict[str, type[Verifier]] = {cls.name: cls for cls in (
    Greedy, TokenMatching, NSS, Naive, NaiveTree, SpecInfer, SpecTr, Khisti, BlockVerification, Traversal)}


def make_verifier(name: str = "greedy") -> Verifier:
    if name not in VERIFIERS:
        raise VerificationError(f"unknown verification rule {name!r}; choose from {', '.join(VERIFIERS)}")
    return VERIFIERS[name]()


def compatible_verifiers(strategy) -> list[str]:
    """Names of the rules that can check this strategy's trees losslessly (child-drawing mode, chain or tree)."""
    names = []
    for name, cls in VERIFIERS.items():
        try:
            cls().check_strategy(strategy)
        except VerificationError:
            continue
        names.append(name)
    return names


def default_verifier(child_mode: str, greedy: bool) -> Verifier:
    """greedy at temperature 0; token matching for deterministic (top-k) children; SpecInfer for sampled ones."""
    if greedy:
        return Greedy()
    return TokenMatching() if child_mode == "topk" else SpecInfer()


__all__ = ["VERIFIERS", "TargetDists", "Verdict", "VerificationError", "Verifier", "compatible_verifiers",
           "default_verifier", "make_verifier"]
