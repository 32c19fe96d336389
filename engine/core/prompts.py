"""Prompts: their encoding into token ids (plain text, or chat messages through the tokenizer's chat template), and
the prompt sets shipped in assets/prompts: code, chat and prose, generated from text every Python install carries
(scripts/make_prompts.py), and grounded, written by hand for context lookup."""
from __future__ import annotations

import json
from pathlib import Path

PROMPT_DIR = Path(__file__).resolve().parents[2] / "assets" / "prompts"
PROMPT_SETS = ("code", "chat", "prose")  # "all": what the bench, sweeps and gallery run by default
# Selectable by name only, outside "all" (adding them would change every existing benchmark): "grounded", prompts whose
# answer copies heavily from the input (edit this function, answer from this passage, fill this template).
EXTRA_PROMPT_SETS = ("grounded",)

Prompt = str | list[dict[str, str]]  # plain text, or chat messages rendered with the tokenizer's chat template


class PromptError(ValueError):
    """A prompt that cannot be decoded from (empty, or longer than the model allows)."""


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    if isinstance(prompt, list):
        if not prompt or not any(str(m.get("content", "")).strip() for m in prompt):
            raise PromptError("the chat prompt is empty: write a message first")
        out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        ids = list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)
    else:
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptError("the prompt is empty: type some text to continue")
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise PromptError("the prompt encodes to no tokens")
    return [int(i) for i in ids]


def prompt_text(prompt: Prompt) -> str:
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in prompt)
    return prompt


def load_prompt_set(name: str) -> list[dict]:
    """Entries {"name", "kind", "prompt"}; `prompt` is text, or chat messages for the chat set."""
    names = PROMPT_SETS if name == "all" else (name,)
    entries = []
    for set_name in names:
        path = PROMPT_DIR / f"{set_name}.json"
        if set_name not in PROMPT_SETS + EXTRA_PROMPT_SETS or not path.exists():
            raise ValueError(f"unknown prompt set {set_name!r}; choose from "
                             f"{', '.join(PROMPT_SETS + EXTRA_PROMPT_SETS)} or all")
        entries += json.loads(path.read_text())
    return entries
