"""A vocabulary-trimmed draft head (the FR-Spec / VocabTrim idea): the draft scores only the V′ most frequent tokens.

The draft's LM head is a large share of a draft step (151,936 × 896 for Qwen2.5-0.5B, ~18 % of it). Most of those
rows are tokens the draft almost never proposes. `trim_head` replaces the head by one that multiplies by the V′
rows of frequent tokens only and writes their logits into a full-vocabulary tensor whose other entries are -inf.
Every consumer then sees an ordinary full-vocabulary distribution: softmax gives q renormalised over V′ and exactly
0 elsewhere, which is the q every verification rule and every tree strategy sees. The target still scores every
token, so greedy output stays exact and sampling stays lossless (a token outside V′ is emitted through the
residual / bonus draw with the target's probability); only the draft's proposals change.

Which tokens are frequent comes from a table the project builds itself (scripts/make_vocab_table.py) from text any
Python install carries: the standard library's sources and pydoc's topic texts. The table for the default pair's
tokenizer is committed under assets/vocab/; for any other tokenizer it is built on first use (from a smaller slice
of the same text) and cached in cache_dir()/vocab.
"""
from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from engine.runtime import cache_dir

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "vocab"
MIN_VOCAB = 64  # the CLI's floor: with fewer, a wide top-k would propose tokens of draft probability zero
_RUNTIME_CORPUS_CHARS = 4_000_000  # building a table on first use: a few seconds of tokenizing


class VocabError(ValueError):
    """A draft vocabulary that cannot be used."""


class TrimmedHead(nn.Module):
    """LM head over `ids` only; returns full-vocabulary logits with -inf outside `ids`."""

    def __init__(self, head: nn.Linear, ids: torch.Tensor):
        super().__init__()
        weight = head.weight.detach()[ids].clone()
        bias = None if head.bias is None else head.bias.detach()[ids].clone()
        self.linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                                device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            if bias is not None:
                self.linear.bias.copy_(bias)
        self.register_buffer("ids", ids.to(weight.device), persistent=False)
        self.vocab_size = head.out_features
        self.vocab_rows = len(ids)

    @property
    def weight(self) -> torch.Tensor:  # transformers' generate reads output embeddings' weight for dtype/device
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sub = self.linear(x)
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids, sub)

    def extra_repr(self) -> str:
        return f"vocab_rows={self.vocab_rows} of {self.vocab_size}"


def trim_head(model, ids: list[int] | torch.Tensor) -> TrimmedHead:
    """Replace `model`'s output head by a TrimmedHead over `ids` (sorted, unique); returns it."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise VocabError(f"the draft's output head is a {type(head).__name__}, not a linear layer: cannot trim it")
    ids = torch.as_tensor(sorted(set(int(i) for i in ids)), dtype=torch.long)
    if len(ids) == 0 or int(ids.max()) >= head.out_features or int(ids.min()) < 0:
        raise VocabError("trimmed vocabulary ids fall outside the model's vocabulary")
    trimmed = TrimmedHead(head, ids)
    model.set_output_embeddings(trimmed)
    return trimmed


AUTO_VOCAB = 32768  # `auto`'s head: DynaTree's L̄ unchanged within noise, the draft step cheaper (docs/engine.md)


def parse_draft_vocab(value) -> int | str | None:
    """'full' / None / 0 -> None (whole vocabulary); N -> N; 'auto' -> 'auto' (`auto_draft_vocab` decides)."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("", "full", "none", "0"):
        return None
    if text == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        raise VocabError(f"--draft-vocab must be 'full' or a token count, got {value!r}") from None
    if n < MIN_VOCAB:
        raise VocabError(f"--draft-vocab must be at least {MIN_VOCAB} (or 'full'), got {n}")
    return n


# ----------------------------------------------------------------------------------------------------------------------
# the frequency table


def tokenizer_fingerprint(tokenizer) -> str:
    """Identifies a vocabulary: ids mean the same tokens iff the fingerprints are equal. Kept on the tokenizer for
    its vocabulary's size (adding tokens grows it): a load asks twice (docs/experiments/2026-11-29-warm-start.md)."""
    kept = getattr(tokenizer, "treeviz_fingerprint", None)
    if kept is not None and kept[0] == len(tokenizer):
        return kept[1]
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    fingerprint = hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]
    tokenizer.treeviz_fingerprint = (len(tokenizer), fingerprint)
    return fingerprint


def corpus_files() -> list[Path]:
    """Text every Python install carries, in a fixed order: pydoc's topic texts, then the stdlib's .py sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts)
    topics = stdlib / "pydoc_data" / "topics.py"
    return ([topics] if topics.is_file() else []) + [p for p in files if p != topics]


def corpus_chunks(max_chars: int | None = None, chunk_chars: int = 20_000):
    """The corpus as text chunks (the topics module is mostly English prose about Python; the rest is code)."""
    total = 0
    for path in corpus_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if path.name == "topics.py" and path.parent.name == "pydoc_data":
            try:
                from pydoc_data.topics import topics
                text = "\n\n".join(topics[k] for k in sorted(topics))
            except ImportError:
                pass
        for start in range(0, len(text), chunk_chars):
            chunk = text[start:start + chunk_chars]
            if max_chars is not None and total + len(chunk) > max_chars:
                return
            total += len(chunk)
            yield chunk


def count_tokens(tokenizer, max_chars: int | None = None) -> Counter:
    counts: Counter = Counter()
    batch = []
    for chunk in corpus_chunks(max_chars):
        batch.append(chunk)
        if len(batch) == 64:
            for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                counts.update(ids)
            batch = []
    if batch:
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            counts.update(ids)
    return counts


def build_table(tokenizer, max_chars: int | None = None, keep: int = 32768) -> dict:
    """The frequency table: ids ordered by count (most frequent first), at most `keep` of them."""
    counts = count_tokens(tokenizer, max_chars)
    ids = [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))][:keep]
    return {"fingerprint": tokenizer_fingerprint(tokenizer), "vocab_size": len(tokenizer),
            "source": "pydoc_data topics + Python standard library sources", "ids": ids}


def frequency_table(tokenizer) -> list[int]:
    """Token ids by frequency: the committed asset for this tokenizer, else one built now and cached."""
    fp = tokenizer_fingerprint(tokenizer)
    for folder in (ASSETS, cache_dir() / "vocab"):
        file = folder / f"{fp}.json"
        if file.is_file():
            return json.loads(file.read_text())["ids"]
    table = build_table(tokenizer, _RUNTIME_CORPUS_CHARS)
    file = cache_dir() / "vocab" / f"{fp}.json"
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".tmp-{file.name}-{os.getpid()}")
    tmp.write_text(json.dumps(table))
    os.replace(tmp, file)
    return table["ids"]


def auto_draft_vocab(tokenizer, rows: int) -> int | None:
    """What `--draft-vocab auto` means for a draft of `rows` vocabulary rows: AUTO_VOCAB where a committed frequency
    table exists for the tokenizer and the head is more than twice that (the measured case: the default pair's
    151,936-row head, 18 % of a draft step), else the whole head (no table measured for it, or little to save)."""
    committed = (ASSETS / f"{tokenizer_fingerprint(tokenizer)}.json").is_file()
    return AUTO_VOCAB if committed and rows > 2 * AUTO_VOCAB else None


def draft_vocab_ids(tokenizer, n: int, always: list[int] = ()) -> list[int]:
    """The V′ = n most frequent ids, plus `always` (end-of-sequence and chat-template tokens the draft must be able
    to propose); topped up with the lowest unused ids where the table has fewer than n entries."""
    table = frequency_table(tokenizer)
    chosen = list(dict.fromkeys([*always, *table]))[:max(n, len(always))]
    if len(chosen) < n:
        taken = set(chosen)
        chosen += [i for i in range(len(tokenizer)) if i not in taken][: n - len(chosen)]
    return sorted(chosen)
