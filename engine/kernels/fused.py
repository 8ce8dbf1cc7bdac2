"""Fused versions of the model's elementwise hot spots on GPUs (RMSNorm, a residual add with the
RMSNorm after it, rope, rope with the latent row's RMSNorm, MoE routing, SwiGLU): the plain
functions of engine/model.py compiled by torch.compile (inductor fuses each into one or a few
Triton kernels), swapped into `engine.model.HOT`; and `use_fused_projections`, which makes each
attention's two input projections one GEMM.

Why: a decode step of a small model is bound by kernel count, not bytes. In the plain form one
RMSNorm is ~7 kernels, rope ~8, routing ~15; compiled, each is 1-3. The compiled functions
compute the same thing (up to float rounding order); the plain ones stay the reference on CPUs.
Compilation happens on the first call of each (shape class, dtype) and is done before graph
capture (the graph runner's warm-up calls), so it adds start-up time, not step time.
Falls back to the plain functions, with a logged reason, when torch.compile cannot run.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def use_fused_hot_path() -> bool:
    """Compile the hot spots process-wide (idempotent); False (and logged) if unavailable."""
    from engine import model as m
    if m.HOT.fused:
        return True
    try:
        import torch._dynamo
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        torch._dynamo.config.suppress_errors = True  # a function that fails to compile runs eagerly
        # A decode worker runs the model on two threads (worker/model_lane.py). While one thread
        # compiles, dynamo's FX trace sets a process-wide flag, and a compiled function called on
        # the other thread meanwhile raised "Detected that you are using FX to symbolically trace a
        # dynamo-optimized function" (a local prefill failed so on the H200). With this off, that
        # call runs the plain function instead: the same result. Dynamo's own lock serialises the
        # compiles themselves.
        if hasattr(torch._dynamo.config, "error_on_nested_fx_trace"):
            torch._dynamo.config.error_on_nested_fx_trace = False
        compile_ = lambda fn: torch.compile(fn, dynamic=True)  # noqa: E731
        m.HOT.rms_norm = compile_(m.rms_norm)
        m.HOT.silu_mul = compile_(m.silu_mul)
        # a MoE layer's per-slot output into the next add + RMSNorm: one Triton kernel
        # (engine/kernels/slot_norm.py) where the compiled function took two
        from engine.kernels import slot_norm
        add_norm = compile_(m.add_rms_norm)
        m.HOT.add_rms_norm = slot_norm.dispatching(add_norm) if slot_norm.triton is not None else add_norm
        m.HOT.rope_cos_sin = compile_(m.rope_cos_sin)
        m.HOT.apply_rope = compile_(m.apply_rope)
        m.HOT.rope_latent = compile_(m.rope_latent)
        m.HOT.route = compile_(m.route)
        m.HOT.fused = True
        _probe(m)
    except Exception as exc:  # noqa: BLE001 - a missing compiler must not stop the worker
        m.HOT.reset()
        log.warning("fused hot path off (torch.compile failed: %s: %s); plain functions run",
                    type(exc).__name__, str(exc)[:300])
        return False
    log.info("fused hot path: RMSNorm, residual add + RMSNorm, rope, rope + latent RMSNorm, routing and "
             "SwiGLU compiled with torch.compile; a MoE output's slots summed into the residual add + RMSNorm "
             "by a Triton kernel")
    return True


def _probe(m) -> None:
    # compile once now on a small input, so a failure shows here rather than inside a step
    x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    m.HOT.rms_norm(x, torch.ones(64, device="cuda", dtype=torch.bfloat16), 1e-6)


@torch.no_grad()
def use_fused_projections(model: torch.nn.Module) -> int:
    """Give every MLA attention of `model` one weight [q rows + kv_dim, hidden] for its two input
    projections (q_proj or q_a_proj, then kv_a_proj_with_mqa), the modules' own weights becoming
    views of it (no second copy), so that a step runs one GEMM where it ran two. The output's
    columns are the two projections' (the same products; a GPU GEMM may sum them in another
    order). Idempotent; returns the number of attentions switched (again after a deepcopy or
    `.to()` left a layer's weights apart from its fused_a)."""
    from engine.model import MLAttention

    n = 0
    for attn in model.modules():
        if not isinstance(attn, MLAttention) or (attn.fused_a is not None and attn._fused_a_current()):
            continue  # fused already (a stale fused_a, after a copy or .to(), is made again)
        first = attn.first_proj
        rows = first.weight.shape[0]
        both = torch.cat((first.weight, attn.kv_a_proj_with_mqa.weight))
        first.weight.data = both[:rows]
        attn.kv_a_proj_with_mqa.weight.data = both[rows:]
        attn.fused_a = both
        n += 1
        if both.is_cuda:  # the two former weights' memory back to the device (see use_grouped_experts)
            torch.cuda.empty_cache()
    return n
