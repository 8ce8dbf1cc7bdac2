"""bench/dynamo_table.py's own parts: the shared arrival file and the pooled-LRU bound."""

from __future__ import annotations

import json

from bench import dynamo_table, traces


def _req(i: int, ids: tuple[int, ...], tokens: int) -> traces.BenchRequest:
    return traces.BenchRequest(i, float(i), 1, hash_ids=ids, input_len=tokens)


def test_pooled_lru_counts_full_cached_blocks_and_evicts_least_recent():
    bs = dynamo_table.BLOCK
    reqs = [_req(0, (1, 2), 2 * bs + 10), _req(1, (1, 2, 3), 3 * bs), _req(2, (4, 5), 2 * bs),
            _req(3, (1, 2, 6), 3 * bs)]
    # Unbounded: request 1 reuses 1, 2; request 3 reuses 1, 2 (a fully cached prompt would recompute its last block).
    assert dynamo_table.pooled_lru_hit_rate(reqs, 100) == (2 * bs + 2 * bs) / (2 * bs + 10 + 3 * bs + 2 * bs + 3 * bs)
    # 3 blocks: request 2 evicts the two least recent, 3 and 2 (a prefix is touched after its
    # extension, so it outlives it): request 3 finds 1 only, its chain broken at 2.
    assert dynamo_table.pooled_lru_hit_rate(reqs, 3) == (2 * bs + bs) / (2 * bs + 10 + 3 * bs + 2 * bs + 3 * bs)
    assert dynamo_table.pooled_lru_hit_rate([_req(0, (7,), bs), _req(1, (7,), bs)], 10) == 0.0  # last block recomputed


def test_shared_arrivals_spread_each_step_into_whole_milliseconds(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": t, "input_length": 512, "output_length": 4, "hash_ids": [i]}
            for i, t in enumerate([0, 0, 0, 3000, 3000])]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = dynamo_table.shared_arrivals(trace, tmp_path / "a.jsonl")
    got = [json.loads(line) for line in out.read_text().splitlines()]
    stamps = [r["timestamp"] for r in got]
    assert stamps == sorted(stamps) and len(set(stamps)) == 5 and all(isinstance(s, int) for s in stamps)
    assert [r["hash_ids"] for r in got] == [r["hash_ids"] for r in rows]
    assert 0 <= stamps[2] < 3000 <= stamps[3]
