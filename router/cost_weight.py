"""The default prefill weight W of the kv/approx cost (router/policy.py), from the workers' own
timings and the requests' mean output length, so the default is not a constant fitted to a trace.

W prices one uncached prompt block in units of one active decode block:
- computing a block of bs tokens takes about bs · p seconds of a worker, p = prefill seconds per
  token (the linear layers; mocker/timing.py `prefill_per_token`);
- a block held by a running request lengthens each decode step of its worker by bs · d seconds
  (d = decode seconds per KV token read, `decode_per_kv_token`), for the L steps the request
  decodes on average (L = the mean output length the router observes, router/load.py);
so one uncached block costs as much worker time as W = (bs · p) / (bs · d · L) = p / (d · L)
active blocks. Both sides delay the other requests on that worker alike (a prefill chunk and a
decode step share the worker's iterations), so that factor cancels.

Workers announce p and d in discovery (Instance.prefill_seconds_per_token and
decode_seconds_per_kv_token; the mocker from its timing model); each candidate gives its own W
and the router uses their median. What a worker does not announce, the defaults of
mocker/timing.py TimingModel stand in for (the order of one H200 serving a
DeepSeek-V3-shaped model: p = 50 µs, d = 9 ns, so W ≈ 5,556 / L: 21.7 at L = 256, 16.2 at the
Mooncake conversation trace's L = 343). W is clipped to [MIN_WEIGHT, MAX_WEIGHT].
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable

from common.pb.tandem.v1 import discovery_pb2

DEFAULT_PREFILL_S_PER_TOKEN = 5.0e-5  # mocker/timing.py TimingModel.prefill_per_token
DEFAULT_DECODE_S_PER_KV_TOKEN = 9.0e-9  # mocker/timing.py TimingModel.decode_per_kv_token
DEFAULT_DECODE_S_PER_REQUEST = 1.0e-4  # mocker/timing.py TimingModel.decode_per_request
MIN_WEIGHT, MAX_WEIGHT = 1.0, 1024.0
MIN_ANNOUNCED_S, MAX_ANNOUNCED_S = 1e-15, 1.0  # outside: not a timing of a decode step or a prompt token
MAX_REQUEST_BLOCKS = 1e6


def _announced(value: float, default: float) -> float:
    return value if math.isfinite(value) and MIN_ANNOUNCED_S <= value <= MAX_ANNOUNCED_S else default


def derived_weight(instances: Iterable[discovery_pb2.Instance], mean_output_tokens: float) -> float:
    """W for these candidates: each instance's own p / (d · L) (what it does not announce, or
    announces outside [MIN_ANNOUNCED_S, MAX_ANNOUNCED_S], taken from the defaults), clipped,
    then their median, so that fewer than half announcing odd timings cannot move it past the
    others' range."""
    return Announced(instances).weight(mean_output_tokens)


class Announced:
    """The instances' announced timings, read once (the router keeps one per candidate list):
    `weight(L)` is derived_weight's W without a pass over 1,000 instances per request. W's median needs only the middle instances by p / d: p / (d · L),
    clipped, keeps their order for every L."""

    def __init__(self, instances: Iterable[discovery_pb2.Instance]) -> None:
        pd = sorted(((_announced(i.prefill_seconds_per_token, DEFAULT_PREFILL_S_PER_TOKEN),
                      _announced(i.decode_seconds_per_kv_token, DEFAULT_DECODE_S_PER_KV_TOKEN)) for i in instances),
                    key=lambda x: x[0] / x[1])
        n = len(pd)
        self._middle = pd[(n - 1) // 2:n // 2 + 1]  # the one or two median instances (none without any)

    def weight(self, mean_output_tokens: float) -> float:
        if not self._middle:
            return prefill_weight(DEFAULT_PREFILL_S_PER_TOKEN, DEFAULT_DECODE_S_PER_KV_TOKEN, mean_output_tokens)
        return statistics.median([prefill_weight(p, d, mean_output_tokens) for p, d in self._middle])


def prefill_weight(p: float, d: float, mean_output_tokens: float) -> float:
    """W = p / (d · L), clipped to [MIN_WEIGHT, MAX_WEIGHT] (L at least 1 token)."""
    return min(MAX_WEIGHT, max(MIN_WEIGHT, p / (d * max(1.0, mean_output_tokens))))


def request_blocks(instances: Iterable[discovery_pb2.Instance], block_size: int) -> float:
    """R: one more request in a decode batch, in active blocks: each decode step takes r seconds
    more per request (decode_seconds_per_request) and bs · d more per block, so R = r / (bs · d)
    (the median over the instances' own announcements, clipped to MAX_REQUEST_BLOCKS; defaults
    where absent)."""
    rs = [min(MAX_REQUEST_BLOCKS, _announced(i.decode_seconds_per_request, DEFAULT_DECODE_S_PER_REQUEST)
              / (block_size * _announced(i.decode_seconds_per_kv_token, DEFAULT_DECODE_S_PER_KV_TOKEN)))
          for i in instances]
    return statistics.median(rs) if rs else DEFAULT_DECODE_S_PER_REQUEST / (block_size * DEFAULT_DECODE_S_PER_KV_TOKEN)
