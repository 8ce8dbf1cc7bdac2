"""The decode worker's own MTP step in-process, next to its plain step: where a speculative
step's time goes on the trained checkpoint (issue 14's MTP target).

Usage (CUDA; seconds):
    python tools/bench_spec_step.py --ks 1,2,3 --batch 1,8 --out docs/bench/spec_step_gpu.json
CPU smoke run of the script itself: --device cpu --steps 4

tandem-shakespeare (engine/assets, 6 layers + 1 MTP layer) in bf16 on the device, B MT-Bench-
free prompts (Shakespeare lines, greedy) prefilled with their MTP rows, then per k:
- k = 0: `ModelRunner.decode_step` (the CUDA graph of engine/graph_runner.py, device sampling)
  with the step's device-to-host copy, at a fixed context (timing only: each step rewrites the
  same position);
- k >= 1: `ModelRunner.spec_step` with the whole-step graphs (engine/spec_graphs.py) and, for
  comparison, the same step eager (graphs off), each followed by its device-to-host copy.
Per row: ms per step (wall, host waits for each step: what a step costs with no overlap),
host ms per step (the call alone, before the wait: what bounds an overlapped loop), tokens per
step (accept length; 1 for k = 0) and tokens/s per request. `--top-logprobs 0,5` times each
step with every row asking for 0 and for 5 alternatives per token (the MTP step computes them
after its graph replay): what top log-probabilities add to a step, in-process. The k >= 1 step
is timed as the worker's overlap loop runs it (`SpecOverlapRunner.launch`: the step and its
packing for the one device-to-host copy; then `collect`). Rows: {"k", "batch", "mode",
"top_logprobs", "ms_per_step", "host_ms_per_step", "tokens_per_step", "tok_s_per_request"}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common.sampling_params import SamplingParams  # noqa: E402
from engine.kv_pool import KvPool, KvPoolConfig  # noqa: E402
from engine.model_source import load_model  # noqa: E402
from engine.runner import DecodeInput, ModelRunner  # noqa: E402
from engine.sampling import sample  # noqa: E402
from engine.spec_batch import SpecRow  # noqa: E402

LINES = ["ROMEO:\nBut soft, what light through yonder window breaks?\n",
         "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\n",
         "KING HENRY:\nOnce more unto the breach, dear friends, once more;\n",
         "HAMLET:\nTo be, or not to be, that is the question:\n",
         "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n",
         "MACBETH:\nIs this a dagger which I see before me,\n",
         "PORTIA:\nThe quality of mercy is not strain'd,\n",
         "PROSPERO:\nWe are such stuff as dreams are made on,\n"]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn, steps: int, dev: torch.device) -> tuple[float, float, list]:
    """(wall ms per step, host ms per step, outputs) over `steps` calls, each waited for: fn
    returns a tensor (read to the host) or a callable that waits and returns the output."""
    wall = host = 0.0
    outs = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        outs.append(out.tolist() if isinstance(out, torch.Tensor) else out() if callable(out) else out)
        t2 = time.perf_counter()
        host += t1 - t0
        wall += t2 - t0
    return wall / steps * 1e3, host / steps * 1e3, outs


def run(k: int, batch: int, steps: int, dev: torch.device, loaded, graphs: bool, top: int = 0) -> dict:
    model = loaded.model
    c = model.config
    pool = KvPool(KvPoolConfig(num_blocks=64 * batch + 8, block_size=16, num_layers=c.num_kv_layers,
                               kv_dim=c.kv_dim, dtype=model.dtype), hash_seed=1, device=dev)
    runner = ModelRunner(model, pool)
    if graphs and dev.type == "cuda":
        runner.capture_graphs(batch, 1024, sizes=[batch], spec_k=k)
    tok = loaded.tokenizer()
    prompts = [tok.encode(LINES[i % len(LINES)]) for i in range(batch)]
    blocks, firsts = [], []
    params = SamplingParams(top_logprobs=top)
    for p in prompts:
        b = pool.allocate_prompt(p).block_ids
        hidden = runner.prefill_chunk(b, p, 0, len(p), mtp=bool(k))
        firsts.append((hidden, sample(runner.logits(hidden), params, 0)[0]))
        pool.grow(b, len(p) + (k + 1) * (steps + 4) + 1)
        blocks.append(b)
    if k == 0:
        batch_in = [DecodeInput(b, len(p), f) for b, p, (_, f) in zip(blocks, prompts, firsts)]
        sampling = [(params, 1)] * batch

        def step():
            return runner.decode_step(batch_in, sampling)  # [B, 2] float64: what the worker copies to the host
        _time(step, 3, dev)
        wall, host, _ = _time(step, steps, dev)
        per_step = 1.0
        mode = "graph" if runner.graphs is not None else "eager"
    else:
        from engine.overlap_runner import SpecOverlapRunner
        sor = SpecOverlapRunner(runner, batch, k)
        rows = []
        for i, (b, p, (hidden, f)) in enumerate(zip(blocks, prompts, firsts)):
            slot = sor.slots.allocate()
            sor.init(slot, hidden[None], p + [f])
            rows.append(SpecRow(slot, b, params, -len(p)))

        def step():  # as the worker's loop: the launch (timed as host), then its collect
            launched = sor.launch(rows)
            return lambda: sum(len(emitted) for emitted in sor.collect(launched))
        _time(step, 1, dev)  # warm-up (eager: compiles)
        wall, host, outs = _time(step, steps, dev)
        per_step = sum(outs) / (steps * batch)
        mode = "graph" if runner.spec_graphs is not None else "eager"
    return {"k": k, "batch": batch, "mode": mode, "top_logprobs": top, "ms_per_step": wall, "host_ms_per_step": host,
            "tokens_per_step": per_step, "tok_s_per_request": per_step / wall * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ks", default="1,2,3", help="draft tokens per step to time (k = 0 always runs)")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--top-logprobs", default="0", help="comma list: alternatives per token every row asks for")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    for batch in [int(x) for x in args.batch.split(",")]:
        for k in [0] + [int(x) for x in args.ks.split(",") if int(x) > 0]:
            for top in [int(x) for x in args.top_logprobs.split(",")]:
                for graphs in ((True, False) if k and dev.type == "cuda" else (True,)):
                    loaded = load_model("tandem-shakespeare")
                    loaded.model.to(dev, dtype)
                    r = run(k, batch, args.steps, dev, loaded, graphs, top)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    base = {(r["batch"], r["top_logprobs"]): r for r in rows if r["k"] == 0}
    print("| k | batch | top log-probs | step | ms / step | host ms / step | tokens / step | tok/s per request "
          "| × k = 0 |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        r["vs_k0"] = r["tok_s_per_request"] / base[r["batch"], r["top_logprobs"]]["tok_s_per_request"]
        print(f"| {r['k']} | {r['batch']} | {r['top_logprobs']} | {r['mode']} | {r['ms_per_step']:.3f} | "
              f"{r['host_ms_per_step']:.3f} | "
              f"{r['tokens_per_step']:.2f} | {r['tok_s_per_request']:,.0f} | {r['vs_k0']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(dev) if dev.type == "cuda"
                                              else "cpu", "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
