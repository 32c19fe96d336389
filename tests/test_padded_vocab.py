"""Pairs whose embedding tables differ only by padding rows (Qwen2.5-7B against 0.5B) load through load_pair and
decode exactly: greedy output equals the target alone, token for token, in fp32.

The tiny pairs are built that way: one byte-level tokenizer (260 ids), a target whose table has PAD extra rows, and
a draft that is the target's first 260 rows plus small noise (or, the other way round, a wider draft).
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from engine.core.sampling import Sampling
from engine.decoder import Decoder
from engine.models import ModelLoadError, load_pair, tiny_config, tiny_random_model, tiny_tokenizer
from engine.models.widths import GuardedEmbedding, WidthHead
from engine.strategies import make_strategy

PAD = 12
TOKENS = 260  # len(tiny_tokenizer())
PROMPT = "def padded_rows(x):\n    return"


def narrowed(model, rows: int, seed: int, noise: float = 0.005):
    """`model` with its embedding and head cut (or zero-extended) to `rows` rows, plus N(0, noise^2) per weight."""
    config = copy.deepcopy(model.config)
    config.vocab_size = rows
    out = tiny_random_model(seed, config=config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for (name, p), q in zip(out.named_parameters(), model.parameters()):
            keep = min(p.shape[0], q.shape[0])
            p.zero_()
            p[:keep] = q[:keep]
            if "norm" not in name and not name.endswith("bias"):
                p[:keep] += torch.randn(p[:keep].shape, generator=g) * noise
    return out


def save(folder: Path, model, tokenizer=None) -> str:
    model.save_pretrained(folder)
    (tokenizer or tiny_tokenizer()).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("padded")
    wide = tiny_random_model(0, config=tiny_config(vocab_size=TOKENS + PAD))  # the 7B's side: padding rows
    narrow = narrowed(wide, TOKENS, seed=5)                                  # the 0.5B's side
    return {"wide": save(root / "wide", wide), "narrow": save(root / "narrow", narrow),
            "wider-draft": save(root / "wider-draft", narrowed(narrow, TOKENS + 2 * PAD, seed=6)),
            "other-tok": save(root / "other-tok", narrow, tiny_tokenizer(["<|x|>"])),
            "too-small": save(root / "too-small", narrowed(wide, TOKENS - 2, seed=7))}


def load(folders, target: str, draft: str):
    return load_pair(folders[target], folders[draft], dtype="fp32", device="cpu", packed="off", calibrate=False)


@pytest.fixture(scope="module")
def pair(folders):
    return load(folders, "wide", "narrow")


def target_alone(pair, n: int, sampling: Sampling | None = None):
    return Decoder(pair, make_strategy("ar"), sampling=sampling).generate(PROMPT, max_new_tokens=n,
                                                                         stop_on_eos=False).output_ids


def test_pair_loads_with_the_draft_at_the_target_width(pair):
    head = pair.draft.get_output_embeddings()
    assert isinstance(head, WidthHead) and (head.rows, head.width) == (TOKENS, TOKENS + PAD)
    assert isinstance(pair.draft.get_input_embeddings(), GuardedEmbedding)
    with torch.inference_mode():
        logits = pair.draft(input_ids=torch.tensor([[1, 2, 3]])).logits[0]
    assert logits.shape == (3, TOKENS + PAD)
    assert torch.isinf(logits[:, TOKENS:]).all() and torch.isfinite(logits[:, :TOKENS]).all()
    q = torch.softmax(logits, -1)
    assert (q[:, TOKENS:] == 0).all()  # the draft never proposes an id it has no row for


@pytest.mark.parametrize("name", ["linear", "dynatree", "eagle2"])
def test_greedy_equals_the_target_alone(pair, name):
    want = target_alone(pair, 40)
    result = Decoder(pair, make_strategy(name)).generate(PROMPT, max_new_tokens=40, stop_on_eos=False)
    assert result.output_ids == want
    assert result.metrics.mean_accepted_len > 0.5  # the draft does draft: it shares the target's rows


def test_a_wider_draft_is_cut_to_the_target(folders):
    pair = load(folders, "narrow", "wider-draft")
    assert pair.draft(input_ids=torch.tensor([[4, 5]])).logits.shape[-1] == TOKENS
    assert not isinstance(pair.draft.get_input_embeddings(), GuardedEmbedding)  # every target id fits its table
    result = Decoder(pair, make_strategy("dynatree")).generate(PROMPT, max_new_tokens=30, stop_on_eos=False)
    assert result.output_ids == target_alone(pair, 30)


@pytest.mark.parametrize("name", ["dynatree", "delayed"])  # token matching; SpecInfer over the whole q
def test_seeded_sampling_runs_and_repeats(pair, name):
    sampling = Sampling(temperature=0.9, seed=11)
    runs = [Decoder(pair, make_strategy(name), sampling=sampling).generate(
        PROMPT, max_new_tokens=30, stop_on_eos=False).output_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 30
    assert all(0 <= t < TOKENS + PAD for t in runs[0])


def test_an_id_past_the_draft_table_reads_the_fallback_row(pair):
    """The target may sample one of its padding rows; the draft must then not index out of its table."""
    embed = pair.draft.get_input_embeddings()
    fallback = embed.fallback
    assert fallback == pair.tokenizer.pad_token_id
    with torch.inference_mode():
        got = embed(torch.tensor([[3, TOKENS + 1]]))
    torch.testing.assert_close(got[0, 1], embed.weight[fallback], rtol=0, atol=0)
    torch.testing.assert_close(got[0, 0], embed.weight[3], rtol=0, atol=0)


def test_refuses_other_tokenizers_and_tables_too_small(folders):
    with pytest.raises(ModelLoadError, match="tokenizers differ"):
        load(folders, "wide", "other-tok")
    with pytest.raises(ModelLoadError, match="do not fit"):
        load(folders, "wide", "too-small")
