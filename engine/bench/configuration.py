"""The configuration a command runs: the app's by default, another where a flag picks it, named in every report.

The app loads every pair with the measured draft vocabulary and draft formats, its kernels and captured steps
chosen by this machine's probe, and sizes trees with the `auto` preset (treeviz/serving/pairs.py, the page's preset
menu). `python -m engine generate|bench|costs` default to exactly that (`APP_CONFIGURATION`), so a number the
command line prints is the number the page runs at; tests/test_cli.py checks the two load calls agree. A flag still
picks another configuration, and `run_configuration` records what was asked, what it became on this machine and
which flags differ from the app's, for the printed header and the JSON reports alike.
"""
from __future__ import annotations

from typing import Any

from engine.runtime import fused_projections

# argparse dest -> the value the app runs with (its load_pair call and its page's preset menu)
APP_CONFIGURATION: dict[str, str] = {
    "dtype": "auto",            # bf16 where this CPU has native bf16, else float32 (engine/models/devices.py)
    "packed_weights": "auto",   # packed formats offered to the per-shape probe
    "draft_vocab": "auto",      # the committed frequency table's 32,768 tokens where one fits the tokenizer
    "draft_quant": "auto",      # int8 / int4 / dyn8 offered to the draft's probe, routed per row count
    "fuse_draft": "on",         # the draft's q|k|v and gate|up stacked into one linear each (CPU: engine/cpu/fusion.py)
    "capture": "auto",          # captured steps where they build and measure faster
    "preset": "auto",           # tree sizes from this machine's measured costs
}
LABELS = {"dtype": "dtype", "packed_weights": "packed weights", "draft_vocab": "draft vocabulary",
          "draft_quant": "draft formats", "fuse_draft": "draft projections fused", "capture": "captured steps",
          "preset": "preset"}
DRAFT_KNOBS = ("draft_vocab", "draft_quant", "fuse_draft")


def flag(key: str) -> str:
    """The command-line flag of a configuration knob: "draft_quant" -> "--draft-quant"."""
    return "--" + key.replace("_", "-")


def differs_from_app(asked: dict[str, Any]) -> list[str]:
    """The knobs whose asked value is not the app's (None: the knob does not apply to this command), in
    APP_CONFIGURATION's order."""
    return [k for k, app in APP_CONFIGURATION.items()
            if asked.get(k) is not None and str(asked[k]).strip().lower() != app]


def run_configuration(pair, asked: dict[str, Any]) -> dict[str, Any]:
    """What a command ran with, for its JSON report: `flags` as asked (None: not used by this command), `ran` what
    each became on this pair and machine, `differs_from_app` the flags that are not the app's (empty: the app's
    configuration), `routing` each model's formats per row count. Recorded because a speedup or a c means little
    without the configuration that produced it."""
    has_draft = pair.draft is not None
    ran = {"dtype": str(pair.dtype).removeprefix("torch."),
           "packed_weights": "packed formats kept" if pair.packed else "none kept",
           "draft_vocab": (pair.draft_vocab or "full") if has_draft else None,
           "draft_quant": kept_formats(pair, "draft") if has_draft else None,
           "fuse_draft": ("q|k|v, gate|up" if fused_projections(pair.draft) else "off") if has_draft else None,
           "capture": pair.describe_capture(),
           "preset": asked.get("preset")}
    flags = {k: (None if asked.get(k) is None else str(asked[k])) for k in APP_CONFIGURATION}
    differs = differs_from_app(asked)
    return {"app": not differs, "differs_from_app": differs, "flags": flags, "ran": ran,
            "draft": pair.draft_name if has_draft else None, "routing": pair.routing()}


def kept_formats(pair, role: str) -> str:
    """The weight formats a model kept after the probe, e.g. "plain, int4, dyn8 kept" ("plain" where none was
    probed: another device, or only plain offered)."""
    choice = pair.formats.get(role)
    return f"{', '.join(choice.kept)} kept" if choice is not None and choice.kept else "plain"


def configuration_text(config: dict[str, Any]) -> str:
    """One line naming a run_configuration: whether it is the app's (else the flags that differ and the app's
    values), then each knob as asked -> as it ran, e.g. "configuration: the app's: dtype auto -> float32; ..."."""
    differs = config["differs_from_app"]
    if differs:
        head = ("configuration: differs from the app's in "
                + ", ".join(f"{flag(k)} {config['flags'][k]} (the app's: {APP_CONFIGURATION[k]})" for k in differs))
    else:
        head = "configuration: the app's"
    parts = []
    for key, label in LABELS.items():
        asked, ran = config["flags"].get(key), config["ran"].get(key)
        if asked is None or (key in DRAFT_KNOBS and config.get("draft") is None):
            continue
        parts.append(f"{label} {asked}" + (f" → {ran}" if ran is not None and str(ran) != asked else ""))
    if config.get("draft") is None:
        parts.append("no draft model")
    return f"{head}: " + "; ".join(parts)
