"""MTP speculative decoding: draft with the MTP module, verify in one target forward, accept.

One speculative step for a batch (docs/architecture.md, "Decode runtime"; SGLang's EAGLE/MTP worker):

1. *MTP extend*: for each request, the MTP rows of the tokens accepted since its last step
   (pairs (main hidden at p, token p + 1) for p = mtp_start..n-1, where n is the position of
   the pending token x_n) in one MTP forward; its last output drafts d_1 (for position n + 1).
2. *MTP chain*: draft d_{i+1} from (MTP hidden of draft i, d_i) at position n - 1 + i. These
   MTP rows are provisional; the next step's extend overwrites them with main hidden states.
3. *Verify*: one main forward over [x_n, d_1..d_k] at positions n..n+k (causal attention over
   the new positions in the paged pool) gives the target's logits for positions n+1..n+k+1.
4. *Accept*: the target's token for each position n+1..n+k+1 is drawn exactly as plain
   decoding draws it (`engine.sampling.sample`: greedy argmax, or Gumbel-max with the
   counter-based noise of (seed, step)); drafts are accepted while they equal those tokens,
   and the target's token at the first mismatch (or after the last draft: the bonus token)
   ends the step. Drafts are drawn from the MTP logits with the same noise as the target's
   token at that step (a coupled draw), so a seeded draft agrees with the target whenever the
   two distributions put their Gumbel-max at the same token.

Every emitted token is the token plain decoding (k = 0) emits at that step, for greedy and
seeded requests alike: the output does not depend on k (nor on the overlap scheduler,
decode_worker/spec_overlap.py), and its distribution is the target's exactly. This replaces
rejection sampling (Leviathan et al. 2023), which keeps the distribution but not the seeded
tokens of k = 0, and which needs draws that depend on the draft's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.sampling_params import SamplingParams
from engine.block_pool import BlockId
from engine.kv_pool import KvPool, PagedKvCache
from engine.mtp import MTP_MODULE
from engine.sampling import sample, sample_one


@dataclass(frozen=True)
class SpecInput:
    """One request in a speculative step.

    The request's pending token x_n (n = num_computed) is extend_ids[-1]; its main KV covers
    positions 0..n-1 and its MTP KV rows 0..mtp_start-1.
    """

    block_ids: list[BlockId]  # block table with room for n + 1 + num_drafts tokens
    num_computed: int  # n
    hidden: torch.Tensor  # [n - mtp_start, hidden] main final-normed hidden at mtp_start..n-1
    extend_ids: list[int]  # tokens at mtp_start+1..n (len == hidden rows)
    num_drafts: int  # k for this request (0 = plain decode step plus the MTP extend)
    params: SamplingParams
    step: int  # sampling step index of the token at position n + 1

    @property
    def mtp_start(self) -> int:
        return self.num_computed - len(self.extend_ids)


@dataclass(frozen=True)
class SpecOutput:
    drafts: list[int]  # d_1..d_k
    target_logits: torch.Tensor  # [k + 1, vocab] float32, for positions n+1..n+k+1
    hidden: torch.Tensor  # [k + 1, hidden] main final-normed hidden at positions n..n+k


def _draft(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    # logits: [vocab] MTP logits -> the draft for generated token `step`: the draw `sample`
    # makes there (same noise as the target's token at that step, so the two are coupled)
    return sample(logits, params, step)[0]


def _idle_mtp(model: torch.nn.Module) -> None:
    # a lock-step rank with no rows for this MTP forward still joins its MoE collectives
    from engine.moe_ep import idle_mtp_forward
    idle_mtp_forward(model, MTP_MODULE)


def _idle_main(model: torch.nn.Module) -> None:
    from engine.moe_ep import idle_forward
    idle_forward(model)


@torch.inference_mode()
def spec_forward(model: torch.nn.Module, pool: KvPool, batch: list[SpecInput],
                 rounds: int | None = None) -> list[SpecOutput]:
    """Steps 1-3 above for every request in batch (steps run batched over the requests).

    Writes MTP rows mtp_start..n-1 (final) and n..n+k-2 (provisional) and main rows n..n+k
    into the pool; rows past the accepted tokens are overwritten by later steps.

    rounds: None (one process) runs only the forwards this batch needs. An expert-parallel
    rank (decode_worker/ep_ranks.py) passes the step's draft count over all ranks (max
    num_drafts, >= every request's here): then the MTP extend, exactly max(rounds - 1, 0)
    chain forwards and the verify forward always run, a forward with no rows on this rank
    joining the MoE all-to-alls with no tokens (`engine.moe_ep` idle paths), so every rank
    runs the same collectives in the same order (docs/architecture.md, "Wide-EP decode"). batch
    may then be empty.
    """
    lockstep = rounds is not None
    if rounds is None:
        rounds = max((b.num_drafts for b in batch), default=0)
    assert all(b.num_drafts <= rounds for b in batch), "rounds below a request's num_drafts"
    if not batch:
        assert lockstep, "an empty batch is only run in lock-step"
        _idle_mtp(model)
        for _ in range(rounds - 1):
            _idle_mtp(model)
        _idle_main(model)
        return []
    device = pool.kv.device
    lt = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    # 1. MTP extend over every request's not yet MTP-cached pairs
    q_lens = [len(b.extend_ids) for b in batch]
    ext_pos = lt([p for b in batch for p in range(b.mtp_start, b.num_computed)])
    kv = PagedKvCache(pool, [(b.block_ids, b.mtp_start, len(b.extend_ids)) for b in batch])
    g = model.mtp_forward(MTP_MODULE, torch.cat([b.hidden for b in batch]),
                          lt([t for b in batch for t in b.extend_ids]), ext_pos, q_lens, kv)
    last = torch.tensor(q_lens, device=device).cumsum(0) - 1
    drafts: list[list[int]] = [[] for _ in batch]
    active = [i for i, b in enumerate(batch) if b.num_drafts > 0]
    prev = g[last[active]]  # [active, hidden] MTP hidden predicting each request's n + 1
    for j in range(rounds):
        # 2. draft j+1 for the active requests; then feed it back for the next draft
        if active:
            logits = model.mtp_logits(MTP_MODULE, prev)  # [len(active), vocab]
            for row, i in enumerate(active):
                drafts[i].append(_draft(logits[row], batch[i].params, batch[i].step + j))
        keep = [row for row, i in enumerate(active) if batch[i].num_drafts > j + 1]
        if j + 1 >= rounds or not (keep or lockstep):
            break
        active = [active[row] for row in keep]
        if not active:  # lock-step: another rank still drafts
            _idle_mtp(model)
            continue
        pos = lt([batch[i].num_computed + j for i in active])
        kv = PagedKvCache(pool, [(batch[i].block_ids, batch[i].num_computed + j, 1) for i in active])
        prev = model.mtp_forward(MTP_MODULE, prev[keep], lt([drafts[i][-1] for i in active]), pos,
                                 [1] * len(active), kv)
    # 3. verify [x_n, d_1..d_k] in one main forward
    ids = lt([t for i, b in enumerate(batch) for t in [b.extend_ids[-1], *drafts[i]]])
    v_lens = [1 + len(d) for d in drafts]
    pos = lt([p for b, n in zip(batch, v_lens) for p in range(b.num_computed, b.num_computed + n)])
    kv = PagedKvCache(pool, [(b.block_ids, b.num_computed, n) for b, n in zip(batch, v_lens)])
    hidden = model(ids, pos, v_lens, kv)  # [sum(v_lens), hidden]
    logits = model.logits(hidden)
    out, start = [], 0
    for i, n in enumerate(v_lens):
        out.append(SpecOutput(drafts[i], logits[start:start + n], hidden[start:start + n]))
        start += n
    return out


def accept(out: SpecOutput, params: SamplingParams, step: int
           ) -> list[tuple[int, float, tuple[tuple[int, float], ...]]]:
    """Step 4: the tokens to emit (1..k+1 of them), each with its log-probability and its
    `params.top_logprobs` most likely (id, logprob) pairs (`sample_one`'s: what a plain decode
    step reports for that token; () where none are asked for).

    step is the sampling step index of the first emitted token (position n + 1).
    """
    emitted: list[tuple[int, float, tuple[tuple[int, float], ...]]] = []
    for i in range(len(out.drafts) + 1):
        token, logprob, top = sample_one(out.target_logits[i], params, step + i)
        emitted.append((token, logprob, top))
        if i == len(out.drafts) or out.drafts[i] != token:
            break
    return emitted
