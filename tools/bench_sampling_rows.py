"""Host cost of a decode step's sampling bookkeeping: `SamplingRows.build` (the rows' parameters
to device tensors) and `unpack_step` (the step's host copy to lists), per step, for a batch of
plain greedy rows and for batches where rows ask for top log-probabilities, a logit bias or
penalties. Both run on the scheduler's host path every step (the overlap loop hides them under
the device's previous step, the plain loop does not).

    python tools/bench_sampling_rows.py [--batch 256] [--repeats 2000] [--device cpu]

Prints one line per case: microseconds per build and per unpack (median of 5 rounds).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.sampling_params import SamplingParams
from engine.sampling import SamplingRows, pack_step, sample_batch, top_logprobs_batch, unpack_step


def _time(fn, repeats: int) -> float:
    fn()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        rounds.append((time.perf_counter() - t0) / repeats * 1e6)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    b, device = args.batch, torch.device(args.device)
    history = list(range(100, 300))  # 200 generated tokens a penalized row
    cases = {
        "plain greedy": [(SamplingParams(), 5) for _ in range(b)],
        "one row top_logprobs=5": [(SamplingParams(top_logprobs=5 if i == 0 else 0), 5) for i in range(b)],
        "every row logit_bias of 300": [(SamplingParams(logit_bias=tuple((7 * t, 1.0) for t in range(300))), 5)
                                        for _ in range(b)],
        "every row penalized, 200 tokens": [(SamplingParams(frequency_penalty=0.5), 5, history) for _ in range(b)],
    }
    logits = torch.randn(b, 4096, device=device)  # (ids of the logit bias below reach 2,093)
    for name, rows in cases.items():
        built = SamplingRows.build(rows, device)
        top = top_logprobs_batch(logits, built) if built.top_logprobs else None
        host = pack_step(*sample_batch(logits, built), top).cpu()
        build_us = _time(lambda rows=rows: SamplingRows.build(rows, device), args.repeats)
        unpack_us = _time(lambda host=host: unpack_step(host), args.repeats)
        print(f"{name:34s} batch {b}: build {build_us:7.1f} us   unpack {unpack_us:7.1f} us")


if __name__ == "__main__":
    main()
