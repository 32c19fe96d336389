"""Cheap drafts (trimmed vocabulary head, int8 / int4 weights): they change only the proposals, never the output.

Greedy: every strategy reproduces the fp32 target's own greedy output with a trimmed and/or quantised draft.
Sampling: with a draft head trimmed to 5 of 8 tokens (q is zero on the other 3), the joint distribution of the first
two emitted tokens still matches the target's exact joint for every sampling rule (chi-square), and the excluded
tokens do get emitted: through the residual / bonus draw, with the target's probability.
"""
import json

import pytest
import torch

from chisq import chi_square_pvalue
from test_sampling import ALPHA, V, compatible, first_two_counts, target_joint, tiny_v8_pair
from engine.core.drafter import Drafter
from engine.decoder import Decoder
from engine.models import ModelLoadError, load_pair
from engine.models.vocab import (TrimmedHead, build_table, draft_vocab_ids, frequency_table, tokenizer_fingerprint,
                                 trim_head)
from engine.strategies import STRATEGIES, make_strategy
from engine.verify import VERIFIERS


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TREEVIZ_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def reference(cache):
    pair = load_pair("tiny-random", "tiny-random", dtype="fp32", packed="off", calibrate=False)
    return {prompt: Decoder(pair, make_strategy("ar")).generate(prompt, max_new_tokens=40,
                                                                 stop_on_eos=False).output_ids
            for prompt in PROMPTS}


PROMPTS = ("def f(x):\n    return", "The cat sat on")
OPTIONS = [dict(draft_vocab=96), dict(draft_quant="int8"), dict(draft_quant="int4"), dict(draft_quant="auto"),
           dict(draft_vocab=128, draft_quant="int4")]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_every_strategy_is_exact_with_a_cheap_draft(reference, options):
    pair = load_pair("tiny-random", "tiny-random", dtype="fp32", packed="on", **options)
    assert pair.costs is not None and pair.describe()
    for name in STRATEGIES:
        for prompt in PROMPTS:
            result = Decoder(pair, make_strategy(name)).generate(prompt, max_new_tokens=40, stop_on_eos=False)
            assert result.output_ids == reference[prompt], (name, options, prompt)


def test_auto_quant_offers_the_quantised_formats_to_the_drafts_probe_on_cpu_only(cache):
    from engine.cpu.kernels import QUANTISED, format_unavailable, quantize_linears, router_of
    pair = load_pair("tiny-random", "tiny-random", dtype="fp32", packed="on", draft_quant="auto")
    assert pair.draft_quant == "auto"
    offered = {p for p in QUANTISED if format_unavailable(p, pair.device, pair.dtype) is None}
    for name, group in pair.formats["draft"].groups.items():  # each probed on every weight shape it takes
        width, height = map(int, name.split("x"))
        takes = {p for p in offered if p != "int4" or (width % 64 == 0 and height % 16 == 0)}
        assert takes <= set(group.seconds) and set(group.kept) <= set(group.seconds)
    assert set(router_of(pair.draft).paths) == set(pair.formats["draft"].kept) | ({"plain"} & set(
        router_of(pair.draft).paths))  # only kept formats stay in memory (a tied plain weight aside)
    assert not set(QUANTISED) & {p for g in pair.formats["target"].groups.values() for p in g.seconds}  # never
    with torch.device("meta"):  # a model off the CPU: auto adds nothing, an explicit mode is refused
        model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    assert quantize_linears(model, "auto") == 0
    with pytest.raises(ValueError, match="CPU kernels"):
        quantize_linears(model, "int4")


def test_quantised_draft_routes_its_rows_to_int_paths_where_forced(reference):
    from engine.cpu.kernels import add_format
    pair = load_pair("tiny-random", "tiny-random", dtype="fp32", packed="off", draft_quant="int4")
    add_format(pair.draft, "int4")  # the probe may not have kept it on this machine: make it, then force it
    pair.draft.kernel_router.install(["int4"] * 64)  # every draft call on the quantised kernel, whatever the table says
    result = Decoder(pair, make_strategy("dynatree")).generate(PROMPTS[0], max_new_tokens=40, stop_on_eos=False)
    assert result.output_ids == reference[PROMPTS[0]]


def test_trimmed_draft_proposes_only_its_vocabulary(cache):
    pair = load_pair("tiny-random", "tiny-random", dtype="fp32", packed="off", calibrate=False, draft_vocab=80)
    head = pair.draft.get_output_embeddings()
    assert isinstance(head, TrimmedHead) and pair.draft_vocab == head.vocab_rows == 80
    allowed = set(head.ids.tolist())
    assert set(pair.eos_token_ids) <= allowed  # the draft can always propose the end of the text
    result = Decoder(pair, make_strategy("dynatree")).generate("hello world", max_new_tokens=30, stop_on_eos=False)
    drafted = {n.token for it in result.iterations for n in it.nodes if n.status not in ("root", "bonus")}
    assert drafted and drafted <= allowed
    # and q as every rule sees it: zero outside V′, a distribution over V′
    drafter = Drafter(pair.draft)
    from engine.core.tree import DraftTree
    tree = DraftTree(root_token=104)
    drafter.begin(tree, [104, 101, 108, 108, 104])
    with torch.inference_mode():
        q = drafter.expand([0])[0]
    outside = torch.ones_like(q, dtype=torch.bool)
    outside[head.ids] = False
    assert q[outside].abs().sum() == 0 and torch.isclose(q.sum(), torch.tensor(1.0))


def test_a_tokenizer_s_fingerprint_is_kept_until_its_vocabulary_grows():
    from engine.models import tiny_tokenizer
    tok, fresh = tiny_tokenizer(), tiny_tokenizer()
    first = tokenizer_fingerprint(tok)
    assert tokenizer_fingerprint(tok) == first == tokenizer_fingerprint(fresh)  # kept, and what a fresh one computes
    tok.add_tokens(["<an added token>"])
    assert tokenizer_fingerprint(tok) != first  # the ids now mean more tokens


def test_frequency_table_built_from_python_sources_and_cached(cache):
    from engine.models import tiny_tokenizer
    tok = tiny_tokenizer()
    table = build_table(tok, max_chars=200_000)
    assert table["fingerprint"] == tokenizer_fingerprint(tok)
    ids = table["ids"]
    assert ids[0] == ord(" ") and len(set(ids)) == len(ids)  # source code: the space byte is most frequent
    first = frequency_table(tok)
    assert frequency_table(tok) == first  # second call reads the cached file
    chosen = draft_vocab_ids(tok, 70, always=[256, 259])
    assert len(chosen) == 70 and {256, 259} <= set(chosen)


def test_committed_table_matches_its_tokenizer():
    from engine.models.vocab import ASSETS
    files = list(ASSETS.glob("*.json"))
    assert files, "assets/vocab holds the default tokenizer's table (scripts/make_vocab_table.py)"
    for file in files:
        data = json.loads(file.read_text())
        assert file.stem == data["fingerprint"] and len(data["ids"]) == len(set(data["ids"])) > 1000
        assert file.stat().st_size < 400_000


def test_bad_draft_options_are_refused(cache):
    with pytest.raises(ModelLoadError, match="at least 64"):
        load_pair("tiny-random", "tiny-random", dtype="fp32", calibrate=False, draft_vocab=10)
    with pytest.raises(ModelLoadError, match="'full' or a token count"):
        load_pair("tiny-random", "tiny-random", dtype="fp32", calibrate=False, draft_vocab="most")
    with pytest.raises(ModelLoadError, match="need a draft"):
        load_pair("tiny-random", None, dtype="fp32", calibrate=False, draft_quant="int8")


# -- sampling with a trimmed q: an 8-token pair whose draft scores only tokens 0..4 ---------------------------------
RUNS = 300
KEPT = [0, 1, 2, 3, 4]
SAMPLING = dict(temperature=1.0)


@pytest.fixture(scope="module")
def trimmed_pair():
    pair = tiny_v8_pair("tiny-v8-trimmed")
    trim_head(pair.draft, KEPT)
    return pair


# Every sampling rule, each on the first of these strategies that it can check.
CASES = []
for _rule in VERIFIERS:
    for _host in ("fixed", "delayed", "linear", "dyspec"):
        if _host in STRATEGIES and _rule in compatible(_host):
            CASES.append((_host, _rule))
            break


@pytest.mark.parametrize("name,rule", CASES)
def test_sampling_with_a_trimmed_q_follows_the_target(trimmed_pair, name, rule):
    counts = first_two_counts(trimmed_pair, name, rule, runs=RUNS, sampling=SAMPLING)
    joint = target_joint(trimmed_pair, SAMPLING)
    second = counts.reshape(V, V).sum(axis=0)
    assert second[[t for t in range(V) if t not in KEPT]].sum() > 0  # tokens the draft cannot propose are emitted
    pvalue = chi_square_pvalue(counts, joint)
    assert pvalue > ALPHA, f"{name} with {rule}: chi-square p = {pvalue:.2g}"


def test_only_a_default_model_that_still_needs_converting_is_prepared_ahead():
    from engine.models.packaged import prepare_ahead
    assert prepare_ahead("tiny-random-related", torch.float32) is None  # nothing to convert: no process started
