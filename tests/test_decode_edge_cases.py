"""Edge cases of the batched decode path (sampling, grouped experts, absorbed decode KV,
worker start-up) found by review; each test names the defect it pins."""

from __future__ import annotations

import dataclasses
import os
import types

import pytest
import torch

from common.pb.tandem.v1 import discovery_pb2
from common.sampling_params import SamplingParams
from engine.kv_pool import KvPool, KvPoolConfig
from engine.model import MoE, build_model
from engine.kernels.grouped_experts import use_grouped_experts
from engine.sampling import SamplingRows, gumbel_noise, sample, sample_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- sampling ----------------------------------------------------------------------------------

def test_gumbel_noise_is_finite() -> None:
    # u = ((h >> 8) + 0.5) / 2^24 rounds to exactly 1.0 in float32 for h >> 8 == 2^24 - 1
    # (16777215.5 is not a float32), and -log(-log(1)) = +inf: about one entry in 2^24, i.e.
    # one decode step in ~130 with a 129k vocabulary. (seed 0, step 11895, entry 691) is one.
    g = gumbel_noise(torch.tensor([0, 1]), torch.tensor([11895, 8343]), 1000)
    assert torch.isfinite(g).all(), g[~torch.isfinite(g)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=0),
                                    SamplingParams(temperature=1.0, top_p=0.5, seed=0)])
def test_sampled_token_is_never_impossible(params: SamplingParams) -> None:
    # token 0 has all the mass; token 691 is -inf (masked), or outside the top-p nucleus
    logits = torch.zeros(1000)
    logits[0] = 30.0
    logits[691] = float("-inf") if params.top_p == 1.0 else 0.0
    token, logprob = sample(logits, params, 11895)
    assert (token, logprob) == (0, pytest.approx(0.0, abs=1e-6))


def test_sampled_never_picks_a_very_unlikely_token_in_a_large_vocab() -> None:
    # a DeepSeek-V3-sized vocabulary, one row whose mass is all on token 5: 200 steps of it
    vocab = 129280
    logits = torch.full((200, vocab), -1e4)
    logits[:, 5] = 0.0
    rows = [(SamplingParams(temperature=1.0, seed=7), s) for s in range(200)]
    tokens, _ = sample_batch(logits, SamplingRows.build(rows, "cpu"))
    assert set(tokens.tolist()) == {5}


# --- grouped experts ---------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,k,same_expert", [(0, 2, False), (1, 1, False), (5, 1, True), (4, 3, True),
                                                   (33, 2, False)])
def test_grouped_experts_edge_shapes_match_loop(tiny_model, tokens: int, k: int, same_expert: bool) -> None:
    # T = 0 raised "cannot reshape tensor of 0 elements into shape [0, 2, -1]"
    c = tiny_model.config
    model = build_model(c, seed=5)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, c.hidden_size, generator=g)
    if same_expert:  # every pair on the last expert: all other groups empty
        ids = torch.full((tokens, k), c.n_routed_experts - 1, dtype=torch.long)
    else:
        ids = torch.stack([torch.randperm(c.n_routed_experts, generator=g)[:k] for _ in range(tokens)]) \
            if tokens else torch.zeros(0, k, dtype=torch.long)
    w = torch.rand(tokens, k, generator=g)
    want = moe.experts_forward(x, ids, w)
    use_grouped_experts(model)
    got = moe.experts_forward(x, ids, w)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


# --- worker start-up ---------------------------------------------------------------------------

def test_expert_parallel_engine_is_built_on_cuda(tiny_model) -> None:
    # worker/host.py: the new `elif self.device.type == "cuda":` (a log line) sat between
    # `if engine is None:` and the EP `else:`, so EP ranks on a GPU never built their engine:
    # AttributeError: 'WorkerRuntime' object has no attribute 'pool'
    from worker.host import WorkerOptions, WorkerRuntime

    class OnCuda:  # all WorkerRuntime reads of a model an EP engine is given
        dtype = torch.float32
        model = types.SimpleNamespace(embed_tokens=types.SimpleNamespace(
            weight=types.SimpleNamespace(device=torch.device("cuda"))))

    built = []

    class Engine:  # stands in for decode_worker/ep_ranks.py's EpEngine
        fast = True  # its ranks run the fast path (which has graphs)

        def __init__(self, opts, loaded, pool_config, seed) -> None:
            from decode_worker.ep_pool import EpKvPool
            shape = (pool_config.num_blocks, pool_config.num_layers, pool_config.block_size, pool_config.kv_dim)
            self.pool = EpKvPool(pool_config, seed, [torch.zeros(shape, dtype=pool_config.dtype) for _ in range(2)])
            self.captured = None
            built.append(self)

        def capture_graphs(self, max_batch, max_context) -> int:  # every rank's graphs, on GPUs
            self.captured = (max_batch, max_context)
            return 0

        def close(self) -> None:
            pass

    loaded = dataclasses.replace(tiny_model, model=OnCuda())
    rt = WorkerRuntime(discovery_pb2.ROLE_DECODE, WorkerOptions(model=tiny_model.name, num_blocks=8, ep_size=2),
                       loaded, engine=Engine)
    try:
        assert built and rt.engine is built[0] and rt.runner is built[0] and rt.pool is built[0].pool
        assert len(rt.endpoints) == 2  # rank 1's pool has a transfer agent of its own
        assert built[0].captured == (rt.opts.max_running, rt.context_length)  # the ranks' decode graphs
    finally:
        rt.close()


def test_greedy_is_the_argmax_of_the_logits() -> None:
    # engine.reference and spec_decode's accept take argmax(logits); sample_batch took
    # argmax(log_softmax(logits)), where logit - logsumexp rounds 0.001 and 0.0010001 to one
    # float32 and the tie went to the lower id
    logits = torch.full((4096,), -5.0)
    logits[10], logits[11] = 0.001, 0.0010001
    assert int(logits.argmax()) == 11
    assert sample(logits, SamplingParams(), 0)[0] == 11
    rows = [(SamplingParams(), 0), (SamplingParams(temperature=1.0, seed=1), 0)]  # greedy beside sampled
    tokens, _ = sample_batch(torch.stack([logits, logits]), SamplingRows.build(rows, "cpu"))
    assert tokens[0].item() == 11


# --- the scheduler with seeded sampling --------------------------------------------------------

def test_scheduler_seeded_batch_equals_reference(tiny_model) -> None:
    # one continuous batch mixing greedy, tempered, top-p and 64-bit seeds, plain and overlap
    # loops: each request as if it ran alone through engine.reference with `sample`
    import asyncio

    from decode_helpers import generate
    from engine.reference import reference_generate

    prompts = [[(17 * i + j) % 9000 for i in range(n)] for j, n in enumerate([3, 15, 16, 31])]
    params = [SamplingParams(max_tokens=9, temperature=0.8, seed=2**64 - 1),
              SamplingParams(max_tokens=6),
              SamplingParams(max_tokens=7, temperature=1.5, top_p=0.3, seed=2**63),
              SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=0, ignore_eos=True)]
    want = [reference_generate(tiny_model.model, pr, p.max_tokens,
                               () if p.ignore_eos else tiny_model.config.eos_token_ids,
                               sample_fn=lambda row, step, p=p: sample(row, p, step)[0])
            for pr, p in zip(prompts, params)]
    for overlap in (False, True):
        got, rt = asyncio.run(generate(tiny_model, 0, prompts, params, overlap=overlap))
        assert got == want, overlap
        assert rt.pool.blocks.num_free == rt.opts.num_blocks


@pytest.mark.parametrize("vocab", [100, 5000, 40000])
def test_top_p_ties_keep_the_lowest_ids(vocab: int) -> None:
    # the nucleus sort was unstable: on the CPU, equal log-probs came out in an order that
    # depends on the vocab size (V = 100 kept ids 50..99; V = 40000 kept 6670 and 20000..39999),
    # and CUDA's sort orders ties differently, so the same (seed, step) and bf16 logits (which
    # tie often) could draw from different nuclei on the prefill and the decode device
    from engine.sampling import sampling_logprobs

    lp = sampling_logprobs(torch.zeros(vocab), SamplingParams(temperature=1.0, top_p=0.5, seed=0))
    kept = torch.isfinite(lp).nonzero()[:, 0]
    assert torch.equal(kept, torch.arange(kept.numel())), kept[:5]
    assert abs(kept.numel() - vocab // 2) <= 1


# --- tools/bench_serving_gpu.py ----------------------------------------------------------------

def test_bench_serving_cluster_does_not_take_http_port_8000(monkeypatch, tmp_path) -> None:
    # `tandem up` serves HTTP on 8000 by default since the router's HTTP API; the bench passed
    # only --port, so a second cluster on the machine made its router exit at start-up
    # ("--http-port 8000: cannot listen on 127.0.0.1:8000: Address already in use")
    import importlib
    import sys
    from pathlib import Path

    tools = str(Path(__file__).resolve().parent.parent / "tools")
    monkeypatch.syspath_prepend(tools)
    bench = importlib.import_module("bench_serving_gpu")
    seen = []

    class Exited:  # a `tandem up` that exits at once (nothing is started)
        pid = -1

        def poll(self):
            return 1

        def wait(self, timeout=None):
            return 1

    def popen(cmd, **kwargs):
        seen.append(cmd)
        return Exited()

    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=1))
    monkeypatch.setattr(bench.os, "killpg", lambda pid, sig: None)
    with pytest.raises(RuntimeError, match="did not become healthy"):
        bench.serve_and_bench(tmp_path, [64], [1], 8, 50461, tmp_path, {})
    cmd = seen[0]
    assert "--http-port" in cmd and cmd[cmd.index("--http-port") + 1] in ("-1", "0"), cmd
    sys.modules.pop("bench_serving_gpu", None)


def test_bench_serving_prefill_device_config(monkeypatch, tmp_path) -> None:
    """--prefill-device: a config file `tandem up --config` hands to its prefill workers, which
    `tandem config show` reads back; a GPU this machine lacks is refused by name."""
    import importlib
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    monkeypatch.syspath_prepend(str(root / "tools"))
    bench = importlib.import_module("bench_serving_gpu")
    errors = []
    monkeypatch.delenv("TANDEM_DEVICE", raising=False)
    path = bench.devices_config("cpu", tmp_path, errors.append)
    assert not errors
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_DEVICE"}  # the environment outranks the file
    shown = subprocess.run([sys.executable, "-m", "cli.main", "config", "show", "prefill", "--config", str(path)],
                           cwd=root, capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0, shown.stderr
    assert any(line.startswith('device = "cpu"') and line.rstrip().endswith("prefill.device")
               for line in shown.stdout.splitlines()), shown.stdout
    far = torch.cuda.device_count() + 1 if torch.cuda.is_available() else 1
    bench.devices_config(f"cuda:{far}", tmp_path, errors.append)
    assert len(errors) == 1 and f"--prefill-device cuda:{far}" in errors[0] and "CUDA device(s)" in errors[0]
    monkeypatch.setenv("TANDEM_DEVICE", "cuda:0")  # would place the prefill workers over the file's say
    bench.devices_config("cpu", tmp_path, errors.append)
    assert len(errors) == 2 and "TANDEM_DEVICE" in errors[1]
    sys.modules.pop("bench_serving_gpu", None)


def test_ep_engine_logits_run_in_inference_mode(tiny_model) -> None:
    # decode_tokens was inserted between `@torch.inference_mode()` and `def logits`, which
    # took the decorator: the first token's logits of an EP worker ran with autograd on
    from decode_worker.ep_ranks import EpEngine

    with torch.inference_mode():
        hidden = torch.randn(1, tiny_model.config.hidden_size)
    out = EpEngine.logits(types.SimpleNamespace(model=tiny_model.model), hidden)
    assert out.is_inference()


# --- absorbed decode KV (checks that held) -----------------------------------------------------

@pytest.mark.parametrize("dtype,scale,bs", [("fp8", 0.25, 1), ("fp8", 1.0, 16), ("float32", 1.0, 16)])
def test_absorbed_decode_fp8_block_boundaries_and_long_tables(tiny_model, dtype, scale, bs) -> None:
    # DecodePlan.build from block lists longer than needed, contexts ending exactly at block
    # boundaries, FP8 pools with a scale: the same logits and KV bytes as the plain path
    from engine.decode_batch import AbsorbedDecodeKv, DecodePlan
    from engine.kernels.mla_decode import mla_decode_reference
    from engine.kv_pool import FP8, PagedKvCache
    from engine.runner import DecodeInput

    c = dataclasses.replace(tiny_model.config, vocab_size=3000, bos_token_id=1, eos_token_id=(2,))
    plain, fast = build_model(c, seed=3), build_model(c, seed=3)
    use_grouped_experts(fast)
    kv_dtype = FP8 if dtype == "fp8" else torch.float32
    pool = KvPool(KvPoolConfig(num_blocks=200, block_size=bs, num_layers=c.num_kv_layers, kv_dim=c.kv_dim,
                               dtype=kv_dtype, scale=scale), 1)
    lens = [max(1, bs - 1), bs, 2 * bs - 1, 2 * bs, 3]
    batch = []
    for i, n in enumerate(lens):
        blocks = pool.blocks.allocate(pool.blocks_for(n + 1) + 2)  # two more than needed
        with torch.inference_mode():
            plain(torch.tensor([(31 * j + i) % 3000 for j in range(n)]), torch.arange(n), [n],
                  PagedKvCache(pool, [(blocks, 0, n)]))
        batch.append(DecodeInput(blocks, n, 7 + i))
    raw = (lambda: pool.kv.view(torch.uint8).clone()) if dtype == "fp8" else (lambda: pool.kv.clone())
    before = pool.kv.clone()
    with torch.inference_mode():
        want = plain.logits(plain(torch.tensor([b.input_token for b in batch]), torch.tensor(lens),
                                  [1] * len(lens), PagedKvCache(pool, [(b.block_ids, b.num_computed, 1) for b in batch])))
        written = raw()
        pool.kv.copy_(before)
        plan = DecodePlan.build(batch, bs, torch.device("cpu"))
        assert plan.width == max(pool.blocks_for(n + 1) for n in lens)
        kv = AbsorbedDecodeKv(pool, plan.tables, plan.lens, attention=mla_decode_reference)
        got = fast.logits(fast(plan.ids, plan.positions, [1] * len(lens), kv))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if dtype == "fp8":
        assert torch.equal(raw(), written)
    else:
        torch.testing.assert_close(pool.kv, written, atol=1e-5, rtol=0)


# --- device-resident block tables (engine/decode_batch.py BlockTables) --------------------------

def test_block_tables_follow_growth_in_place_edits_and_recycled_rows() -> None:
    # the store's rows must equal each list's first `need` entries after every step, whatever
    # happened to the lists in between (append, shrink and regrow in place as MTP's rollback
    # does, new lists, eviction when the store is full, growth of an unfixed store)
    import random

    from engine.decode_batch import BlockTables, DecodePlan
    from engine.runner import DecodeInput

    rng = random.Random(0)
    tables = BlockTables(3, 2, torch.device("cpu"))
    lists = [[rng.randrange(1000) for _ in range(rng.randrange(1, 6))] for _ in range(4)]
    for step in range(200):
        op = rng.randrange(4)
        i = rng.randrange(len(lists))
        if op == 0:
            lists[i].append(rng.randrange(1000))
        elif op == 1 and len(lists[i]) > 1:
            del lists[i][rng.randrange(1, len(lists[i])):]
            lists[i].extend(rng.randrange(1000) for _ in range(rng.randrange(3)))
        elif op == 2:
            lists[i] = [rng.randrange(1000) for _ in range(rng.randrange(1, 8))]
        batch_lists = rng.sample(lists, rng.randrange(1, len(lists) + 1))
        bs = 4
        batch = [DecodeInput(lst, rng.randrange(bs * (len(lst) - 1), bs * len(lst)), 5) for lst in batch_lists]
        plan = DecodePlan.build(batch, bs, torch.device("cpu"), tables)
        need = [-(-(b.num_computed + 1) // bs) for b in batch]
        assert plan.width == max(need)
        got = plan.tables
        for row, b, n in zip(got.tolist(), batch, need):
            assert row[:n] == b.block_ids[:n], step
        assert plan.lens.tolist() == [b.num_computed + 1 for b in batch]


def test_fixed_block_tables_refuse_what_they_cannot_hold() -> None:
    from engine.decode_batch import BlockTables

    tables = BlockTables(2, 2, torch.device("cpu"), fixed=True)
    with pytest.raises(ValueError, match="exceeds the captured"):
        tables.rows_for([[1, 2, 3]], [3])
    with pytest.raises(ValueError, match="exceeds the captured"):
        tables.rows_for([[1], [2], [3]], [1, 1, 1])
    assert tables.rows_for([[1, 2], [3]], [2, 1]) == [0, 1]


def test_graph_replay_inputs_padding_and_future_ids_on_cpu(tiny_model, monkeypatch) -> None:
    # DecodeGraphs' host side (plan padded to the bucket, rows from the fixed store, placeholder
    # ids resolved inside the "graph") on a CPU: the graph is a stand-in that runs the captured
    # function eagerly into the graph's output tensor, so what reaches the model is exactly what
    # a CUDA graph would read. The logits must equal the eager fast step and the plain path's.
    from engine import decode_batch
    from engine.graph_runner import DecodeGraphs
    from engine.kernels.mla_decode import mla_decode_reference
    from engine.runner import DecodeInput, ModelRunner

    monkeypatch.setattr(decode_batch.AbsorbedDecodeKv.__init__, "__defaults__", (mla_decode_reference,))

    class EagerGraph:
        def __init__(self, fn, out):
            self.fn, self.out = fn, out

        def replay(self):
            for o, new in zip(self.out, self.fn()):
                o.copy_(new)

    class CpuGraphs(DecodeGraphs):
        def _capture(self, dev):
            for bs in self.sizes:
                self.pad_inputs(bs)
                out = tuple(t.clone() for t in self._forward(bs))
                self.graphs[bs] = (EagerGraph(lambda bs=bs: self._forward(bs), out), out)
            self.memory_bytes = 0

    c = dataclasses.replace(tiny_model.config, vocab_size=3000, bos_token_id=1, eos_token_id=(2,))
    plain_model, fast_model = build_model(c, seed=4), build_model(c, seed=4)
    use_grouped_experts(fast_model)
    pool = KvPool(KvPoolConfig(num_blocks=300, block_size=4, num_layers=c.num_kv_layers, kv_dim=c.kv_dim,
                               dtype=torch.float32), 1)
    pool.kv.normal_(0, 0.5)
    plain = ModelRunner(plain_model, pool, fast=False)
    fast = ModelRunner(fast_model, pool, fast=False)
    fast.fast = True  # the fast mode's host code on a CPU (grouped experts, absorbed attention)
    lens = [3, 9, 21, 4, 13]
    batch = [DecodeInput(pool.blocks.allocate(pool.blocks_for(n + 1) + 1), n, 11 + i) for i, n in enumerate(lens)]
    before = pool.kv.clone()
    with torch.inference_mode():
        want = plain.decode(batch)
        pool.kv.copy_(before)
        eager = fast.decode(batch).clone()
        from engine.decode_batch import BlockTables
        scratch = pool.blocks.allocate(1)[0]
        fast.tables = BlockTables(2 * 8 + 1, pool.blocks_for(64), pool.kv.device)
        fast.graphs = CpuGraphs(fast_model, pool, fast.tables, fast.future, 8, scratch, [2, 8])
        assert fast.graphs.bucket(5) == 8 and fast.graphs.bucket(9) is None
        assert fast.graphs.scratch == scratch  # the MTP loop's sink block too (decode_worker/spec_overlap.py)
        for _ in range(2):  # twice: the second step finds its rows in the store (no upload)
            pool.kv.copy_(before)
            graphed = fast.decode(batch).clone()
            torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(eager, want, atol=1e-4, rtol=1e-4)
        # placeholder ids: a step whose inputs are still on the "device" resolves them in the graph
        slots = fast.future.reserve(len(batch))
        fast.future.store(torch.tensor(slots), torch.tensor([b.input_token for b in batch]))
        pending = [DecodeInput(b.block_ids, b.num_computed, fast.future.placeholder(s)) for b, s in zip(batch, slots)]
        pool.kv.copy_(before)
        torch.testing.assert_close(fast.decode(pending), eager, atol=1e-4, rtol=1e-4)
        # the padding rows wrote only into the scratch block: every live block as the plain step left it
        pool.kv.copy_(before)
        plain.decode(batch)
        after_plain = pool.kv.clone()
        pool.kv.copy_(before)
        fast.decode(batch)
        live = [blk for b in batch for blk in b.block_ids]
        torch.testing.assert_close(pool.kv[live], after_plain[live], atol=1e-5, rtol=0)
        # the step's plan is copied into the bucket's own contiguous static inputs (no copy of
        # its own at the replay)
        built = []
        real_build = decode_batch.DecodePlan.build
        monkeypatch.setattr(decode_batch.DecodePlan, "build",
                            staticmethod(lambda *a, **k: built.append(real_build(*a, **k)) or built[-1]))
        pool.kv.copy_(before)
        fast.decode(batch)
        monkeypatch.setattr(decode_batch.DecodePlan, "build", staticmethod(real_build))
        static = fast.graphs.inputs(8)
        assert static.is_contiguous() and built[0].ints.data_ptr() == static.data_ptr()
        assert built[0].ints.stride() == static.stride() and static[0, :5].tolist() == [11, 12, 13, 14, 15]
        # the greedy head inside the "graph": decode_step's [B, 2] pack matches the eager fast
        # step's (same tokens, logprobs within float32 noise), and the tokens are in the future
        # map at the step's slots with nothing run after the replay
        greedy = [(SamplingParams(max_tokens=8), 0)] * len(batch)
        seeded = greedy[:2] + [(SamplingParams(max_tokens=8, temperature=0.9, seed=77), 3)] + greedy[3:]
        graphs = fast.graphs
        packs = []
        from engine import runner as runner_module

        def no_sampling_after_the_replay(*args):
            raise AssertionError("an all-greedy graph step sampled after the replay")
        for sampling in (greedy, seeded):
            pool.kv.copy_(before)
            slots = fast.future.reserve(len(batch))
            if sampling is greedy:
                monkeypatch.setattr(runner_module, "sample_step", no_sampling_after_the_replay)
            packed = fast.decode_step(batch, sampling, slots).clone()
            monkeypatch.undo()
            monkeypatch.setattr(decode_batch.AbsorbedDecodeKv.__init__, "__defaults__", (mla_decode_reference,))
            assert packed.shape == (len(batch), 2) and packed.dtype == torch.float64
            assert fast.future.tokens[slots].tolist() == packed[:, 0].long().tolist()
            fast.graphs = None  # the eager fast step: sample_step after the forward
            pool.kv.copy_(before)
            eager_pack = fast.decode_step(batch, sampling)
            fast.graphs = graphs
            assert packed[:, 0].tolist() == eager_pack[:, 0].tolist()
            torch.testing.assert_close(packed[:, 1], eager_pack[:, 1], atol=1e-4, rtol=1e-4)
            want_tokens, want_lp = sample_batch(eager, SamplingRows.build(sampling, pool.kv.device))
            assert packed[:, 0].long().tolist() == want_tokens.tolist()
            packs.append(packed)
        # the sampled row's token overwrote the graph's greedy one in the map (seed chosen so they differ)
        assert packs[1][2, 0] != packs[0][2, 0]
        assert fast.future.tokens[slots[2]].item() == int(packs[1][2, 0])
