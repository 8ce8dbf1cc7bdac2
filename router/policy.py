"""Worker choice for the skeleton router: least loaded by the router's own in-flight count.

KV-aware placement (DESIGN.md section 4) replaces this in the KV router issue; the
interface — candidates in, one instance (or None) out — stays.
"""

from __future__ import annotations

import itertools
from typing import Mapping, Sequence

from common.pb.tandem.v1 import discovery_pb2


class LeastLoaded:
    """Lowest in-flight count wins; ties rotate so equal workers share the load."""

    def __init__(self) -> None:
        self._tick = itertools.count()

    def choose(self, candidates: Sequence[discovery_pb2.Instance],
               in_flight: Mapping[str, int]) -> discovery_pb2.Instance | None:
        if not candidates:
            return None
        ordered = sorted(candidates, key=lambda i: i.instance_id)
        start = next(self._tick) % len(ordered)
        rotated = ordered[start:] + ordered[:start]
        return min(rotated, key=lambda i: in_flight.get(i.instance_id, 0))
