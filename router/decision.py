"""A routing decision with its inputs, so every choice can be explained (debug log,
`tandem explain`, and span attributes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Candidate:
    instance_id: str
    address: str
    role: str  # "prefill" | "decode"
    overlap_blocks: int  # leading prompt blocks the worker holds (index or approximation)
    load: float  # decode: active blocks; prefill: queued prefill blocks; other modes: in-flight requests
    cost: float  # lower is better; see router/policy.py for the formula of each mode


@dataclass(frozen=True)
class RouteDecision:
    mode: str
    prompt_tokens: int
    prompt_blocks: int  # full blocks (the hashed ones)
    decode: Candidate
    prefill: Candidate | None  # None: the decode worker prefills locally
    local_prefill_reason: str = ""  # why prefill runs on the decode worker, when it does
    candidates: tuple[Candidate, ...] = field(default=())
    seconds: float = 0.0  # time to decide (hash + lookup + scoring)

    def explain(self) -> str:
        """A human-readable table of the candidates and the choice."""
        lines = [f"mode={self.mode} prompt={self.prompt_tokens} tokens ({self.prompt_blocks} full blocks) "
                 f"decided in {self.seconds * 1e6:.0f} us"]
        lines.append(f"{'role':8} {'instance':28} {'overlap':>8} {'load':>8} {'cost':>9}  chosen")
        chosen = {self.decode.instance_id} | ({self.prefill.instance_id} if self.prefill else set())
        for c in sorted(self.candidates, key=lambda c: (c.role, c.cost)):
            mark = "*" if c.instance_id in chosen else ""
            lines.append(f"{c.role:8} {c.instance_id:28} {c.overlap_blocks:8d} {c.load:8.1f} {c.cost:9.2f}  {mark}")
        lines.append("prefill: " + (self.prefill.instance_id if self.prefill else f"local ({self.local_prefill_reason})"))
        return "\n".join(lines)
