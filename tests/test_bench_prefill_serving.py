"""tools/bench_prefill_serving_gpu.py runs end to end on a CPU with a tiny model (checkpoint,
`tandem up`, `tandem bench`, in-process single and burst prefills), so the H200 run of the
script is known to work before it starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from harness import free_port

ROOT = Path(__file__).resolve().parent.parent


def test_bench_prefill_serving_script_smoke_on_cpu(tmp_path) -> None:
    out = tmp_path / "p.json"
    port = free_port()  # the router of the script's `tandem up` (see harness.free_port)
    r = subprocess.run([sys.executable, "tools/bench_prefill_serving_gpu.py", "--smoke", "--device", "cpu",
                        "--configs", "S", "--contexts", "96", "--concurrency", "4", "--concurrency-context", "96",
                        "--chunk-size", "32", "--max-prefill-tokens", "64", "--repeats", "1",
                        "--output-tokens", "2", "--port", str(port), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    single, burst = json.loads(out.read_text())["rows"]
    keys = {"config", "prompt_tokens", "concurrency", "served_ttft_ms", "inprocess_ttft_ms", "model_tflops",
            "share_of_peak"}
    assert keys <= single.keys() and keys <= burst.keys()
    assert (single["prompt_tokens"], single["concurrency"], burst["concurrency"]) == (96, 1, 4)
    assert single["served_ttft_ms"] > 0 and single["inprocess_ttft_ms"] > 0 and single["failed"] == 0
    assert 0 < single["share_of_peak"] < 1 and single["model_tflops"] > 0
    assert burst["served_ttft_p99_ms"] >= burst["served_ttft_p50_ms"] > 0 and burst["failed"] == 0
    assert burst["inprocess_ttft_ms"] > 0 and burst["ttft_vs_single"] > 0
    burst_line = next(line for line in r.stdout.splitlines() if line.startswith("| S | 96 | 4 |"))
    assert burst_line.endswith("| — | — |")  # no FLOP/s figure for a burst: a dash, not 0.0


def test_counted_flops_of_a_dense_layer_by_hand() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    import dataclasses

    from bench_prefill_serving_gpu import prefill_flops
    from engine.config import ModelConfig
    c = dataclasses.replace(ModelConfig.tiny(), num_hidden_layers=1, first_k_dense_replace=1, q_lora_rank=None)
    h, H = c.hidden_size, c.num_attention_heads
    per_token = (h * H * c.qk_head_dim + h * c.kv_dim + c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim)
                 + H * c.v_head_dim * h + 3 * h * c.intermediate_size)
    n = 10
    attention = 2 * (n * (n + 1) / 2) * H * (c.qk_head_dim + c.v_head_dim)
    assert prefill_flops(c, n) == 2 * n * per_token + 2 * h * c.vocab_size + attention
