"""Sampling: greedy, temperature and top-p, batched on the device, reproducible across processes.

`sample_batch` picks one token per row of a [B, vocab] logits tensor where the logits are
(CPU or GPU), with no host sync. Seeded draws use the Gumbel-max trick with counter-based
noise: the noise of vocabulary entry v for generated token `step` of a request with `seed` is
a fixed integer hash of (seed, step, v), computed with integer tensor ops that give the same
bits on every device. A row's draw therefore depends on its own logits, seed and step only —
not on which other requests share the batch, on the batch's order, on the process or on any
generator state — so the prefill worker (which samples token 0), the decode worker and a
migrated request all draw the same token from the same logits.

Gumbel-max: argmax_v(logp_v + g_v) with g_v = -log(-log(u_v)), u_v uniform in (0, 1), is a
draw from softmax(logp) (Gumbel 1954; e.g. Maddison et al., "A* Sampling", 2014). u_v has 23
random bits ((k + 0.5) / 2^23, exact in float32, strictly inside (0, 1)), which truncates the
Gumbel tail at about 16.6: the distribution differs from the exact one only by a term of order
2^-23 per entry.

`sample` is the one-row form of the same function.

Logit bias and penalties (`adjusted`): a row's (token id, bias) pairs are added to its logits
before anything else, and its presence and frequency penalties subtracted (OpenAI's rule: a
token generated c times so far in the request loses frequency × c + presence × [c > 0]), so
greedy rows take the argmax of the adjusted logits and every reported log-probability is one of
the adjusted distribution. A penalized row's history (the tokens it generated before this one)
comes with its row: (params, step, history); placeholders of tokens still being computed (the
overlap loop's) are resolved on the device.

Top log-probabilities (`top_logprobs_batch`): where a row asks for them
(`SamplingParams.top_logprobs`), the step also reports that row's most likely tokens under the
very distribution its token was drawn from, so the sampled token's log-probability and its
alternatives' compare like for like. They travel in the step's one device-to-host copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch
from common.sampling_params import SamplingParams
from engine.kernels import greedy_head as greedy_kernel
from engine.upload import upload

__all__ = ["SamplingParams", "SamplingRows", "StepTokens", "sample", "sample_batch", "sampling_logprobs",
           "sample_one", "sample_step", "top_logprobs_batch"]

_M32 = 0xFFFFFFFF


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2^32).

    Products are taken in int64 and masked back to 32 bits: the low 32 bits of a product do
    not depend on overflow, so CPU and CUDA give the same bits."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[B] int64 seeds (any 64-bit value) and steps -> [B] 32-bit row keys (int64 tensor)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    k = _fmix32(lo ^ 0x9E3779B9)
    k = _fmix32(k ^ hi)
    return _fmix32(k ^ (steps & _M32))


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, vocab] float32 for rows (seeds[b], steps[b]), on their device."""
    keys = _row_keys(seeds, steps)  # [B]
    v = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    h = _fmix32(_fmix32(keys[:, None] ^ ((v * 0x27D4EB2F) & _M32)[None, :]) ^ keys[:, None])  # [B, V]
    # (k + 0.5) / 2^23 for a 23-bit k is exact in float32 and lies in [2^-24, 1 - 2^-24]; with 24
    # bits, (2^24 - 1) + 0.5 rounds to 2^24, u to 1.0 and the noise to +inf (one entry in 2^24)
    u = ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(u))


@dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling parameters of a batch as device tensors (built once per step).

    temperature [B] float32 (0 = greedy), top_p [B] float32, seed [B] int64, step [B] int64
    (index of the token being generated, 0 = first); `any_sampled` / `any_top_p` are known on
    the host so a greedy batch runs no noise or sort kernels. `top_logprobs`: the most
    alternatives any row asks for (0 = none: the step reports none, `top_logprobs_batch`).
    `bias`: None where no row has a logit bias, else (rows [N] int64, token ids [N] int64,
    biases [N] float32), every row's pairs in one list. `penalty`: None where no row has a
    penalty, else (rows [P] int64: the penalized rows, presence [P] float32, frequency [P]
    float32, at [N] int64 into those P, tokens [N] int64: every penalized row's history in one
    list). Both are applied by `adjusted`.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    step: torch.Tensor
    any_sampled: bool
    any_top_p: bool
    top_logprobs: int = 0
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalty: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def adjusts(self) -> bool:
        """Whether some row's logits change before its draw (a logit bias or a penalty)."""
        return self.bias is not None or self.penalty is not None

    @staticmethod
    def build(rows: Sequence[tuple], device: torch.device | str,
              resolve: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SamplingRows:
        """rows[i] = (params, step), or (params, step, history) for a penalized row (its tokens
        generated so far: ids, or the overlap loop's placeholders, which `resolve` turns into
        ids on the device) -> tensors on device: two small host-to-device copies, none for an
        all-greedy batch (its tensors are never read), more where rows adjust their logits."""
        device = torch.device(device)
        params = [r[0] for r in rows]
        if all(p.plain for p in params):  # the common step: greedy rows asking nothing more
            z = _zeros(len(rows), device)
            return SamplingRows(z, z, z, z, False, False)
        any_sampled = any(not p.greedy for p in params)
        top = max(p.top_logprobs for p in params)
        bias = bias_rows(params, device)
        penalty = _penalty_rows(rows, device, resolve)
        if not any_sampled:
            z = _zeros(len(rows), device)
            return SamplingRows(z, z, z, z, False, False, top, bias, penalty)
        floats = upload([[p.temperature for p in params], [p.top_p for p in params]], torch.float32, device)
        ints = upload([[seed_int64(p.seed) for p in params], [r[1] for r in rows]], torch.int64, device)
        return SamplingRows(floats[0], floats[1], ints[0], ints[1], True,
                            any(not p.greedy and p.top_p < 1.0 for p in params), top, bias, penalty)

    def repeat(self, times: int) -> SamplingRows:
        """Each row `times` times in a row ([B] -> [B * times]), its logit bias with it (row r's
        pairs on rows r·times .. r·times + times - 1); an all-greedy batch's per-row tensors are
        never read and stay as they are. (MTP's verify rows: its workers refuse penalties, whose
        history would differ per repeated row, so a batch with one raises ValueError.)"""
        if self.penalty is not None:
            raise ValueError("a penalty in a speculative step")
        def rep(t: torch.Tensor) -> torch.Tensor:  # (expand, not repeat_interleave: never a sync)
            return t[:, None].expand(-1, times).reshape(-1)
        bias = None
        if self.bias is not None:
            r, ids, values = self.bias
            at = (r[:, None] * times + torch.arange(times, device=r.device)).reshape(-1)
            bias = (at, rep(ids), rep(values))
        if not self.any_sampled:
            return dataclasses.replace(self, bias=bias) if bias is not None else self
        return SamplingRows(rep(self.temperature), rep(self.top_p), rep(self.seed), rep(self.step), True,
                            self.any_top_p, self.top_logprobs, bias)


def bias_rows(params: list[SamplingParams], device: torch.device) -> tuple | None:
    """SamplingRows.bias of rows with these params (each request's arrays built once): (rows [N]
    int64, token ids [N] int64, biases [N] float32) on device in two uploads, or None."""
    with_bias = [(r, p.bias_arrays) for r, p in enumerate(params) if p.logit_bias]
    if not with_bias:
        return None
    ids = np.concatenate([a[0] for _, a in with_bias])
    at = np.repeat(np.array([r for r, _ in with_bias], dtype=np.int64), [len(a[0]) for _, a in with_bias])
    where = upload(np.stack((at, ids)), torch.int64, device)
    return where[0], where[1], upload(np.concatenate([a[1] for _, a in with_bias]), torch.float32, device)


def _penalty_rows(rows: Sequence[tuple], device: torch.device,
                  resolve: Callable[[torch.Tensor], torch.Tensor] | None) -> tuple | None:
    """SamplingRows.penalty of these rows: their histories in one upload (O(tokens generated)
    a step: the overlap loop builds the next step's while the device runs the last)."""
    pen = [(r, row[0], row[2] if len(row) > 2 else ()) for r, row in enumerate(rows) if row[0].penalized]
    if not pen:
        return None
    tokens = np.concatenate([np.asarray(h, dtype=np.int64).reshape(-1) for _, _, h in pen])
    at = np.repeat(np.arange(len(pen), dtype=np.int64), [len(h) for _, _, h in pen])
    pairs = upload(np.stack((at, tokens)), torch.int64, device)
    weights = upload([[p.presence_penalty for _, p, _ in pen], [p.frequency_penalty for _, p, _ in pen]],
                     torch.float32, device)
    tok = resolve(pairs[1]) if resolve is not None else pairs[1]
    return upload([r for r, _, _ in pen], torch.int64, device), weights[0], weights[1], pairs[0], tok


def seed_int64(seed: int) -> int:
    """A uint64 seed as the int64 of the same bits (what the device's seed tensors hold)."""
    return seed - (1 << 64) if seed >= (1 << 63) else seed


_ZEROS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _zeros(n: int, device: torch.device) -> torch.Tensor:
    # placeholder rows of an all-greedy batch (never read); cached per (size, device)
    key = (n, device)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(n, device=device)
    return _ZEROS[key]


def _nucleus(logp: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of entries with mass >= top_p (among equal log-probs the
    lower ids first: a stable sort, so every device and batch keeps the same set; bf16 logits
    tie often); logp [B, V] normalised log-probs, top_p [B] -> renormalised log-probs with -inf
    elsewhere."""
    sorted_logp, order = torch.sort(logp, dim=-1, descending=True, stable=True)
    p = sorted_logp.exp()
    drop = (torch.cumsum(p, dim=-1) - p) >= top_p[:, None]
    sorted_logp = sorted_logp.masked_fill(drop, float("-inf"))
    out = torch.full_like(logp, float("-inf")).scatter(1, order, sorted_logp)
    return torch.log_softmax(out, dim=-1)


def adjusted(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """logits [B, V] with each row's logit bias added and its penalties subtracted (a new
    float32 tensor), or the logits themselves where no row has either. No host sync."""
    if rows.bias is not None:
        r, ids, values = rows.bias
        # one atomic scatter over the flat logits (index_put's accumulate sorts its indices
        # first; this one is a single kernel, also inside the MTP step's CUDA graphs)
        vocab = logits.shape[-1]
        logits = logits.float().reshape(-1).scatter_add(0, r * vocab + ids, values).view(logits.shape)
    if rows.penalty is not None:
        pen_rows, presence, frequency, at, tokens = rows.penalty
        counts = torch.zeros((pen_rows.shape[0], logits.shape[-1]), dtype=torch.float32, device=logits.device)
        counts.index_put_((at, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
        cut = counts * frequency[:, None] + (counts > 0).float() * presence[:, None]
        logits = logits.float().index_add(0, pen_rows, cut, alpha=-1)
    return logits


def sampling_logprobs_batch(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """The distributions `sample_batch` draws from, as log-probs [B, V] float32: greedy rows
    log_softmax(logits); sampled rows log_softmax(logits / T) restricted to the top-p nucleus;
    the logits adjusted first (`adjusted`: logit bias, penalties)."""
    return _logprobs(adjusted(logits, rows), rows)


def _logprobs(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """`sampling_logprobs_batch` of logits already adjusted."""
    logits = logits.float()
    if not rows.any_sampled:
        return torch.log_softmax(logits, dim=-1)
    greedy = rows.temperature <= 0
    t = torch.where(greedy, torch.ones_like(rows.temperature), rows.temperature)
    logp = torch.log_softmax(logits / t[:, None], dim=-1)
    if rows.any_top_p:
        top_p = torch.where(greedy, torch.ones_like(rows.top_p), rows.top_p)
        logp = torch.where((top_p < 1.0)[:, None], _nucleus(logp, top_p), logp)
    return torch.where(greedy[:, None], torch.log_softmax(logits, dim=-1), logp)


def sample_batch(logits: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row, on the logits' device, without a host sync.

    Args:
        logits: [B, vocab] logits (any float dtype) of each row's last position.
        rows: the rows' parameters (`SamplingRows.build`), on the same device.
    Returns:
        (tokens [B] int64, logprobs [B] float32): greedy rows take the argmax and its
        log_softmax; sampled rows a Gumbel-max draw from the tempered top-p distribution
        (`sampling_logprobs_batch`) with its log-probability there; both of the adjusted
        logits where a row has a logit bias or a penalty (`adjusted`).
    """
    return _draw(adjusted(logits, rows), rows)[:2]


def sample_step(logits: torch.Tensor, rows: SamplingRows
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`sample_batch` and, where rows ask for them, `top_logprobs_batch` of the same logits
    [B, vocab], the logits adjusted and the distribution computed once for both: (tokens [B],
    logprobs [B], top [B, 2K] float64 or None). No host sync."""
    logits = adjusted(logits, rows)
    tokens, logprobs, logp = _draw(logits, rows)
    if not rows.top_logprobs:
        return tokens, logprobs, None
    return tokens, logprobs, _top(logp if logp is not None else _logprobs(logits, rows), rows.top_logprobs)


def _draw(logits: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`sample_batch` of logits already adjusted, with the distribution drawn from
    (`_logprobs`; None for an all-greedy batch, which computes none)."""
    if not rows.any_sampled:
        return *greedy_batch(logits), None
    logp = _logprobs(logits, rows)
    # Greedy rows of a mixed batch take greedy_batch's token and log-probability, so a greedy
    # row's numbers do not depend on whether a sampled row shares its step.
    greedy_tokens, greedy_logp = greedy_batch(logits)
    noise = gumbel_noise(rows.seed, rows.step, logp.shape[-1])
    sampled = torch.argmax(logp + noise, dim=-1)
    sampled_logp = logp.gather(1, sampled[:, None])[:, 0]
    is_sampled = rows.temperature > 0
    return (torch.where(is_sampled, sampled, greedy_tokens), torch.where(is_sampled, sampled_logp, greedy_logp),
            logp)


def greedy_batch(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_batch` for an all-greedy batch: (argmax [B] int64, its log_softmax [B] float32).

    The argmax is taken on the logits themselves (as engine.reference and spec_decode's accept
    do): logits - logsumexp can round two close logits to one value and flip the tie to the
    lower id. On CUDA (with triton) it runs as `engine.kernels.greedy_head` (two launches
    spread over the vocabulary: the same tokens, the log-probability up to float32 summation
    order), elsewhere as its torch twin `greedy_reference`. The decode graphs run this very
    function inside the captured step (engine/graph_runner.py), so a replayed greedy step and an
    eager one give the same bits."""
    if logits.is_cuda and greedy_kernel.triton is not None:
        return greedy_kernel.greedy_head(logits)
    return greedy_kernel.greedy_reference(logits)


def top_logprobs_batch(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Each row's `rows.top_logprobs` most likely tokens under the distribution it draws from
    (`sampling_logprobs_batch`), most likely first, as [B, 2K] float64: K token ids, then their K
    log-probabilities; an entry outside a row's top-p nucleus (log-probability -inf) has id -1.
    Among equal log-probabilities the order is torch.topk's. No host sync."""
    return _top(sampling_logprobs_batch(logits, rows), rows.top_logprobs)


def _top(logp: torch.Tensor, k: int) -> torch.Tensor:
    """`top_logprobs_batch` of the rows' distributions logp [B, V]."""
    values, ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    ids = torch.where(torch.isinf(values), torch.full_like(ids, -1), ids)
    return torch.cat((ids.double(), values.double()), dim=1)


class StepTokens(NamedTuple):
    """A step's results on the host, per row: its token, that token's log-probability, and its
    most likely tokens as (id, log-probability) pairs (empty when no row asked for them; a row
    that asked for fewer than the step's K keeps its first ones: `for_row`)."""

    tokens: list[int]
    logprobs: list[float]
    tops: list[tuple[tuple[int, float], ...]]


def top_pairs(flat: Sequence[float], k1: int) -> list[tuple[tuple[int, float], ...]]:
    """k1 positions' `top_logprobs_batch` rows laid end to end ([k1 × 2K] floats, as a
    speculative step packs them) -> each position's (id, logprob) pairs."""
    width = len(flat) // k1 if k1 else 0
    return [_pairs(list(flat[i * width:(i + 1) * width])) for i in range(k1)]


def for_row(top: tuple[tuple[int, float], ...], params: SamplingParams) -> tuple[tuple[int, float], ...]:
    """The alternatives of a step's row that the row's own request asked for (its first
    `params.top_logprobs`)."""
    return top[: params.top_logprobs]


def pack_step(tokens: torch.Tensor, logprobs: torch.Tensor, top: torch.Tensor | None = None) -> torch.Tensor:
    """A step's (tokens [B], logprobs [B]) and, where rows asked for them, its top
    log-probabilities ([B, 2K], `top_logprobs_batch`) as one [B, 2 + 2K] float64 tensor, so the
    step needs one device-to-host copy (float64 holds every token id exactly: integers up to 2^53)."""
    both = torch.stack((tokens.double(), logprobs.double()), dim=1)
    return both if top is None else torch.cat((both, top), dim=1)


def unpack_step(host: torch.Tensor) -> StepTokens:
    """`pack_step`'s [B, 2 + 2K] float64, on the host -> StepTokens (lists)."""
    rows = host.tolist()
    tops = [_pairs(r[2:]) for r in rows] if host.dim() == 2 and host.shape[1] > 2 else [()] * len(rows)
    return StepTokens([int(r[0]) for r in rows], [r[1] for r in rows], tops)


def _pairs(top: list[float]) -> tuple[tuple[int, float], ...]:
    """One row of `top_logprobs_batch` (K ids, then K log-probs) -> (id, logprob) pairs, the
    entries outside the nucleus (id -1) left out."""
    k = len(top) // 2
    pairs = tuple(zip(map(int, top[:k]), top[k:]))
    return pairs if not pairs or pairs[-1][0] >= 0 else tuple(p for p in pairs if p[0] >= 0)  # (-1s come last)


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams, history: Sequence[int] = ()) -> torch.Tensor:
    """The distribution `sample` draws from for one row of logits [vocab], as log-probs [vocab]
    float32 (greedy: plain log_softmax); history: see `sample`."""
    rows = SamplingRows.build([(params, 0, history)], logits.device)
    return sampling_logprobs_batch(logits[None], rows)[0]


def sample(logits: torch.Tensor, params: SamplingParams, step: int, history: Sequence[int] = ()) -> tuple[int, float]:
    """Pick the next token from one row of logits: `sample_batch` for a batch of one.

    Args:
        logits: [vocab] logits of the last position (any device).
        params: sampling parameters.
        step: index of the token being generated (0 = first generated token).
        history: the tokens the request generated before this one (its penalties count them;
            a migrated request's first token has some).
    Returns:
        (token id, its log-probability under the distribution drawn from).
    """
    rows = SamplingRows.build([(params, step, history)], logits.device)
    tokens, logprobs = sample_batch(logits[None], rows)
    return int(tokens[0]), float(logprobs[0])


def sample_one(logits: torch.Tensor, params: SamplingParams, step: int,
               history: Sequence[int] = ()) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """`sample` with the row's most likely tokens where params asks for them (`sample_step`):
    (token id, its log-probability, its `params.top_logprobs` (id, logprob) pairs, () for
    none), in one device-to-host copy. A request's first token (prefill)."""
    rows = SamplingRows.build([(params, step, history)], logits.device)
    host = unpack_step(pack_step(*sample_step(logits[None], rows)).cpu())
    return host.tokens[0], host.logprobs[0], host.tops[0]
