"""Where one decode step's GPU time goes: kernels per step grouped by name (count, ms), for the
worker's own step (`ModelRunner.decode_step`, fast mode) on config S or M of
tools/bench_serving_gpu.py, seeded N(0, 0.02) weights drawn on the GPU (no checkpoint written).

Usage (CUDA only):
    python tools/profile_decode.py --config M --batch 1,64 --context 1024 [--top 25] [--out FILE]

Two figures per batch: the eager step under torch.profiler (kernels summed per step: how many
launches a step makes and which kernels hold the time), and the CUDA-graph replay's wall time
per step (what the worker runs). Prints one JSON line per batch and the top kernels; --out
writes the JSON lines to FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_decode import bench_config, bench_engine, bytes_per_step, row_tokens  # noqa: E402
from bench_serving_gpu import m_config  # noqa: E402
from engine.kv_pool import KvPool, KvPoolConfig  # noqa: E402
from engine.model import DeepseekV3ForCausalLM, _param_seed  # noqa: E402
from engine.runner import DecodeInput, ModelRunner  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402


@torch.no_grad()
def seeded_model(cfg, device: torch.device) -> torch.nn.Module:
    """bf16 model with N(0, initializer_range) weights (norms 1), drawn per tensor on the GPU."""
    model = DeepseekV3ForCausalLM(cfg, dtype=torch.bfloat16, device=device)
    model.share_mtp_weights()
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("norm.weight"):
            t.fill_(1.0)
            continue
        g = torch.Generator(device=device).manual_seed(_param_seed(0, name))
        t.copy_(torch.empty(t.shape, dtype=torch.float32, device=device).normal_(0.0, cfg.initializer_range,
                                                                                 generator=g))
    return model.eval()


@torch.no_grad()
def profile_eager(model, cfg, device: torch.device, batch: int, context: int, steps: int = 5
                  ) -> tuple[dict, list[tuple[str, int, float]]]:
    """Kernels of `steps` eager fast-mode decode steps: (summary, [(name, count per step, ms per step)])."""
    width = -(-(context + steps + 16) // 16)
    pool = KvPool(KvPoolConfig(num_blocks=2 + batch * width, block_size=16, num_layers=cfg.num_hidden_layers,
                               kv_dim=cfg.kv_dim, dtype=torch.bfloat16), 1, device)
    pool.kv.normal_(0.0, 0.5)
    runner = ModelRunner(model, pool)
    tables = [pool.blocks.allocate(width) for _ in range(batch)]
    params = [(SamplingParams(max_tokens=1 << 20), 0)] * batch
    tokens = row_tokens(batch, cfg.vocab_size)  # distinct rows route to different experts
    for i in range(3):  # compiles and warm-up
        runner.decode_step([DecodeInput(t, context + i, x) for t, x in zip(tables, tokens)], params)
    torch.cuda.synchronize(device)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            runner.decode_step([DecodeInput(t, context + 3 + i, x) for t, x in zip(tables, tokens)], params)
        torch.cuda.synchronize(device)
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[ev.name[:90]]
            a[0] += 1
            a[1] += ev.device_time_total / 1e3
    rows = sorted(((n, round(c / steps), ms / steps) for n, (c, ms) in agg.items()), key=lambda r: -r[2])
    del runner, pool
    torch.cuda.empty_cache()
    return ({"kernels_per_step": sum(r[1] for r in rows), "kernel_ms_per_step": sum(r[2] for r in rows)}, rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=("S", "M"), default="M")
    ap.add_argument("--batch", default="1,64", help="comma-separated batch sizes (default 1,64)")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per sequence (default 1024)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed per batch (default 25)")
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the bound (default 4.8)")
    ap.add_argument("--out", type=Path, help="also write the JSON lines here")
    ap.add_argument("--pdl-ab", type=int, default=0, metavar="N",
                    help="also N rounds of the graph step with programmatic dependent launch off "
                         "(TANDEM_PDL=0) and on, alternating: graph_ms_pdl_off / graph_ms_pdl_on lists")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_decode.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    device = torch.device("cuda")
    cfg = m_config() if args.config == "M" else bench_config(False)
    t0 = time.time()
    model = seeded_model(cfg, device)
    print(json.dumps({"config": args.config, "weights_s": round(time.time() - t0, 1)}), flush=True)
    lines = []
    for b in (int(x) for x in args.batch.split(",")):
        summary, rows = profile_eager(model, cfg, device, b, args.context)
        graph = bench_engine(model, cfg, device, torch.bfloat16, b, args.context, 30, 16, True)
        bound_ms = 1e3 * bytes_per_step(cfg, model, b, args.context, 2) / (args.hbm_tbps * 1e12)
        line = {"config": args.config, "batch": b, "context": args.context, **summary,
                "graph_ms_per_step": graph["ms_per_step"], "bound_ms_per_step": bound_ms,
                "top": [[n, c, round(ms, 4)] for n, c, ms in rows[:args.top]]}
        before = os.environ.get("TANDEM_PDL")
        for _ in range(args.pdl_ab):  # engine/kernels/pdl.py reads TANDEM_PDL when a graph is captured
            for key, value in (("graph_ms_pdl_off", "0"), ("graph_ms_pdl_on", "1")):
                os.environ["TANDEM_PDL"] = value
                ms = bench_engine(model, cfg, device, torch.bfloat16, b, args.context, 30, 16, True)["ms_per_step"]
                line.setdefault(key, []).append(round(ms, 4))
        if args.pdl_ab:
            os.environ.pop("TANDEM_PDL") if before is None else os.environ.update(TANDEM_PDL=before)
        lines.append(line)
        print(json.dumps({k: v for k, v in line.items() if k != "top"}), flush=True)
        for n, c, ms in rows[:args.top]:
            print(f"  {ms:8.4f} ms  x {c:5d}  {n}", flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(x) + "\n" for x in lines))


if __name__ == "__main__":
    main()
