"""Expert-parallel MoE: dispatch tokens to the ranks owning their experts, combine back.

Wide-EP (DeepSeek-V3 report section 3.4; SGLang's and DeepEP's layout): each EP rank holds a
disjoint share of every MoE layer's routed experts (an `ExpertPlacement` says which, with
redundant copies of hot experts); attention and the shared experts stay data-parallel. One MoE
layer on one rank, for its own tokens x [T, hidden]:

  gate → top-k ids/weights [T, k] (unchanged, `engine.model.MoE.forward`)
  → for every slot, the rank that computes it (its expert's holder; copies take turns)
  → dispatch (one all-to-all): to each rank r, every token's row of x with the k slots that r
    computes (r's local expert index and the gate weight; -1 and 0 for the slots it does not)
  → each rank's local experts over all rows it received, in one grouped call
    (engine/kernels/grouped_experts.py: the Triton fused MoE kernels on CUDA, slots of -1 skipped;
    the torch reference elsewhere), the weighted sum over a row's local slots in float32
  → combine (one all-to-all): the float32 partial sums travel back along the reversed splits
  → the token's sum over ranks in rank order, then `MoE.forward` adds the shared experts.

Why this shape: the split sizes are each rank's token count, which the step's caller knows
on the host (`EpRank.counts`; equal on all ranks in a decode step padded to a common CUDA graph
bucket), so a layer needs no host sync and can be captured in a CUDA graph, NCCL collectives
included. The price is that every token's row goes to every rank (DeepEP's low-latency mode
sends it only where one of its experts lives): with top-8 of 256 experts over 8 ranks a token
needs 5.3 ranks on average, so about 1.5 × the bytes of the minimal dispatch. A row's result
does not depend on which other rows share the step (fixed summation orders), so seeded sampling
stays reproducible across batches and migration.

A rank with no tokens still calls every layer's collectives with T = 0 (`idle_forward`), so the
ranks that do have tokens can reach its experts. The collectives are
`torch.distributed.all_to_all_single` on the default process group (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from engine.ep_placement import ExpertPlacement
from engine.kernels.grouped_experts import GroupedExperts
from engine.model import MoE, DeepseekV3ForCausalLM

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "deepep")


@dataclass
class EpStats:
    """Traffic and load of one rank's MoE layers since start.

    comm_s / collectives: wall time in the all-to-alls and their number, measured only when
    `timed` (default: off CUDA, where gloo calls block; on CUDA timing needs a device sync around
    each collective, which a benchmark may ask for and a CUDA graph cannot have).
    pairs_sent: (token, expert) pairs of this rank's tokens (T × k per layer call).
    These host counters (and layer_calls) count eager calls and graph captures, not replays.
    pairs_received / expert_load: (token, slot) pairs this rank's experts ran, and per routed
    expert the pairs this rank's tokens routed to it (padding rows of a graph bucket left out);
    kept on the device (no sync in a step, counted in graph replays too), read as host values
    through the properties.
    """

    comm_s: float = 0.0
    collectives: int = 0
    pairs_sent: int = 0
    layer_calls: int = 0
    timed: bool = True
    _received: torch.Tensor | None = None  # [] int64 on the device
    _load: torch.Tensor | None = None  # [n_experts] int64 on the device

    @property
    def pairs_received(self) -> int:
        return 0 if self._received is None else int(self._received)

    @property
    def expert_load(self) -> torch.Tensor | None:
        """[n_experts] int64 on the CPU, or None before the first layer call."""
        return None if self._load is None else self._load.cpu()

    def __getstate__(self) -> dict:  # host values only (a rank sends its stats over a pipe)
        state = dict(self.__dict__)
        for key in ("_received", "_load"):
            if state[key] is not None:
                state[key] = state[key].cpu()
        return state


@dataclass
class EpRank:
    """One rank's expert-parallel state shared by its MoE layers.

    counts: the token count of every rank in each MoE layer of the next forward (index = rank),
    set by the step's caller (a decode step: one token per request, or the common bucket of a
    padded CUDA graph step) and cleared after it; None = each layer gathers the counts first
    (a host sync per layer: prefill and MTP forwards, whose counts differ forward by forward).
    Every rank must see the same counts.
    """

    stats: EpStats = field(default_factory=EpStats)
    counts: Sequence[int] | None = None
    # True: every rank has as many tokens as this one (a decode step padded to a common CUDA graph
    # bucket, and the graphs' capture): the splits need no counts and no gather
    uniform: bool = False
    # [T] bool on the device: which rows of the forward are requests' (False: a graph bucket's
    # padding rows, which then go to no expert and count in no stats); None = all. Set by
    # engine/graph_runner.py while it captures a decode forward (a tensor the graph recomputes
    # from its inputs at every replay).
    real_rows: torch.Tensor | None = None


@dataclass(eq=False)
class ExpertParallelDispatch:
    """The expert-parallel replacement of one MoE layer's `experts_forward` on one rank.

    `experts` maps each local expert id to its MLP (their weights are stacked into one
    `GroupedExperts`, the MLPs' parameters becoming views of the stacks); `group` is None for
    the default group; `step` is the rank's `EpRank` its layers share (counts and stats; a new
    one when None).
    """

    placement: ExpertPlacement
    rank: int
    experts: dict[int, nn.Module]
    group: dist.ProcessGroup | None = None
    step: EpRank | None = None

    @property
    def stats(self) -> EpStats:
        return self.step.stats

    def __post_init__(self) -> None:
        p = self.placement
        if self.step is None:
            self.step = EpRank()
        self._local = p.local_experts(self.rank)
        if sorted(self.experts) != self._local:
            raise ValueError(f"rank {self.rank} must hold experts {self._local}, got {sorted(self.experts)}")
        self.grouped = GroupedExperts(*GroupedExperts.stack([self.experts[e] for e in self._local]))
        dev = self.grouped.gate_up.device
        # local_index[r, e]: e's index among rank r's local experts, -1 where r lacks it
        local_index = torch.full((p.world_size, p.n_experts), -1, dtype=torch.long)
        for r in range(p.world_size):
            for j, e in enumerate(p.local_experts(r)):
                local_index[r, e] = j
        holders = [p.holders(e) for e in range(p.n_experts)]
        width = max(map(len, holders))
        self._local_index = local_index.to(dev)
        self._holders = torch.tensor([h + [h[0]] * (width - len(h)) for h in holders], device=dev)  # [E, width]
        self._n_holders = torch.tensor([len(h) for h in holders], device=dev)  # [E]
        self._ranks = torch.arange(p.world_size, device=dev)[:, None, None]  # [world, 1, 1]

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                    in_splits: list[int]) -> None:
        timed = self.stats.timed
        if timed:
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            t0 = time.perf_counter()
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        if timed:
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            self.stats.comm_s += time.perf_counter() - t0
        self.stats.collectives += 1

    def _exchange_counts(self, t: int, device: torch.device) -> list[int]:
        """Every rank's token count, gathered (one small collective and a host sync)."""
        mine = torch.tensor([t], dtype=torch.long, device=device)
        every = [torch.empty_like(mine) for _ in range(self.placement.world_size)]
        dist.all_gather(every, mine, group=self.group)
        return torch.cat(every).tolist()

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], ids / weights [T, k] (T may be 0) -> routed experts' sum [T, hidden].

        Every rank of the group must call this for the same layer at the same time. The split
        sizes are T on every rank when `step.uniform`, else `step.counts` when set (both with no
        host sync: CUDA graph safe), else gathered from the ranks first. Raises ValueError when
        the counts do not give this rank T tokens.
        """
        world = self.placement.world_size
        t, k = ids.shape
        if self.step.uniform:
            counts = [t] * world
        else:
            counts = list(self.step.counts) if self.step.counts is not None else self._exchange_counts(t, x.device)
        if len(counts) != world or counts[self.rank] != t:
            raise ValueError(f"EP rank {self.rank}: {t} tokens but the step's counts are {counts}")
        dev = x.device
        st = self.stats
        st.layer_calls += 1
        st.pairs_sent += t * k
        if st._load is None:
            st._load = torch.zeros(self.placement.n_experts, dtype=torch.long, device=dev)
            st._received = torch.zeros((), dtype=torch.long, device=dev)
        real = self.step.real_rows
        real = real[:t] if real is not None else None  # [T] bool, or None: every row is a request's
        counted = (torch.ones(t * k, dtype=torch.long, device=dev) if real is None
                   else real.repeat_interleave(k).long())
        st._load.index_add_(0, ids.reshape(-1), counted)
        # which rank computes each slot: an expert's copies take its tokens in turn (by token
        # index, offset by rank), so each copy gets an even share, as engine/ep_placement.py plans
        tok = torch.arange(t, device=dev)[:, None]
        dest = self._holders[ids, (tok + self.rank) % self._n_holders[ids]]  # [T, k]
        mine = dest[None] == self._ranks  # [world, T, k]: slots rank r computes
        if real is not None:  # a padding row's slots go nowhere
            mine = mine & real[None, :, None]
        lid = torch.where(mine, self._local_index[dest, ids][None], -1)  # [world, T, k]
        w = torch.where(mine, weights.float()[None], 0.0)
        # one message per row: x's bytes, then k local ids and k weights (int32 and float32 bits)
        xb = x.contiguous().view(torch.uint8)  # [T, hidden × itemsize]
        nx = xb.shape[1]
        send = torch.empty((world, t, nx + 8 * k), dtype=torch.uint8, device=dev)
        send[:, :, :nx] = xb[None]
        send[:, :, nx:nx + 4 * k] = lid.to(torch.int32).contiguous().view(torch.uint8).view(world, t, 4 * k)
        send[:, :, nx + 4 * k:] = w.contiguous().view(torch.uint8).view(world, t, 4 * k)
        r_total = sum(counts)
        recv = torch.empty((r_total, nx + 8 * k), dtype=torch.uint8, device=dev)
        self._all_to_all(recv, send.view(world * t, nx + 8 * k), counts, [t] * world)
        r_x = recv[:, :nx].contiguous().view(x.dtype)  # [R, hidden]
        r_ids = recv[:, nx:nx + 4 * k].contiguous().view(torch.int32).long()  # [R, k]
        r_w = recv[:, nx + 4 * k:].contiguous().view(torch.float32)  # [R, k]
        st._received += (r_ids >= 0).sum()
        # tiles sized for this rank's share of the pairs (about 1 / world of them have an expert here)
        partial = self.grouped.forward(r_x, r_ids, r_w, sum_slots="float32", no_expert=True,
                                       pairs_hint=max(1, r_total * k // world))  # [R, hidden] float32
        back = torch.empty((world * t, x.shape[1]), dtype=torch.float32, device=dev)
        self._all_to_all(back, partial, [t] * world, counts)
        return back.view(world, t, x.shape[1]).sum(0).to(x.dtype)  # summed in rank order


def moe_layers(model: DeepseekV3ForCausalLM, main_only: bool = True) -> list[MoE]:
    """The MoE modules in forward order (main layers; MTP layers too unless main_only)."""
    layers = model.model.layers
    if main_only:
        layers = layers[: model.config.num_hidden_layers]
    return [layer.mlp for layer in layers if isinstance(layer.mlp, MoE)]


def install_expert_parallel(model: DeepseekV3ForCausalLM, placement: ExpertPlacement, rank: int,
                            group: dist.ProcessGroup | None = None) -> EpRank:
    """Make `model` an EP rank: drop the routed experts `rank` does not own (their weights are
    freed), stack the local ones, and route every MoE layer's `experts_forward` through an
    `ExpertParallelDispatch`. Mutates the model (build a private copy per rank). Returns the
    `EpRank` its layers share (set its counts before a forward; its stats).
    """
    c = model.config
    if len(placement.owner) != c.n_routed_experts:
        raise ValueError(f"placement of {len(placement.owner)} experts for a model with {c.n_routed_experts}")
    step = EpRank(EpStats(timed=model.model.embed_tokens.weight.device.type != "cuda"))
    local = set(placement.local_experts(rank))
    for moe in moe_layers(model, main_only=False):
        for e in range(c.n_routed_experts):
            if e not in local:
                moe.experts[e] = nn.Module()  # an empty placeholder keeps the indices of the rest
        # the instance attribute shadows MoE.experts_forward ("EP runtimes replace this call");
        # the single-device grouped form (which also runs the shared experts) would bypass it,
        # and engine.kernels.grouped_experts.use_grouped_experts leaves the layer alone
        moe.grouped = None
        moe.expert_parallel = True
        moe.experts_forward = ExpertParallelDispatch(  # type: ignore[method-assign]
            placement, rank, {e: moe.experts[e] for e in sorted(local)}, group, step=step)
    model.ep_rank = step  # ep_rank_of; engine/graph_runner.py marks a bucket's padding rows in it
    return step


@torch.inference_mode()
def idle_forward(model: DeepseekV3ForCausalLM, main_only: bool = True) -> None:
    """Join one step's collectives with no tokens: every main MoE layer (and the MTP modules'
    unless main_only) with T = 0, so the other ranks' tokens still reach this rank's experts
    (docs/architecture.md, "Wide-EP decode"). Every rank must run the same layers in the same order."""
    c = model.config
    x = torch.empty(0, c.hidden_size, dtype=model.dtype, device=model.model.embed_tokens.weight.device)
    ids = torch.empty(0, c.num_experts_per_tok, dtype=torch.long, device=x.device)
    weights = torch.empty(0, c.num_experts_per_tok, dtype=torch.float32, device=x.device)
    for moe in moe_layers(model, main_only):
        moe.experts_forward(x, ids, weights)


@torch.inference_mode()
def idle_mtp_forward(model: DeepseekV3ForCausalLM, k: int = 0) -> None:
    """Join the collectives of one forward of MTP module k with no tokens (a lock-step rank with
    no rows in a speculative step's MTP extend or chain round, engine/spec_decode.py)."""
    moe = model.mtp_layer(k).mlp
    if not isinstance(moe, MoE):  # a dense MTP layer has no collectives
        return
    c = model.config
    x = torch.empty(0, c.hidden_size, dtype=model.dtype, device=model.model.embed_tokens.weight.device)
    ids = torch.empty(0, c.num_experts_per_tok, dtype=torch.long, device=x.device)
    weights = torch.empty(0, c.num_experts_per_tok, dtype=torch.float32, device=x.device)
    moe.experts_forward(x, ids, weights)


def ep_rank_of(model: DeepseekV3ForCausalLM) -> EpRank:
    """The `EpRank` install_expert_parallel gave the model. Raises ValueError for a model that
    is not an EP rank."""
    step = getattr(model, "ep_rank", None)
    if step is None:
        raise ValueError("the model is not an expert-parallel rank (install_expert_parallel)")
    return step


def select_backend(requested: str, device: torch.device | str) -> str:
    """The all-to-all backend for ranks on `device`: 'torch' (torch.distributed: gloo on CPU,
    NCCL on CUDA) or 'deepep'. 'auto' picks DeepEP only when `deep_ep` imports and the ranks are
    on CUDA. Never falls back silently: an explicit 'deepep' that cannot run raises ValueError
    naming --ep-backend.
    """
    if requested not in BACKENDS:
        raise ValueError(f"--ep-backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    on_cuda = torch.device(device).type == "cuda"
    if requested == "torch":
        return "torch"
    try:
        import deep_ep  # noqa: F401  (the sgl-deep-ep package)
        have_deep_ep = True
    except ImportError:
        have_deep_ep = False
    if requested == "auto":
        # DeepEP is only ever chosen where it can run, and then the dispatcher must exist
        return "deepep" if (have_deep_ep and on_cuda and DEEPEP_IMPLEMENTED) else "torch"
    if not on_cuda:
        raise ValueError("--ep-backend deepep needs the EP ranks on CUDA GPUs; this decode worker runs them "
                         f"on {torch.device(device).type}")
    if not have_deep_ep:
        raise ValueError("--ep-backend deepep: `import deep_ep` failed (install the sgl-deep-ep package)")
    if not DEEPEP_IMPLEMENTED:
        raise ValueError("--ep-backend deepep: the DeepEP dispatcher is not implemented yet; use "
                         "--ep-backend torch (NCCL all-to-all on GPUs)")
    return "deepep"


# The DeepEP low-latency dispatch/combine path has not been written: it could not be run here
# (no GPUs, no deep_ep). select_backend refuses it explicitly instead of pretending.
DEEPEP_IMPLEMENTED = False


__all__: Sequence[str] = ("ExpertPlacement", "ExpertParallelDispatch", "EpRank", "EpStats", "ep_rank_of", "install_expert_parallel",
                          "idle_forward", "idle_mtp_forward", "moe_layers", "select_backend")
