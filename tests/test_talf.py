"""TALF (engine/training/talf.py): the one-forward tree loss against a per-node brute force, training, and loading drafts."""
import copy

import pytest
import torch

from engine.decoder import Decoder
from engine.models import load_pair, tiny_random_model, tiny_random_pair, tiny_tokenizer
from engine.strategies import STRATEGIES, make_strategy
from engine.training.talf import (TalfError, add_lora, load_adapter, node_path, soft_cross_entropy, target_tree_batch,
                                  tree_loss)

K, DEPTH, TOPK = 3, 3, 8


def peaked_target(seed=0):
    """A tiny target whose next-token distributions have clear winners, so top-k sets are free of near-ties."""
    target = tiny_random_model(seed, num_layers=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)
    return target


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = peaked_target()
    draft = tiny_random_model(5, num_layers=2)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    return target, draft, ids


def last_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1]


def test_tree_shape_and_positions(models):
    target, _, ids = models
    batch = target_tree_batch(target, ids, k=K, depth=DEPTH, label_topk=TOPK)
    L = ids.shape[1]
    assert batch.input_ids.shape == (2, L + (DEPTH - 1) * L * K)
    assert batch.depth.tolist() == [0] * L + [1] * (L * K) + [2] * (L * K)
    for b in range(2):
        for row in range(batch.input_ids.shape[1]):
            path = node_path(batch, b, row)
            assert batch.position_ids[b, row] == len(path) - 1  # position = prefix length + depth
            assert batch.visible[b, row].sum() == len(path)     # its prefix, its ancestors and itself


def test_beam_expands_the_k_most_probable_paths(models):
    """Depth 1 = the target's top-k at the root; depth 2 = the k best of the k*k children by path probability."""
    target, _, ids = models
    batch = target_tree_batch(target, ids, k=K, depth=DEPTH, label_topk=TOPK)
    L = ids.shape[1]
    for b in range(2):
        for root in range(L):
            p_root = torch.softmax(last_logits(target, ids[b, :root + 1].tolist()), -1)
            depth1 = set(p_root.topk(K).indices.tolist())
            rows1 = [L + root * K + j for j in range(K)]
            assert {int(batch.input_ids[b, r]) for r in rows1} == depth1
            candidates = {}
            for c in depth1:
                p_c = torch.softmax(last_logits(target, ids[b, :root + 1].tolist() + [c]), -1)
                for v in p_c.topk(K).indices.tolist():
                    candidates[(c, v)] = float(p_root[c] * p_c[v])
            best = sorted(candidates, key=candidates.get, reverse=True)[:K]
            rows2 = [L + L * K + root * K + j for j in range(K)]
            assert {tuple(node_path(batch, b, r)[-2:]) for r in rows2} == set(best)


def test_tree_loss_equals_per_node_brute_force(models):
    """One forward with tree attention == one plain causal forward per node, for labels and for the draft's CE."""
    target, draft, ids = models
    batch = target_tree_batch(target, ids, k=K, depth=DEPTH, label_topk=TOPK)
    total = 0.0
    for b in range(2):
        for row in range(batch.input_ids.shape[1]):
            path = node_path(batch, b, row)
            p = torch.softmax(last_logits(target, path), -1)
            ids_ = batch.label_ids[b, row]
            assert torch.allclose(p[ids_], batch.label_probs[b, row], atol=2e-4)  # fp32 noise x peaked logits
            assert p[ids_].min() >= p.topk(TOPK).values[-1] - 2e-4  # the stored ids are the top-k
            assert abs(1 - p[ids_].sum() - batch.label_tail[b, row]) < 2e-4
            total += soft_cross_entropy(last_logits(draft, path)[None], ids_[None], batch.label_probs[b, row][None],
                                        batch.label_tail[b, row][None]).item()
    with torch.no_grad():
        loss = tree_loss(draft, batch).item()
    assert loss == pytest.approx(total / batch.roots, rel=1e-4)


def test_soft_cross_entropy_is_the_coarsened_cross_entropy():
    logits = torch.tensor([[2.0, 0.5, -1.0, 0.0, 1.0]])
    target = torch.tensor([[0.5, 0.1, 0.1, 0.2, 0.1]])
    ids = torch.tensor([[0, 3]])
    q = torch.softmax(logits, -1)[0]
    expected = -(0.5 * q[0].log() + 0.2 * q[3].log() + 0.3 * (q[1] + q[2] + q[4]).log())
    got = soft_cross_entropy(logits, ids, target[0, [0, 3]][None], torch.tensor([0.3]))
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def test_bad_settings_are_refused(models):
    target, _, ids = models
    with pytest.raises(TalfError, match="label_topk"):
        target_tree_batch(target, ids, k=9, label_topk=8)
    with pytest.raises(TalfError, match="depth"):
        target_tree_batch(target, ids, depth=0)
    with pytest.raises(TalfError, match="adapter"):
        load_adapter(tiny_random_model(0), "/nonexistent/adapter")


def test_one_training_step_lowers_the_loss(models):
    target, draft, ids = models
    draft = copy.deepcopy(draft).train()
    batch = target_tree_batch(target, ids, k=K, depth=DEPTH, label_topk=TOPK)
    opt = torch.optim.SGD(draft.parameters(), lr=0.05)
    before = tree_loss(draft, batch)
    opt.zero_grad()
    before.backward()
    opt.step()
    with torch.no_grad():
        after = tree_loss(draft, batch)
    assert after.item() < before.item()


def talf_trained_draft(target, steps=5, seed=0):
    draft = tiny_random_model(seed + 7, num_layers=2)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed))
    batch = target_tree_batch(target, ids, k=4, depth=3, label_topk=16)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    draft.train()
    for _ in range(steps):
        loss = tree_loss(draft, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


@pytest.fixture(scope="module")
def trained_pair(tmp_path_factory):
    """The tiny pair's target and a TALF-trained draft, saved and loaded back through the project's loader."""
    base = tiny_random_pair(None, seed=0, dtype=torch.float32)
    draft = talf_trained_draft(base.target)
    folder = tmp_path_factory.mktemp("talf")
    for name, model in (("target", base.target), ("draft", draft)):
        model.save_pretrained(folder / name)
        tiny_tokenizer().save_pretrained(folder / name)
    return load_pair(str(folder / "target"), str(folder / "draft"), dtype="fp32", device="cpu", packed="off",
                     calibrate=False)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_trained_draft_decodes_exactly(name, trained_pair):
    prompt = "def f(x):\n    return"
    reference = Decoder(trained_pair, make_strategy("ar")).generate(prompt, max_new_tokens=40, stop_on_eos=False)
    result = Decoder(trained_pair, make_strategy(name)).generate(prompt, max_new_tokens=40, stop_on_eos=False)
    assert result.output_ids == reference.output_ids


def test_lora_adapter_round_trips(tmp_path):
    target = peaked_target()
    base = tiny_random_model(5, num_layers=2)
    model = add_lora(copy.deepcopy(base), rank=4)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(3))
    batch = target_tree_batch(target, ids, k=2, depth=2, label_topk=4)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss = tree_loss(model, batch)
    opt.zero_grad()
    loss.backward()
    opt.step()  # LoRA's B starts at zero: one step makes the adapter change the logits
    model.eval()
    probe = torch.tensor([[104, 101, 108, 108, 111, 32, 119]])
    with torch.no_grad():
        trained = model(input_ids=probe).logits
        assert not torch.allclose(trained, base(input_ids=probe).logits, atol=1e-6)
    model.save_pretrained(str(tmp_path))
    for merge in (True, False):
        loaded = load_adapter(copy.deepcopy(base), tmp_path, merge=merge)
        with torch.no_grad():
            # merging adds B @ A into W once: fp32 rounding only
            assert torch.allclose(loaded(input_ids=probe).logits, trained, atol=2e-4)


def test_resumed_adapter_keeps_training_and_its_run_record(tmp_path):
    """`talf.py lora --resume`: the saved adapter comes back trainable (only its LoRA matrices), at its own rank,
    a step moves it from where it was saved, and the earlier runs stay in the record."""
    import argparse
    import json
    script = talf_script()
    base = tiny_random_model(5, num_layers=2)
    first = add_lora(copy.deepcopy(base), rank=4)
    with torch.no_grad():
        for name, param in first.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    first.save_pretrained(str(tmp_path))
    (tmp_path / "talf_run.json").write_text(json.dumps({"steps": 7, "wall_s": 60.0}))
    args = argparse.Namespace(resume=str(tmp_path), rank=16)
    model, earlier = script.with_adapter(copy.deepcopy(base), args)
    assert earlier == [{"steps": 7, "wall_s": 60.0}] and args.rank == 4
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    saved = {n: p.detach().clone() for n, p in first.named_parameters() if "lora_" in n}
    assert all(torch.equal(p, saved[n]) for n, p in model.named_parameters() if n in saved)  # starts where it stopped
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(3))
    batch = target_tree_batch(peaked_target(), ids, k=2, depth=2, label_topk=4)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tree_loss(model, batch).backward()
    opt.step()
    assert any(not torch.equal(p, saved[n]) for n, p in model.named_parameters() if n in saved)
    fresh, none = script.with_adapter(copy.deepcopy(base), argparse.Namespace(resume=None, rank=2))
    assert none == [] and fresh.peft_config["default"].r == 2


def talf_script():
    from scripts import train_talf as talf
    return talf


def test_tiny_experiment_writes_table_and_figure(tmp_path):
    """scripts/train_talf.py tiny end to end at toy sizes: trains, evaluates every tree strategy, writes md + html."""
    from pathlib import Path
    script = talf_script()
    args = ["tiny", "--out", str(tmp_path), "--seeds", "1", "--target-steps", "2", "--steps", "1",
            "--draft-pretrain", "1", "--sequences", "2", "--seq-len", "8", "--batch", "2", "--prompts", "1",
            "--prompt-bytes", "16", "--tokens", "4", "--train-chars", "20000", "--equal-rows"]
    assert script.main(args) == 0
    table = (tmp_path / "talf.md").read_text()
    for label in ("TALF", "plain distillation", "plain distillation, 9x steps", "text only"):
        assert f"| {label}" in table
    assert (tmp_path / "talf.html").stat().st_size > 100_000  # plotly.js inlined: opens offline
    repo = Path(__file__).parent.parent
    assert script.main(["lora", "--minutes", "1", "--out", str(repo / "adapter")]) == 2  # refused, nothing loaded


def test_adapter_onto_routed_linears_is_refused_with_a_message(tmp_path):
    from engine.cpu.kernels import route_linears
    base = tiny_random_model(5, num_layers=2)
    add_lora(copy.deepcopy(base), rank=2).save_pretrained(str(tmp_path))
    route_linears(base)  # what kernel preparation does to a loaded pair
    with pytest.raises(TalfError, match="before engine.models.prepare_kernels"):
        load_adapter(base, tmp_path)


def test_adapter_loads_as_a_draft_spec(tmp_path):
    """`SPEC+talf:PATH` through load_pair: the adapter is merged before the kernels wrap the linears, the draft's
    name says so, and decoding with it stays exact; a folder without an adapter is a ModelLoadError."""
    from engine.models import ModelLoadError
    base = tiny_random_pair("related", seed=0, dtype=torch.float32)
    lora = add_lora(copy.deepcopy(base.draft), rank=2)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)  # B starts at zero: give the adapter an effect to detect
    lora.save_pretrained(str(tmp_path / "adapter"))
    probe = torch.tensor([[104, 101, 108, 108, 111]])
    with torch.no_grad():
        expected = lora.eval()(input_ids=probe).logits
    pair = load_pair("tiny-random", f"tiny-random+talf:{tmp_path / 'adapter'}", dtype="fp32", device="cpu")
    assert pair.draft_name.endswith("+ TALF LoRA (adapter)")
    with torch.no_grad():
        assert torch.allclose(pair.draft(input_ids=probe).logits, expected, atol=2e-4)
    prompt = "def f(x):"
    reference = Decoder(pair, make_strategy("ar")).generate(prompt, max_new_tokens=24, stop_on_eos=False)
    assert Decoder(pair, make_strategy("dynatree")).generate(prompt, max_new_tokens=24,
                                                           stop_on_eos=False).output_ids == reference.output_ids
    with pytest.raises(ModelLoadError, match="not a LoRA adapter folder"):
        load_pair("tiny-random", f"tiny-random+talf:{tmp_path}", dtype="fp32", device="cpu")
