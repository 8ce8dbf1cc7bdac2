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

from engine.model import MoE, DeepseekV3ForCausalLM

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "deepep")


@dataclass(frozen=True)
class ExpertPlacement:
    """Which EP rank holds each routed expert: owner[e] = rank (the same for every MoE layer).

    Raises ValueError when a rank would hold no expert or an owner is out of range.
    """

    owner: tuple[int, ...]
    world_size: int

    def __post_init__(self) -> None:
        if any(not 0 <= r < self.world_size for r in self.owner):
            raise ValueError(f"expert placement {self.owner}: owners must be in [0, {self.world_size})")
        empty = [r for r in range(self.world_size) if r not in self.owner]
        if empty:
            raise ValueError(f"expert placement {self.owner}: ranks {empty} hold no expert")

    @classmethod
    def contiguous(cls, n_experts: int, world_size: int) -> ExpertPlacement:
        """Expert e on rank e // (n_experts / world_size). Raises ValueError (naming --ep-size)
        unless world_size divides n_experts."""
        if world_size < 1 or n_experts % world_size:
            raise ValueError(f"--ep-size {world_size} must divide n_routed_experts ({n_experts})")
        per = n_experts // world_size
        return cls(tuple(e // per for e in range(n_experts)), world_size)

    def local_experts(self, rank: int) -> list[int]:
        """Expert ids held by `rank`, ascending."""
        return [e for e, r in enumerate(self.owner) if r == rank]

    def order(self) -> list[int]:
        """All experts, grouped by owner rank (rank 0's first), ascending within a rank: the
        order in which pairs are laid out in the dispatch buffers."""
        return [e for r in range(self.world_size) for e in self.local_experts(r)]


@dataclass
class EpStats:
    """Time in the all-to-all collectives (seconds, wall clock: gloo calls block; on CUDA this
    would need events) and how many pairs this rank sent and received."""

    comm_s: float = 0.0
    collectives: int = 0
    pairs_sent: int = 0
    pairs_received: int = 0
    layer_calls: int = 0


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
        # slot[e]: position of expert e in placement.order(); sorting pairs by slot sorts them by
        # owner rank, then expert id
        order = p.order()
        self._slot = torch.empty(len(order), dtype=torch.long)
        self._slot[torch.tensor(order)] = torch.arange(len(order))
        self._send_count_splits = [len(p.local_experts(r)) for r in range(p.world_size)]

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None,
                    in_splits: list[int] | None) -> None:
        t0 = time.perf_counter()
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
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
        key = self._slot[ids.reshape(-1).cpu()].to(x.device)  # [T*k]
        order = torch.argsort(key, stable=True)  # [P]
        tok = torch.arange(t, device=x.device).repeat_interleave(k)[order]  # [P] source token of each pair
        send_x = x[tok]  # [P, hidden]
        send_counts = torch.bincount(key, minlength=len(self._slot))  # [E] in slot order
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
        y = back.float() * weights.reshape(-1)[order, None].float()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        out.index_add_(0, tok, y)
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
        # the instance attribute shadows MoE.experts_forward ("EP runtimes replace this call")
        moe.experts_forward = ExpertParallelDispatch(  # type: ignore[method-assign]
            placement, rank, {e: moe.experts[e] for e in sorted(local)}, c.hidden_size, group, stats)
    return stats


@torch.inference_mode()
def idle_forward(model: DeepseekV3ForCausalLM) -> None:
    """Join one step's collectives with no tokens: every main MoE layer with T = 0, so the
    other ranks' tokens still reach this rank's experts (DESIGN.md section 8)."""
    c = model.config
    x = torch.empty(0, c.hidden_size, dtype=model.dtype, device=model.model.embed_tokens.weight.device)
    ids = torch.empty(0, c.num_experts_per_tok, dtype=torch.long, device=x.device)
    weights = torch.empty(0, c.num_experts_per_tok, dtype=torch.float32, device=x.device)
    for moe in moe_layers(model):
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


def per_rank_counts(ids: torch.Tensor, placement: ExpertPlacement) -> list[int]:
    """(token, expert) pairs of ids [T, k] that go to each rank (for tests and load reports)."""
    owner = torch.tensor(placement.owner)
    return torch.bincount(owner[ids.reshape(-1).cpu()], minlength=placement.world_size).tolist()


__all__: Sequence[str] = ("ExpertPlacement", "ExpertParallelDispatch", "EpStats", "install_expert_parallel",
                          "idle_forward", "moe_layers", "select_backend", "per_rank_counts")
