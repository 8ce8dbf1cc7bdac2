"""The mocker's timing model: how long a simulated engine iteration takes, in seconds.

One engine iteration (like SGLang's or vLLM's mixed batch with chunked prefill) runs one decode
step for every running request plus at most one prefill chunk. Its duration is the sum of

    prefill chunk of c new tokens after p tokens already in the pool (cached or earlier chunks):
        t_prefill(p, c) = prefill_per_token · c + prefill_attention · (c·p + c²/2) + prefill_overhead
    (linear layers cost per token; attention of token i costs its context length, so a chunk costs
    Σ_{i<c} (p + i) ≈ c·p + c²/2 — the quadratic growth with context; overhead per chunk call)

    decode step over a batch of b requests holding k KV tokens in total:
        t_decode(b, k) = decode_overhead + decode_per_request · b + decode_per_kv_token · k
    (a fixed launch cost, per-token linear layers, and the KV read of attention)

and a KV transfer from a prefill worker to a decode worker of n tokens takes
        t_transfer(n) = transfer_latency + n · kv_bytes_per_token / transfer_bandwidth.

`speedup` divides every simulated duration when the mocker runs in real time, so an hour-long
trace replays in minutes; reported latencies are multiplied back by the bench.

Defaults are round numbers of the order of one H200 serving a DeepSeek-V3-shaped model (about
20K prefill tokens/s on short prompts, halving at a 64K-token context; ~10 ms decode steps);
`fit_prefill` / `fit_decode` refit them by least squares from measurements of the real engine
(`python -m mocker.calibrate`, which times engine/runner.py), and `load` reads such a fit.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class TimingModel:
    prefill_per_token: float = 5.0e-5  # seconds per new prompt token (linear layers)
    prefill_attention: float = 7.6e-10  # seconds per (new token × context token) pair
    prefill_overhead: float = 2.0e-3  # seconds per prefill chunk
    decode_overhead: float = 8.0e-3  # seconds per decode step
    decode_per_request: float = 1.0e-4  # seconds per request in the decode batch
    decode_per_kv_token: float = 9.0e-9  # seconds per KV token read by a decode step
    kv_bytes_per_token: int = 35_136  # DeepSeek-R1 MLA in FP8 (docs/bench/capacity.md)
    transfer_bandwidth: float = 25e9  # bytes/second, prefill → decode worker
    transfer_latency: float = 1.0e-3  # seconds per transfer
    speedup: float = 1.0  # simulated seconds per real second

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"timing {f.name} must be >= 0, got {getattr(self, f.name)}")
        if self.speedup <= 0 or self.transfer_bandwidth <= 0:
            raise ValueError("timing speedup and transfer_bandwidth must be > 0")

    def prefill_s(self, prefix_tokens: int, new_tokens: int) -> float:
        """Simulated seconds to prefill `new_tokens` after `prefix_tokens` already in the pool."""
        if new_tokens <= 0:
            return 0.0
        pairs = new_tokens * prefix_tokens + new_tokens * new_tokens / 2
        return self.prefill_overhead + self.prefill_per_token * new_tokens + self.prefill_attention * pairs

    def decode_s(self, batch: int, kv_tokens: int) -> float:
        """Simulated seconds of one decode step over `batch` requests with `kv_tokens` in total."""
        if batch <= 0:
            return 0.0
        return self.decode_overhead + self.decode_per_request * batch + self.decode_per_kv_token * kv_tokens

    def transfer_s(self, tokens: int) -> float:
        """Simulated seconds to move the KV of `tokens` tokens to another worker."""
        return self.transfer_latency + tokens * self.kv_bytes_per_token / self.transfer_bandwidth

    def fit_prefill(self, samples: Sequence[tuple[int, int, float]]) -> TimingModel:
        """Refit the prefill terms from (prefix tokens, new tokens, seconds) measurements
        (least squares, coefficients clipped at 0). Needs >= 3 samples."""
        import numpy as np

        a = np.array([[c, c * p + c * c / 2, 1.0] for p, c, _ in samples], dtype=float)
        y = np.array([s for _, _, s in samples], dtype=float)
        per_tok, attn, over = np.clip(np.linalg.lstsq(a, y, rcond=None)[0], 0, None)
        return replace(self, prefill_per_token=float(per_tok), prefill_attention=float(attn),
                       prefill_overhead=float(over))

    def fit_decode(self, samples: Sequence[tuple[int, int, float]]) -> TimingModel:
        """Refit the decode terms from (batch, KV tokens, seconds) measurements (least squares)."""
        import numpy as np

        a = np.array([[1.0, b, k] for b, k, _ in samples], dtype=float)
        y = np.array([s for _, _, s in samples], dtype=float)
        over, per_req, per_kv = np.clip(np.linalg.lstsq(a, y, rcond=None)[0], 0, None)
        return replace(self, decode_overhead=float(over), decode_per_request=float(per_req),
                       decode_per_kv_token=float(per_kv))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, **overrides: float) -> TimingModel:
        """Read a JSON object of fields (as written by `save` or mocker.calibrate).

        Raises:
            ValueError: an unknown field or a negative value.
        """
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"--timing {path}: unknown fields {sorted(unknown)}")
        return cls(**{**data, **overrides})
