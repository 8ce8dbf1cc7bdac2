"""MTP speculative decoding (engine/spec_decode.py, decode_worker/spec_step.py): the accept
rule, rejection sampling's output distribution, the prompt's MTP KV rows, and the decode loop
with k = 1, 2, 3 against reference_generate on the shipped trained checkpoint (whose MTP
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
    out = SpecOutput(drafts, None, _onehot_logits(targets), torch.zeros(len(targets), 4))
    assert [t for t, _ in accept(out, SamplingParams(), step=0)] == emitted


def test_rejection_sampling_follows_the_target_distribution() -> None:
    # Leviathan et al. 2023, Theorem 1: whatever the draft distribution q, the first emitted
    # token is distributed as the target p. 3000 seeded trials, 4 tokens.
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(4)
    n = 3000
    for seed in range(n):
        d = int(torch.multinomial(q, 1, generator=torch.Generator().manual_seed(seed + 10**6)))
        out = SpecOutput([d], q.log()[None], torch.stack([p.log(), p.log()]), torch.zeros(2, 1))
        first = accept(dataclasses.replace(out), dataclasses.replace(params, seed=seed), step=0)[0][0]
        counts[first] += 1
    # 4 standard deviations of a binomial proportion at n = 3000 is < 0.037
    assert torch.allclose(counts / n, p, atol=0.037), counts / n


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

@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_batch_equals_reference(shakespeare, k) -> None:
    tok = shakespeare.tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    lens = [24, 5, 1, 17]  # max_tokens: short ones exercise the draft cap at max_tokens
    prompts.append(prompts[0][:16])  # a prompt of exactly one block (cached block reused)
    params = [SamplingParams(max_tokens=n) for n in lens]
    got, rt = asyncio.run(_generate(shakespeare, k, prompts, params))
    for prompt, n, out in zip(prompts, lens, got):
        assert out == reference_generate(shakespeare.model, prompt, n, shakespeare.config.eos_token_ids)
    assert rt.pool.blocks.num_free == rt.opts.num_blocks  # no block leaked
    # the trained MTP module drafts usefully: more than one token per verify step on average
    assert rt.stats.spec_verify_steps > 0
    assert rt.stats.spec_emitted_tokens / rt.stats.spec_verify_steps > 1.2


def test_eos_inside_accepted_drafts_stops_there(tiny_model) -> None:
    # tiny seeded model: choose an "eos" that greedy decoding produces mid-sequence
    prompt = [(11 * i + 5) % 5000 for i in range(20)]
    plain = reference_generate(tiny_model.model, prompt, 12)
    eos = next(t for i, t in enumerate(plain) if i >= 4 and t not in plain[:i])
    cfg = dataclasses.replace(tiny_model.config, eos_token_id=(eos,))
    loaded = dataclasses.replace(tiny_model, config=cfg)
    got, rt = asyncio.run(_generate(loaded, 3, [prompt], [SamplingParams(max_tokens=12)]))
    assert got[0] == plain[:plain.index(eos) + 1]
    assert rt.pool.blocks.num_free == rt.opts.num_blocks


def test_seeded_sampling_is_reproducible(shakespeare) -> None:
    tok = shakespeare.tokenizer()
    prompts = [tok.encode(t) for t in TEXTS[:2]]
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=s) for s in (3, 4)]
    a, rt = asyncio.run(_generate(shakespeare, 2, prompts, params))
    b, _ = asyncio.run(_generate(shakespeare, 2, prompts, params))
    assert a == b and all(len(x) == 20 for x in a)
    assert rt.stats.spec_emitted_tokens > rt.stats.spec_verify_steps  # some drafts accepted
    c, _ = asyncio.run(_generate(shakespeare, 2, prompts, [dataclasses.replace(p, seed=9) for p in params]))
    assert c != a


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
