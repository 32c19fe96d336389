"""Prompt sets shipped in assets/prompts (code, chat, prose), generated from text every Python install carries."""
from __future__ import annotations

import json
from pathlib import Path

PROMPT_DIR = Path(__file__).resolve().parent.parent / "assets" / "prompts"
PROMPT_SETS = ("code", "chat", "prose")


def load_prompt_set(name: str) -> list[dict]:
    """Entries {"name", "kind", "prompt"}; `prompt` is text, or chat messages for the chat set."""
    names = PROMPT_SETS if name == "all" else (name,)
    entries = []
    for set_name in names:
        path = PROMPT_DIR / f"{set_name}.json"
        if set_name not in PROMPT_SETS or not path.exists():
            raise ValueError(f"unknown prompt set {set_name!r}; choose from {', '.join(PROMPT_SETS)} or all")
        entries += json.loads(path.read_text())
    return entries
