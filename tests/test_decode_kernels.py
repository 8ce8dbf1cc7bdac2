"""The GPU decode path's parts against their references.

CPU (float32): the absorbed decode step (`AbsorbedDecodeKv` with the reference attention) and
the fused experts' torch twin against the plain model path; the pair alignment's properties;
the batched sampler's properties.
CUDA (skipped without; run on the lent H200): the Triton MLA decode kernel against
`mla_decode_reference` over shapes, splits and FP8; the Triton pair alignment against its torch
twin; the fused MoE kernels in bf16 against the loop; the captured graph against the eager fast
step; sampling on the GPU against the CPU for the same logits.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.decode_batch import AbsorbedDecodeKv
from engine.kernels.fused_moe import align, block_m_for
from engine.kernels.grouped_experts import use_grouped_experts
from engine.kernels.mla_decode import mla_decode_reference
from engine.kv_pool import FP8, KvPool, KvPoolConfig, PagedKvCache
from engine.model import MoE, build_model
from engine.sampling import SamplingRows, greedy_batch, sample, sample_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the lent H200)")


def _tables(tables: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], dtype=torch.int32)


def test_absorbed_decode_matches_plain_path(tiny_model) -> None:
    c = dataclasses.replace(tiny_model.config, vocab_size=3000, bos_token_id=1, eos_token_id=(2,))
    plain, fast = build_model(c, seed=3), build_model(c, seed=3)
    assert use_grouped_experts(fast) == c.num_kv_layers - c.first_k_dense_replace  # MTP too
    lens = [5, 17, 40]  # context before the step
    pool = KvPool(KvPoolConfig(num_blocks=16, block_size=8, num_layers=c.num_kv_layers, kv_dim=c.kv_dim), 1)
    tables = []
    for i, n in enumerate(lens):  # prefill each sequence through the plain path
        blocks = pool.blocks.allocate(pool.blocks_for(n + 1))
        ids = torch.tensor([(31 * j + i) % 3000 for j in range(n)])
        with torch.inference_mode():
            plain(ids, torch.arange(n), [n], PagedKvCache(pool, [(blocks, 0, n)]))
        tables.append(blocks)
    ids, pos = torch.tensor([7, 8, 9]), torch.tensor(lens)
    before = pool.kv.clone()
    with torch.inference_mode():
        want = plain.logits(plain(ids, pos, [1, 1, 1], PagedKvCache(pool, [(t, n, 1) for t, n in zip(tables, lens)])))
        written = pool.kv.clone()
        pool.kv.copy_(before)
        kv = AbsorbedDecodeKv(pool, _tables(tables, 6), (pos + 1).int(), attention=mla_decode_reference)
        got = fast.logits(fast(ids, pos, [1, 1, 1], kv))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool.kv, written, atol=1e-5, rtol=0)  # same KV rows written
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_grouped_experts_match_loop(tiny_model, tokens: int) -> None:
    c = tiny_model.config
    model = build_model(c, seed=5)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    x = torch.randn(tokens, c.hidden_size, generator=torch.Generator().manual_seed(tokens))
    ids, w = moe.gate(x)
    want = moe.experts_forward(x, ids, w)
    use_grouped_experts(model)
    got = moe.experts_forward(x, ids, w)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert moe.experts[0].gate_proj.weight.data_ptr() == moe.grouped.gate_up.data_ptr()  # views, no copy


def _skewed_ids(pairs: int, experts: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, experts, (pairs,), generator=g, device=device)
    ids[: pairs // 3] = experts // 2  # one expert takes a third of the pairs
    return ids


@pytest.mark.parametrize("pairs,experts,block_m", [(1, 64, 16), (6, 64, 16), (5, 4, 16), (384, 64, 16),
                                                    (1536, 64, 32), (12288, 64, 128), (1000, 256, 64)])
def test_align_groups_every_pair_once_by_expert(pairs: int, experts: int, block_m: int) -> None:
    ids = _skewed_ids(pairs, experts, pairs)
    rows, block_expert = align(ids, experts, block_m)
    nb = block_expert.numel()
    assert rows.numel() == nb * block_m and nb == -(-(pairs + min(experts, pairs) * (block_m - 1)) // block_m)
    real = rows[rows < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once, padding = pairs
    used = block_expert < experts
    assert bool((block_expert[used][1:] >= block_expert[used][:-1]).all())  # expert order
    assert not used[used.sum():].any()  # the blocks past the last used one, and only those, are E
    for b in range(nb):
        r = rows[b * block_m:(b + 1) * block_m]
        r = r[r < pairs]
        if used[b]:
            assert r.numel() and bool((ids[r.long()] == block_expert[b]).all())
            assert bool((r[1:] > r[:-1]).all())  # one expert's pairs in their own order
        else:
            assert r.numel() == 0
    counts = torch.bincount(ids, minlength=experts)
    assert int(used.sum()) == int(((counts + block_m - 1) // block_m).sum())  # no block wasted


def test_align_gives_no_row_to_a_pair_without_expert() -> None:
    # an expert-parallel rank's slots that other ranks compute carry id -1 (engine/moe_ep.py)
    experts, block_m = 8, 16
    ids = _skewed_ids(300, experts, 7)
    ids[::3] = -1
    rows, block_expert = align(ids, experts, block_m)
    valid = torch.nonzero(ids >= 0)[:, 0]
    assert sorted(rows[rows < ids.numel()].tolist()) == valid.tolist()  # each routed pair once, no -1 pair
    used = block_expert < experts
    counts = torch.bincount(ids[valid], minlength=experts)
    assert int(used.sum()) == int(((counts + block_m - 1) // block_m).sum())
    for b in torch.nonzero(used)[:, 0].tolist():
        r = rows[b * block_m:(b + 1) * block_m]
        assert bool((ids[r[r < ids.numel()].long()] == block_expert[b]).all())


def test_fused_experts_reference_skips_slots_without_expert() -> None:
    from engine.kernels.fused_moe import fused_experts_reference
    g = torch.Generator().manual_seed(4)
    gate_up, down = torch.randn(5, 16, 12, generator=g), torch.randn(5, 12, 8, generator=g)
    x = torch.randn(7, 12, generator=g)
    ids = torch.randint(0, 5, (7, 3), generator=g)
    ids[1] = -1  # a row with no slot here
    ids[2, 0] = ids[4, 2] = -1
    w = torch.rand(7, 3, generator=g)
    per_slot = fused_experts_reference(x, ids, w, gate_up, down, sum_slots=False)  # [T, k, hidden]
    assert bool((per_slot[ids < 0] == 0).all()) and bool((per_slot[ids >= 0] != 0).any())
    # a -1 slot is the same slot routed anywhere with weight 0
    w0 = torch.where(ids < 0, 0.0, w)
    want = fused_experts_reference(x, ids.clamp(min=0), w0, gate_up, down, sum_slots="float32")
    got = fused_experts_reference(x, ids, w, gate_up, down, sum_slots="float32")
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert fused_experts_reference(x[:0], ids[:0], w[:0], gate_up, down, sum_slots="float32").shape == (0, 12)


def test_warm_up_compiles_every_tile_size(tiny_model) -> None:
    from engine.kernels.fused_moe import TILES
    from engine.kernels.grouped_experts import warm_up_fused_experts, warm_up_token_counts
    for experts, k in ((64, 6), (256, 8), (4, 2)):
        assert sorted(block_m_for(t * k, experts) for t in warm_up_token_counts(experts, k)) == sorted(TILES)
    model = build_model(tiny_model.config, seed=1)
    assert warm_up_fused_experts(model) == 0  # nothing stacked yet: nothing to warm up
    use_grouped_experts(model)
    # every tile size, and one token (the block-per-pair form); the torch twin on a CPU
    assert warm_up_fused_experts(model) == len(TILES) + 1


def test_block_m_grows_with_the_rows_per_expert() -> None:
    assert [block_m_for(p, 64) for p in (1, 384, 1024, 2048, 6144, 12288)] == [16, 16, 16, 32, 64, 128]


def test_sample_batch_rows_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=g) * 3
    params = [SamplingParams(temperature=0.7 + 0.1 * i, top_p=1.0 if i % 2 else 0.8, seed=100 + i) for i in range(5)]
    params.append(SamplingParams())  # greedy row
    rows = [(p, 3 + i) for i, p in enumerate(params)]
    tokens, logprobs = sample_batch(logits, SamplingRows.build(rows, "cpu"))
    alone = [sample(logits[i], p, s) for i, (p, s) in enumerate(rows)]
    assert tokens.tolist() == [t for t, _ in alone]
    torch.testing.assert_close(logprobs, torch.tensor([lp for _, lp in alone]))
    perm = [4, 0, 5, 2, 1, 3]  # another order, another batch: the same draws
    t2, _ = sample_batch(logits[perm], SamplingRows.build([rows[i] for i in perm], "cpu"))
    assert t2.tolist() == [tokens[i].item() for i in perm]
    assert tokens[5].item() == int(logits[5].argmax())


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_a_greedy_row_gives_the_same_bits_with_or_without_sampled_rows(device: str) -> None:
    # one rule for greedy rows: greedy_batch's token and log-probability (on CUDA its Triton head,
    # whose float32 summation order differs from torch's log_softmax)
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 3000, generator=g) * 4).to(device=device, dtype=torch.bfloat16)
    rows = [(SamplingParams(), 0), (SamplingParams(temperature=0.9, top_p=0.7, seed=5), 2), (SamplingParams(), 0)]
    tokens, logprobs = sample_batch(logits, SamplingRows.build(rows, device))
    want_tokens, want_logprobs = greedy_batch(logits)
    for i in (0, 2):
        assert tokens[i].item() == want_tokens[i].item()
        assert logprobs[i].item() == want_logprobs[i].item()  # bit for bit, not close


def test_a_mixed_steps_greedy_rows_come_from_greedy_batch(monkeypatch) -> None:
    # on a CPU greedy_batch's twin computes what torch did before, so mark its answers instead
    import engine.sampling as sampling
    marked = (torch.tensor([7, 8, 9]), torch.tensor([-0.25, -0.5, -0.75]))
    monkeypatch.setattr(sampling, "greedy_batch", lambda logits: marked)
    rows = [(SamplingParams(), 0), (SamplingParams(temperature=0.9, seed=5), 2), (SamplingParams(), 0)]
    tokens, logprobs = sample_batch(torch.randn(3, 50), SamplingRows.build(rows, "cpu"))
    assert (tokens[0].item(), tokens[2].item()) == (7, 9)
    assert (logprobs[0].item(), logprobs[2].item()) == (-0.25, -0.75)
    assert logprobs[1].item() != -0.5  # the sampled row's own draw


def test_sample_follows_the_distribution() -> None:
    logits = torch.tensor([0.0, 1.0, 0.5, -1.0, 2.0])
    p = SamplingParams(temperature=1.3, seed=9)
    n = 20000
    draws = torch.tensor([sample(logits, p, s)[0] for s in range(n)])
    freq = torch.bincount(draws, minlength=5).float() / n
    torch.testing.assert_close(freq, torch.softmax(logits / 1.3, 0), atol=0.015, rtol=0)
    top = SamplingParams(temperature=1.0, top_p=0.6, seed=3)
    assert {sample(logits, top, s)[0] for s in range(300)} == {4, 1}  # the 0.6 nucleus: ids 4 and 1


# --- CUDA -------------------------------------------------------------------------------------

def _random_pool(blocks: int, layers: int, bs: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn(blocks, layers, bs, dim, device="cuda", generator=g)
    return kv.to(FP8) if dtype == FP8 else kv.to(dtype)


@cuda
@pytest.mark.parametrize("heads,rank,rope,bs,dtype", [
    (16, 512, 64, 64, torch.bfloat16), (16, 512, 64, 16, torch.bfloat16), (128, 512, 64, 64, torch.bfloat16),
    (4, 32, 8, 8, torch.bfloat16), (16, 512, 64, 64, FP8)])
def test_mla_decode_kernel_matches_reference(heads, rank, rope, bs, dtype) -> None:
    from engine.kernels.mla_decode import mla_decode
    torch.manual_seed(heads + bs)
    lens = torch.tensor([1, 2, 63, 64, 65, 700, 4100, 9], dtype=torch.int32, device="cuda")
    width = int((lens.max() + bs - 1) // bs) + 3
    nb = 1 + len(lens) * width
    kv = _random_pool(nb, 3, bs, rank + rope, dtype, seed=1)
    perm = torch.randperm(nb - 1, device="cuda")[: len(lens) * width] + 1  # scattered blocks
    tables = perm.view(len(lens), width).int()
    q = torch.randn(len(lens), heads, rank + rope, device="cuda", dtype=torch.bfloat16)
    scale, kv_scale = 0.07, (0.5 if dtype == FP8 else 1.0)
    want = mla_decode_reference(q, kv, 1, tables, lens, rank, scale, kv_scale)
    from engine.kernels.mla_decode import Stage1Config
    for splits in (None, 1, 3, 32):
        for config in (None, Stage1Config(64, 8, 2, 4), Stage1Config(128, 4, 2, 1)):  # shapes of the sweep
            got = mla_decode(q, kv, 1, tables, lens, rank, scale, kv_scale, splits=splits, config=config).float()
            err = (got - want).norm() / want.norm()
            assert err < 1e-2, (splits, config, float(err))
            assert torch.isfinite(got).all()
    # the decode step's form: the absorbed query strided as the einsum leaves it, q_pe apart
    q_lat = torch.empty(heads, len(lens), rank, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    q_lat.copy_(q[..., :rank])
    got = mla_decode(q_lat, kv, 1, tables, lens, rank, scale, kv_scale, q_pe=q[..., rank:].clone()).float()
    assert torch.equal(got, mla_decode(q, kv, 1, tables, lens, rank, scale, kv_scale).float())


@cuda
def test_grouped_experts_bf16_match_loop_on_cuda() -> None:
    from engine.model_source import TINY, load_model
    c = dataclasses.replace(load_model(TINY).config, n_routed_experts=64, num_experts_per_tok=6, n_group=1,
                            topk_group=1, hidden_size=256, moe_intermediate_size=128)
    model = build_model(c, seed=2, dtype=torch.bfloat16, device="cuda")
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    for t in (1, 7, 64, 300, 2048):
        x = torch.randn(t, c.hidden_size, device="cuda", dtype=torch.bfloat16)
        ids, w = moe.gate(x)
        if t == 300:  # skewed: a third of the pairs on one expert (bigger blocks, many empty experts)
            ids = _skewed_ids(t * 6, 64, t, "cuda").view(t, 6)
        moe.grouped = None
        want = moe.experts_forward(x, ids, w).float()
        use_grouped_experts(model)
        got = moe.experts_forward(x, ids, w).float()
        assert (got - want).norm() / want.norm() < 1e-2, t


@cuda
@pytest.mark.parametrize("experts,shared", [(4, 0), (64, 0), (256, 0), (64, 2), (32, 1), (4, 3)])
def test_align_kernel_equals_torch_align(experts: int, shared: int) -> None:
    from engine.kernels.fused_moe import align_triton
    for pairs in (1, 5, 6, 48, 384, 1000, 1536, 12288, 49152):
        for block_m in (16, 32, 64, 128):
            ids = _skewed_ids(pairs, experts + shared, pairs + block_m, "cuda")  # shared ids among them
            for no_expert in (False, True):  # then every fifth pair without expert (id -1, EP ranks)
                if no_expert:
                    ids[::5] = -1
                want, got = align(ids, experts + shared, block_m), align_triton(ids, experts, block_m, shared)
                assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), (pairs, block_m, no_expert)
    # other launch shapes (tools/bench_moe_align.py's sweep) give the same rows
    for block_p, warps in ((16, 1), (256, 16), (32, 8)):
        if block_p * experts > 32768:
            continue
        ids = _skewed_ids(512, experts + shared, 528, "cuda")
        want, got = align(ids, experts + shared, 16), align_triton(ids, experts, 16, shared, tiles=(block_p, warps))
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), (block_p, warps)


def test_bench_moe_align_picks_the_fastest_choice_that_gave_align_s_rows_everywhere() -> None:
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import bench_moe_align

    def rows(tiles, us, same=True):
        return [{"block_p": tiles[0], "warps": tiles[1], "tokens": t, "us": u, "same_rows": same}
                for t, u in us.items()]

    good = rows((128, 4), {2: 5.0, 64: 19.0})
    faster = rows((64, 8), {2: 4.0, 64: 9.0})
    wrong = rows((256, 16), {2: 1.0, 64: 1.0}, same=False)  # other rows: out, however fast
    failed = rows((32, 16), {2: 1.0}) + [{"block_p": 32, "warps": 16, "tokens": 64, "error": "OutOfResources"}]
    assert bench_moe_align.pick(good + faster + wrong + failed, [2, 64]) == ((64, 8), 13.0)
    assert bench_moe_align.pick(wrong + failed, [2, 64]) is None
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:  # a clear error, not a kernel launch on the CPU
            bench_moe_align.main([])
        assert exc.value.code == 2


@cuda
def test_fused_experts_skip_slots_without_expert_on_cuda() -> None:
    from engine.kernels.fused_moe import fused_experts, fused_experts_reference
    g = torch.Generator(device="cuda").manual_seed(3)
    gate_up = torch.randn(16, 256, 128, device="cuda", generator=g).bfloat16() * 0.05
    down = torch.randn(16, 128, 128, device="cuda", generator=g).bfloat16() * 0.05
    for t in (1, 9, 300):
        x = torch.randn(t, 128, device="cuda", generator=g).bfloat16()
        ids = torch.randint(0, 16, (t, 6), device="cuda", generator=g)
        ids[torch.rand(t, 6, device="cuda", generator=g) < 0.6] = -1
        w = torch.rand(t, 6, device="cuda", generator=g)
        got = fused_experts(x, ids, w, gate_up, down, sum_slots="float32", no_expert=True)
        want = fused_experts_reference(x, ids, w, gate_up, down, sum_slots="float32")
        assert got.dtype == torch.float32 and (got - want).norm() / want.norm() < 1e-2, t


@cuda
def test_one_token_runs_a_block_per_pair_and_equals_its_row_in_a_batch() -> None:
    """A decode step at batch 1 skips the align launch (a block per pair: the kernels' PAIR_BLOCKS):
    its per-slot outputs equal the reference and, bit for bit, the same token's row in a batch
    of 5 (aligned blocks), with and without the shared experts' chunks and -1 slots."""
    from engine.kernels.fused_moe import fused_experts, fused_experts_reference
    g = torch.Generator(device="cuda").manual_seed(5)
    gate_up = torch.randn(16, 256, 128, device="cuda", generator=g).bfloat16() * 0.05
    down = torch.randn(16, 128, 128, device="cuda", generator=g).bfloat16() * 0.05
    shared = (torch.randn(256, 128, device="cuda", generator=g).bfloat16() * 0.05,
              torch.randn(256, 128, device="cuda", generator=g).bfloat16() * 0.05,
              torch.randn(128, 256, device="cuda", generator=g).bfloat16() * 0.05)
    x = torch.randn(5, 128, device="cuda", generator=g).bfloat16()
    routed = torch.stack([torch.randperm(16, device="cuda", generator=g)[:6] for _ in range(5)])
    for sh in (None, shared):
        ids = routed if sh is None else torch.cat((routed, torch.tensor([[16, 17]] * 5, device="cuda")), 1)
        for no_expert in (False, True):
            ids = ids.clone()
            if no_expert:
                ids[:, ::3] = -1
            w = torch.rand(ids.shape, device="cuda", generator=g)
            one = fused_experts(x[:1], ids[:1], w[:1], gate_up, down, shared=sh, sum_slots=False, no_expert=no_expert)
            batch = fused_experts(x, ids, w, gate_up, down, shared=sh, sum_slots=False, no_expert=no_expert)
            want = fused_experts_reference(x[:1], ids[:1], w[:1], gate_up, down, shared=sh, sum_slots=False)
            assert torch.equal(one[0], batch[0]), (sh is None, no_expert)
            if no_expert:  # a slot without expert here gives exactly 0
                assert not one[0, ::3].any()
            assert (one - want).norm() / want.norm() < 1e-2, (sh is None, no_expert)


@cuda
def test_cuda_sampling_equals_cpu_for_the_same_logits() -> None:
    logits = torch.randn(32, 32000, generator=torch.Generator().manual_seed(1)) * 4
    rows = [(SamplingParams(temperature=0.9, top_p=0.95 if i % 3 else 1.0, seed=i * 7919), i) for i in range(32)]
    cpu_t, cpu_lp = sample_batch(logits, SamplingRows.build(rows, "cpu"))
    gpu_t, gpu_lp = sample_batch(logits.cuda(), SamplingRows.build(rows, "cuda"))
    assert (cpu_t == gpu_t.cpu()).float().mean() >= 0.95  # equal bits of noise; log/exp may differ in the last ulp
    torch.testing.assert_close(cpu_lp[cpu_t == gpu_t.cpu()], gpu_lp.cpu()[cpu_t == gpu_t.cpu()], atol=1e-4, rtol=1e-4)


@cuda
def test_a_forced_graph_bucket_pads_and_an_empty_share_replays() -> None:
    """What an EP rank's step asks of its runner (decode_worker/ep_ranks.py): replay a given
    bucket, larger than its rows (same tokens as its own bucket), or with no rows at all."""
    from engine.model_source import TINY, load_model
    from engine.runner import DecodeInput, ModelRunner
    loaded = load_model(TINY, dtype=torch.bfloat16)
    c = loaded.config
    pool = KvPool(KvPoolConfig(num_blocks=100, block_size=16, num_layers=c.num_kv_layers, kv_dim=c.kv_dim,
                               dtype=torch.bfloat16), 1, "cuda")
    pool.kv.normal_(0, 0.5)
    runner = ModelRunner(loaded.model.to("cuda"), pool)
    runner.capture_graphs(max_batch=16, max_context=256)
    tables = [pool.blocks.allocate(pool.blocks_for(n + 1)) for n in (5, 60, 33)]
    batch = [DecodeInput(t, n, 7 + i) for i, (t, n) in enumerate(zip(tables, (5, 60, 33)))]
    greedy = [(SamplingParams(), 0)] * 3
    before = pool.kv.clone()
    own = runner.decode_tokens(batch, greedy).tokens  # bucket 4
    pool.kv.copy_(before)
    # the same tokens (GEMMs of another row count may round differently: tokens, not log-probs)
    assert runner.decode_tokens(batch, greedy, bucket=16)[0] == own
    assert runner.decode_tokens([], [], bucket=8) == ([], [], [])  # an idle rank: all padding
    with pytest.raises(ValueError, match="cannot replay graph bucket 2"):
        runner.decode_tokens(batch, greedy, bucket=2)  # fewer rows than the batch: refused, no eager step


@cuda
def test_a_pipeline_stage_remakes_its_layers_fast_forms() -> None:
    """engine/pipeline.py `_stage_layers_to`, on one GPU (a stage on another GPU does the same
    there): the stage's MoE layers get stacks of their own on the stage's device (a stack is a
    plain tensor that `.to()` leaves behind), and its layers compute what they did."""
    from engine.kv_cache_contiguous import ContiguousKvCache
    from engine.model_source import TINY, load_model
    from engine.pipeline import _stage_layers_to
    from engine.runner import ModelRunner
    loaded = load_model(TINY, dtype=torch.bfloat16)
    c = loaded.config
    pool = KvPool(KvPoolConfig(num_blocks=8, block_size=16, num_layers=c.num_kv_layers, kv_dim=c.kv_dim,
                               dtype=torch.bfloat16), 1, "cuda")
    model = ModelRunner(loaded.model.to("cuda"), pool).model  # the fast forms, as stage 0's runner makes them
    x = torch.randn(12, c.hidden_size, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(12, device="cuda")
    with torch.inference_mode():
        want = model.run_layers(x, positions, [12], ContiguousKvCache(c.num_hidden_layers))
        # the stage's layers only: the MTP layer after them (an MoE too) is no stage's
        stage = torch.nn.ModuleList(model.model.layers[i] for i in range(c.num_hidden_layers))
        old = [m.grouped.gate_up for m in stage.modules() if isinstance(m, MoE)]
        _stage_layers_to(model, (0, c.num_hidden_layers), torch.device("cuda", 0), last=True)
        moes = [m for m in stage.modules() if isinstance(m, MoE)]
        assert len(moes) == len(old) > 0
        assert all(m.grouped is not None and m.grouped.gate_up.is_cuda for m in moes)
        assert all(m.grouped.gate_up.data_ptr() != o.data_ptr() for m, o in zip(moes, old))  # stacked again
        got = model.run_layers(x, positions, [12], ContiguousKvCache(c.num_hidden_layers))
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@cuda
def test_graph_replay_equals_eager_fast_step_and_plain_path() -> None:
    from engine.model_source import TINY, load_model
    from engine.runner import DecodeInput, ModelRunner
    loaded = load_model(TINY, dtype=torch.bfloat16)
    c = loaded.config
    model = loaded.model.to("cuda")
    pool = KvPool(KvPoolConfig(num_blocks=200, block_size=16, num_layers=c.num_kv_layers, kv_dim=c.kv_dim,
                               dtype=torch.bfloat16), 1, "cuda")
    pool.kv.normal_(0, 0.5)
    plain = ModelRunner(model, pool, fast=False)
    want_plain = None
    lens = [3, 40, 100, 17, 250]
    tables = [pool.blocks.allocate(pool.blocks_for(n + 1)) for n in lens]
    batch = [DecodeInput(t, n, 5 + i) for i, (t, n) in enumerate(zip(tables, lens))]
    before = pool.kv.clone()
    want_plain = plain.decode(batch)
    fast = ModelRunner(model, pool)  # grouped experts from here on
    assert fast.fast
    pool.kv.copy_(before)
    eager = fast.decode(batch).clone()
    fast.capture_graphs(max_batch=8, max_context=512)
    pool.kv.copy_(before)
    graphed = fast.decode(batch)
    assert fast.graphs is not None and fast.graphs.bucket(len(batch)) == 8
    torch.testing.assert_close(graphed, eager, atol=2e-2, rtol=2e-2)
    err = (eager - want_plain).norm() / want_plain.norm()
    assert err < 2e-2, float(err)
    agree = (eager.argmax(-1) == want_plain.argmax(-1)).float().mean()
    assert agree >= 0.6, float(agree)
    # the graph's own greedy head: the bits `greedy_batch` gives on the graph's logits, its
    # tokens already in the future map at the step's slots
    from common.sampling_params import SamplingParams
    from engine.sampling import greedy_batch
    pool.kv.copy_(before)
    slots = fast.future.reserve(len(batch))
    packed = fast.decode_step(batch, [(SamplingParams(), 0)] * len(batch), slots)
    tokens, logprobs = greedy_batch(fast.graphs.graphs[8][1][0][: len(batch)])
    assert torch.equal(packed[:, 0].long(), tokens) and torch.equal(packed[:, 1], logprobs.double())
    assert torch.equal(fast.future.tokens[torch.tensor(slots, device="cuda")], tokens)
    # a greedy graphed step whose rows ask for top log-probabilities: the graph's greedy pack,
    # then the top columns of the graph's logits (read before the next replay)
    from engine.sampling import SamplingRows, top_logprobs_batch
    asking = [(SamplingParams(top_logprobs=k), 0) for k in (3, 0, 1, 3, 2)]
    pool.kv.copy_(before)
    slots = fast.future.reserve(len(batch))
    packed = fast.decode_step(batch, asking, slots)
    logits = fast.graphs.graphs[8][1][0][: len(batch)]
    assert packed.shape == (len(batch), 2 + 2 * 3)
    assert torch.equal(packed[:, 0].long(), tokens)
    assert torch.equal(packed[:, 2:], top_logprobs_batch(logits, SamplingRows.build(asking, "cuda")))
    # a greedy graphed step with a logit bias: not the graph's own greedy head, but the argmax of
    # the biased logits, and that token is the one the future map keeps
    from engine.sampling import adjusted
    banning = [(SamplingParams(), 0), (SamplingParams(logit_bias=((int(tokens[1]), -100.0),)), 0)] + [
        (SamplingParams(), 0)] * 3
    pool.kv.copy_(before)
    slots = fast.future.reserve(len(batch))
    packed = fast.decode_step(batch, banning, slots)
    logits = fast.graphs.graphs[8][1][0][: len(batch)]
    want, _ = greedy_batch(adjusted(logits, SamplingRows.build(banning, "cuda")))
    assert torch.equal(packed[:, 0].long(), want) and int(want[1]) != int(tokens[1])
    assert torch.equal(fast.future.tokens[torch.tensor(slots, device="cuda")], want)
    # a seeded row in a graphed step: sampled after the replay (on the caller's stream, after the
    # graph's greedy write on the replay stream), its token the one the map keeps
    from engine.sampling import SamplingRows, sample_batch
    seeded = [(SamplingParams(), 0)] * 2 + [(SamplingParams(temperature=1.0, seed=77), 3)] + [(SamplingParams(), 0)] * 2
    pool.kv.copy_(before)
    slots = fast.future.reserve(len(batch))
    packed = fast.decode_step(batch, seeded, slots)
    want, _ = sample_batch(fast.graphs.graphs[8][1][0][: len(batch)], SamplingRows.build(seeded, "cuda"))
    assert torch.equal(packed[:, 0].long(), want)
    assert torch.equal(fast.future.tokens[torch.tensor(slots, device="cuda")], want)


def test_graph_batch_buckets() -> None:
    from engine.graph_runner import batch_sizes
    assert batch_sizes(1) == [1]
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    sizes = batch_sizes(300)
    assert sizes[-1] == 300 and sizes == sorted(set(sizes)) and 256 in sizes and 288 in sizes
    for b in range(1, 301):  # every batch has a bucket, padded by less than a bucket step
        bucket = next(s for s in sizes if s >= b)
        assert bucket - b < (8 if b <= 256 else 32)


def test_graph_reserve_grows_with_batch_and_vocab(tiny_model) -> None:
    from engine.capacity import graph_reserve_bytes
    c = tiny_model.config
    small, big = graph_reserve_bytes(c, 8), graph_reserve_bytes(c, 256)
    assert 256 * 2**20 < small < big
    wide = graph_reserve_bytes(dataclasses.replace(c, vocab_size=c.vocab_size * 10), 256)
    assert wide - big >= 256 * 2 * 4 * 9 * c.vocab_size  # float32 logits twice per row
    from engine.capacity import spec_bias_reserve_bytes
    # the MTP graphs' biased mode: one float32 copy of the verify's logits, (k + 1) rows a request
    assert spec_bias_reserve_bytes(c, 64, 2) == 64 * 3 * c.vocab_size * 4


def test_bench_serving_script_smoke_on_cpu(tmp_path) -> None:
    """tools/bench_serving_gpu.py end to end on a CPU with a tiny model: checkpoint, tandem up,
    tandem bench, in-process step, exactness (the plain and the 'fast' runner agree exactly here:
    on a CPU both run the plain path)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    from harness import free_port
    out = tmp_path / "s.json"
    port = free_port()  # the router of the script's `tandem up` (below the ephemeral range: no worker
    # or etcd of that cluster, given port 0, can take it first)
    r = subprocess.run([sys.executable, "tools/bench_serving_gpu.py", "--smoke", "--device", "cpu",
                        "--contexts", "48", "--concurrency", "2", "--output-tokens", "4", "--skip-transformers",
                        "--stream-interval", "2", "--port", str(port), "--prefill-device", "cpu",
                        "--top-logprobs", "2", "--out", str(out)], cwd=root, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["served_tok_s"] > 0 and row["inprocess_tok_s"] > 0 and row["failed"] == 0
    assert row["stream_interval"] == 2 and row["top_logprobs"] == 2  # (served with them asked for)
    # the prefill worker's forwards (one per prompt or fewer, batched) and their device share
    assert row["prefill_device"] == "cpu" and 1 <= row["prefill_forwards"] <= 4
    assert 0 < row["prefill_device_share"] < 1 and row["prefill_device_ms_per_request"] > 0
    assert 1 <= row["decode_mean_batch"] <= 2 and row["decode_cadence_ms"] > 0  # the worker's own counters
    assert doc["exactness"]["S"]["identical_token_share"] == 1.0


def test_bench_serving_script_mtp_mode_smoke_on_cpu(tmp_path) -> None:
    """tools/bench_serving_gpu.py --mtp on a CPU: MTP k = 1 served on the trained checkpoint
    (one `tandem up`), tokens/s per user and the decode worker's accept length scraped from /metrics."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from harness import free_port
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "mtp.json"
    port = free_port()
    r = subprocess.run([sys.executable, "tools/bench_serving_gpu.py", "--configs", "", "--mtp", "1",
                        "--mtp-concurrency", "2", "--output-tokens", "8", "--device", "cpu", "--port", str(port),
                        "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (row,) = json.loads(out.read_text())["mtp"]
    assert row["k"] == 1 and row["failed"] == 0 and row["tok_s_per_user"] > 0
    assert 1.0 <= row["accept_length"] <= 2.0  # at most k + 1 tokens per verify step
