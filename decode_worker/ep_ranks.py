"""The EP ranks of one expert-parallel decode worker (`--ep-size N`).

Process shape: the decode worker process is rank 0; it hosts the gRPC service, the scheduler
and every rank's block accounting (`decode_worker/ep_pool.py`), and spawns ranks 1..N-1 as
child processes. All ranks join one torch.distributed group (rendezvous through a TCPStore on
loopback) used only for the MoE all-to-alls (`engine/moe_ep.py`). Every model call of the
worker is one *step* in lock-step over all ranks: rank 0 sends each child its share
(`RankWork`: block tables, positions and tokens of the requests it owns, or nothing) over a
pipe, runs its own share, and collects each rank's results. A rank with no work still runs the
step's MoE collectives (`idle_forward`).

Devices (engine/rank_devices.py): on a CPU every rank is a CPU process and the group is gloo; from
`--device cuda:i` rank r owns GPU i + r and the group is NCCL (NVLink multicast off:
NCCL_NVLS_ENABLE=0, as on the lent machines). Each rank runs the worker's `ModelRunner` over
its own pool: on a GPU the fast path (paged MLA decode kernel, its local experts in the fused
MoE kernels), on a CPU the plain path (the exactness contract). In a decode step each rank
samples its own requests' tokens (engine/sampling.py: seeded rows do not depend on the batch),
so only token ids and log-probabilities travel back to rank 0.

Each rank builds the same model from `--model`/`--seed` and keeps only its experts
(`install_expert_parallel`). KV storage: rank 0 allocates each rank's pool on that rank's
device (shared memory on a CPU, the rank's HBM on GPUs) and hands it to the rank (CUDA IPC on
GPUs); the worker registers each with a transfer agent of that rank's own (worker/host.py), and a
request's KvDestination names the agent of the rank that owns it, so a prefill worker's KV lands
in the owning rank's pool.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.gc_pauses import freeze_startup_heap, own_process
from common.lifecycle import exit_with_parent
from decode_worker.ep_pool import EpKvPool
from engine.block_pool import BlockId
from engine.kv_pool import KvPool, KvPoolConfig, PagedKvCache
from engine.model import DeepseekV3ForCausalLM
from engine.ep_placement import ExpertPlacement
from engine.moe_ep import EpRank, ep_rank_of, idle_forward, idle_mtp_forward, install_expert_parallel, select_backend
from engine.rank_devices import collective_backend, rank_devices
from engine.mtp import MTP_MODULE, pool_has_mtp, prefill_mtp_rows
from engine.runner import DecodeInput, ModelRunner
from engine.sampling import StepTokens
from engine.spec_decode import SpecInput, SpecOutput, spec_forward

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0  # a child rank must load its model and join the group within this


@dataclass(frozen=True)
class RankWork:
    """One rank's share of a step: per sequence (local block table, tokens already in its pool,
    new tokens this step), and the new tokens of all sequences concatenated. Empty = idle."""

    seqs: tuple[tuple[tuple[int, ...], int, int], ...] = ()
    token_ids: tuple[int, ...] = ()
    # prefill with MTP rows (engine/mtp.py): set on every rank of the step; `prompt` is the
    # whole prompt of the one prefill sequence (its MTP rows pair hidden p with token p + 1)
    mtp: bool = False
    prompt: tuple[int, ...] = ()
    # every rank's token count in the step's MoE layers (a decode step: its requests per rank),
    # so the layers need not gather them (engine/moe_ep.py EpRank.counts); () = gather
    counts: tuple[int, ...] = ()
    # a decode step: per sequence (SamplingParams, step index); the rank samples its rows
    sampling: tuple = ()
    decode: bool = False
    # a decode step on GPUs with graphs: the CUDA graph bucket every rank replays (its rows
    # padded to it; an idle rank's all padding); 0 = an eager step
    bucket: int = 0

    @property
    def busy(self) -> bool:
        return bool(self.seqs)


@dataclass(frozen=True)
class SpecWork:
    """One rank's share of an MTP speculative step: its requests (local block tables; may be
    empty) and the step's draft rounds over all ranks (`spec_forward`'s lock-step `rounds`)."""

    batch: tuple[SpecInput, ...]
    rounds: int

    @property
    def busy(self) -> bool:
        return bool(self.batch)


@dataclass(frozen=True)
class CaptureWork:
    """Every rank captures its decode graphs (engine/graph_runner.py) for batches up to
    max_batch and contexts up to max_context, in lock-step (their MoE all-to-alls are captured
    with the same bucket on every rank); `scratch`: the rank's padding block, reserved in rank
    0's accounting of that rank's pool."""

    max_batch: int
    max_context: int
    scratch: int

    @property
    def busy(self) -> bool:
        return True


@dataclass
class StepStats:
    """Rank 0's view of the steps: wall time of whole steps and of every rank's collectives."""

    steps: int = 0
    step_s: float = 0.0  # rank 0's wall time per step, summed (seconds)
    own_s: float = 0.0  # of which rank 0 ran its own share (collectives included)
    comm_s: list[float] = field(default_factory=list)  # per rank: seconds inside all-to-alls
    pairs_received: list[int] = field(default_factory=list)  # per rank: (token, expert) pairs its experts ran
    idle_rank_steps: int = 0  # (rank, step) pairs where a rank had no work
    all_busy_steps: int = 0  # steps where every rank had work


def run_work(runner: ModelRunner, work: RankWork | SpecWork | CaptureWork) -> Any:
    """Run one rank's share of a step (its collectives run even when it has no rows):
    - a decode RankWork: its sequences' StepTokens (tokens, logprobs, tops), sampled here
      (empty lists when idle);
    - a prefill RankWork: final-normed hidden [len(work.seqs), hidden] of each sequence's last
      new token, on the CPU ([0, hidden] idle);
    - a SpecWork: `spec_forward`'s outputs (the rank's SpecOutputs, [] when idle);
    - a CaptureWork: the bytes its graphs took."""
    model, pool = runner.model, runner.pool
    if isinstance(work, SpecWork):  # tensors travel through the host, both ways (not CUDA IPC)
        batch = [dataclasses.replace(b, hidden=b.hidden.to(pool.kv.device)) for b in work.batch]
        return [_moved(o, "cpu") for o in spec_forward(model, pool, batch, rounds=work.rounds)]
    step = ep_rank_of(model)
    if isinstance(work, CaptureWork):
        step.uniform = True
        try:
            runner.capture_graphs(work.max_batch, work.max_context, scratch=work.scratch)
        finally:
            step.uniform = False
        return runner.graphs.memory_bytes
    step.counts = work.counts or None
    step.uniform = bool(work.bucket)
    try:
        if work.decode:
            return _decode_share(runner, work)
        return _prefill_share(model, pool, work).cpu()
    finally:
        step.counts, step.uniform = None, False


def _moved(out: SpecOutput, device: torch.device | str) -> SpecOutput:
    return dataclasses.replace(out, target_logits=out.target_logits.to(device), hidden=out.hidden.to(device))


def _decode_share(runner: ModelRunner, work: RankWork) -> StepTokens:
    """The step's bucket on every rank: a graph replay padded to it (all padding when idle), or
    with bucket 0 an eager step on every rank (a rank whose rows fit a graph must not replay
    one: its captured collectives would meet the others' eager ones)."""
    batch = [DecodeInput(list(b), n, t) for (b, n, _), t in zip(work.seqs, work.token_ids)]
    if not batch and not work.bucket:
        with torch.inference_mode():
            idle_forward(runner.model)
        return StepTokens([], [], [])
    return runner.decode_tokens(batch, list(work.sampling), bucket=work.bucket)


def _prefill_share(model: DeepseekV3ForCausalLM, pool: KvPool, work: RankWork) -> torch.Tensor:
    device = pool.kv.device
    with torch.inference_mode():
        if not work.seqs:
            idle_forward(model)
            if work.mtp:
                idle_mtp_forward(model, MTP_MODULE)
            return torch.empty(0, model.config.hidden_size, dtype=model.dtype)
        q_lens = [q for _, _, q in work.seqs]
        ids = torch.tensor(work.token_ids, dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(s, s + q) for _, s, q in work.seqs]).to(device)
        kv = PagedKvCache(pool, [(list(b), s, q) for b, s, q in work.seqs])
        hidden = model.forward(ids, positions, q_lens, kv)  # [T, hidden]
        if work.mtp:  # one prefill sequence: its chunk's MTP rows, or an idle MTP forward
            (blocks, start, q), = work.seqs
            if not prefill_mtp_rows(model, pool, list(blocks), list(work.prompt), start, start + q, hidden):
                idle_mtp_forward(model, MTP_MODULE)
        last = torch.tensor(q_lens, device=device).cumsum(0) - 1
        return hidden[last]


def _init_group(rank: int, world: int, store: dist.Store, timeout_s: float, device: torch.device) -> None:
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: one EP decode worker "
                           "per process")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds this process's communicator to its GPU
    dist.init_process_group(collective_backend(device), store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def _ep_model(spec: str, seed: int, placement: ExpertPlacement, rank: int, device: torch.device,
              dtype: torch.dtype) -> tuple[DeepseekV3ForCausalLM, EpRank]:
    from engine.model_source import load_model
    model = load_model(spec, seed=seed, dtype=dtype).model.to(device)
    return model, install_expert_parallel(model, placement, rank)


def _rank_main(rank: int, world: int, port: int, spec: str, seed: int, threads: int, timeout_s: float,
               placement: ExpertPlacement, rank_config: KvPoolConfig, hash_seed: int, kv: torch.Tensor,
               dtype: torch.dtype, conn: multiprocessing.connection.Connection, gc_freeze: bool = False,
               parent_pid: int | None = None) -> None:
    """A child rank: join the group, build the model with this rank's experts on kv's device
    and a runner over its pool (kv: this rank's storage, shared memory or CUDA IPC), then serve
    steps until rank 0 sends None or the pipe closes. gc_freeze: freeze the start-up heap once
    warmed up (the worker's --gc-freeze: a collection in one rank stalls every rank's step).
    parent_pid: the worker's process; the rank exits once it is gone (even mid start-up)."""
    if parent_pid is not None:
        exit_with_parent(parent_pid)
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=timeout_s))
    _init_group(rank, world, store, timeout_s, kv.device)
    try:
        model, step = _ep_model(spec, seed, placement, rank, kv.device, dtype)
        runner = ModelRunner(model, KvPool(rank_config, hash_seed, kv=kv))
        _warm_up(runner)
        if gc_freeze:
            own_process()  # a process of the worker's own
            freeze_startup_heap()
        conn.send(("ready", None))
        while True:
            try:
                work = conn.recv()
            except EOFError:  # rank 0 went away
                return
            if work is None:
                return
            try:
                out = run_work(runner, work)
            except Exception as exc:  # rank 0 raises it as the step's error
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
                raise
            conn.send(("ok", (out, step.stats)))
    finally:
        dist.destroy_process_group()


def _warm_up(runner: ModelRunner) -> None:
    """Compile a GPU rank's fused MoE kernels (every tile size) before the first step, on its
    own: compiled inside a lock-step step, they would keep the other ranks waiting in NCCL. Twice
    where the decode graphs launch them with programmatic dependent launch (a variant of its own
    per kernel: engine/kernels/pdl.py)."""
    if runner.fast:
        from engine.kernels import pdl
        from engine.kernels.grouped_experts import warm_up_fused_experts
        warm_up_fused_experts(runner.model)
        device = runner.pool.kv.device
        if pdl.supported(device):
            with pdl.dependent_launches(device):
                warm_up_fused_experts(runner.model)


def model_experts(spec: str) -> int:
    from engine.model_source import load_config
    return load_config(spec)[1].n_routed_experts


class EpEngine:
    """Rank 0 of an EP decode worker: starts ranks 1..N-1, owns the `EpKvPool`, and is the
    worker's model runner (same calls as `engine.runner.ModelRunner`: prefill_chunk, decode,
    logits), each call one lock-step step over all ranks. Calls come from the model thread.

    Raises ValueError (naming the flag) for an --ep-size that does not divide the experts or an
    --ep-backend that cannot run, RuntimeError when a rank fails to start.
    """

    def __init__(self, spec: str, seed: int, ep_size: int, backend: str, threads: int, timeout_s: float,
                 rank_config: KvPoolConfig, hash_seed: int, placement: ExpertPlacement | None = None,
                 model: DeepseekV3ForCausalLM | None = None, device: torch.device | str | None = None,
                 gc_freeze: bool = False) -> None:
        """`model`: rank 0's model to turn into an EP rank in place (its other experts are freed);
        None = load `spec` again (when the loaded model is shared, as in tests). `device`: rank
        0's (default: the model's, else the CPU); the other ranks' follow (engine/rank_devices.py).
        gc_freeze: the other ranks' processes freeze their start-up heap once warmed up (rank 0
        is the worker's process, which freezes its own once serving: --gc-freeze)."""
        self.world = ep_size
        n_experts = model_experts(spec)
        self.placement = placement or ExpertPlacement.contiguous(n_experts, ep_size)
        if self.placement.n_experts != n_experts or self.placement.world_size != ep_size:
            raise ValueError(f"expert placement for {self.placement.n_experts} experts over "
                             f"{self.placement.world_size} ranks; need {n_experts} over --ep-size {ep_size}")
        if device is None:
            device = model.model.embed_tokens.weight.device if model is not None else "cpu"
        self.devices = rank_devices(device, ep_size, "--ep-size")
        on_cuda = self.devices[0].type == "cuda"
        dtype = model.dtype if model is not None else (torch.bfloat16 if on_cuda else torch.float32)
        self.backend = select_backend(backend, self.devices[0])
        log.info("expert parallelism: %d ranks on %s, %d routed experts (%s per rank, %d redundant copies), "
                 "all-to-all backend %s (torch.distributed %s)", ep_size, ", ".join(map(str, self.devices)),
                 n_experts, "/".join(str(len(self.placement.local_experts(r))) for r in range(ep_size)),
                 len(self.placement.replicas), self.backend, collective_backend(self.devices[0]))
        shape = (rank_config.num_blocks, rank_config.num_layers, rank_config.block_size, rank_config.kv_dim)
        # each rank's pool on its own device, allocated here (where the worker's transfer agents
        # register them) and handed to the rank: shared memory on a CPU, CUDA IPC on GPUs
        shares = [torch.zeros(shape, dtype=rank_config.dtype, device=d) for d in self.devices]
        if not on_cuda:
            for t in shares:
                t.share_memory_()
        self.pool = EpKvPool(rank_config, hash_seed, shares)
        self.stats = StepStats(comm_s=[0.0] * ep_size, pairs_received=[0] * ep_size)
        self._loads: list[torch.Tensor | None] = [None] * ep_size
        store = dist.TCPStore("127.0.0.1", 0, ep_size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s))
        ctx = mp.get_context("spawn")
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list[Any] = []
        self._joined = False  # this engine initialized the process group (so close destroys it)
        for rank in range(1, ep_size):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=_rank_main, name=f"ep-rank-{rank}", daemon=True,
                            args=(rank, ep_size, store.port, spec, seed, threads, timeout_s, self.placement,
                                  rank_config, hash_seed, shares[rank], dtype, theirs, gc_freeze, os.getpid()))
            p.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(p)
        try:
            _init_group(0, ep_size, store, timeout_s, self.devices[0])
            self._joined = True
            if model is None:
                self.model, step0 = _ep_model(spec, seed, self.placement, 0, self.devices[0], dtype)
            else:
                self.model, step0 = model, install_expert_parallel(model, self.placement, 0)
            self._stats0 = step0.stats
            # rank 0's runner: the worker's runner for its own share (fast path on a GPU)
            self.runner0 = ModelRunner(self.model, self.pool.ranks[0])
            _warm_up(self.runner0)
            for rank, conn in enumerate(self._conns, start=1):
                if not conn.poll(STARTUP_TIMEOUT_S):
                    raise RuntimeError(f"EP rank {rank} did not start within {STARTUP_TIMEOUT_S:.0f} s")
                self._recv(rank, conn)
        except BaseException:
            self.close()
            raise
        self._store = store  # the children's rendezvous point; kept alive with the group

    def _recv(self, rank: int, conn: multiprocessing.connection.Connection) -> Any:
        try:
            status, payload = conn.recv()
        except EOFError:
            raise RuntimeError(f"EP rank {rank} exited") from None
        if status == "error":
            raise RuntimeError(f"EP rank {rank} failed: {payload}")
        return payload

    def step(self, works: list[RankWork] | list[SpecWork] | list[CaptureWork]) -> list[Any]:
        """One lock-step step: works[r] to rank r; returns each rank's result (`run_work`)."""
        t0 = time.perf_counter()
        for rank, (conn, work) in enumerate(zip(self._conns, works[1:]), start=1):
            try:
                conn.send(work)
            except OSError:  # a broken pipe: the rank is gone
                raise RuntimeError(f"EP rank {rank} exited") from None
        outs = [run_work(self.runner0, works[0])]
        self.stats.own_s += time.perf_counter() - t0
        rank_stats = [self._stats0]
        for rank, conn in enumerate(self._conns, start=1):
            hidden, stats = self._recv(rank, conn)
            outs.append(hidden)
            rank_stats.append(stats)
        for rank, st in enumerate(rank_stats):  # each rank's running totals
            self.stats.comm_s[rank] = st.comm_s
            self.stats.pairs_received[rank] = st.pairs_received
            self._loads[rank] = st.expert_load
        self.stats.steps += 1
        self.stats.step_s += time.perf_counter() - t0
        idle = sum(1 for w in works if not w.busy)
        self.stats.idle_rank_steps += idle
        self.stats.all_busy_steps += idle == 0
        return outs

    def expert_load(self) -> list[int]:
        """Observed (token, expert) pairs per routed expert since start, summed over ranks and
        MoE layers: the input of `engine.ep_placement.plan_redundant`."""
        loads = [x for x in self._loads if x is not None]
        return (sum(loads[1:], loads[0]).tolist() if loads else [0] * self.placement.n_experts)

    @torch.inference_mode()
    def prefill_chunk(self, block_ids: list[BlockId], token_ids: list[int], start: int, end: int,
                      mtp: bool = False) -> torch.Tensor:
        """Prompt tokens [start, end) on the rank owning block_ids (others idle) -> hidden [hidden];
        with `mtp` the chunk's MTP KV rows too (engine/mtp.py; the other ranks join the MTP
        module's collectives with no tokens)."""
        mtp = mtp and pool_has_mtp(self.pool.ranks[0], self.model)
        rank, local = self.pool.split(block_ids)
        works = [RankWork(mtp=mtp) for _ in range(self.world)]
        works[rank] = RankWork(((tuple(local), start, end - start),), tuple(token_ids[start:end]), mtp,
                               tuple(token_ids) if mtp else ())
        return self.step(works)[rank][0].to(self.devices[0])

    def spec_decode(self, batch: list[SpecInput]) -> list[SpecOutput]:
        """One MTP speculative step (engine/spec_decode.py) for every request, each on the rank
        that owns its blocks: every rank runs the MTP extend, the same number of chain rounds
        (the most drafts of any request) and the verify forward, idle where it has no rows."""
        shares: list[list[SpecInput]] = [[] for _ in range(self.world)]
        where = []
        for b in batch:
            rank, local = self.pool.split(b.block_ids)
            where.append((rank, len(shares[rank])))
            shares[rank].append(dataclasses.replace(b, block_ids=list(local), hidden=b.hidden.cpu()))
        rounds = max((b.num_drafts for b in batch), default=0)
        outs = self.step([SpecWork(tuple(s), rounds) for s in shares])
        return [_moved(outs[r][i], self.devices[0]) for r, i in where]

    def decode_tokens(self, batch: list[DecodeInput], sampling: list) -> StepTokens:
        """One decode step for every request, each on its own rank, which samples its rows
        (engine.runner.ModelRunner.decode_tokens) -> (tokens, logprobs, tops) in batch order."""
        seqs: list[list[tuple[tuple[int, ...], int, int]]] = [[] for _ in range(self.world)]
        tokens: list[list[int]] = [[] for _ in range(self.world)]
        rows: list[list] = [[] for _ in range(self.world)]
        where = []
        for b, s in zip(batch, sampling):
            rank, local = self.pool.split(b.block_ids)
            where.append((rank, len(seqs[rank])))
            seqs[rank].append((tuple(local), b.num_computed, 1))
            tokens[rank].append(b.input_token)
            rows[rank].append(s)
        counts = tuple(len(s) for s in seqs)
        bucket = self._bucket(batch, max(counts))
        outs = self.step([RankWork(tuple(s), tuple(t), counts=counts, sampling=tuple(r), decode=True, bucket=bucket)
                          for s, t, r in zip(seqs, tokens, rows)])
        return StepTokens(*([outs[r][part][i] for r, i in where] for part in range(3)))

    def _bucket(self, batch: list[DecodeInput], rows: int) -> int:
        """The graph bucket every rank replays for a step whose largest share is `rows`, or 0
        (an eager step on every rank): no graphs, more rows than the largest bucket, or a
        context wider than the captured block tables (then no rank could replay)."""
        graphs = self.runner0.graphs
        if graphs is None:
            return 0
        bs = self.pool.rank_config.block_size
        if any(-(-(b.num_computed + 1) // bs) > graphs.width for b in batch):
            return 0
        return graphs.bucket(rows) or 0

    @property
    def fast(self) -> bool:
        """Whether the ranks run the fast path (GPUs with bf16/fp16 weights and triton), which
        alone has decode graphs."""
        return self.runner0.fast

    def capture_graphs(self, max_batch: int, max_context: int) -> int:
        """Every rank captures its decode graphs, in lock-step (GPUs; CaptureWork). Returns the
        most bytes one rank's graphs took."""
        scratch = [p.blocks.allocate(1)[0] for p in self.pool.ranks]  # never freed: padding rows write here
        sizes = self.step([CaptureWork(max_batch, max_context, s) for s in scratch])
        log.info("EP ranks' decode graphs: %d buckets up to %d rows on every rank, %.0f MiB at most per GPU",
                 len(self.runner0.graphs.sizes), self.runner0.graphs.sizes[-1], max(sizes) / 2**20)
        return max(sizes)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the child ranks (call on the model thread, between steps) and leave the group.
        A rank that has not exited within timeout_s (a busy machine) is terminated: ranks hold
        no state of their own (the KV is in shared memory, the accounting on rank 0)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.warning("EP rank %s did not stop within %.0f s; terminating it", p.name, timeout_s)
                p.terminate()
                p.join(5.0)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        if self._joined:
            self._joined = False
            dist.destroy_process_group()


def ep_engine_factory(own_model: bool) -> Callable[[Any, Any, KvPoolConfig, int], EpEngine]:
    """The `engine` factory WorkerRuntime takes for `--ep-size` > 1. Ranks 1..N-1 load
    `--model`/`--seed` themselves. With own_model (the worker loaded the model itself), rank 0
    turns that model into its EP rank in place, so it too keeps only its experts; otherwise the
    model is shared (tests) and rank 0 loads its own copy."""
    def start(opts: Any, loaded: Any, rank_config: KvPoolConfig, hash_seed: int) -> EpEngine:
        n = loaded.config.n_routed_experts
        placement = (ExpertPlacement.from_file(opts.ep_placement, n, opts.ep_size) if opts.ep_placement
                     else ExpertPlacement.contiguous(n, opts.ep_size))
        device = loaded.model.model.embed_tokens.weight.device
        # a collective's timeout; on GPUs the first steps also compile the decode kernels (Triton,
        # torch.compile) on every rank, which the slowest rank's peers wait for inside NCCL
        timeout_s = max(300.0 if device.type == "cuda" else 60.0, opts.stall_timeout_s)
        return EpEngine(opts.model, opts.seed, opts.ep_size, opts.ep_backend, opts.torch_threads,
                        timeout_s, rank_config, hash_seed, placement,
                        model=loaded.model if own_model else None, device=device, gc_freeze=opts.gc_freeze)
    return start
