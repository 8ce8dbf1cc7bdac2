"""MTP speculative decoding (engine/spec_decode.py, decode_worker/spec_step.py, and with the
overlap scheduler engine/spec_batch.py + decode_worker/spec_overlap.py): the accept rule, the
prompt's MTP KV rows, and the decode loop with k = 1, 2, 3, overlap off and on, against
reference_generate (greedy) and k = 0 (seeded) on the shipped trained checkpoint (whose MTP
module drafts well, so accepted and rejected drafts both occur)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.kv_pool import KvPool, KvPoolConfig
from engine.model_source import load_model
from engine.reference import reference_generate
from engine.runner import ModelRunner
from engine.sampling import sample
from engine.spec_decode import SpecOutput, accept
from decode_helpers import generate as _generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TEXTS = ["ROMEO:\nBut soft, what light through yonder window breaks?\n",
         "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\n",
         "KING HENRY:\nOnce more unto the breach, dear friends,"]


@pytest.fixture(scope="module")
def shakespeare():
    return load_model("tandem-shakespeare")


# ---- the accept rule ----------------------------------------------------------------------------

def _onehot_logits(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    out = torch.full((len(tokens), vocab), -5.0)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return out


@pytest.mark.parametrize("drafts,targets,emitted", [
    ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),  # all accepted, plus the bonus token
    ([1, 5, 3], [1, 2, 3, 4], [1, 2]),  # second draft rejected: the target's token replaces it
    ([6], [0, 7], [0]),
    ([], [3], [3]),  # k = 0 is a plain decode step
])
def test_greedy_accept_is_longest_matching_prefix(drafts, targets, emitted) -> None:
    out = SpecOutput(drafts, _onehot_logits(targets), torch.zeros(len(targets), 4))
    assert [t for t, *_ in accept(out, SamplingParams(), step=0)] == emitted


def test_seeded_accept_emits_the_plain_draws() -> None:
    # whatever the drafts, the emitted tokens are what `sample` draws at those steps (k = 0)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=7)
    plain = [sample(logits[i], params, 10 + i)[0] for i in range(4)]
    for drafts in ([0, 0, 0], plain[:3], [plain[0], (plain[1] + 1) % 50, plain[2]]):
        out = SpecOutput(drafts, logits, torch.zeros(4, 1))
        got = [t for t, *_ in accept(out, params, step=10)]
        n = next((i for i, d in enumerate(drafts) if d != plain[i]), 3)
        assert got == plain[:n + 1]


# ---- the prompt's MTP rows ----------------------------------------------------------------------

def test_chunked_prefill_writes_the_prompts_mtp_rows(tiny_model) -> None:
    model, c = tiny_model.model, tiny_model.config
    prompt = [(17 * i + 3) % 1000 for i in range(37)]
    pool = KvPool(KvPoolConfig(num_blocks=8, block_size=16, num_layers=c.num_kv_layers,
                               kv_dim=c.kv_dim), hash_seed=1)
    blocks = pool.allocate_prompt(prompt).block_ids
    runner = ModelRunner(model, pool)
    for s in range(0, len(prompt), 10):  # chunks that do not align with blocks
        runner.prefill_chunk(blocks, prompt, s, min(s + 10, len(prompt)), mtp=True)
    # one unchunked forward, then MTP rows 0..P-2 over (hidden at p, token p + 1)
    kv = _Recording()
    with torch.inference_mode():
        ids, pos = torch.tensor(prompt), torch.arange(len(prompt))
        hidden = model(ids, pos, [len(prompt)], kv)
        model.mtp_forward(0, hidden[:-1], ids[1:], pos[:-1], [len(prompt) - 1], kv)
    mtp_layer = c.num_hidden_layers
    paged = pool.kv[torch.tensor(blocks), mtp_layer].reshape(-1, c.kv_dim)[:len(prompt) - 1]
    torch.testing.assert_close(paged, kv.layers[mtp_layer], atol=1e-5, rtol=0)


class _Recording:
    """KvCache of one sequence that keeps each layer's latents readable."""

    def __init__(self) -> None:
        self.layers: dict[int, torch.Tensor] = {}

    def update(self, layer: int, latent: torch.Tensor) -> list[torch.Tensor]:
        past = self.layers.get(layer)
        self.layers[layer] = latent if past is None else torch.cat((past, latent))
        return [self.layers[layer]]


# ---- the decode loop ----------------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [False, True, "in turn"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_batch_equals_reference(shakespeare, k, overlap) -> None:
    tok = shakespeare.tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    lens = [24, 5, 1, 17]  # max_tokens: short ones exercise the draft cap at max_tokens
    prompts.append(prompts[0][:16])  # a prompt of exactly one block (cached block reused)
    params = [SamplingParams(max_tokens=n) for n in lens]
    got, rt = asyncio.run(_generate(shakespeare, k, prompts, params, overlap=overlap))
    for prompt, n, out in zip(prompts, lens, got):
        assert out == reference_generate(shakespeare.model, prompt, n, shakespeare.config.eos_token_ids)
    # no block leaked (the MTP overlap loop keeps one scratch block for positions past max_tokens)
    assert rt.pool.blocks.num_free == rt.opts.num_blocks - (1 if overlap else 0)
    # the trained MTP module drafts usefully: more than one token per verify step on average
    assert rt.stats.spec_verify_steps > 0
    assert rt.stats.spec_emitted_tokens / rt.stats.spec_verify_steps > 1.2


@pytest.mark.parametrize("overlap", [False, True])
def test_eos_inside_accepted_drafts_stops_there(tiny_model, overlap) -> None:
    # tiny seeded model: choose an "eos" that greedy decoding produces mid-sequence
    prompt = [(11 * i + 5) % 5000 for i in range(20)]
    plain = reference_generate(tiny_model.model, prompt, 12)
    eos = next(t for i, t in enumerate(plain) if i >= 4 and t not in plain[:i])
    cfg = dataclasses.replace(tiny_model.config, eos_token_id=(eos,))
    loaded = dataclasses.replace(tiny_model, config=cfg)
    got, rt = asyncio.run(_generate(loaded, 3, [prompt], [SamplingParams(max_tokens=12)], overlap=overlap))
    assert got[0] == plain[:plain.index(eos) + 1]
    assert rt.pool.blocks.num_free == rt.opts.num_blocks - (1 if overlap else 0)


@pytest.mark.parametrize("overlap", [False, True, "in turn"])
def test_seeded_sampling_equals_k0(shakespeare, overlap) -> None:
    # every emitted token is the one plain decoding draws with the same (seed, step) noise
    tok = shakespeare.tokenizer()
    prompts = [tok.encode(t) for t in TEXTS[:2]]
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=s) for s in (3, 4)]
    base, _ = asyncio.run(_generate(shakespeare, 0, prompts, params))
    a, rt = asyncio.run(_generate(shakespeare, 2, prompts, params, overlap=overlap))
    assert a == base and all(len(x) == 20 for x in a)
    assert rt.stats.spec_emitted_tokens > rt.stats.spec_verify_steps  # some drafts accepted
    c, _ = asyncio.run(_generate(shakespeare, 2, prompts, [dataclasses.replace(p, seed=9) for p in params],
                                 overlap=overlap))
    assert c != a


def test_overlap_cancel_and_pool_pressure_free_every_block(shakespeare) -> None:
    # a cancelled request, and a pool so small that requests are retracted and resume
    tok = shakespeare.tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=30) for _ in prompts]
    got, rt = asyncio.run(_generate(shakespeare, 3, prompts, params, num_blocks=8, overlap=True,
                                    cancel=1))
    for i, (prompt, out) in enumerate(zip(prompts, got)):
        ref = reference_generate(shakespeare.model, prompt, 30, shakespeare.config.eos_token_ids)
        assert out == (ref[:3] if i == 1 else ref)
    assert rt.stats.retractions > 0
    assert rt.pool.blocks.num_free == rt.opts.num_blocks - 1


def test_model_without_mtp_is_refused_by_name(tiny_model) -> None:
    from common.pb.tandem.v1 import discovery_pb2
    from decode_worker.scheduler import DecodeScheduler
    from engine.model import build_model
    from engine.model_source import LoadedModel
    from worker.host import WorkerOptions, WorkerRuntime

    cfg = dataclasses.replace(tiny_model.config, num_nextn_predict_layers=0)
    loaded = LoadedModel("no-mtp", cfg, build_model(cfg), None)
    rt = WorkerRuntime(discovery_pb2.ROLE_DECODE, WorkerOptions(num_blocks=8, speculative_num_steps=2), loaded)
    try:
        with pytest.raises(ValueError, match="--speculative-num-steps 2: model no-mtp has no MTP module"):
            DecodeScheduler(rt)
    finally:
        rt.close()
    with pytest.raises(ValueError, match="--speculative-num-steps must be in 0..8"):
        WorkerOptions(speculative_num_steps=9)
