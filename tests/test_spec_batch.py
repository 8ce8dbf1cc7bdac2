"""The device-resident MTP step (engine/spec_batch.py) on its two attention paths: the plain
path (`PagedKvCache`) and the fast path (every verify query one row of the paged MLA decode
kernel, and on CUDA its graphs, engine/spec_graphs.py). On a CPU the fast path runs with the
kernel's torch reference; the CUDA tests (skipped without a GPU) compare the Triton kernel and
the graph replays with the plain path on the same bf16 weights, and the served MTP loop in
float32 with reference_generate. Each takes seconds."""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.kernels.mla_decode import mla_decode_reference
from engine.kv_pool import KvPool, KvPoolConfig
from engine.model_source import load_model
from engine.reference import reference_generate
from engine.runner import ModelRunner
from engine.spec_batch import SpecRow, SpecSlots, spec_step
from engine.sampling import sample
from decode_helpers import generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")
cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs CUDA: the Triton MLA decode kernel and CUDA graphs (run on the lent H200)")
TEXTS = ["ROMEO:\nBut soft, what light through yonder window breaks?\n",
         "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\n",
         "KING HENRY:\nOnce more unto the breach, dear friends, once more;\n"]
K = 3


@pytest.fixture(scope="module")
def shakespeare():
    return load_model("tandem-shakespeare")


class _Batch:
    """Prompts prefilled (with their MTP rows) into a pool, their slots started, and the rows of
    a step with blocks for `steps` steps; `clone` copies pool and slots for another path."""

    def __init__(self, model, texts, tok, params, steps: int, device) -> None:
        c = model.config
        self.model = model
        self.pool = KvPool(KvPoolConfig(num_blocks=64, block_size=16, num_layers=c.num_kv_layers,
                                        kv_dim=c.kv_dim, dtype=model.dtype), hash_seed=1, device=device)
        runner = ModelRunner(model, self.pool, fast=False)
        self.slots = SpecSlots(8, K, c.hidden_size, model.dtype, device)
        self.rows = []
        for i, (text, p) in enumerate(zip(texts, params)):
            prompt = tok.encode(text)
            blocks = self.pool.allocate_prompt(prompt).block_ids
            hidden = runner.prefill_chunk(blocks, prompt, 0, len(prompt), mtp=True)
            first, _ = sample(runner.logits(hidden), p, 0)
            self.pool.grow(blocks, len(prompt) + steps * (K + 1) + 1)
            self.slots.init(i, hidden[None], prompt + [first])
            self.rows.append(SpecRow(i, blocks, p, -len(prompt)))

    def clone(self) -> _Batch:
        other = copy.copy(self)
        other.pool = copy.copy(self.pool)
        other.pool.kv = self.pool.kv.clone()
        other.slots = copy.copy(self.slots)
        for name in ("hidden", "ids", "count", "n"):
            setattr(other.slots, name, getattr(self.slots, name).clone())
        other.slots._free = list(self.slots._free)
        return other

    def run(self, steps: int, **kw) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per step: (tokens [B, K+1], count [B], the verify's logits [B, K+1, vocab])."""
        out = []
        for _ in range(steps):
            res = spec_step(self.model, self.pool, self.slots, self.rows, **kw)
            idx = torch.tensor([r.slot for r in self.rows], device=self.pool.kv.device)
            logits = self.model.logits(self.slots.hidden[idx])  # hidden of the verify just run
            out.append((res.tokens.cpu(), res.count.cpu(), logits.float().cpu()))
        return out


def test_fast_path_step_equals_plain_on_cpu(shakespeare) -> None:
    # float32: the absorbed one-query-per-row attention gives the plain path's tokens
    tok = shakespeare.tokenizer()
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams()]
    batch = _Batch(shakespeare.model, TEXTS, tok, params, steps=4, device="cpu")
    fast = batch.clone()
    plain_out = batch.run(4, fast=False)
    fast_out = fast.run(4, fast=True, attention=mla_decode_reference)
    for (t0, c0, l0), (t1, c1, l1) in zip(plain_out, fast_out):
        assert torch.equal(t0, t1) and torch.equal(c0, c1)
        torch.testing.assert_close(l1, l0, atol=2e-4, rtol=0)
    assert sum(int(c.sum()) for _, c, _ in plain_out) > 4 * len(TEXTS)  # drafts were accepted
    torch.testing.assert_close(fast.slots.n, batch.slots.n, atol=0, rtol=0)


def test_verify_logits_written_into_a_buffer_change_nothing(shakespeare) -> None:
    # the MTP graphs' form (engine/spec_graphs.py): step_body writing the verify's logits into one
    # buffer that outlives the step gives the same tokens, and the buffer holds those logits
    from engine.spec_batch import FastForwards, step_body
    from engine.sampling import SamplingRows
    tok = shakespeare.tokenizer()
    params = [SamplingParams(top_logprobs=3), SamplingParams(temperature=0.8, top_p=0.9, seed=3, top_logprobs=2)]
    batch = _Batch(shakespeare.model, TEXTS[:2], tok, params, steps=1, device="cpu")
    other = batch.clone()
    results = []
    for b, buf in ((batch, None), (other, torch.full((8 * (K + 1), shakespeare.config.vocab_size), float("nan")))):
        idx = torch.tensor([r.slot for r in b.rows])
        shift = torch.tensor([r.step_shift for r in b.rows])
        one = SamplingRows.build([(r.params, 0) for r in b.rows], "cpu")
        tables = torch.tensor([r.block_ids for r in b.rows], dtype=torch.int32)
        results.append((step_body(b.model, b.slots, idx, shift, one,
                                  lambda n, c, b=b, t=tables: FastForwards(b.model, b.pool, t, K + 1,
                                                                           mla_decode_reference),
                                  logits_out=buf), buf))
    (plain, _), (into, buf) = results
    assert torch.equal(plain.tokens, into.tokens) and torch.equal(plain.count, into.count)
    assert torch.equal(plain.top, into.top)
    # the verify's logits: of the hidden rows the step left in the slots (the same on both paths)
    idx = torch.tensor([r.slot for r in batch.rows])
    assert torch.equal(batch.slots.hidden[idx], other.slots.hidden[idx])
    rows = len(TEXTS[:2]) * (K + 1)
    want = shakespeare.model.logits(batch.slots.hidden[idx].reshape(rows, -1))
    assert torch.equal(buf[:rows], want) and buf[rows:].isnan().all()


class _EagerReplay:
    """A captured graph's stand-in on a CPU: `replay` runs the captured function eagerly and
    writes its results into the tensors the 'capture' returned, as a replay does."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.out = fn()

    def replay(self) -> None:
        new = self.fn()
        for name in ("tokens", "logprobs", "count"):
            getattr(self.out, name).copy_(getattr(new, name))


def eager_spec_graphs(batch: _Batch, sizes: list[int], modes, monkeypatch):
    """engine/spec_graphs.py's SpecGraphs over batch's pool and slots with every bucket and mode
    'captured' as an _EagerReplay (the attention's torch reference for the Triton kernel): its
    `run` (inputs, replay, tops after it) on a CPU."""
    from engine import spec_graphs
    from engine.spec_batch import FastForwards
    monkeypatch.setattr(spec_graphs, "FastForwards",
                        lambda model, pool, tables, k1: FastForwards(model, pool, tables, k1, mla_decode_reference))
    g = spec_graphs.SpecGraphs.__new__(spec_graphs.SpecGraphs)
    width = max(len(r.block_ids) for r in batch.rows) + 1
    g._inputs(batch.model, batch.pool, batch.slots, max(sizes), width, batch.pool.blocks.allocate(1)[0], sizes)
    for bs in g.sizes:
        for mode in modes:
            stand_in = _EagerReplay(lambda bs=bs, mode=mode: g._forward(bs, mode))
            g.graphs[bs, mode] = (stand_in, stand_in.out)
    return g


def test_graph_replays_report_the_eager_steps_tokens_and_tops_on_cpu(shakespeare, monkeypatch) -> None:
    # SpecGraphs.run on a CPU, its replays eager stand-ins: padded to a bucket, its inputs
    # written into the static buffers, the tops computed after the replay from the shared
    # logits buffer for the asking rows only; in float32 the eager fast step's tokens, counts
    # and top log-probabilities, step after step
    tok = shakespeare.tokenizer()
    params = [SamplingParams(top_logprobs=3), SamplingParams(),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, top_logprobs=2)]
    batch = _Batch(shakespeare.model, TEXTS, tok, params, steps=4, device="cpu")
    replayed = batch.clone()
    graphs = eager_spec_graphs(replayed, [1, 2, 4], (False, True), monkeypatch)
    emitted = 0
    for step in range(4):
        want = spec_step(batch.model, batch.pool, batch.slots, batch.rows, fast=True, attention=mla_decode_reference)
        got = spec_step(replayed.model, replayed.pool, replayed.slots, replayed.rows, fast=True, graphs=graphs)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.count, want.count), step
        assert got.top is not None and torch.equal(got.top[1], torch.zeros_like(got.top[1]))  # row 1 asked none
        for i in (0, 2):
            torch.testing.assert_close(got.top[i], want.top[i], atol=1e-5, rtol=0)
        emitted += int(got.count.sum())
    assert emitted > 4 * len(TEXTS)  # drafts were accepted: the replays ran whole steps


def test_biased_graph_replays_apply_the_batchs_bias_on_cpu(shakespeare, monkeypatch) -> None:
    # the biased mode's pair buffer on a CPU (eager stand-ins for the replays): a batch with
    # biased rows (one at MAX_LOGIT_BIAS pairs, one banning the eager step's picks) gives the
    # eager fast step's tokens and top log-probabilities (those of the biased distribution), a
    # smaller batch after it (fewer pairs: the rest of the buffer must add nothing) too
    from common.sampling_params import MAX_LOGIT_BIAS
    from engine.spec_graphs import BIASED, GREEDY, SAMPLED
    tok = shakespeare.tokenizer()
    vocab = shakespeare.config.vocab_size
    # common tokens first (ids from 257: ' t', 'he', ' a', ...), so that a stale pair left live
    # past a later batch's own would move a likely token of that batch's row 0
    many = tuple((t, 6.0 if t % 2 else -6.0) for t in range(257, 257 + MAX_LOGIT_BIAS))
    params = [SamplingParams(top_logprobs=3, logit_bias=many), SamplingParams(top_logprobs=1),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, top_logprobs=2,
                             logit_bias=((tok.encode(" the")[0], 4.0), (vocab - 1, -100.0)))]
    batch = _Batch(shakespeare.model, TEXTS, tok, params, steps=4, device="cpu")
    replayed = batch.clone()
    graphs = eager_spec_graphs(replayed, [1, 2, 4], (GREEDY, SAMPLED, BIASED), monkeypatch)
    modes = []
    real_run = graphs.run
    graphs.run = lambda rows: (modes.append(any(r.params.logit_bias for r in rows)), real_run(rows))[1]
    for step in range(4):
        rows = (batch.rows, replayed.rows) if step < 2 else (batch.rows[1:], replayed.rows[1:])
        want = spec_step(batch.model, batch.pool, batch.slots, rows[0], fast=True, attention=mla_decode_reference)
        got = spec_step(replayed.model, replayed.pool, replayed.slots, rows[1], fast=True, graphs=graphs)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.count, want.count), step
        torch.testing.assert_close(got.top, want.top, atol=1e-5, rtol=0)
    assert modes == [True, True, True, True]  # every step replayed (the third row stays biased)
    assert int(graphs.bias_count) == 2  # the last batch's pairs: the 300 of row 0 are past them


def test_step_emits_the_plain_decoding_tokens(shakespeare) -> None:
    # the emitted tokens of consecutive steps are reference_generate's greedy continuation
    tok = shakespeare.tokenizer()
    batch = _Batch(shakespeare.model, TEXTS[:2], tok, [SamplingParams()] * 2, steps=3, device="cpu")
    got = [[] for _ in TEXTS[:2]]
    for tokens, count, _ in batch.run(3, fast=False):
        for i in range(len(got)):
            got[i] += tokens[i, :int(count[i])].tolist()
    for text, g in zip(TEXTS, got):
        ref = reference_generate(shakespeare.model, tok.encode(text), 1 + len(g))
        assert g == ref[1:]


# ---- CUDA -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_cuda(shakespeare):
    model = copy.deepcopy(shakespeare.model).to("cuda", torch.bfloat16)
    runner = ModelRunner(model, KvPool(KvPoolConfig(num_blocks=4, block_size=16, num_layers=model.config.num_kv_layers,
                                                    kv_dim=model.config.kv_dim, dtype=torch.bfloat16),
                                       hash_seed=1, device="cuda"))
    assert runner.fast, "bf16 on CUDA with triton takes the fast path"  # (grouped experts set up)
    return model


def _compare(plain_out, fast_out, plain_routes=None, fast_routes=None) -> tuple[float, float]:
    """(max, share of rows left out): the per-row max logit difference relative to the logits'
    scale over the verify rows both paths ran on the same inputs, and asserts their target
    tokens mostly agree. Row i of a request's verify reads draft i as input; only rows below the
    accept count (drafts accepted, so equal to the agreeing targets) have equal inputs in both
    paths: a rejected draft may differ between two bf16 paths, and so may every logit after it.
    Steps after the counts first differ start from different states and are not compared.
    With the experts each path's verify chose (`_run_routed`), a request's rows of a step from
    the first one whose experts differ are left out too: where a token's top-k choice is a near
    tie, bf16 rounding tips it one way in one path and the other way in the other (on a CPU in
    bf16 one verify row of 23 did so, its logits 0.057 apart where the others were 0.002-0.007).
    The later rows read that row's KV; later steps are compared again (the row's KV is one of
    many context rows each of them reads)."""
    same = total = left_out = 0
    worst = 0.0
    for step, ((t0, c0, l0), (t1, c1, l1)) in enumerate(zip(plain_out, fast_out)):
        first_flip = _first_flips(t0.shape, plain_routes[step], fast_routes[step]) if plain_routes else {}
        for b in range(t0.shape[0]):
            rows = int(min(c0[b], c1[b]))
            same += int((t0[b, :rows] == t1[b, :rows]).sum())
            total += rows
            keep = min(rows, first_flip.get(b, rows))
            left_out += rows - keep
            if keep:
                worst = max(worst, float((l1[b, :keep] - l0[b, :keep]).abs().max() / l0[b, :rows].abs().max()))
        if not torch.equal(c0, c1):  # a different accept length: the paths part ways here
            break
    assert total and same >= 0.8 * total, f"{same}/{total} target tokens agree"
    return worst, left_out / total


def _first_flips(shape, plain_calls, fast_calls) -> dict[int, int]:
    """{request: first verify row whose experts differ between the paths} for one step: the MoE
    calls over the verify's B × (K + 1) rows, in the same order in both paths."""
    rows_per = shape[1]
    flips: dict[int, int] = {}
    if len(plain_calls) != len(fast_calls):
        return flips
    for a, b in zip(plain_calls, fast_calls):
        if a.shape != b.shape or a.shape[0] != shape[0] * rows_per:
            continue
        for r in (a != b).any(-1).nonzero().flatten().tolist():
            req, i = divmod(r, rows_per)
            flips[req] = min(flips.get(req, i), i)
    return flips


def _run_routed(batch, steps: int, monkeypatch, **kw):
    """batch.run(steps, **kw) step by step, and per step the experts every MoE call of the
    verify forward chose (the grouped form's routing: [T, k] sorted ids per layer; the MTP
    extend and drafts, which also route, are not recorded). Eager paths only (not graph replays)."""
    import engine.kernels.grouped_experts as ge
    import engine.spec_batch as sb
    real = ge.route_with_shared
    calls: list[torch.Tensor] = []
    in_verify = [False]

    def record(x, weight, bias, c, shared):
        ids, w = real(x, weight, bias, c, shared)
        if in_verify[0]:
            calls.append(ids[:, :c.num_experts_per_tok].sort(-1).values.cpu())
        return ids, w

    def recording(verify):
        def wrapped(self, *args, **kwargs):
            in_verify[0] = True
            try:
                return verify(self, *args, **kwargs)
            finally:
                in_verify[0] = False
        return wrapped
    monkeypatch.setattr(ge, "route_with_shared", record)
    for cls in (sb._PlainForwards, sb.FastForwards):
        monkeypatch.setattr(cls, "verify", recording(cls.verify))
    out, routes = [], []
    for _ in range(steps):
        calls.clear()
        out += batch.run(1, **kw)
        routes.append(list(calls))
    monkeypatch.undo()
    return out, routes


def test_compare_leaves_out_a_request_from_its_first_other_expert_choice() -> None:
    # two requests, K + 1 = 2 rows each, one step: request 1's row 1 chose other experts
    t = torch.zeros(2, 2, dtype=torch.long)
    c = torch.tensor([2, 2])
    l0 = torch.ones(2, 2, 4)
    l1 = l0.clone()
    l1[1, 1] += 5.0  # that row's logits are far apart
    plain_calls = [torch.tensor([[0, 1], [0, 1], [0, 1], [2, 3]])]
    fast_calls = [torch.tensor([[0, 1], [0, 1], [0, 1], [2, 4]])]
    worst, left_out = _compare([(t, c, l0)], [(t, c, l1)], [plain_calls], [fast_calls])
    assert worst == 0.0 and left_out == 0.25
    with pytest.raises(AssertionError):  # without the routes the row counts, and it is far off
        assert _compare([(t, c, l0)], [(t, c, l1)])[0] < 0.05


@cuda
def test_cuda_fast_step_and_graphs_match_plain_bf16(bf16_cuda, monkeypatch) -> None:
    from engine.spec_graphs import SpecGraphs
    tok = load_model("tandem-shakespeare").tokenizer()
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams()]
    batch = _Batch(bf16_cuda, TEXTS, tok, params, steps=3, device="cuda")
    fast, graphed, greedy = batch.clone(), batch.clone(), batch.clone()
    plain_out, plain_routes = _run_routed(batch, 3, monkeypatch, fast=False)
    fast_out, fast_routes = _run_routed(fast, 3, monkeypatch, fast=True)
    scratch = graphed.pool.blocks.allocate(1)[0]
    # the batch's rows use slots 0..2; the graphs reserve the last of its 8 for padding rows
    graphs = SpecGraphs(bf16_cuda, graphed.pool, graphed.slots, max_batch=4, width=8, scratch_block=scratch)
    graph_out = graphed.run(3, fast=True, graphs=graphs)
    # a greedy-only batch replays the greedy graph; its rows' tokens equal the eager step's too
    greedy.rows = [dataclasses.replace(r, params=SamplingParams()) for r in greedy.rows]
    greedy_eager, greedy_graphed = greedy.clone(), greedy.clone()
    g_scratch = greedy_graphed.pool.blocks.allocate(1)[0]
    g_graphs = SpecGraphs(bf16_cuda, greedy_graphed.pool, greedy_graphed.slots, max_batch=4, width=8,
                          scratch_block=g_scratch)
    for (t0, c0, _), (t1, c1, _) in zip(greedy_eager.run(3, fast=True), greedy_graphed.run(3, fast=True, graphs=g_graphs)):
        assert torch.equal(c0, c1) and torch.equal(t0, t1)
    worst, left_out = _compare(plain_out, fast_out, plain_routes, fast_routes)
    assert worst < 0.05 and left_out <= 0.3, (worst, left_out)
    for (t0, c0, l0), (t1, c1, l1) in zip(fast_out, graph_out):  # replay = the eager fast path
        assert torch.equal(c0, c1) and torch.equal(t0, t1)


@cuda
def test_cuda_served_mtp_overlap_equals_reference_float32(shakespeare) -> None:
    # float32 on CUDA: the plain path with the overlap loop (on by default there), exact
    model = copy.deepcopy(shakespeare.model).to("cuda")
    loaded = dataclasses.replace(shakespeare, model=model)
    tok = shakespeare.tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=20) for _ in prompts]
    got, rt = asyncio.run(generate(loaded, 2, prompts, params))
    assert rt.pool.kv.device.type == "cuda" and rt.stats.spec_verify_steps > 0
    for prompt, out in zip(prompts, got):
        assert out == reference_generate(model, prompt, 20, shakespeare.config.eos_token_ids)


@cuda
def test_cuda_served_mtp_bf16_graphs_agree_with_k0(shakespeare) -> None:
    # bf16 fast path with graphs, overlap on: MTP k = 2 against k = 0 on the same weights
    model = copy.deepcopy(shakespeare.model).to("cuda", torch.bfloat16)
    loaded = dataclasses.replace(shakespeare, model=model)
    tok = shakespeare.tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=24) for _ in prompts]
    base, _ = asyncio.run(generate(loaded, 0, prompts, params, max_running=4))
    got, rt = asyncio.run(generate(loaded, 2, prompts, params, max_running=4))
    assert rt.runner.spec_graphs is not None  # the MTP steps replayed their graphs
    # --disable-overlap-schedule: the same device-resident steps, post-processed in turn
    in_turn, rt2 = asyncio.run(generate(loaded, 2, prompts, params, max_running=4, disable_overlap_schedule=True))
    assert rt2.stats.spec_verify_steps > 0
    for other in (got, in_turn):
        agree = sum(a == b for x, y in zip(base, other) for a, b in zip(x, y))
        assert agree >= 0.8 * sum(len(x) for x in base), (base, other)
    assert rt.stats.spec_emitted_tokens / rt.stats.spec_verify_steps > 1.2


@cuda
def test_cuda_mtp_graphs_report_top_logprobs_as_the_eager_step(shakespeare, monkeypatch) -> None:
    # bf16 fast path with graphs captured: a batch holding requests that ask for top
    # log-probabilities replays the graphs, its tops computed after the replay from the verify
    # logits, for every decoded token; against the same run without graphs (--disable-cuda-graph:
    # the eager step's sample_step) the same alternatives up to each request's first differing
    # token, and the tokens mostly agree with k = 0 on the same weights
    from engine.spec_graphs import SpecGraphs
    replayed = []
    real_run = SpecGraphs.run

    def run(self, rows):
        out = real_run(self, rows)
        replayed.append(out.top is not None)
        return out
    monkeypatch.setattr(SpecGraphs, "run", run)
    model = copy.deepcopy(shakespeare.model).to("cuda", torch.bfloat16)
    loaded = dataclasses.replace(shakespeare, model=model)
    tok = shakespeare.tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=16, top_logprobs=4), SamplingParams(max_tokens=16),
              SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=5, top_logprobs=2)]
    base, _ = asyncio.run(generate(loaded, 0, prompts, params, max_running=4))
    tops = [[] for _ in prompts]
    got, rt = asyncio.run(generate(loaded, 2, prompts, params, max_running=4, tops=tops))
    assert rt.runner.spec_graphs is not None and rt.stats.spec_verify_steps > 0
    assert any(replayed)  # the graphs took batches asking for tops
    eager_tops = [[] for _ in prompts]
    eager, rt2 = asyncio.run(generate(loaded, 2, prompts, params, max_running=4, tops=eager_tops,
                                      disable_cuda_graph=True))
    assert rt2.runner.spec_graphs is None
    for p, out, t, e_out, e in zip(params, got, tops, eager, eager_tops):
        assert len(t) == len(out) - 1 and all((len(x) > 0) == (p.top_logprobs > 0) for x in t)
        if p.greedy and p.top_logprobs:  # a greedy token is among its likeliest alternatives (ties: any order)
            assert all(tok_id in dict(x) for x, tok_id in zip(t, out[1:]))
        same = next((i for i, (a, b) in enumerate(zip(out[1:], e_out[1:])) if a != b), len(out) - 1)
        for a, b in zip(t[:same], e[:same]):
            assert [i for i, _ in a] == [i for i, _ in b]
            assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=2e-2)
    agree = sum(a == b for x, y in zip(base[:2], got[:2]) for a, b in zip(x, y))
    assert agree >= 0.8 * sum(len(x) for x in base[:2]), (base, got)


@cuda
def test_cuda_mtp_graphs_apply_a_logit_bias(shakespeare, monkeypatch) -> None:
    # bf16 fast path with graphs captured: a batch holding biased requests replays the biased
    # graph (its pairs in the fixed-size buffer, the rest adding 0); the banned tokens never
    # come, the tokens equal the eager step's (--disable-cuda-graph) up to a near-tie, and
    # mostly agree with k = 0 under the same bias on the same weights; a later batch without a
    # bias (the buffer's count back to 0 there is not needed: another graph) is unaffected
    from engine.spec_graphs import SpecGraphs
    modes = []
    real_run = SpecGraphs.run

    def run(self, rows):
        modes.append(any(r.params.logit_bias for r in rows))
        return real_run(self, rows)
    monkeypatch.setattr(SpecGraphs, "run", run)
    model = copy.deepcopy(shakespeare.model).to("cuda", torch.bfloat16)
    loaded = dataclasses.replace(shakespeare, model=model)
    tok = shakespeare.tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    plain, _ = asyncio.run(generate(loaded, 0, prompts[:1], [SamplingParams(max_tokens=8)], max_running=4))
    banned = tuple((t, -100.0) for t in sorted(set(plain[0][1:])))
    params = [SamplingParams(max_tokens=16, logit_bias=banned), SamplingParams(max_tokens=16),
              SamplingParams(max_tokens=16, temperature=0.8, seed=5, logit_bias=((tok.encode(" the")[0], 3.0),))]
    base, _ = asyncio.run(generate(loaded, 0, prompts, params, max_running=4))
    got, rt = asyncio.run(generate(loaded, 2, prompts, params, max_running=4))
    assert rt.runner.spec_graphs is not None and rt.stats.spec_verify_steps > 0
    assert any(modes) and int(rt.runner.spec_graphs.bias_count) > 0  # the biased graph was replayed
    assert not set(got[0][1:]) & {t for t, _ in banned}
    eager, rt2 = asyncio.run(generate(loaded, 2, prompts, params, max_running=4, disable_cuda_graph=True))
    assert rt2.runner.spec_graphs is None
    for out, e_out in zip(got, eager):  # bf16 graphs against eager launches: the same up to a near-tie
        same = next((i for i, (a, b) in enumerate(zip(out, e_out)) if a != b), len(out))
        assert same >= 4, (out, e_out)
    agree = sum(a == b for x, y in zip(base[:2], got[:2]) for a, b in zip(x, y))
    assert agree >= 0.8 * sum(len(x) for x in base[:2]), (base, got)
