"""Future-token map for the overlap scheduler (SGLang's FutureMap; docs/architecture.md).

Step i's sampled tokens stay on the device: they are written into a ring `tokens` [capacity]
at slots reserved when step i was launched. Before step i's result reaches the host, the
scheduler already builds step i + 1 with the placeholder id -(slot + 1) as a request's input
token; `resolve` swaps every placeholder for the real token on the device, so no
device-to-host copy sits between two steps.
"""

from __future__ import annotations

import torch


class FutureTokenMap:
    """A device ring of sampled token ids addressed by negative placeholder ids.

    capacity must exceed the tokens of every step whose placeholders are still in use (the
    overlap loop has at most two launches of N steps in flight, --decode-steps-per-launch:
    2 × N × max batch is enough). One more entry past
    the ring is a sink: slot -1 (padding rows, steps whose tokens nobody awaits) writes there.
    """

    def __init__(self, capacity: int, device: torch.device | str) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: must be >= 1")
        self.tokens = torch.zeros(capacity + 1, dtype=torch.long, device=device)
        self._next = 0

    @property
    def capacity(self) -> int:
        return self.tokens.shape[0] - 1

    def reserve(self, n: int) -> list[int]:
        """n consecutive ring slots (wrapping) for one step's tokens."""
        cap, start = self.capacity, self._next
        slots = [(start + i) % cap for i in range(n)]
        self._next = (start + n) % cap
        return slots

    @staticmethod
    def placeholder(slot: int) -> int:
        """The input id that stands for the token the device writes into `slot`."""
        return -(slot + 1)

    def resolve(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] (real ids >= 0, placeholders < 0) on the map's device -> real ids [T]."""
        return torch.where(ids < 0, self.tokens[(-ids - 1).clamp(min=0)], ids)

    def store(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """tokens [B] -> ring slots [B] (both on the map's device; -1 = the sink)."""
        self.tokens[slots] = tokens
