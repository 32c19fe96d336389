"""Sampling: the processing rule, its validation, and end-to-end losslessness through the decoder.

End to end (tiny 8-token model pair, T = 0.7, top-p 0.9): over seeded runs of 2 tokens, the joint distribution of the
first 2 emitted tokens matches the target's exact joint (chi-square against probabilities computed from the target
itself), for every registered strategy with its default rule and for every rule on a strategy it can check. The
first token comes from the prefill, the second from the first speculative iteration. At T = 0 every strategy and
every rule reproduce the greedy output exactly.
"""

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from chisq import chi_square_pvalue
from engine.core.sampling import Sampling, SamplingError
from engine.core.trace import RunSampling
from engine.decoder import Decoder
from engine.models import ModelPair
from engine.strategies import STRATEGIES, make_strategy
from engine.verify import VERIFIERS, VerificationError, make_verifier
from engine.verify.base import TopDown

# -- Sampling.process -----------------------------------------------------------------------------------------------


def test_process_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.25, 0.15], [0.4, 0.3, 0.2, 0.1]]))
    plain = Sampling(temperature=1.0).process(logits)
    assert plain.dtype == torch.float32 and torch.allclose(plain, logits.exp())
    hot = Sampling(temperature=2.0).process(logits)
    assert torch.allclose(hot, torch.softmax(logits / 2, -1))
    top2 = Sampling(temperature=1.0, top_k=2).process(logits)
    assert torch.allclose(top2[0], torch.tensor([0, 0.5, 0.25, 0]) / 0.75)
    nucleus = Sampling(temperature=1.0, top_p=0.6).process(logits)  # keep the fewest tokens reaching 0.6
    assert torch.allclose(nucleus[0], torch.tensor([0, 0.5, 0.25, 0]) / 0.75)
    assert torch.allclose(nucleus[1], torch.tensor([0.4, 0.3, 0, 0]) / 0.7)
    assert torch.allclose(Sampling(temperature=1.0, top_p=0.01).process(logits)[1], torch.tensor([1.0, 0, 0, 0]))
    # temperature first, then top-k, then top-p, renormalised
    both = Sampling(temperature=0.5, top_k=3, top_p=0.8).process(logits[1])
    sharp = torch.softmax(logits[1] / 0.5, -1)[:3]
    kept = sharp[:2] if sharp[0] / sharp.sum() < 0.8 else sharp[:1]
    assert torch.allclose(both[: len(kept)], kept / kept.sum()) and both[len(kept):].sum() == 0
    assert torch.allclose(both.sum(), torch.tensor(1.0))


def test_greedy_processing_is_one_hot_argmax():
    logits = torch.randn(3, 7)
    probs = Sampling(temperature=0).process(logits)
    assert Sampling().greedy and torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.sum(-1), torch.ones(3))


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": 1e6}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"top_k": True}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": -1}, "top_p"),
    ({"seed": -3}, "seed"), ({"seed": 1.5}, "seed"),
])
def test_absurd_settings_are_refused(kwargs, match):
    with pytest.raises(SamplingError, match=match):
        Sampling(**kwargs)


# -- a tiny 8-token model pair ---------------------------------------------------------------------------------------
V, PROMPT, ALPHA = 8, "abcab", 1e-3
SAMPLING = dict(temperature=0.7, top_p=0.9)


class ModTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % V for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + int(i)) for i in ids)

    def batch_decode(self, sequences, skip_special_tokens=False):
        return [self.decode(ids) for ids in sequences]


def tiny_v8_pair(draft_name: str = "tiny-v8-draft") -> "NoEosPair":
    """An 8-token target and a related draft (close to the target, not equal); shared with test_draft_options."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    target, draft = Qwen2ForCausalLM(cfg).eval(), Qwen2ForCausalLM(cfg).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(torch.randn_like(w) * 0.05 * w.std().clamp(min=1e-3))
    return NoEosPair(target, draft, ModTokenizer(), torch.device("cpu"), torch.float32, "tiny-v8", draft_name)


@pytest.fixture(scope="module")
def small_pair():
    return tiny_v8_pair()


class NoEosPair(ModelPair):
    """The engine's own pair type over the 8-token models; no end-of-sequence token, so runs never stop early."""

    @property
    def eos_token_ids(self) -> list[int]:
        return []


def target_joint(pair, sampling: dict = SAMPLING) -> np.ndarray:
    """Exact P(first two tokens) under the target with the test's sampling rule."""
    process = Sampling(**sampling).process
    ids = ModTokenizer()(PROMPT)["input_ids"]
    with torch.no_grad():
        first = process(pair.target(torch.tensor([ids])).logits[0, -1]).double()
        joint = np.zeros((V, V))
        for y in range(V):
            if first[y] > 0:
                second = process(pair.target(torch.tensor([ids + [y]])).logits[0, -1]).double()
                joint[y] = (first[y] * second).numpy()
    return joint.reshape(-1)




# Small trees keep a 2-token run cheap; strategies not listed run with their defaults.
SMALL = {"linear": {"k": 2}, "fixed": {"depth": 2, "branch": 2}, "dynatree": {"budget": 6, "d0": 2, "d_max": 3},
         "dyspec": {"budget": 6, "max_depth": 2}, "salf": {"n": 6, "b": 3, "max_depth": 2},
         "eagle2": {"n": 6, "k": 2, "depth": 2}, "ddtree": {"budget": 6, "block": 2},
         "delayed": {"k": 2, "l1": 1, "l2": 1}}
RUNS = 200


def first_two_counts(pair, name, rule, runs=RUNS, extra=None, sampling: dict = SAMPLING) -> np.ndarray:
    counts = np.zeros(V * V, dtype=np.int64)
    for seed in range(runs):
        params = {**SMALL.get(name, {}), **(extra or {})}
        if any(p.name == "seed" for p in STRATEGIES[name].params):
            params["seed"] = seed  # a strategy with its own draft sampler: fresh draws every run
        verifier = rule() if isinstance(rule, type) else (make_verifier(rule) if rule else None)
        decoder = Decoder(pair, make_strategy(name, **params), verifier, Sampling(**sampling, seed=seed))
        out = decoder.generate(PROMPT, max_new_tokens=2, stop_on_eos=False).output_ids
        counts[out[0] * V + out[1]] += 1
    return counts


def compatible(name: str) -> list[str]:
    """The sampling rules that accept this strategy."""
    rules = []
    for rule, cls in VERIFIERS.items():
        try:
            if not cls.greedy_only:
                cls().check_strategy(make_strategy(name, **SMALL.get(name, {})))
                rules.append(rule)
        except VerificationError:
            pass
    return rules


def default_rule(name: str) -> str:
    return "token_matching" if STRATEGIES[name].child_mode == "topk" else "specinfer"


# Every strategy with its default rule; then every other rule on a branching tree it can check (fixed: top-k,
# delayed: i.i.d.), else on the linear chain.
CASES = [(name, None) for name in STRATEGIES]
for _rule in VERIFIERS:
    for _host in [n for n in ("fixed", "delayed", "linear") if n in STRATEGIES]:
        if _rule in compatible(_host) and _rule != default_rule(_host):
            CASES.append((_host, _rule))
            break
if "delayed" in STRATEGIES:
    CASES.append(("delayed", "traversal"))  # bottom-up over merged i.i.d. paths


@pytest.mark.parametrize("name,rule", CASES)
def test_first_two_tokens_follow_the_target(small_pair, name, rule):
    pvalue = chi_square_pvalue(first_two_counts(small_pair, name, rule), target_joint(small_pair))
    assert pvalue > ALPHA, f"{name} with {rule or 'its default rule'}: chi-square p = {pvalue:.2g}"


@pytest.mark.parametrize("rule", ["specinfer", "naive_tree", "traversal"])
def test_branches_drawn_without_replacement_follow_the_target(small_pair, rule):
    counts = first_two_counts(small_pair, "delayed", rule, extra={"k": 3, "without_replacement": True})
    pvalue = chi_square_pvalue(counts, target_joint(small_pair))
    assert pvalue > ALPHA, f"delayed without replacement with {rule}: chi-square p = {pvalue:.2g}"


class AcceptFirstChild(TopDown):
    """Deliberately wrong: always accepts the draft's first child."""
    name, label = "accept_first_child", "wrong on purpose"

    def solve(self, tree, p, draws, rng, accept):
        return draws[0][0], tree.tokens[draws[0][0]], False


def test_end_to_end_harness_detects_a_wrong_rule(small_pair):
    pvalue = chi_square_pvalue(first_two_counts(small_pair, "fixed", AcceptFirstChild, runs=100),
                               target_joint(small_pair))
    assert pvalue < ALPHA


# -- plumbing ---------------------------------------------------------------------------------------------------------
def test_runs_are_seeded_and_record_sampling(small_pair):
    make = lambda seed: Decoder(small_pair, make_strategy("fixed"), sampling=Sampling(**SAMPLING, seed=seed))  # noqa
    a, b = (make(3).generate(PROMPT, max_new_tokens=24, stop_on_eos=False) for _ in range(2))
    assert a.output_ids == b.output_ids
    assert any(make(s).generate(PROMPT, max_new_tokens=24, stop_on_eos=False).output_ids != a.output_ids
               for s in range(4, 8))
    assert a.config.sampling == RunSampling(temperature=0.7, top_k=0, top_p=0.9, seed=3)
    assert a.config.verifier == "token_matching"
    # trace: p is the processed target probability; sampling rules fill accept_prob on tried children
    probs = [n.p for it in a.iterations for n in it.nodes if n.p is not None]
    assert probs and all(0.0 <= p <= 1.0 for p in probs)
    assert any(n.accept_prob is not None for it in a.iterations for n in it.nodes)


def test_default_rules(small_pair):
    hot = Sampling(**SAMPLING)
    assert Decoder(small_pair, make_strategy("fixed")).verifier.name == "greedy"
    assert Decoder(small_pair, make_strategy("fixed"), sampling=hot).verifier.name == "token_matching"
    if "delayed" in STRATEGIES:
        assert Decoder(small_pair, make_strategy("delayed"), sampling=hot).verifier.name == "specinfer"


def test_incompatible_pairs_are_refused(small_pair):
    hot = Sampling(**SAMPLING)
    with pytest.raises(VerificationError, match="temperature 0"):
        Decoder(small_pair, make_strategy("fixed"), make_verifier("greedy"), hot)
    with pytest.raises(VerificationError, match="spectr.*topk"):
        Decoder(small_pair, make_strategy("fixed"), make_verifier("spectr"), hot)
    with pytest.raises(VerificationError, match="single draft chain"):
        Decoder(small_pair, make_strategy("fixed"), make_verifier("block"), hot)


def greedy_reference(pair, n=30):
    return Decoder(pair, make_strategy("ar")).generate("hello world", max_new_tokens=n, stop_on_eos=False).output_ids


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_temperature_zero_is_exact_greedy(related_pair, name):
    """Sampling(temperature=0): the greedy rule, and the strategy's sampling rule with one-hot p, both give the
    target's greedy output."""
    for rule in (None, default_rule(name)):
        verifier = make_verifier(rule) if rule else None
        out = Decoder(related_pair, make_strategy(name), verifier, Sampling(temperature=0)).generate(
            "hello world", max_new_tokens=30, stop_on_eos=False).output_ids
        assert out == greedy_reference(related_pair), f"{name} with {rule or 'greedy'} at T = 0"


@pytest.mark.parametrize("name", [n for n in ("fixed", "delayed") if n in STRATEGIES])
def test_every_rule_is_greedy_at_temperature_zero(related_pair, name):
    for rule in compatible(name):
        out = Decoder(related_pair, make_strategy(name), make_verifier(rule), Sampling(temperature=0)).generate(
            "hello world", max_new_tokens=30, stop_on_eos=False).output_ids
        assert out == greedy_reference(related_pair), f"{name} with {rule} at T = 0"
