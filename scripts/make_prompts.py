"""Regenerate assets/prompts/*.json from real text that every Python install carries.

code:  signature + docstring of standard-library functions (the model completes the body);
prose: opening passages of the language reference topics in pydoc_data (the model continues the text);
chat:  questions about those same functions and topics, as chat messages.
Run: python -m scripts.make_prompts
"""
import ast
import inspect
import json
import re
import textwrap
from pathlib import Path

import pydoc_data.topics as topics

CODE_FUNCTIONS = [
    ("textwrap", "dedent"), ("calendar", "isleap"), ("string", "capwords"), ("shlex", "quote"),
    ("json", "dumps"), ("statistics", "median"), ("fnmatch", "translate"), ("base64", "b64encode"),
]
PROSE_TOPICS = ["assert", "for", "with", "lambda", "truth", "exceptions", "import", "slicings"]
CHAT_QUESTIONS = [
    "What does textwrap.dedent do, and when would I use it?",
    "Explain how the bisect module keeps a list sorted, with a short example.",
    "What is the difference between heapq.nsmallest and sorted(...)[:n]?",
    "How does Python's `with` statement work? Explain the context manager protocol briefly.",
    "Write a Python function that returns the median of a list without using the statistics module.",
    "When is an object considered false in Python? List the rules.",
    "What does the `assert` statement do, and why should it not be used to validate user input?",
    "How do I safely quote a filename for a shell command in Python?",
]


def code_prompt(module_name: str, func_name: str) -> str:
    module = __import__(module_name)
    source = inspect.getsource(getattr(module, func_name))
    node = ast.parse(textwrap.dedent(source)).body[0]
    body_start = node.body[1].lineno if len(node.body) > 1 else node.body[0].end_lineno + 1
    lines = textwrap.dedent(source).splitlines()[: body_start - 1]
    return "\n".join(lines) + "\n"


def prose_prompt(topic: str, words: int = 90) -> str:
    lines = topics.topics[topic].strip().splitlines()[2:]  # drop the title and its underline
    text = "\n".join(lines).strip()
    ends = [m.end() for m in re.finditer(r"\S+", text)]
    return text[: ends[min(words, len(ends)) - 1]]


def main() -> None:
    out = Path(__file__).resolve().parent.parent / "assets" / "prompts"
    out.mkdir(exist_ok=True)
    code = [{"name": f"{m}.{f}", "kind": "code", "prompt": code_prompt(m, f)} for m, f in CODE_FUNCTIONS]
    prose = [{"name": f"topic:{t}", "kind": "prose", "prompt": prose_prompt(t)} for t in PROSE_TOPICS]
    chat = [{"name": f"chat:{i}", "kind": "chat", "prompt": [{"role": "user", "content": q}]}
            for i, q in enumerate(CHAT_QUESTIONS)]
    for name, items in (("code", code), ("prose", prose), ("chat", chat)):
        (out / f"{name}.json").write_text(json.dumps(items, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
