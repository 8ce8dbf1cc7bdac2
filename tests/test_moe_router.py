"""A MoE layer's routing kernel, the shared experts run inside the fused MoE launches, and the
attention's fused input projections and rope + latent function, against their references:
`engine.model.route`, `MoE.forward` (the per-expert loop plus the shared MLP) and the unfused
MLAttention. CPU tests check the references and the fast mode's host code; the kernel tests
need CUDA (run on the lent H200)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from engine.kernels.fused import use_fused_projections
from engine.kernels.fused_moe import fused_experts, fused_experts_reference, shared_chunks
from engine.kernels.grouped_experts import use_grouped_experts, warm_up_fused_experts
from engine.kernels.moe_router import kernel_applies, route_grouped, route_with_shared, route_with_shared_reference
from engine.model import (HOT, MLAttention, MoE, add_rms_norm, apply_rope, branching, build_model, rms_norm,
                          rope_latent, route, shared_experts_beside, slot_sum, sum_parts)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the lent H200)")


def _config(tiny_model, **kw):
    return dataclasses.replace(tiny_model.config, **kw)


def _moe(model) -> MoE:
    return next(m for m in model.modules() if isinstance(m, MoE))


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_moe_with_shared_in_the_grouped_form_equals_the_reference(tiny_model, tokens: int) -> None:
    c = _config(tiny_model, n_shared_experts=2)  # two chunks of the shared MLP
    ref = build_model(c, seed=4)
    fast = copy.deepcopy(ref)
    use_grouped_experts(fast)
    x = torch.randn(tokens, c.hidden_size, generator=torch.Generator().manual_seed(tokens))
    want = _moe(ref)(x)
    routed, shared = _moe(fast).forward_parts(x)
    assert shared is None  # the shared experts are inside the routed call's result
    assert routed.shape == (tokens, c.num_experts_per_tok + 2, c.hidden_size)  # per slot, for slot_sum
    torch.testing.assert_close(slot_sum(routed, x.dtype), want, atol=1e-6, rtol=1e-5)
    assert torch.equal(_moe(fast)(x), slot_sum(routed, x.dtype))
    g = _moe(fast).grouped
    assert g.num_shared == 2
    assert g.shared[0].data_ptr() == _moe(fast).shared_experts.gate_proj.weight.data_ptr()  # read in place


def test_a_prefill_runs_the_shared_experts_as_their_own_gemms(tiny_model, monkeypatch) -> None:
    c = _config(tiny_model, n_shared_experts=2)
    ref = build_model(c, seed=4)
    fast = copy.deepcopy(ref)
    use_grouped_experts(fast)
    g = _moe(fast).grouped
    monkeypatch.setattr(g, "SHARED_IN_KERNEL_MAX_TOKENS", 8)
    x = torch.randn(9, c.hidden_size, generator=torch.Generator().manual_seed(9))
    calls = []
    real = _moe(fast).shared_experts.forward
    monkeypatch.setattr(_moe(fast).shared_experts, "forward", lambda h: calls.append(h.shape[0]) or real(h))
    whole, none = _moe(fast).forward_parts(x)
    want_routed, want_shared = _moe(ref).forward_parts(x)
    assert none is None and calls == [9]  # the shared MLP ran on its own, then was added
    torch.testing.assert_close(whole, want_routed + want_shared, atol=1e-6, rtol=1e-5)
    _moe(fast).forward_parts(x[:8])
    assert calls == [9]  # at the limit: inside the kernel


def test_per_slot_moe_output_summed_in_the_add_rms_norm_is_bit_identical() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, generator=g).bfloat16()
    y = torch.randn(5, 4, 16, generator=g)  # per slot, float32
    w = torch.rand(16, generator=g).bfloat16()
    summed = y.sum(1).to(torch.bfloat16)  # what fused_experts returns with sum_slots=True
    for got, want in zip(add_rms_norm(x, y, w, 1e-6), add_rms_norm(x, summed, w, 1e-6)):
        assert torch.equal(got, want)
    assert torch.equal(slot_sum(summed, x.dtype), summed)  # a [T, hidden] delta passes through


def test_route_with_shared_reference_appends_the_shared_slots(tiny_model) -> None:
    c = _config(tiny_model, n_routed_experts=8, num_experts_per_tok=2)
    moe = _moe(build_model(c, seed=1))
    x = torch.randn(3, c.hidden_size, generator=torch.Generator().manual_seed(0))
    ids, w = route_with_shared_reference(x, moe.gate.weight, moe.gate.e_score_correction_bias, c, 2)
    want_ids, want_w = route(x, moe.gate.weight, moe.gate.e_score_correction_bias, c)
    assert torch.equal(ids[:, :2], want_ids) and torch.equal(w[:, :2], want_w)
    assert ids[:, 2:].tolist() == [[8, 9]] * 3 and w[:, 2:].tolist() == [[1.0, 1.0]] * 3
    assert not kernel_applies(x, c)  # a CPU tensor: the reference routes
    assert torch.equal(route_with_shared(x, moe.gate.weight, moe.gate.e_score_correction_bias, c, 2)[0], ids)


def test_shared_chunks_rejects_weights_that_do_not_split() -> None:
    gate = torch.zeros(96, 16)
    assert shared_chunks((gate, gate.clone(), torch.zeros(16, 96)), 32) == 3
    with pytest.raises(ValueError, match="intermediate 40"):
        shared_chunks((gate, gate.clone(), torch.zeros(16, 96)), 40)
    with pytest.raises(ValueError, match="do not split"):
        shared_chunks((gate, gate.clone(), torch.zeros(16, 95)), 32)


def test_fused_projections_are_views_and_give_the_same_attention(tiny_model) -> None:
    for q_lora in (None, 32):
        c = _config(tiny_model, q_lora_rank=q_lora)
        ref = build_model(c, seed=6)
        fast = copy.deepcopy(ref)
        names = sorted(fast.state_dict())
        assert use_fused_projections(fast) == c.num_kv_layers
        assert use_fused_projections(fast) == 0  # idempotent
        assert sorted(fast.state_dict()) == names  # HF names unchanged, nothing added
        attn = next(m for m in fast.modules() if isinstance(m, MLAttention))
        first = attn.q_proj if q_lora is None else attn.q_a_proj
        assert first.weight.data_ptr() == attn.fused_a.data_ptr()  # a view, no copy
        assert attn.kv_a_proj_with_mqa.weight.data_ptr() == attn.fused_a[first.weight.shape[0]:].data_ptr()
        ids = torch.arange(12) * 7 % c.vocab_size
        with torch.inference_mode():
            from engine.kv_pool import KvPool, KvPoolConfig, PagedKvCache
            outs = []
            for m in (ref, fast):
                pool = KvPool(KvPoolConfig(num_blocks=4, block_size=8, num_layers=c.num_kv_layers,
                                           kv_dim=c.kv_dim), 1)
                blocks = pool.blocks.allocate(2)
                outs.append(m.logits(m(ids, torch.arange(12), [12], PagedKvCache(pool, [(blocks, 0, 12)]))))
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(outs[1].argmax(-1), outs[0].argmax(-1))


def test_a_stale_fused_projection_is_not_read(tiny_model) -> None:
    # after a deepcopy, a dtype change or new weights, the modules' weights are no longer views
    # of fused_a: the forward must use the weights, not the old concatenation
    c = _config(tiny_model, q_lora_rank=None)
    fast = build_model(c, seed=6)
    use_fused_projections(fast)
    other = build_model(c, seed=7)
    copied = copy.deepcopy(fast)
    copied.load_state_dict(other.state_dict())
    ids = torch.arange(10) * 5 % c.vocab_size
    from engine.kv_pool import KvPool, KvPoolConfig, PagedKvCache

    def logits(m):
        pool = KvPool(KvPoolConfig(num_blocks=2, block_size=8, num_layers=c.num_kv_layers, kv_dim=c.kv_dim,
                                   dtype=m.dtype), 1)
        with torch.inference_mode():
            return m.logits(m(ids, torch.arange(10), [10], PagedKvCache(pool, [(pool.blocks.allocate(2), 0, 10)])))
    attn = next(m for m in copied.modules() if isinstance(m, MLAttention))
    assert not attn._fused_a_current()
    torch.testing.assert_close(logits(copied), logits(other), atol=1e-6, rtol=0)
    doubled = copy.deepcopy(fast).to(torch.float64)
    torch.testing.assert_close(logits(doubled).float(), logits(fast), atol=1e-4, rtol=1e-4)
    assert use_fused_projections(doubled) == c.num_kv_layers  # fused again, in float64
    attn = next(m for m in doubled.modules() if isinstance(m, MLAttention))
    assert attn._fused_a_current() and attn.fused_a.dtype == torch.float64


def test_rope_latent_is_its_parts(tiny_model) -> None:
    c = tiny_model.config
    g = torch.Generator().manual_seed(2)
    t, h = 5, c.num_attention_heads
    q_pe = torch.randn(t, h, c.qk_rope_head_dim, generator=g)
    kv_a = torch.randn(t, c.kv_dim, generator=g)
    cos, sin = HOT.rope_cos_sin(torch.arange(t), c.qk_rope_head_dim, c.rope_theta, torch.float32)
    w = torch.rand(c.kv_lora_rank, generator=g)
    for interleave in (False, True):
        got_q, got_latent = rope_latent(q_pe, kv_a, cos, sin, w, 1e-6, c.kv_lora_rank, interleave)
        c_kv, k_pe = kv_a[:, :c.kv_lora_rank], kv_a[:, c.kv_lora_rank:]
        assert torch.equal(got_q, apply_rope(q_pe, cos, sin, interleave))
        assert torch.equal(got_latent[:, :c.kv_lora_rank], rms_norm(c_kv, w, 1e-6))
        assert torch.equal(got_latent[:, c.kv_lora_rank:], apply_rope(k_pe[:, None], cos, sin, interleave)[:, 0])


def _margins(x, moe, c) -> torch.Tensor:
    """Per token: the gap between the reference's k-th and (k+1)-th masked choice (a tie or a
    near-tie may fall either way under another summation order)."""
    scores = torch.nn.functional.linear(x.float(), moe.gate.weight.float()).sigmoid()
    choice = scores + moe.gate.e_score_correction_bias.float()
    t, e, grp = x.shape[0], c.n_routed_experts, c.n_group
    if c.topk_group < grp:
        gs = choice.view(t, grp, e // grp).topk(2, dim=-1).values.sum(-1)
        top = gs.topk(c.topk_group + (1 if c.topk_group < grp else 0), dim=-1).values
        group_gap = top[:, c.topk_group - 1] - top[:, c.topk_group]
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(c.topk_group, -1).indices, True)
        choice = choice.masked_fill(~keep[:, :, None].expand(t, grp, e // grp).reshape(t, e), float("-inf"))
    else:
        group_gap = torch.full((t,), float("inf"), device=x.device)
    top = choice.topk(c.num_experts_per_tok + 1, dim=-1).values
    return torch.minimum(top[:, -2] - top[:, -1], group_gap)


@cuda
@pytest.mark.parametrize("experts,k,groups,topk_group,shared,hidden,other_tiles", [
    (64, 6, 1, 1, 2, 2048, (256, 8, 2, 0)),  # config M of tools/bench_serving_gpu.py
    (32, 4, 4, 2, 1, 1024, (128, 4, 2, 4)),  # config S (tools/bench_decode.py): group-limited
    (256, 8, 8, 4, 1, 512, (64, 8, 2, 16)),  # DeepSeek-V3's gate shape (narrower hidden; splits past it)
])
# the default tiles, or others tools/bench_moe_router.py tries (a bigger BLOCK_K, a split gate GEMM)
@pytest.mark.parametrize("default", [True, False])
def test_route_kernel_matches_reference(tiny_model, experts, k, groups, topk_group, shared, hidden, other_tiles,
                                        default) -> None:
    c = _config(tiny_model, n_routed_experts=experts, num_experts_per_tok=k, n_group=groups,
                topk_group=topk_group, n_shared_experts=shared, hidden_size=hidden, moe_intermediate_size=64)
    moe = _moe(build_model(c, seed=3, dtype=torch.bfloat16, device="cuda"))
    moe.gate.e_score_correction_bias.normal_(0, 0.01)
    for t in (1, 7, 64, 300, 5000):
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        assert kernel_applies(x, c)
        ids, w = route_with_shared(x, moe.gate.weight, moe.gate.e_score_correction_bias, c, shared,
                                   tiles=None if default else other_tiles)
        want_ids, want_w = route_with_shared_reference(x, moe.gate.weight, moe.gate.e_score_correction_bias, c, shared)
        clear = _margins(x, moe, c) > 1e-5
        assert clear.float().mean() > 0.9, t
        same = torch.sort(ids[:, :k], -1).values == torch.sort(want_ids[:, :k], -1).values
        assert same.all(-1)[clear].all(), t
        order_got, order_want = ids[:, :k].argsort(-1), want_ids[:, :k].argsort(-1)
        torch.testing.assert_close(w[:, :k].gather(1, order_got)[clear], want_w[:, :k].gather(1, order_want)[clear],
                                   atol=1e-5, rtol=1e-5)
        assert torch.equal(ids[:, k:], want_ids[:, k:]) and torch.equal(w[:, k:], want_w[:, k:])
        # a token's routing does not depend on the tokens beside it: three alone, bit for bit, from
        # the start and from the end (other blocks, a partial last one; with a split gate GEMM at
        # 300 and 5,000 tokens the routing program's own splits against the partials kernel's)
        for lo in {0, max(0, t - 3)}:
            few = route_with_shared(x[lo:lo + 3], moe.gate.weight, moe.gate.e_score_correction_bias, c, shared,
                                    tiles=None if default else other_tiles)
            assert torch.equal(few[0], ids[lo:lo + 3]) and torch.equal(few[1], w[lo:lo + 3]), (t, lo)


def _check_lists_and_bits(x: torch.Tensor, moe: MoE, c) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """route_grouped on x: route_with_shared's ids and weights bit for bit, each routed expert's
    pairs listed once (in any order), and fused_experts on the lists equal to the sorted path bit
    for bit, per slot and summed. Returns (ids, weights, the experts' pair counts)."""
    g, t, k = moe.grouped, x.shape[0], c.num_experts_per_tok
    ids, w, (rows, counts) = route_grouped(x, moe.gate.weight, moe.gate.e_score_correction_bias, c, g.num_shared)
    want_ids, want_w = route_with_shared(x, moe.gate.weight, moe.gate.e_score_correction_bias, c, g.num_shared)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w), t
    flat = ids.reshape(-1)
    assert int(counts.sum()) == t * k, t
    for e in range(c.n_routed_experts):
        listed = torch.sort(rows[e, :int(counts[e])]).values
        assert torch.equal(listed, torch.nonzero(flat == e)[:, 0].to(torch.int32)), (t, e)
    for sum_slots in (False, True):
        sorted_path = fused_experts(x, ids, w, g.gate_up, g.down, shared=g.shared, sum_slots=sum_slots)
        listed_path = fused_experts(x, ids, w, g.gate_up, g.down, shared=g.shared, sum_slots=sum_slots,
                                    expert_rows=(rows, counts))
        assert torch.equal(sorted_path, listed_path), (t, sum_slots)
    return ids, w, counts


@cuda
@pytest.mark.parametrize("experts,k,groups,topk_group,shared,hidden", [
    (64, 6, 1, 1, 2, 2048),  # config M (a split gate GEMM: partials up to 256 tokens, then in the program)
    (32, 4, 4, 2, 1, 1024),  # config S: group-limited
    (256, 8, 8, 4, 1, 512),  # DeepSeek-V3's gate shape
])
def test_route_grouped_lists_each_experts_pairs_and_the_kernels_give_the_sorts_bits(
        tiny_model, experts, k, groups, topk_group, shared, hidden) -> None:
    """route_grouped: the same ids and weights as route_with_shared, bit for bit, and each
    expert's pairs listed once (in any order); fused_experts on those lists (no sort) gives the
    sorted path's result bit for bit, per slot and summed, at decode and MTP-verify sizes."""
    c = _config(tiny_model, n_routed_experts=experts, num_experts_per_tok=k, n_group=groups,
                topk_group=topk_group, n_shared_experts=shared, hidden_size=hidden, moe_intermediate_size=64)
    model = build_model(c, seed=4, dtype=torch.bfloat16, device="cuda")
    use_grouped_experts(model)
    moe = _moe(model)
    g = moe.grouped
    for t in (2, 7, 64, 256, 300, 1024):
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        ids, w, _ = _check_lists_and_bits(x, moe, c)
        # and through the layer's own call (what a decode step runs), in a CUDA graph
        eager = g.forward_gated(x, moe.gate, with_shared=True, sum_slots=False)
        assert torch.equal(eager, fused_experts(x, ids, w, g.gate_up, g.down, shared=g.shared, sum_slots=False)), t
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = g.forward_gated(x, moe.gate, with_shared=True, sum_slots=False)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager), t


def test_branching_is_on_only_inside_its_context_and_only_on_its_thread() -> None:
    import threading
    assert not branching()
    seen = []
    with shared_experts_beside():
        assert branching()
        t = threading.Thread(target=lambda: seen.append(branching()))  # the worker's other model thread
        t.start()
        t.join()
        with shared_experts_beside():
            assert branching()
        assert branching()  # a nested exit leaves the outer one on
    assert not branching() and seen == [False]


@cuda
def test_one_tokens_moe_in_two_branches_replays_in_a_graph_with_the_eager_bits(tiny_model) -> None:
    c = _config(tiny_model, n_routed_experts=64, num_experts_per_tok=6, n_group=1, topk_group=1,
                n_shared_experts=2, hidden_size=256, moe_intermediate_size=128)
    fast = build_model(c, seed=3, dtype=torch.bfloat16, device="cuda")
    use_grouped_experts(fast)
    moe = _moe(fast)
    g = moe.grouped
    x = torch.randn(1, c.hidden_size, device="cuda", dtype=torch.bfloat16)
    eager = g.forward_branched(x, moe.gate)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the side stream forks from and joins the capture: two branches
        replayed = g.forward_branched(x, moe.gate)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(replayed, eager))
    with pytest.raises(ValueError, match="forward_branched takes one token"):
        g.forward_branched(torch.cat((x, x)), moe.gate)


@cuda
def test_moe_with_shared_kernels_match_reference_on_cuda(tiny_model) -> None:
    c = _config(tiny_model, n_routed_experts=64, num_experts_per_tok=6, n_group=1, topk_group=1,
                n_shared_experts=2, hidden_size=256, moe_intermediate_size=128)
    ref = build_model(c, seed=2, dtype=torch.bfloat16, device="cuda")
    fast = copy.deepcopy(ref)
    use_grouped_experts(fast)
    assert warm_up_fused_experts(fast) == 5
    g = _moe(fast).grouped
    for t in (1, 7, 64, 300, 2048):  # 2048: a prefill's batch, the shared experts as their own GEMMs
        x = torch.randn(t, c.hidden_size, device="cuda", dtype=torch.bfloat16)
        want = _moe(ref)(x).float()
        got, shared = _moe(fast).forward_parts(x)
        if t == 1:  # one token, in the decode graphs: the shared experts on a second stream, both per slot
            assert shared is None  # eager: one stream
            with shared_experts_beside():
                got, shared = _moe(fast).forward_parts(x)
            assert got.shape == (1, 6, c.hidden_size) and shared.shape == (1, 2, c.hidden_size)
            one = g.forward_gated(x, _moe(fast).gate, with_shared=True, sum_slots=False)
            assert torch.equal(torch.cat((got, shared), 1), one)  # the same kernels per slot: the same bits
            got = sum_parts(x.dtype, got, shared)
        else:
            assert shared is None
            got = slot_sum(got, x.dtype)
        assert (got.float() - want).norm() / want.norm() < 1e-2, t
        ids, w = route_with_shared_reference(x, _moe(fast).gate.weight, _moe(fast).gate.e_score_correction_bias, c, 2)
        kernel = g.forward(x, ids, w).float()
        twin = fused_experts_reference(x, ids, w, g.gate_up, g.down, shared=g.shared).float()
        assert (kernel - twin).norm() / twin.norm() < 1e-2, t


def test_bench_moe_router_compares_weights_by_expert_and_needs_cuda() -> None:
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import bench_moe_router
    ids = torch.tensor([[5, 2, 9], [1, 0, 3]])
    w = torch.tensor([[0.5, 0.2, 0.3], [0.1, 0.6, 0.3]])
    # the same (expert, weight) pairs in another slot order compare equal
    assert torch.equal(bench_moe_router.by_id(ids, w), bench_moe_router.by_id(ids[:, [2, 0, 1]], w[:, [2, 0, 1]]))
    c, shared = bench_moe_router.gate_config("M")
    assert (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, shared) == (2048, 64, 6, 2)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:  # a clear error, not a kernel launch on the CPU
            bench_moe_router.main([])
        assert exc.value.code == 2


def test_bench_moe_router_picks_the_fastest_decode_tiles_that_keep_the_prefill_fast() -> None:
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from bench_moe_router import pick

    def rows(tiles, us, agree=1.0, default=False):
        return [{"block_k": tiles[0], "warps": tiles[1], "stages": tiles[2], "split": tiles[3], "tokens": t,
                 "us": u, "same_experts_as_reference": agree, "default": default} for t, u in us.items()]

    base = rows((64, 4, 3, 0), {1: 15.0, 64: 16.0, 8192: 100.0}, default=True)
    split = rows((64, 4, 3, 16), {1: 4.0, 64: 5.0, 8192: 120.0})  # decode 9 us, prefill within 25 %
    faster_decode = rows((128, 8, 2, 16), {1: 3.0, 64: 4.0, 8192: 130.0})  # prefill 30 % slower: out
    wrong = rows((256, 4, 2, 4), {1: 2.0, 64: 2.0, 8192: 90.0}, agree=0.5)  # disagrees with the reference
    partial = rows((64, 8, 2, 4), {1: 1.0, 64: 1.0})  # not measured at 8192
    tokens = [1, 64, 8192]
    assert pick(base + split + faster_decode + wrong + partial, tokens) == ((64, 4, 3, 16), 9.0)
    assert pick(base + faster_decode, tokens) == ((64, 4, 3, 0), 31.0)  # the default, when nothing beats it
    slow_prefill = rows((64, 4, 3, 0), {1: 15.0, 64: 16.0, 8192: 200.0}, default=True)
    fast_prefill = rows((32, 4, 3, 0), {1: 30.0, 64: 30.0, 8192: 100.0})
    assert pick(slow_prefill + fast_prefill, tokens) == ((32, 4, 3, 0), 60.0)  # the default's prefill is out
    assert pick(slow_prefill + rows((16, 4, 3, 0), {1: 30.0, 64: 30.0}), tokens) == ((64, 4, 3, 0), 31.0)
    assert pick(wrong, tokens) is None  # with no default row, agreement is held to 99 %
    assert pick([], tokens) is None


interpreter = pytest.mark.skipif(
    __import__("os").environ.get("TRITON_INTERPRET") != "1" or __import__("importlib").util.find_spec("triton") is None,
    reason="needs triton and TRITON_INTERPRET=1 (the kernels on a CPU through Triton's interpreter)")


@interpreter
@pytest.mark.parametrize("experts,k,groups,topk_group,shared", [(64, 6, 1, 1, 2), (32, 4, 4, 2, 1)])
def test_route_grouped_in_the_interpreter(tiny_model, monkeypatch, experts, k, groups, topk_group, shared) -> None:
    """float32 on a CPU: what the CUDA test above checks (the lists hold each expert's pairs;
    the fused kernels on them give the sorted path's bits), with several tiles per expert, and
    a token whose hidden state holds a NaN still gets k distinct experts below E."""
    from engine.kernels import fused_moe, moe_router
    monkeypatch.setattr(moe_router, "kernel_applies", lambda x, c: True)
    c = _config(tiny_model, n_routed_experts=experts, num_experts_per_tok=k, n_group=groups,
                topk_group=topk_group, n_shared_experts=shared, hidden_size=64, moe_intermediate_size=32)
    model = build_model(c, seed=4, dtype=torch.float32)
    use_grouped_experts(model)
    moe = _moe(model)
    g = moe.grouped
    gen = torch.Generator().manual_seed(1)
    for t, block_m in ((2, None), (9, None), (200, 16)):  # 200 tokens: up to 3 tiles of 16 per expert
        if block_m is not None:  # several tiles per expert
            monkeypatch.setattr(fused_moe, "block_m_for", lambda *a, **kw: block_m)
        x = torch.randn(t, c.hidden_size, generator=gen)
        _, _, counts = _check_lists_and_bits(x, moe, c)
        if block_m is not None:
            assert int(counts.max()) > 2 * block_m, "the case meant to give experts several tiles does not"
    x = torch.randn(3, c.hidden_size, generator=gen)
    x[1, 5] = float("nan")
    ids, _, (rows, counts) = route_grouped(x, moe.gate.weight, moe.gate.e_score_correction_bias, c, g.num_shared)
    routed = ids[1, :k]
    assert len(set(routed.tolist())) == k and int(routed.max()) < experts
    assert int(counts.sum()) == 3 * k
