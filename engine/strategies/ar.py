"""Autoregressive decoding: no draft, one target token per iteration. The baseline for every speedup."""
from engine.strategies.base import Strategy


class Autoregressive(Strategy):
    name = "ar"
    label = "Autoregressive (target only)"
    summary = "No draft model: each iteration is one target forward that emits one token."
    uses_draft = False
    chain = True
    presets = {"cpu": {}, "paper": {}}

    def build(self, drafter, tree) -> None:
        return  # the tree is the root alone: verification emits exactly the bonus token
