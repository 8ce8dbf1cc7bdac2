"""MTP speculative steps whose per-request state stays on the device (the overlap scheduler's
MTP step: a future map of variable accept length).

engine/spec_decode.py runs one speculative step from host-side inputs: the host must know each
request's accept length before it can build the next step. Here the state a request's next
step needs lives in device tensors (`SpecSlots`, one slot per request) and every step reads and
rewrites it on the device:

    hidden [k+1, H]  main final-normed hidden at positions n-c .. n-c+k (the first c rows valid)
    ids    [k+1]     the tokens at positions n-c+1 .. n-c+k+1 (the first c valid; ids[c-1] is
                     the pending token x_n)
    count            c, 1..k+1: tokens the previous step emitted (1 for a fresh request)
    n                position of the pending token (main KV covers 0..n-1, MTP KV 0..n-c-1)

One step (`spec_step`), every forward with a fixed k+1 (or 1) rows per request, so no shape
depends on an accept length:
1. MTP extend over all k+1 rows (n-c+i, hidden[i], ids[i]); rows i >= c write provisional MTP
   KV at positions >= n that later steps overwrite; the output at row c-1 drafts d_1.
2. k-1 chain forwards at positions n..n+k-2 (as engine/spec_decode.py's step 2).
3. Verify [x_n, d_1..d_k] at positions n..n+k.
4. Accept on the device: target tokens t_0..t_k drawn as plain decoding draws them
   (`sample_batch`, steps of positions n+1..n+k+1), a = the number of leading drafts equal
   to them; emitted t_0..t_a; the slot becomes (hidden of the verify, t, a+1, n+a+1).
So the host launches step i+1 before step i's tokens reach it; it only needs an upper bound
on n for the block tables (`SpecRow.block_ids` has room for it).

Attention: with the plain path (CPU, the exactness contract; float32 on CUDA) the forwards use
`PagedKvCache`, which needs n and c on the host: they are read with one `.tolist()` (free on
a CPU; a sync on CUDA, where the plain path is the reference run, not the served one). The
fast path (CUDA bf16) runs every row as its own query of the paged MLA decode kernel
(`AbsorbedDecodeKv`): row i of a request sees context n+i+1 (causal), all of a layer's rows
being stored before the kernel reads them, so the one-query-per-row kernel serves the k+1
queries of a request unchanged, and nothing reads the host. engine/spec_graphs.py captures
the fast path's whole step (`step_body`) as one CUDA graph per batch bucket.

Errors: `SpecSlots.allocate` raises RuntimeError when every slot is taken (the loop sizes the
slots for --max-running); shapes are the caller's invariants (asserted, not checked per step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from common.sampling_params import SamplingParams
from engine.block_pool import BlockId
from engine.kv_pool import KvPool, PagedKvCache
from engine.mtp import MTP_MODULE
from engine.sampling import SamplingRows, sample_batch, sample_step
from engine.upload import upload


class SpecSlots:
    """Device state of up to `capacity` requests between speculative steps (module docstring).

    Args:
        capacity: slots (requests decoding at once).
        k: draft tokens per step (>= 1).
        hidden_size, dtype, device: the model's.
    """

    def __init__(self, capacity: int, k: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if k < 1 or capacity < 1:
            raise ValueError(f"SpecSlots(capacity={capacity}, k={k}): both must be >= 1")
        self.k = k
        self.hidden = torch.zeros(capacity, k + 1, hidden_size, dtype=dtype, device=device)
        self.ids = torch.zeros(capacity, k + 1, dtype=torch.long, device=device)
        self.count = torch.ones(capacity, dtype=torch.long, device=device)
        self.n = torch.zeros(capacity, dtype=torch.long, device=device)
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free slot. Raises RuntimeError when every slot is taken."""
        if not self._free:
            raise RuntimeError(f"all {self.hidden.shape[0]} speculative slots are taken")
        return self._free.pop()

    def reserve_last(self) -> int:
        """Take the highest-numbered slot for good (the graphs' padding slot). Raises
        RuntimeError when it is taken."""
        last = self.hidden.shape[0] - 1
        if last not in self._free:
            raise RuntimeError(f"speculative slot {last} is taken")
        self._free.remove(last)
        return last

    def free(self, slot: int) -> None:
        # a step still in flight may write the slot: a later `init` is queued behind it
        self._free.append(slot)

    def init(self, slot: int, hidden: torch.Tensor, tokens: list[int]) -> None:
        """Start a request: hidden [r, H] (main hidden at positions n-r..n-1, r <= k+1; r = 1
        after a prefill: the prompt's last token) and its tokens (prompt + generated, the last
        one pending at n = len(tokens) - 1)."""
        r = hidden.shape[0]
        assert 1 <= r <= self.k + 1, f"{r} hidden rows for k = {self.k}"
        n = len(tokens) - 1
        ids = tokens[n - r + 1:] + [0] * (self.k + 1 - r)
        self.hidden[slot, :r] = hidden.to(self.hidden.dtype)
        self.ids[slot] = upload(ids, torch.long, self.ids.device)
        self.count[slot] = r
        self.n[slot] = n


@dataclass(frozen=True)
class SpecRow:
    """One request in a device-resident speculative step."""

    slot: int
    block_ids: list[BlockId]  # its table with room for n + k + 1 tokens (padded past its blocks
    # with a scratch block where positions beyond its last possible token may be written)
    params: SamplingParams
    step_shift: int  # sampling step of the token at position p is p + step_shift


@dataclass(frozen=True)
class SpecResult:
    """A step's device outputs: tokens [B, k+1] int64 (t_0..t_k; the first count[b] are emitted),
    logprobs [B, k+1] float32, count [B] int64 (1..k+1), and where a row asked for top
    log-probabilities top [B, k+1, 2K] float64 (`engine.sampling.top_logprobs_batch` of each
    target token's distribution, K the most any row asked for), else None."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    count: torch.Tensor
    top: torch.Tensor | None = None


class _PlainForwards:
    """The step's three forwards on the plain path: `PagedKvCache` with host lengths."""

    def __init__(self, model: torch.nn.Module, pool: KvPool, rows: list[SpecRow], n: torch.Tensor,
                 c: torch.Tensor, k1: int) -> None:
        self.model, self.pool, self.rows, self.k1 = model, pool, rows, k1
        self.n, self.c = n.tolist(), c.tolist()  # free on a CPU; a sync on CUDA (the reference run)

    def extend(self, hid: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        kv = PagedKvCache(self.pool, [(r.block_ids, n - c, self.k1) for r, n, c in zip(self.rows, self.n, self.c)])
        return self.model.mtp_forward(MTP_MODULE, hid, ids, pos, [self.k1] * len(self.rows), kv)

    def chain(self, prev: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, j: int) -> torch.Tensor:
        kv = PagedKvCache(self.pool, [(r.block_ids, n + j, 1) for r, n in zip(self.rows, self.n)])
        return self.model.mtp_forward(MTP_MODULE, prev, ids, pos, [1] * len(self.rows), kv)

    def verify(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        kv = PagedKvCache(self.pool, [(r.block_ids, n, self.k1) for r, n in zip(self.rows, self.n)])
        return self.model(ids, pos, [self.k1] * len(self.rows), kv)


class FastForwards:
    """The step's forwards on the fast path: every row one query of the paged MLA decode
    kernel (`AbsorbedDecodeKv`), its context length on the device (position + 1).

    Args:
        tables: [B, W] int32 block tables on the device; rows of a request's k+1 queries share
            its table. attention: overrides the kernel (tests: `mla_decode_reference` on a CPU).
    """

    def __init__(self, model: torch.nn.Module, pool: KvPool, tables: torch.Tensor, k1: int,
                 attention=None) -> None:
        self.model, self.pool, self.k1 = model, pool, k1
        self.tables = tables
        b, w = tables.shape
        self.tables_rep = tables[:, None].expand(b, k1, w).reshape(b * k1, w)  # [B * (k+1), W]
        self.kw = {} if attention is None else {"attention": attention}

    def _kv(self, tables: torch.Tensor, pos: torch.Tensor):
        from engine.decode_batch import AbsorbedDecodeKv
        return AbsorbedDecodeKv(self.pool, tables, (pos + 1).int(), **self.kw)

    def extend(self, hid: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.model.mtp_forward(MTP_MODULE, hid, ids, pos, [1] * ids.shape[0], self._kv(self.tables_rep, pos))

    def chain(self, prev: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, j: int) -> torch.Tensor:
        return self.model.mtp_forward(MTP_MODULE, prev, ids, pos, [1] * ids.shape[0], self._kv(self.tables, pos))

    def verify(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.model(ids, pos, [1] * ids.shape[0], self._kv(self.tables_rep, pos))


def block_tables(rows: list[SpecRow], device: torch.device) -> torch.Tensor:
    """The rows' block tables as [B, W] int32 on device (padded with each row's first block)."""
    width = max(len(r.block_ids) for r in rows)
    table = [r.block_ids + [r.block_ids[0]] * (width - len(r.block_ids)) for r in rows]
    return upload(table, torch.int32, device)


@torch.inference_mode()
def spec_step(model: torch.nn.Module, pool: KvPool, slots: SpecSlots, rows: list[SpecRow],
              fast: bool, attention=None, graphs=None) -> SpecResult:
    """One speculative step for rows (module docstring): reads and rewrites their slots.

    fast: the paged MLA decode kernel path (one query per row); attention overrides its kernel
    (tests pass `mla_decode_reference` to run the fast path on a CPU); graphs: the runner's
    `engine.spec_graphs.SpecGraphs`, whose whole-step graph replays when it fits the batch and
    owns `slots` (fast path only). Every path runs `step_body`.
    """
    if fast and graphs is not None and graphs.slots is slots and graphs.can_run(rows):
        return graphs.run(rows)
    dev = pool.kv.device
    k1 = slots.k + 1
    # (engine/upload.py: no host copy here waits for the step in flight, so steps overlap)
    ints = upload([[r.slot for r in rows], [r.step_shift for r in rows]], torch.long, dev)
    one = SamplingRows.build([(r.params, 0) for r in rows], dev)
    if fast:
        tables = block_tables(rows, dev)
        def forwards(n, c):
            return FastForwards(model, pool, tables, k1, attention)
    else:
        def forwards(n, c):
            return _PlainForwards(model, pool, rows, n, c, k1)
    return step_body(model, slots, ints[0], ints[1], one, forwards)


def step_body(model: torch.nn.Module, slots: SpecSlots, idx: torch.Tensor, shift: torch.Tensor,
              one: SamplingRows, forwards, logits_out: torch.Tensor | None = None) -> SpecResult:
    """The step on device tensors only (no host read or copy on the fast path, so
    engine/spec_graphs.py captures it whole).

    Args:
        idx: [B] int64 slots of the rows; shift: [B] int64, the sampling step of the token at
            position p is p + shift[b]; one: the rows' sampling parameters (their `step` is
            ignored: set here per position).
        forwards: (n [B], c [B]) -> the step's extend / chain / verify forwards
            (`FastForwards`, or `_PlainForwards`, which reads n and c on the host).
        logits_out: [≥ B·(k+1), vocab] float32 the verify's logits are written into (the
            graphs' one buffer for every bucket and mode: only the last replay's is read);
            None: a new tensor.
    """
    k = slots.k
    k1, b = k + 1, idx.shape[0]
    dev = idx.device
    n, c = slots.n[idx], slots.count[idx]  # [B]
    hid, ids = slots.hidden[idx], slots.ids[idx]  # [B, k+1, H], [B, k+1]
    ar = torch.arange(k1, device=dev)
    every = torch.arange(b, device=dev)
    fw = forwards(n, c)
    # 1. MTP extend over the k+1 rows of each request; row c-1's output drafts d_1
    ext_pos = ((n - c)[:, None] + ar).reshape(-1)  # [B * (k+1)]
    g = fw.extend(hid.reshape(b * k1, -1), ids.reshape(-1), ext_pos)
    prev = g.view(b, k1, -1)[every, c - 1]  # [B, H]
    # sampling rows: the token at position n + 1 + i has step n + 1 + i + shift
    base = n + 1 + shift
    per = one.repeat(k1)
    drafts = []
    for j in range(k):  # 2. drafts d_1..d_k, each fed back for the next
        d, _ = sample_batch(model.mtp_logits(MTP_MODULE, prev), dataclasses.replace(one, step=base + j))
        drafts.append(d)
        if j + 1 < k:
            prev = fw.chain(prev, d, n + j, j)
    d = torch.stack(drafts, 1)  # [B, k]
    # 3. verify [x_n, d_1..d_k] at positions n..n+k
    v_ids = torch.cat((ids[every, c - 1][:, None], d), 1).reshape(-1)  # [B * (k+1)]
    hv = fw.verify(v_ids, (n[:, None] + ar).reshape(-1))  # [B * (k+1), H]
    logits = model.logits(hv) if logits_out is None else model.logits_into(hv, logits_out[:hv.shape[0]])
    # the targets as a plain step draws them, with their top log-probabilities where asked
    t, lp, top = sample_step(logits, dataclasses.replace(per, step=(base[:, None] + ar).reshape(-1)))
    t, lp = t.view(b, k1), lp.view(b, k1)
    # 4. accept: the leading drafts equal to the target's tokens, then its own token
    count = (d == t[:, :k]).long().cumprod(1).sum(1) + 1  # [B]
    slots.hidden[idx] = hv.view(b, k1, -1).to(slots.hidden.dtype)
    slots.ids[idx] = t
    slots.count[idx] = count
    slots.n[idx] = n + count
    return SpecResult(t, lp, count, None if top is None else top.view(b, k1, -1))
