"""router/load.py LoadTracker: the placement's view as arrays (`views`, by worker slot) equals the
formula of its docstring after any sequence of starts, first tokens, growth, finishes, reports
and forgets: max(own count, last report + this router's changes since), the own count for a
worker that never reported or was forgotten; and `inflight_prefixes` equals `inflight_prefix`
of every worker."""

from __future__ import annotations

import random

import numpy as np
import pytest

from router.load import LoadTracker

BS = 16
ROWS = ("in_flight", "active_blocks", "prefill_tokens")


def _expected(load: LoadTracker, at_report: dict[str, tuple[int, int, int]], w: str) -> list[float]:
    own = [getattr(load, row).get(w, 0) for row in ROWS]
    if w not in load.reported:
        return [float(x) for x in own]
    # the changes since the report are exactly the own counts' changes since then
    return [float(max(o, r + (o - o0))) for o, r, o0 in zip(own, load.reported[w], at_report[w])]


@pytest.mark.parametrize("seed", range(6))
def test_views_follow_the_formula_through_random_operations(seed):
    rng = random.Random(seed)
    load = LoadTracker(BS)
    decodes = [f"d{i}" for i in range(90)]  # more than the arrays' first 64 slots
    prefills = [f"p{i}" for i in range(30)]
    prefixes = [[rng.randrange(1 << 60) for _ in range(6)] for _ in range(12)]  # shared prompt blocks
    live, at_report = [], {}
    for step in range(3000):
        op = rng.random()
        if op < 0.3:
            p = rng.choice(prefills) if rng.random() < 0.6 else None
            hashes = rng.choice(prefixes)[: rng.randrange(7)]
            live.append(load.start(rng.choice(decodes), p, 16 * len(hashes) + rng.randrange(16),
                                   rng.randrange(200), hashes, local_prefill=p is None and rng.random() < 0.5))
        elif op < 0.45 and live:
            load.prefill_finished(rng.choice(live))
        elif op < 0.6 and live:
            before = rng.randrange(100)
            load.grow(rng.choice(live), before, before + rng.randrange(40))
        elif op < 0.75 and live:
            r = live.pop(rng.randrange(len(live)))
            load.finish(r)
            load.finish(r)  # released exactly once
        elif op < 0.9:
            w = rng.choice(decodes + prefills + [f"reports-only{rng.randrange(50)}"])
            load.report(w, rng.randrange(5), rng.randrange(50), rng.randrange(500))
            at_report[w] = tuple(getattr(load, row).get(w, 0) for row in ROWS)
        else:
            load.forget(rng.choice(decodes + prefills + ["never-seen"]))
        if step % 50 == 0 or step == 2999:
            ws = rng.sample(decodes + prefills, 40) + ["never-seen"]
            want = np.array([_expected(load, at_report, w) for w in ws]).T
            assert np.array_equal(load.views(load.slots(ws)), want)
            assert [load.requests(w) for w in ws] == list(want[0])
            assert [load.active(w) for w in ws] == list(want[1])
            assert [load.queued_tokens(w) for w in ws] == list(want[2])
            assert np.array_equal(load.own_requests(load.slots(ws)), [float(load.in_flight.get(w, 0)) for w in ws])
            hashes = rng.choice(prefixes)
            every = {w: n for w in decodes + prefills if (n := load.inflight_prefix(w, hashes))}
            assert load.inflight_prefixes(hashes) == every
    for r in live:
        load.finish(r)
    assert load._holders == {} and all(not refs for refs in load._refs.values())
