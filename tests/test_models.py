"""engine/models/: tiny pairs, dtype/device resolution, refusals, local loading, default-pair assembly.

Fast and offline: nothing here loads the real Qwen pair (another suite does) or touches a model hub.
"""
import functools
import hashlib
import importlib.util
import itertools
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine import models
from engine.models import devices, packaged
from engine.models import (
    PAIRS,
    ModelLoadError,
    PackagedModel,
    assemble_chunks,
    check_rollbackable,
    find_chunks,
    load_model,
    load_pair,
    resolve_device,
    resolve_dtype,
    tiny_config,
    tiny_random_model,
    tiny_random_pair,
    tiny_tokenizer,
)
from engine.runtime import cache_dir

PROMPTS = ["def fibonacci(n):", "Hello, my name is", "The quick brown fox", "12345", "ü"]


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    # never write into the real cache (or the repo) from tests
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path / "cache"))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny models gain nothing from threads, and on a busy 2-core box OpenMP spinning makes each step ~6x slower
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@torch.no_grad()
def greedy(model, ids, n):
    """Plain sequential greedy decoding with the KV cache, one token per forward."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@functools.cache
def target_greedy(prompt, n=200):
    """Greedy continuation by the tiny target (seed 0): the same target in every tiny pair."""
    pair = tiny_random_pair(None)
    return greedy(pair.target, pair.tokenizer.encode(prompt), n)


@torch.no_grad()
def agreement(pair, prompt, n=150):
    """Fraction of positions along the target's greedy continuation where the draft's argmax is the target's."""
    ids = pair.tokenizer.encode(prompt)
    seq = torch.tensor([ids + target_greedy(prompt)[:n]])
    t = pair.target(seq).logits[0, len(ids) - 1:-1].argmax(-1)
    d = pair.draft(seq).logits[0, len(ids) - 1:-1].argmax(-1)
    return (t == d).float().mean().item()


# ---- tiny pairs -------------------------------------------------------------------------------------------------


def test_tiny_pair_builds_fast_and_is_sane():
    tiny_random_pair()  # warm up imports
    t0 = time.perf_counter()
    pair = tiny_random_pair("related", seed=0)
    assert time.perf_counter() - t0 < 1.0
    assert pair.draft is not None and pair.draft is not pair.target
    assert not pair.target.training and not pair.draft.training
    assert pair.target.config._attn_implementation == "tree_sdpa"  # sdpa, grouped heads folded (engine/core/attention.py)
    assert pair.target.dtype == torch.float32 and pair.device == torch.device("cpu")
    assert pair.target.config.vocab_size == len(pair.tokenizer)
    assert pair.eos_token_ids == [pair.tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                                  pair.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    line = pair.describe()
    assert "tiny-random" in line and "cpu" in line and "float32" in line and "sdpa" in line


def test_tiny_models_are_deterministic_and_leave_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = tiny_random_pair(seed=0)
    after = torch.rand(3)
    b = tiny_random_pair(seed=0)
    c = tiny_random_pair(seed=1)
    assert torch.equal(before, after)
    ids = torch.tensor([a.tokenizer.encode("same seed, same model")])
    with torch.no_grad():
        assert torch.equal(a.target(ids).logits, b.target(ids).logits)
        assert torch.equal(a.draft(ids).logits, b.draft(ids).logits)
        assert not torch.allclose(a.target(ids).logits, c.target(ids).logits)


def test_identical_draft_has_identical_logits():
    pair = tiny_random_pair("identical")
    assert pair.draft is not pair.target
    ids = torch.tensor([pair.tokenizer.encode("identical drafts accept everything")])
    with torch.no_grad():
        assert torch.equal(pair.target(ids).logits, pair.draft(ids).logits)
    assert agreement(pair, PROMPTS[0], 60) == 1.0


def test_related_draft_differs_but_mostly_agrees():
    pair = tiny_random_pair("related")
    ids = torch.tensor([pair.tokenizer.encode("related drafts are close, not equal")])
    with torch.no_grad():
        assert not torch.equal(pair.target(ids).logits, pair.draft(ids).logits)
    rates = [agreement(pair, p) for p in PROMPTS]
    mean = sum(rates) / len(rates)
    assert 0.6 <= mean <= 0.9, rates


def test_unrelated_draft_rarely_agrees():
    pair = tiny_random_pair("unrelated")
    rates = [agreement(pair, p) for p in PROMPTS]
    assert sum(rates) / len(rates) < 0.1, rates


def test_no_draft_pair():
    pair = tiny_random_pair(None)
    assert pair.draft is None and "none" in pair.describe()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tiny_greedy_text_is_not_degenerate(prompt):
    # trees are only interesting if greedy decoding does not fall into a short loop
    pair = tiny_random_pair()
    tokens = target_greedy(prompt, 200)
    assert tokens[:20] == greedy(pair.target, pair.tokenizer.encode(prompt), 20)
    longest_run = max(len(list(g)) for _, g in itertools.groupby(tokens))
    assert longest_run <= 3 and len(set(tokens)) > 50
    assert len(set(tokens[-50:])) > 20  # no late collapse into a short cycle either
    assert not set(tokens) & set(pair.eos_token_ids)  # random text does not stop early


@torch.no_grad()
def test_tiny_logits_are_peaky_and_consistent_across_query_lengths():
    # exactness tests compare tree decoding (N-token queries) with sequential (1-token) decoding in fp32
    pair = tiny_random_pair()
    ids = pair.tokenizer.encode("consistency of one-token and many-token queries")
    full = pair.target(torch.tensor([ids])).logits[0]
    out = pair.target(torch.tensor([ids[:10]]), use_cache=True)
    step = pair.target(torch.tensor([[ids[10]]]), past_key_values=out.past_key_values).logits[0, -1]
    assert (step - full[10]).abs().max().item() < 1e-4
    top2 = full.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert gaps.median().item() > 0.1  # not near-uniform
    probs = full.softmax(-1).max(-1).values
    assert 0.1 < probs.mean().item() < 0.95  # neither uniform nor one-hot


def test_tiny_pair_other_dtype_and_layers():
    pair = tiny_random_pair("identical", dtype="bf16", num_layers=3)
    assert pair.target.dtype == torch.bfloat16 and pair.draft.dtype == torch.bfloat16
    assert pair.target.config.num_hidden_layers == 3


@pytest.mark.parametrize("text", ["", "hello", "héllo wörld — 你好, 世界 🎉🚀",
                                  "tabs\tand\nnewlines\r\n  spaces ",
                                  "\x00\x01 control", "<|endoftext|> literal specials <|im_end|>",
                                  "def f(x):\n    return x ** 2  # ∑"])
def test_tokenizer_round_trips(text):
    tok = tiny_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert all(0 <= i < len(tok) for i in ids)


def test_tokenizer_bytes_are_ids():
    tok = tiny_tokenizer()
    assert tok.encode("A\xff", add_special_tokens=False) == [65, 0xC3, 0xBF]
    assert tok.decode([0xE2, 0x82, 0xAC]) == "€"
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                              tokenize=False, add_generation_prompt=True)


# ---- dtype / device ---------------------------------------------------------------------------------------------


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ModelLoadError, match="Unknown device"):
        resolve_device("tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            resolve_device("cuda")


@pytest.mark.parametrize("name,expected", [("fp32", torch.float32), ("float32", torch.float32),
                                           ("bf16", torch.bfloat16), ("BFloat16", torch.bfloat16),
                                           ("fp16", torch.float16),
                                           ("float16", torch.float16), ("torch.float32", torch.float32),
                                           (torch.bfloat16, torch.bfloat16)])
def test_resolve_dtype_names(name, expected):
    assert resolve_dtype(name, torch.device("cpu")) == expected


def test_resolve_dtype_auto_on_cpu(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(devices, "cpu_has_fast_bf16", lambda: True)
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(devices, "cpu_has_fast_bf16", lambda: False)
    assert resolve_dtype("auto", cpu) == torch.float32


def test_resolve_dtype_auto_on_cuda(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", cuda) == torch.float16


def test_cpu_bf16_detection_reads_cpuinfo(monkeypatch):
    """The flags, ATen's ISA and oneDNN's bf16 GEMMs all decide: each is stood in, so the answer is this logic's, not
    the CPU's that runs the test (a real AVX2-only machine failed the version that stood in the flags alone)."""
    monkeypatch.setattr(devices, "cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(devices, "onednn_bf16", lambda: True)
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "flags : fpu sse2 avx512f amx_bf16 amx_tile\n")
    assert devices.cpu_has_fast_bf16()
    monkeypatch.setattr(devices, "cpu_capability", lambda: "AVX2")  # ATen lowered to AVX2 (an emulated AVX2 CPU)
    assert not devices.cpu_has_fast_bf16()
    monkeypatch.setattr(devices, "cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(devices, "onednn_bf16", lambda: False)  # oneDNN without bf16 GEMMs
    assert not devices.cpu_has_fast_bf16()
    monkeypatch.setattr(devices, "onednn_bf16", lambda: True)
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "flags : fpu sse2 avx512f avx512_vnni\n")
    assert not devices.cpu_has_fast_bf16()


@pytest.mark.parametrize("bad", ["fp8", "int4", "double", torch.int64])
def test_resolve_dtype_refuses_unknown(bad):
    with pytest.raises(ModelLoadError, match="dtype"):
        resolve_dtype(bad, torch.device("cpu"))


def test_load_pair_refuses_unknown_dtype_and_device():
    with pytest.raises(ModelLoadError, match="dtype"):
        load_pair("tiny-random", "tiny-random", dtype="fp64")
    with pytest.raises(ModelLoadError, match="device"):
        load_pair("tiny-random", "tiny-random", device="quantum")


# ---- load_pair on specs, shorthands ---------------------------------------------------------------------------


def test_pairs_shorthands_load():
    assert set(PAIRS) >= {"default", "tiny-random", "tiny-random-unrelated", "tiny-random-identical"}
    assert PAIRS["default"] == ("default-target", "default-draft")
    seen = []
    # packed="off": the two models' separately measured cost tables may route a 3-row call to different kernels
    pair = load_pair(*PAIRS["tiny-random-identical"], dtype="fp32", device="cpu", packed="off",
                     progress=lambda f, m: seen.append((f, m)))
    ids = torch.tensor([pair.tokenizer.encode("abc")])
    with torch.no_grad():
        assert torch.equal(pair.target(ids).logits, pair.draft(ids).logits)
    assert seen and seen[-1][0] == 1.0 and all(0.0 <= f <= 1.0 for f, _ in seen)
    assert [f for f, _ in seen] == sorted(f for f, _ in seen)


def test_tiny_specs_match_tiny_random_pair():
    # as the target every tiny-random-* spec is the same tiny target; as the draft the suffix picks the kind
    ref = tiny_random_pair("unrelated")
    pair = load_pair("tiny-random-unrelated", "tiny-random-unrelated", dtype="fp32", device="cpu")
    ids = torch.tensor([ref.tokenizer.encode("xyz")])
    with torch.no_grad():
        assert torch.equal(pair.target(ids).logits, ref.target(ids).logits)
        assert torch.equal(pair.draft(ids).logits, ref.draft(ids).logits)
    assert load_pair("tiny-random", None, dtype="fp32", device="cpu").draft is None
    assert load_pair("tiny-random", "none", dtype="fp32", device="cpu").draft is None
    with pytest.raises(ModelLoadError, match="tiny"):
        load_model("tiny-random-weird", dtype="fp32", device="cpu", role="draft")


# ---- local directories and refusals -----------------------------------------------------------------------------


def save_tiny(folder: Path, config=None, tokenizer=None, seed=0) -> Path:
    model = tiny_random_model(seed, config=config)
    model.save_pretrained(folder)
    (tokenizer or tiny_tokenizer()).save_pretrained(folder)
    return folder


def test_local_directory_round_trip(tmp_path):
    folder = save_tiny(tmp_path / "tiny")
    model, tok, name = load_model(str(folder), dtype="fp32", device="cpu")
    assert name.startswith("tiny") and "local" in name
    assert model.config._attn_implementation == "sdpa" and not model.training
    ref = tiny_random_model(0)
    ids = torch.tensor([tok.encode("round trip through save_pretrained ✓")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    assert tok.decode(tok.encode("héllo 🎉", add_special_tokens=False)) == "héllo 🎉"

    pair = load_pair(str(folder), str(folder), dtype="bf16", device="cpu")
    assert pair.target.dtype == torch.bfloat16 and pair.draft is not None
    assert 256 in pair.eos_token_ids


def test_draft_reuses_identical_tokenizer(tmp_path):
    a, b = save_tiny(tmp_path / "a"), save_tiny(tmp_path / "b", seed=1)
    _, tok_a, _ = load_model(str(a), dtype="fp32", device="cpu")
    _, tok_b, _ = load_model(str(b), dtype="fp32", device="cpu", role="draft", tokenizer=tok_a)
    assert tok_b is tok_a
    c = save_tiny(tmp_path / "c", tokenizer=tiny_tokenizer(["<|x|>"]))
    _, tok_c, _ = load_model(str(c), dtype="fp32", device="cpu", role="draft", tokenizer=tok_a)
    assert tok_c is not tok_a and "<|x|>" in tok_c.get_vocab()


def test_refuses_vocab_size_mismatch(tmp_path):
    # different sizes are only padding rows (allowed: tests/test_padded_vocab.py) when the tokenizers are identical
    target = save_tiny(tmp_path / "t")
    draft = save_tiny(tmp_path / "d", config=tiny_config(vocab_size=300), tokenizer=tiny_tokenizer(["<|x|>"]))
    with pytest.raises(ModelLoadError, match="vocab"):
        load_pair(str(target), str(draft), dtype="fp32", device="cpu")


def test_refuses_tokenizer_mismatch(tmp_path):
    # same vocab_size, different token -> id mapping
    target = save_tiny(tmp_path / "t", config=tiny_config(vocab_size=264))
    draft = save_tiny(tmp_path / "d", config=tiny_config(vocab_size=264), tokenizer=tiny_tokenizer(["<|x|>"]))
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_pair(str(target), str(draft), dtype="fp32", device="cpu")


def test_refuses_sliding_window(tmp_path):
    config = tiny_config(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert "sliding_attention" in config.layer_types
    folder = save_tiny(tmp_path / "sw", config=config)
    with pytest.raises(ModelLoadError, match="sliding"):
        load_pair(str(folder), None, dtype="fp32", device="cpu")
    ok = save_tiny(tmp_path / "ok")
    with pytest.raises(ModelLoadError, match="full attention"):
        load_pair(str(ok), str(folder), dtype="fp32", device="cpu")


def test_check_rollbackable_configs():
    from transformers import MambaConfig, MistralConfig

    check_rollbackable(tiny_config(), "tiny")  # full attention: fine
    with pytest.raises(ModelLoadError, match="mamba"):
        check_rollbackable(MambaConfig(), "mamba")
    with pytest.raises(ModelLoadError, match="linear_attention"):
        check_rollbackable(tiny_config(layer_types=["full_attention", "linear_attention"]), "hybrid")
    mistral = MistralConfig(sliding_window=4096)
    if getattr(mistral, "layer_types", None) is None or "sliding_attention" in mistral.layer_types:
        with pytest.raises(ModelLoadError, match="sliding"):
            check_rollbackable(mistral, "mistral-v0.1")
    check_rollbackable(MistralConfig(sliding_window=None), "mistral-v0.3")


def test_refuses_nonexistent_paths(tmp_path):
    for spec in [str(tmp_path / "nope"), "./no/such/model", str(tmp_path / "missing.gguf")]:
        with pytest.raises(ModelLoadError, match="exist|no such"):
            load_pair(spec, None, dtype="fp32", device="cpu")


def test_refuses_corrupt_gguf(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(ModelLoadError, match="Could not load"):
        load_pair(str(junk), None, dtype="fp32", device="cpu")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01" * 40)
    with pytest.raises(ModelLoadError, match="Could not load"):
        load_pair(str(truncated), None, dtype="fp32", device="cpu")


def test_refuses_directory_without_model(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="Could not load"):
        load_pair(str(tmp_path / "empty"), None, dtype="fp32", device="cpu")


def test_refuses_non_causal_lm(tmp_path):
    from transformers import T5Config

    folder = tmp_path / "t5"
    folder.mkdir()
    T5Config(d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=32, vocab_size=64).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    with pytest.raises(ModelLoadError, match="Could not load"):
        load_pair(str(folder), None, dtype="fp32", device="cpu")


def test_invalid_hub_id_is_refused_without_network():
    # an id that fails validation before any request is made
    with pytest.raises(ModelLoadError, match="network"):
        load_pair("not a valid id!!", None, dtype="fp32", device="cpu")


# ---- default pair: chunk assembly on fake packages ---------------------------------------------------------------


def fake_packages(root: Path, dist: str, parts: list[bytes]) -> None:
    """Install-like layout: <module>/__init__.py, <module>/data/partNN.bin, importable from `root`."""
    for i, data in enumerate(parts, start=1):
        pkg = root / f"{dist}{i}".replace("-", "_")
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)


def test_find_and_assemble_chunks_in_numeric_order(tmp_path, monkeypatch):
    parts = [f"chunk {i};".encode() * (i + 1) for i in range(1, 13)]  # 12 parts: part10 must follow part9
    blob = b"".join(parts)
    fake_packages(tmp_path / "site", "fake-treeviz-model-part", parts)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    pm = PackagedModel("Fake", "fake-treeviz-model-part", "1.0", len(parts), len(blob),
                       hashlib.sha256(blob).hexdigest())
    chunks = find_chunks(pm)
    assert [c.name for c in chunks] == [f"part{i:02d}.bin" for i in range(1, 13)]
    seen = []
    out = assemble_chunks(chunks, tmp_path / "cache" / "fake.gguf", size=pm.size, sha256=pm.sha256,
                          progress=lambda f, m: seen.append((f, m)))
    assert out.read_bytes() == blob
    assert seen[-1][0] == 1.0 and any("verifying" in m for _, m in seen) and any("assembling" in m for _, m in seen)
    assert [p.name for p in out.parent.iterdir()] == ["fake.gguf"]  # no temp files left


def test_assemble_refuses_wrong_sha_and_size(tmp_path):
    chunks = []
    for i in range(3):
        chunks.append(tmp_path / f"part{i}.bin")
        chunks[-1].write_bytes(bytes([i]) * 1000)
    good = hashlib.sha256(b"".join(c.read_bytes() for c in chunks)).hexdigest()
    dest = tmp_path / "out" / "m.gguf"
    with pytest.raises(ModelLoadError, match="SHA-256"):
        assemble_chunks(chunks, dest, size=3000, sha256="0" * 64)
    with pytest.raises(ModelLoadError, match="bytes"):
        assemble_chunks(chunks, dest, size=3001, sha256=good)
    with pytest.raises(ModelLoadError, match="SHA-256"):  # right bytes, wrong order
        assemble_chunks(chunks[::-1], dest, size=3000, sha256=good)
    assert not dest.exists() and list(dest.parent.iterdir()) == []  # nothing half-written
    assert assemble_chunks(chunks, dest, size=3000, sha256=good).stat().st_size == 3000


def test_gguf_needs_accelerate_and_says_so(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else real(name, *a))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="accelerate.*requirements.txt"):
        load_model(str(tmp_path / "m.gguf"), dtype="fp32", device="cpu")


def test_missing_packages_name_the_pip_command(tmp_path, monkeypatch):
    fake_packages(tmp_path / "site", "fake-treeviz-missing-part", [b"a", b"b"])  # 2 of 3 installed
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    pm = PackagedModel("Fake", "fake-treeviz-missing-part", "0.1", 3, 3, "0" * 64)
    with pytest.raises(ModelLoadError, match=r"pip install -r requirements.txt") as err:
        find_chunks(pm)
    assert "fake-treeviz-missing-part3==0.1" in str(err.value)


def test_default_spec_reports_missing_packages(tmp_path, monkeypatch):
    monkeypatch.setitem(models.PACKAGED, "default-draft",
                        PackagedModel("Fake", "fake-treeviz-absent-part", "0.1", 2, 2, "0" * 64))
    with pytest.raises(ModelLoadError, match="requirements.txt"):
        load_model("default", dtype="fp32", device="cpu", role="draft")


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("TREEVIZ_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "treeviz"
    repo = Path(__file__).resolve().parent.parent
    assert repo not in cache_dir().resolve().parents


# ---- default pair end to end, on a tiny GGUF shipped in fake chunk packages --------------------------------------


def write_tiny_gguf(path: Path, model, tok) -> Path:
    """The tiny Qwen2 as an F32 GGUF (qwen2 architecture, byte-level gpt2 tokenizer), like llama.cpp would write."""
    from gguf import GGUFWriter, TokenType

    cfg = model.config
    w = GGUFWriter(str(path), "qwen2")
    w.add_name("tiny gguf")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([TokenType.NORMAL if i < 256 else TokenType.CONTROL for _, i in vocab])
    w.add_token_merges([])
    w.add_token_scores([0.0] * len(vocab))
    w.add_eos_token_id(256)
    w.add_pad_token_id(257)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for name, p in model.state_dict().items():
        if name in top:
            gname = top[name]
        else:
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{per_layer[module]}.{kind}"
        w.add_tensor(gname, p.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny_gguf_package(tmp_path, monkeypatch):
    """The tiny model as 'default-target': a GGUF split over 3 fake chunk packages, like the real ones."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_random_model(0), tiny_tokenizer())
    blob = gguf.read_bytes()
    cut = [0, len(blob) // 3, 2 * len(blob) // 3, len(blob)]
    fake_packages(tmp_path / "site", "fake-treeviz-gguf-part", [blob[a:b] for a, b in zip(cut, cut[1:])])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    pm = PackagedModel("Tiny-GGUF", "fake-treeviz-gguf-part", "1.0", 3, len(blob), hashlib.sha256(blob).hexdigest())
    monkeypatch.setitem(models.PACKAGED, "default-target", pm)
    return pm


def bf16_rounded_tiny():
    """The converted cache stores weights in bf16: the tiny target with exactly that rounding, computing in fp32."""
    ref = tiny_random_model(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
    return ref


def count_gguf_parses(monkeypatch) -> list[str]:
    """The files gguf's reader parses from now on, one entry per parse."""
    import gguf

    parsed, reader = [], gguf.GGUFReader

    def counted(path, *args, **kwargs):
        parsed.append(str(path))
        return reader(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    return parsed


def test_default_path_assembles_converts_caches_and_reloads(tiny_gguf_package, monkeypatch):
    parsed = count_gguf_parses(monkeypatch)
    cache = cache_dir()
    (cache / "converted").mkdir(parents=True)
    stale = cache / "converted" / ".tmp-0123456789abcdef-999999999"  # left by a crashed run (no such pid)
    stale.mkdir()
    seen = []
    model, tok, name = load_model("default", dtype="fp32", device="cpu", progress=lambda f, m: seen.append((f, m)))
    assert name == "Tiny-GGUF (GGUF, offline)"
    messages = " | ".join(m for _, m in seen)
    for stage in ("assembling", "verifying", "converting tokenizer", "dequantising", "converted model (float32)",
                  "loaded"):
        assert stage in messages, stage
    assert "copy" not in messages  # converted straight into float32: no bf16 copy written and read back
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0

    ids = torch.tensor([tok.encode("through GGUF and back")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, bf16_rounded_tiny()(ids).logits)
    assert tok.decode(tok.encode("héllo 🎉", add_special_tokens=False)) == "héllo 🎉"
    assert model.config._attn_implementation == "sdpa" and model.dtype == torch.float32
    assert 256 in models.eos_token_ids(model, tok)
    assert len(parsed) == 1  # transformers asks three times (tokenizer, config, weights): one parse serves all

    sha = tiny_gguf_package.sha256[:16]
    assert sorted(p.name for p in (cache / "converted").iterdir()) == [f"{sha}-float32"]  # stale temp gone
    assert not list(cache.glob("*.gguf")) and not list(cache.rglob(".tmp-*"))  # assembled file deleted
    with safe_open(cache / "converted" / f"{sha}-float32" / "model.safetensors", "pt") as stored:
        assert {stored.get_slice(k).get_dtype() for k in stored.keys()} == {"F32"}  # a lazy mmap at every load

    # later starts: straight from the cache, no assembling or converting
    monkeypatch.setattr(packaged, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    monkeypatch.setattr(packaged, "assemble_chunks", lambda *a, **k: pytest.fail("assembled twice"))
    again, _, _ = load_model("default-target", dtype="fp32", device="cpu")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    bf16, _, _ = load_model("default", dtype="bf16", device="cpu")  # copied from the float32 variant
    assert bf16.dtype == torch.bfloat16
    rounded = bf16_rounded_tiny().state_dict()
    assert all(torch.equal(w.float(), rounded[name]) for name, w in bf16.state_dict().items())
    assert sorted(p.name for p in (cache / "converted").iterdir()) == [sha, f"{sha}-float32"]


def test_failed_conversion_leaves_no_cache(tiny_gguf_package, monkeypatch):
    from transformers import PreTrainedModel

    def disk_full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(PreTrainedModel, "save_pretrained", disk_full)
        with pytest.raises(ModelLoadError, match="No space left"):
            load_model("default", dtype="bf16", device="cpu")
    cache = cache_dir()
    assert [p for p in cache.rglob("*") if p.is_file()] == []  # no .gguf, no temp dir, no half cache
    model, _, _ = load_model("default", dtype="bf16", device="cpu")  # a later run starts over and succeeds
    assert model.dtype == torch.bfloat16


def test_gguf_file_loads_directly(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "direct.gguf", tiny_random_model(0), tiny_tokenizer())
    parsed = count_gguf_parses(monkeypatch)
    model, tok, name = load_model(str(path), dtype="fp32", device="cpu")
    assert parsed == [str(path)]
    assert name == "direct (GGUF)"
    ids = torch.tensor([tok.encode("no bf16 rounding here")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, tiny_random_model(0)(ids).logits)
