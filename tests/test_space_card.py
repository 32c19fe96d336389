"""Pre-flight for the Space: README.md's front matter against the Hub's documented keys and limits, and the install
against what ZeroGPU lists, so that a push is not the first check.

Sources (read 2026-12): the Hub's Spaces configuration reference (huggingface/hub-docs,
docs/hub/spaces-config-reference.md: the accepted keys, the SDKs, the thumbnail colours, the hardware flavours of
`suggested_hardware`, which "will not automatically assign an hardware"), its ZeroGPU page (docs/hub/spaces-zerogpu.md:
PyTorch 2.8.0, 2.9.1, 2.10.0, 2.11.0; Python 3.12.12, 3.10.13; ZeroGPU is selected in the Space's settings), and the
60-character limit of `short_description`, which the Hub enforces on upload (merged fixes of other projects: a
64-character one was rejected)."""
from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import gradio as gr
import yaml

from engine.recipe import split_pair
from treeviz.serving.pairs import GPU_PRESET, HUB_PRESETS

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTED_KEYS = {
    "title", "emoji", "colorFrom", "colorTo", "sdk", "python_version", "sdk_version", "suggested_hardware",
    "suggested_storage", "app_file", "app_build_command", "app_port", "base_path", "fullWidth", "header",
    "short_description", "models", "datasets", "tags", "thumbnail", "pinned", "hf_oauth", "hf_oauth_scopes",
    "hf_oauth_expiration_minutes", "hf_oauth_authorized_org", "disable_embedding", "startup_duration_timeout",
    "custom_headers", "preload_from_hub", "license",  # license: the repository card's, which Spaces share
}
COLOURS = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}
SDKS = {"gradio", "docker", "static"}
HARDWARE = {"cpu-basic", "cpu-upgrade", "t4-small", "t4-medium", "l4x1", "l4x4", "l40sx1", "l40sx4", "l40sx8",
            "a10g-small", "a10g-large", "a10g-largex2", "a10g-largex4", "a100-large", "a100x4", "a100x8"}
ZERO_GPU_TORCH = {"2.8.0", "2.9.1", "2.10.0", "2.11.0"}
ZERO_GPU_PYTHON = {"3.12.12", "3.10.13"}
SHORT_DESCRIPTION_MAX = 60


def front_matter() -> dict:
    text = (ROOT / "README.md").read_text()
    assert text.startswith("---\n"), "README.md must open with the Space's YAML block"
    return yaml.safe_load(text.split("---\n")[1])


def test_front_matter_uses_only_documented_keys_within_their_limits():
    card = front_matter()
    assert set(card) <= DOCUMENTED_KEYS, f"keys the Hub does not document: {set(card) - DOCUMENTED_KEYS}"
    assert card["sdk"] in SDKS and card["colorFrom"] in COLOURS and card["colorTo"] in COLOURS
    assert isinstance(card["short_description"], str) and len(card["short_description"]) <= SHORT_DESCRIPTION_MAX
    assert card.get("suggested_hardware", "cpu-basic") in HARDWARE  # it assigns nothing: ZeroGPU is a setting
    assert card["app_file"] == "app.py" and (ROOT / card["app_file"]).is_file()
    assert isinstance(card["pinned"], bool) and all(isinstance(m, str) for m in card["models"])


def test_the_space_installs_what_zero_gpu_lists():
    """python_version and the torch the Space's Python installs are versions ZeroGPU lists; the Gradio and spaces
    pins are the ones these tests run."""
    card = front_matter()
    assert card["python_version"] in ZERO_GPU_PYTHON
    requirements = (ROOT / "requirements.txt").read_text()
    pins = re.findall(r'^torch==([\d.]+); python_version >= "3\.12"$', requirements, re.M)
    assert len(pins) == 1 and pins[0] in ZERO_GPU_TORCH, pins
    assert card["sdk_version"] == gr.__version__ and f"gradio=={gr.__version__}" in requirements
    assert f"spaces=={version('spaces')}" in requirements


def test_front_matter_lists_the_apps_models():
    models = front_matter()["models"]
    assert models == [m for preset in HUB_PRESETS for m in split_pair(preset)]
    assert GPU_PRESET in HUB_PRESETS


def test_the_docs_say_zero_gpu_is_chosen_in_the_settings():
    page = (ROOT / "docs" / "app.md").read_text()
    assert "Space's settings" in page and "assigns no hardware" in page
