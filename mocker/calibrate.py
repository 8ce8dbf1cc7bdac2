"""Calibrate the mocker's timing model against the real engine (engine/runner.py).

Times `ModelRunner.prefill_chunk` over a grid of (prefix, chunk) lengths and
`ModelRunner.decode` over a grid of (batch, context) sizes on the chosen model and device,
fits mocker/timing.py's terms by least squares, and writes the JSON `tandem mocker --timing`
reads (transfer terms and speedup keep their defaults):

    python -m mocker.calibrate --model tandem-shakespeare --out timing.json            # CPU
    python -m mocker.calibrate --model PATH --device cuda --max-context 16384 --out timing-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def measure(model_spec: str, device: str, max_context: int, block_size: int, repeats: int):
    import torch

    from engine.kv_pool import KvPool, KvPoolConfig
    from engine.model_source import load_model
    from engine.runner import DecodeInput, ModelRunner

    loaded = load_model(model_spec)
    model = loaded.model.to(device)
    cfg = loaded.config
    max_context = min(max_context, cfg.max_position_embeddings - 1)
    batches = [1, 4, 16]
    contexts = sorted({max(block_size, max_context // 8), max_context // 2})
    need = max(max_context, max(batches) * max(contexts)) // block_size + 2 * max(batches) + 8
    pool = KvPool(KvPoolConfig(num_blocks=need, block_size=block_size, num_layers=cfg.num_hidden_layers,
                               kv_dim=cfg.kv_dim), 0, device=device)
    runner = ModelRunner(model, pool)
    blocks = list(range(need))
    tokens = [i % cfg.vocab_size for i in range(max_context)]

    def timed(fn, *args) -> float:
        fn(*args)  # warm-up
        out = []
        for _ in range(repeats):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn(*args)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    prefill = []
    for prefix in sorted({0, max_context // 4, max_context // 2}):
        for chunk in sorted({max(16, max_context // 16), max_context // 4, max_context // 2}):
            if prefix + chunk <= max_context:
                prefill.append((prefix, chunk, timed(runner.prefill_chunk, blocks, tokens, prefix, prefix + chunk)))
    decode = []
    for b in batches:
        for ctx in contexts:
            per = ctx // block_size + 1
            batch = [DecodeInput(blocks[i * per:(i + 1) * per], ctx, 1) for i in range(b)]
            if b * per <= need:
                decode.append((b, b * ctx, timed(runner.decode, batch)))
    return prefill, decode


def main(argv: list[str] | None = None) -> int:
    from mocker.timing import TimingModel

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tandem-shakespeare")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-context", type=int, default=1024, help="longest prefix + chunk timed, in tokens")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True, help="timing JSON for tandem mocker --timing")
    args = ap.parse_args(argv)
    prefill, decode = measure(args.model, args.device, args.max_context, args.block_size, args.repeats)
    fit = TimingModel().fit_prefill(prefill).fit_decode(decode)
    fit.save(args.out)
    with open(args.out.removesuffix(".json") + "-samples.json", "w") as f:
        json.dump({"prefill (prefix, chunk, s)": prefill, "decode (batch, kv tokens, s)": decode}, f, indent=1)
    print(f"wrote {args.out}: {fit}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
