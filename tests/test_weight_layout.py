"""engine/weight_layout.py: a model moved to its device in the fast mode's layout one module at
a time equals the model moved whole and converted after, and on CUDA holds no more of the card
than its weights."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from engine.kernels.fused import use_fused_projections
from engine.kernels.grouped_experts import use_grouped_experts
from engine.model import MLAttention, MoE, build_model
from engine.reference import reference_generate
from engine.weight_layout import fast_mode, to_device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the lent H200)")


def _views_of_stacks(model) -> int:
    """Number of MoE layers whose experts' weights all lie inside their stacks (asserted)."""
    n = 0
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        g = moe.grouped
        assert g is not None
        lo, hi = g.gate_up.data_ptr(), g.gate_up.data_ptr() + g.gate_up.numel() * g.gate_up.element_size()
        for e in moe.experts:
            for w in (e.gate_proj.weight, e.up_proj.weight):
                assert lo <= w.data_ptr() < hi
            d = g.down
            assert d.data_ptr() <= e.down_proj.weight.data_ptr() < d.data_ptr() + d.numel() * d.element_size()
        n += 1
    return n


def test_the_layout_made_on_the_way_equals_the_one_made_after(tiny_model) -> None:
    c = dataclasses.replace(tiny_model.config, n_shared_experts=2, num_nextn_predict_layers=1)
    ref = build_model(c, seed=3)
    after = copy.deepcopy(ref)
    use_grouped_experts(after)
    use_fused_projections(after)
    placed = to_device(copy.deepcopy(ref), "cpu", fast=True)
    assert _views_of_stacks(placed) == c.num_kv_layers - c.first_k_dense_replace  # the MTP layer's too
    attns = [m for m in placed.modules() if isinstance(m, MLAttention)]
    assert attns and all(a.fused_a is not None and a._fused_a_current() for a in attns)
    for (name, p), (_, q) in zip(placed.state_dict().items(), after.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    rows: dict[str, list[torch.Tensor]] = {"placed": [], "after": []}

    def keep(name):
        def sample(row: torch.Tensor, step: int) -> int:
            rows[name].append(row.clone())
            return int(row.argmax())
        return sample

    prompt = [1 + i % 13 for i in range(9)]
    assert (reference_generate(placed, prompt, 6, sample_fn=keep("placed"))
            == reference_generate(after, prompt, 6, sample_fn=keep("after")))
    assert all(torch.equal(a, b) for a, b in zip(rows["placed"], rows["after"], strict=True))
    # converted already: the runner's own calls find nothing left to do, nor does a second move
    stacks = [m.grouped for m in placed.modules() if isinstance(m, MoE)]
    assert use_grouped_experts(placed) == 0 and use_fused_projections(placed) == 0
    to_device(placed, torch.device("cpu"), fast=True)
    assert [m.grouped for m in placed.modules() if isinstance(m, MoE)] == stacks


def test_a_model_stacked_on_one_device_is_stacked_again_on_the_next(tiny_model) -> None:
    """`.to()` copies each expert's views apart; the stacks are made again where the model lands
    (the meta device stands in for a second one)."""
    model = to_device(build_model(tiny_model.config, seed=3), "cpu", fast=True)
    to_device(model, "meta", fast=True)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        assert moe.grouped.gate_up.device.type == "meta"
        def storage(t: torch.Tensor) -> int:  # the storage a tensor lives in (on meta too, which has no data)
            return t.untyped_storage()._cdata
        assert all(storage(e.gate_proj.weight) == storage(moe.grouped.gate_up)
                   and storage(e.down_proj.weight) == storage(moe.grouped.down) for e in moe.experts)


def test_off_the_fast_mode_it_is_a_plain_move(tiny_model) -> None:
    model = build_model(tiny_model.config, seed=3)
    assert not fast_mode(torch.device("cpu"), torch.bfloat16)
    assert not fast_mode(torch.device("cuda"), torch.float32)
    assert to_device(model, "cpu") is model
    assert all(m.grouped is None for m in model.modules() if isinstance(m, MoE))
    assert all(m.fused_a is None for m in model.modules() if isinstance(m, MLAttention))


@cuda
def test_on_cuda_the_card_holds_the_weights_and_little_more(tiny_model) -> None:
    # experts of 1 to 10 MiB: each took a 20 MiB allocator segment of its own when moved whole
    c = dataclasses.replace(tiny_model.config, hidden_size=1024, moe_intermediate_size=1408, n_routed_experts=16,
                            num_hidden_layers=3, first_k_dense_replace=1, num_nextn_predict_layers=0)
    model = build_model(c, seed=1, dtype=torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    to_device(model, "cuda")
    assert _views_of_stacks(model) == 2
    held = torch.cuda.memory_reserved() - base
    assert held < weights + (64 << 20), (held, weights)  # no per-expert segments left behind
