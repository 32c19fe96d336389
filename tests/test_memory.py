"""What the machine or its container has (engine/cpu/memory.py), and the weights ceiling the memory plan takes from it
(engine/cpu/formats.py): a container's limit bounds the host's numbers, and a machine with room keeps one-row AR's
own format."""
import pytest
import torch

from engine.cpu import formats, memory
from engine.cpu.formats import (FormatChoice, GroupChoice, plan_memory, untouched_by_make_whole, weights_budget,
                                 weights_ceiling)
from engine.cpu.kernels import _file_mapped, named_routed_linears, own_plain_weights, route_linears, routed_linears
from engine.cpu.memory import available_memory, total_memory
from engine.models import load_model, load_pair, tiny_random_model, tiny_tokenizer
from engine.models.tiny import tiny_config
from treeviz.serving.pairs import memory_ceiling

GIB = 1 << 30


def meminfo(folder, total_gib, available_gib):
    path = folder / "meminfo"
    path.write_text(f"MemTotal:       {total_gib * GIB // 1024} kB\nMemFree:        1024 kB\n"
                    f"MemAvailable:   {available_gib * GIB // 1024} kB\n")
    return path


def cgroup_v2(folder, limit, current, inactive_file):
    root = folder / "cgroup"
    root.mkdir()
    (root / "memory.max").write_text(f"{limit}\n")
    (root / "memory.current").write_text(f"{current}\n")
    (root / "memory.stat").write_text(f"anon 123\ninactive_file {inactive_file}\nactive_file 7\n")
    return root


def cgroup_v1(folder, limit, usage, inactive_file):
    root = folder / "cgroup"
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (root / "memory" / "memory.stat").write_text(f"inactive_file 5\ntotal_inactive_file {inactive_file}\n")
    return root


def test_without_a_cgroup_limit_the_machine_s_numbers_hold(tmp_path):
    info = meminfo(tmp_path, 24, 20)
    assert total_memory(info, tmp_path / "none") == 24 * GIB
    assert available_memory(info, tmp_path / "none") == 20 * GIB
    v2 = cgroup_v2(tmp_path, "max", 5 * GIB, 0)
    assert (total_memory(info, v2), available_memory(info, v2)) == (24 * GIB, 20 * GIB)


def test_a_cgroup_v2_limit_bounds_a_larger_host(tmp_path):
    """A 16 GB Space on a 128 GiB host: the container's limit, and what its use (less inactive file pages) leaves."""
    info, root = meminfo(tmp_path, 128, 100), cgroup_v2(tmp_path, 16 * GIB, 6 * GIB, 1 * GIB)
    assert total_memory(info, root) == 16 * GIB
    assert available_memory(info, root) == 11 * GIB


def test_a_cgroup_v1_limit_bounds_a_larger_host_and_its_no_limit_sentinel_does_not(tmp_path):
    info = meminfo(tmp_path, 128, 100)
    root = cgroup_v1(tmp_path, 16 * GIB, 15 * GIB, 2 * GIB)
    assert (total_memory(info, root), available_memory(info, root)) == (16 * GIB, 3 * GIB)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert (total_memory(info, root), available_memory(info, root)) == (128 * GIB, 100 * GIB)


def test_the_host_is_shorter_than_a_generous_container(tmp_path):
    info, root = meminfo(tmp_path, 24, 2), cgroup_v2(tmp_path, 20 * GIB, 1 * GIB, 0)
    assert (total_memory(info, root), available_memory(info, root)) == (20 * GIB, 2 * GIB)


def test_the_weights_ceiling_grows_with_the_machine_above_eighteen_gib(monkeypatch):
    monkeypatch.setattr(memory, "total_memory", lambda: None)
    assert weights_ceiling() == formats.WEIGHTS_CEILING  # nothing readable: the 16 GiB plan
    assert weights_ceiling(16 * GIB) == 8 * GIB  # the 16 GiB plan, unchanged
    assert weights_ceiling(18 * GIB) == 8 * GIB
    assert weights_ceiling(24 * GIB) == 14 * GIB
    assert weights_ceiling(32 * GIB) == 22 * GIB


def default_target_fp32() -> FormatChoice:
    """The default target's wide fp32 groups (28 layers) with the Ice Lake probe's shape: plain fastest at one row,
    MKL's packed GEMM at 2-16 rows (2026-11-28: plain 18-32 % faster at one row), and MKL's padding of each shape."""
    seconds = {"plain": {1: 1.0, 2: 2.0, 4: 2.1, 8: 2.3, 16: 2.8}, "mkl": {1: 1.25, 2: 1.3, 4: 1.3, 8: 1.4, 16: 1.6}}
    groups = {shape: GroupChoice({p: dict(t) for p, t in seconds.items()}, ["mkl", "plain"], plain_bytes=n)
              for shape, n in {"1536x1536": 28 * 2 * 1536 * 1536 * 4, "1536x8960": 28 * 2 * 1536 * 8960 * 4,
                               "8960x1536": 28 * 8960 * 1536 * 4}.items()}
    return FormatChoice(groups, {"1536x1536": {"mkl": 1.84}, "1536x8960": {"mkl": 1.244}, "8960x1536": {"mkl": 1.244}})


def test_a_24_gib_machine_keeps_one_row_ar_s_plain_weights_and_a_16_gib_one_drops_them(monkeypatch):
    monkeypatch.delenv("TREEVIZ_WEIGHTS_GIB", raising=False)
    for total in (16 * GIB, 24 * GIB):
        monkeypatch.setattr(memory, "total_memory", lambda total=total: total)
        monkeypatch.setattr(formats, "available_memory", lambda total=total: total - 2 * GIB)
        choice = default_target_fp32()
        plan_memory([choice], weights_budget(loaded_bytes=sum(g.plain_bytes for g in choice.groups.values())))
        if total == 24 * GIB:
            assert all(g.kept == ["mkl", "plain"] for g in choice.groups.values()), choice.summary()
        else:  # one-row AR runs the trees' format where plain was dropped
            assert any("plain" not in g.kept for g in choice.groups.values()), choice.summary()


def test_the_app_s_ceiling_grows_with_the_weights_plan_and_leaves_its_builder_room(monkeypatch):
    monkeypatch.delenv("TREEVIZ_MEMORY_GIB", raising=False)
    assert memory_ceiling(16 * GIB) == 16 * GIB  # a 16 GB laptop or Space: the plan as it was
    assert memory_ceiling(24 * GIB) == 20 * GIB
    for total in (16 * GIB, 24 * GIB, 32 * GIB, 64 * GIB):  # the app's ~2-3 GiB beside its weights, a builder's ~3.6
        assert memory_ceiling(total) - weights_ceiling(total) >= 6 * GIB
    monkeypatch.setenv("TREEVIZ_MEMORY_GIB", "12")
    assert memory_ceiling(24 * GIB) == 12 * GIB


def routed_mapped(model) -> list[bool]:
    return [_file_mapped(m.weight.data_ptr(), m.weight.data_ptr() + m.weight.nbytes) for m in routed_linears(model)]


def saved_tiny(folder, tied: bool):
    model = tiny_random_model(3, config=tiny_config(tie_word_embeddings=tied))
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("tied", [False, True])
def test_routed_plain_weights_are_copied_out_of_the_checkpoint_s_pages_bit_for_bit(tmp_path, tied):
    model, _, _ = load_model(saved_tiny(tmp_path / "t", tied), dtype="fp32", device="cpu")
    route_linears(model)
    assert all(routed_mapped(model))  # as loaded: views of the safetensors file
    reference = {name: m.weight.detach().clone() for name, m in named_routed_linears(model)}
    ids = torch.arange(1, 12)[None]
    with torch.inference_mode():
        before = model(ids).logits
    distinct = {id(m.weight): m.weight.nbytes for m in routed_linears(model)}
    assert own_plain_weights(model) == sum(distinct.values())
    assert not any(routed_mapped(model)) and own_plain_weights(model) == 0
    assert all(torch.equal(m.weight, reference[name]) for name, m in named_routed_linears(model))
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied  # a tie stays one
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)


def test_only_weights_no_format_is_made_from_are_copied_while_the_formats_are_made(tmp_path):
    """`make_formats` copies these on a second worker while `make_whole` reads the others to make their formats."""
    model, _, _ = load_model(saved_tiny(tmp_path / "t", tied=False), dtype="fp32", device="cpu")
    route_linears(model)
    groups = sorted({m.group for m in routed_linears(model)})
    made_from = groups[0]
    seconds = {"plain": {1: 1.0}, "dyn8": {1: 0.5}}
    choice = FormatChoice({g: GroupChoice(seconds, ["dyn8"] if g == made_from else ["plain"], 100) for g in groups}, {})
    beside = untouched_by_make_whole(model, choice)
    assert beside and all(m.group != made_from for m in beside)
    assert len(beside) == sum(m.group != made_from for m in routed_linears(model))
    assert untouched_by_make_whole(model, None) == routed_linears(model)  # no probe's choice: make_whole does not run


def test_load_pair_leaves_no_routed_plain_weight_on_the_file(tmp_path):
    """The production path: whatever the probe keeps, a plain weight a route reads is the process's own memory."""
    pair = load_pair(saved_tiny(tmp_path / "t", tied=False), None, dtype="fp32", device="cpu", calibrate=False)
    plain = [m for m in routed_linears(pair.target) if "plain" in m.paths]
    assert plain and not any(_file_mapped(m.weight.data_ptr(), m.weight.data_ptr() + m.weight.nbytes) for m in plain)


def test_the_builder_s_load_copies_no_weight_out_of_the_file(tmp_path, monkeypatch):
    """The builder drops its weights unread (aoti.release_weights), so a copy there would only sit beside the app's:
    on a 16 GiB plan the fp32 pair's copy took app and builder together to 16.3 GiB."""
    from engine.cli import load_request_pair
    from engine.models import loading
    copied = []
    monkeypatch.setattr(loading, "own_plain_weights", lambda model, layers=None: copied.append(model) or 0)
    folder = saved_tiny(tmp_path / "t", tied=False)
    load_request_pair({"target": folder, "draft": None, "dtype": "float32", "device": "cpu"})
    assert copied == []
    pair = load_pair(folder, None, dtype="fp32", device="cpu", calibrate=False)  # the app's load does copy
    assert copied and all(model is pair.target for model in copied)
