"""Expert-parallel MoE: dispatch tokens to the ranks owning their experts, combine back.

DESIGN.md section 8 ("Wide-EP"): each EP rank holds a disjoint share of every MoE layer's
routed experts (an `ExpertPlacement` says which); attention and the shared experts stay
data-parallel. One MoE layer on one rank, for its own tokens x [T, hidden]:

  gate → top-k ids/weights [T, k] (unchanged, `engine.model.MoE.forward`)
  → sort the T·k (token, expert) pairs by owning rank, then expert
  → all-to-all #1: per-(rank, expert) pair counts, so every rank knows what it receives
  → all-to-all #2 (dispatch): the pairs' rows of x, variable split sizes
  → each local expert's MLP over the rows it received (from every rank)
  → all-to-all #3 (combine): the expert outputs travel back along the same splits
  → weight by the gate and sum per token in float32 (in expert order, as the dense
    `MoE.experts_forward` does), then `MoE.forward` adds the shared experts locally.

A rank with no tokens still calls every layer's collectives with T = 0 (`idle_forward`), so the
ranks that do have tokens can reach their experts. The collectives are
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
from engine.model import MoE, DeepseekV3ForCausalLM

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "deepep")


@dataclass
class EpStats:
    """Time in the all-to-all collectives (seconds, wall clock; gloo calls block, on CUDA the
    device is synchronized around each call), pairs this rank sent and received, and the
    observed load per expert."""

    comm_s: float = 0.0
    collectives: int = 0
    pairs_sent: int = 0
    pairs_received: int = 0
    layer_calls: int = 0
    expert_load: torch.Tensor | None = None  # [n_experts] pairs this rank's tokens routed to each expert


@dataclass(eq=False)
class ExpertParallelDispatch:
    """The expert-parallel replacement of one MoE layer's `experts_forward` on one rank.

    `experts` maps each local expert id to its MLP; `group` is None for the default group.
    """

    placement: ExpertPlacement
    rank: int
    experts: dict[int, nn.Module]
    hidden_size: int
    group: dist.ProcessGroup | None = None
    stats: EpStats = field(default_factory=EpStats)

    def __post_init__(self) -> None:
        p = self.placement
        self._local = p.local_experts(self.rank)
        if sorted(self.experts) != self._local:
            raise ValueError(f"rank {self.rank} must hold experts {self._local}, got {sorted(self.experts)}")
        # slot_table[r, e]: position of (rank r, expert e) in placement.slots(); sorting pairs by
        # slot sorts them by destination rank, then expert id
        slots = p.slots()
        self._n_slots = len(slots)
        self._slot_table = torch.full((p.world_size, p.n_experts), -1, dtype=torch.long)
        for i, (r, e) in enumerate(slots):
            self._slot_table[r, e] = i
        holders = [p.holders(e) for e in range(p.n_experts)]
        width = max(map(len, holders))
        self._holders = torch.tensor([h + [h[0]] * (width - len(h)) for h in holders])  # [E, width]
        self._n_holders = torch.tensor([len(h) for h in holders])  # [E]
        self._send_count_splits = [len(p.local_experts(r)) for r in range(p.world_size)]

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None,
                    in_splits: list[int] | None) -> None:
        if out.is_cuda:  # time the collective alone (costs overlap; only benchmarks run EP on GPUs now)
            torch.cuda.synchronize(out.device)
        t0 = time.perf_counter()
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        self.stats.comm_s += time.perf_counter() - t0
        self.stats.collectives += 1

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], ids / weights [T, k] (T may be 0) -> routed experts' sum [T, hidden].

        Every rank of the group must call this for the same layer at the same time.
        """
        world, n_local = self.placement.world_size, len(self._local)
        t, k = ids.shape
        self.stats.layer_calls += 1
        # Pairs in token-major order; a stable sort by slot keeps token order per expert, so with
        # one rank the experts see exactly the rows the dense path gives them.
        flat_e = ids.reshape(-1).cpu()  # [T*k] expert of each pair
        tok_all = torch.arange(t).repeat_interleave(k)  # [T*k] its token
        load = torch.bincount(flat_e, minlength=self.placement.n_experts)
        self.stats.expert_load = load if self.stats.expert_load is None else self.stats.expert_load + load
        # an expert's copies take its pairs in turn (by token index, offset by rank), so each
        # copy gets an even share, as engine/ep_placement.py plans
        dest = self._holders[flat_e, (tok_all + self.rank) % self._n_holders[flat_e]]
        key_cpu = self._slot_table[dest, flat_e]  # [T*k]
        order_cpu = torch.argsort(key_cpu, stable=True)
        # for the final sum: the pairs in expert order, token order within (as the dense loop)
        by_expert = torch.argsort(flat_e[order_cpu], stable=True).to(x.device)
        key, order = key_cpu.to(x.device), order_cpu.to(x.device)  # [P]
        tok = tok_all.to(x.device)[order]  # [P] source token of each pair, in dispatch order
        send_x = x[tok]  # [P, hidden]
        send_counts = torch.bincount(key, minlength=self._n_slots)  # [slots] in slot order
        # 1: counts. recv_counts[s, j]: pairs rank s sends to my j-th local expert.
        recv_counts = torch.empty(world * n_local, dtype=torch.long, device=x.device)
        self._all_to_all(recv_counts, send_counts, [n_local] * world, self._send_count_splits)
        recv_counts = recv_counts.view(world, n_local)
        send_splits = [int(c.sum()) for c in send_counts.split(self._send_count_splits)]
        recv_splits = recv_counts.sum(1).tolist()
        # 2: dispatch
        recv_x = x.new_empty(sum(recv_splits), self.hidden_size)
        self._all_to_all(recv_x, send_x, recv_splits, send_splits)
        # experts: rows arrive grouped by source rank, then by local expert
        row_expert = torch.arange(n_local, device=x.device).repeat(world).repeat_interleave(
            recv_counts.reshape(-1))  # [R] local expert index of each received row
        out_rows = torch.empty_like(recv_x)
        for j, e in enumerate(self._local):
            rows = torch.where(row_expert == j)[0]
            if rows.numel():
                out_rows[rows] = self.experts[e](recv_x[rows])
        # 3: combine, along the reversed splits
        back = x.new_empty(send_x.shape)
        self._all_to_all(back, out_rows, send_splits, recv_splits)
        self.stats.pairs_sent += int(send_x.shape[0])
        self.stats.pairs_received += int(recv_x.shape[0])
        # gate weights and the per-token sum in float32, pairs in expert order (like MoE.experts_forward)
        y = back[by_expert].float() * weights.reshape(-1)[order][by_expert, None].float()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        out.index_add_(0, tok[by_expert], y)
        return out.to(x.dtype)


def moe_layers(model: DeepseekV3ForCausalLM, main_only: bool = True) -> list[MoE]:
    """The MoE modules in forward order (main layers; MTP layers too unless main_only)."""
    layers = model.model.layers
    if main_only:
        layers = layers[: model.config.num_hidden_layers]
    return [layer.mlp for layer in layers if isinstance(layer.mlp, MoE)]


def install_expert_parallel(model: DeepseekV3ForCausalLM, placement: ExpertPlacement, rank: int,
                            group: dist.ProcessGroup | None = None) -> EpStats:
    """Make `model` an EP rank: drop the routed experts `rank` does not own (their weights are
    freed) and route every MoE layer's `experts_forward` through an `ExpertParallelDispatch`.
    Mutates the model (build a private copy per rank). Returns the stats shared by its layers.
    """
    c = model.config
    if len(placement.owner) != c.n_routed_experts:
        raise ValueError(f"placement of {len(placement.owner)} experts for a model with {c.n_routed_experts}")
    stats = EpStats()
    local = set(placement.local_experts(rank))
    for moe in moe_layers(model, main_only=False):
        for e in range(c.n_routed_experts):
            if e not in local:
                moe.experts[e] = nn.Module()  # an empty placeholder keeps the indices of the rest
        # the instance attribute shadows MoE.experts_forward ("EP runtimes replace this call");
        # the grouped form (which also runs the shared experts) would bypass it
        moe.grouped = None
        moe.experts_forward = ExpertParallelDispatch(  # type: ignore[method-assign]
            placement, rank, {e: moe.experts[e] for e in sorted(local)}, c.hidden_size, group, stats)
    return stats


@torch.inference_mode()
def idle_forward(model: DeepseekV3ForCausalLM, main_only: bool = True) -> None:
    """Join one step's collectives with no tokens: every main MoE layer (and the MTP modules'
    unless main_only) with T = 0, so the other ranks' tokens still reach this rank's experts
    (DESIGN.md section 8). Every rank must run the same layers in the same order."""
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


__all__: Sequence[str] = ("ExpertPlacement", "ExpertParallelDispatch", "EpStats", "install_expert_parallel",
                          "idle_forward", "idle_mtp_forward", "moe_layers", "select_backend")
