"""Decode through the real serving path on one GPU, next to the same engine in-process,
transformers `generate` and the HBM bound, in one run (the GPU decode issue's measurement).

Usage (one H200; needs etcd on PATH and the project's packages importable):
    python tools/bench_serving_gpu.py --configs S --out docs/bench/serving_gpu.json
    python tools/bench_serving_gpu.py --configs S,M --contexts 1024,8192 --concurrency 1,8,64,256 ...
CPU smoke run of the script itself (tiny sizes): --smoke --device cpu
MTP on the trained checkpoint, served at batch 1 and 8, k = 0..3 (tokens/s per user, accept length):
    python tools/bench_serving_gpu.py --configs '' --mtp 0,1,2,3 --out docs/bench/serving_gpu_mtp.json

For each config (S = tools/bench_decode.py's ~490M model; M = a 16B-class DeepSeek-V2-Lite /
Moonlight-shaped MoE with V3 routing) it
1. writes seeded bf16 weights as a checkpoint folder (M's weights are drawn on the GPU: per
   tensor a generator seeded from (seed, name), as engine/model.py's init_weights does on the CPU);
2. starts `tandem up --model DIR --insecure` (loopback only, plaintext as in the earlier runs; etcd, router, one prefill and one decode worker, both on
   the GPU) and runs `tandem bench --dataset synthetic-prefix` for every context C (prompts of
   C tokens: C/2 shared by 8 groups, C/2 fresh) and concurrency c, `--output-tokens` each;
   served tok/s is the bench's output throughput (TTFT included), TPOT its mean;
3. stops the cluster and times the worker's own decode step in this process at batch c and
   context C (`bench_decode.bench_engine`: `ModelRunner.decode_step`, graphs);
4. transformers `generate` on the same folder (S, batch 1 and 64 at the first context);
5. the HBM bound: bytes read per step (weights touched + the batch's KV latents) ÷ --hbm-tbps;
6. exactness (S): 64 prompts × 64 greedy tokens through the worker's fast step against the
   plain path (per-sequence attention, per-expert loop) on the same bf16 weights: share of
   identical tokens, first-divergence positions, and the first step's logit error.
Rows (`rows` in the JSON): {"config", "context", "concurrency", "served_tok_s", "inprocess_tok_s",
"transformers_tok_s", "bound_tok_s", "tpot_ms", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_decode import bench_config, bench_engine, bench_hf, bytes_per_step  # noqa: E402
import host_profile  # noqa: E402
from cli.cluster import MPS_PREFILL_PERCENT  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.loader import load_checkpoint, save_checkpoint  # noqa: E402
from engine.model import DeepseekV3ForCausalLM, _param_seed, tied_aliases  # noqa: E402


def m_config() -> ModelConfig:
    """M: DeepSeek-V2-Lite / Moonlight shapes with V3 routing (~15.7B parameters)."""
    return dataclasses.replace(
        bench_config(False), hidden_size=2048, num_hidden_layers=27, first_k_dense_replace=1,
        intermediate_size=10944, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64,
        num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408, vocab_size=102400,
        n_group=1, topk_group=1, max_position_embeddings=16384)


def smoke_config() -> ModelConfig:
    return dataclasses.replace(bench_config(True), max_position_embeddings=4096)


@torch.no_grad()
def write_checkpoint(cfg: ModelConfig, directory: Path, device: torch.device, seed: int = 0) -> int:
    """Seeded weights (drawn on `device`, N(0, initializer_range), norms 1) saved as an HF folder.
    Returns the parameter count."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = DeepseekV3ForCausalLM(cfg, dtype=dtype, device=device)
    model.share_mtp_weights()
    tensors = model.state_dict(keep_vars=True)
    aliases = tied_aliases(cfg)
    for name, t in tensors.items():
        if name in aliases and t is tensors[aliases[name]]:
            continue
        if name.endswith("norm.weight"):
            t.fill_(1.0)
            continue
        g = torch.Generator(device=device).manual_seed(_param_seed(seed, name))
        t.copy_(torch.empty(t.shape, dtype=torch.float32, device=device).normal_(0.0, cfg.initializer_range,
                                                                                 generator=g))
    save_checkpoint(model, cfg, directory)
    n = sum(p.numel() for p in model.parameters())
    del model, tensors
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return n


UP_TIMEOUT_S = 600  # config M: two workers load 31 GB each, capture graphs and compile kernels


def _up_failure(what: str, work: Path) -> RuntimeError:
    """`what`, the end of tandem up's output and of every process log in the folder it named."""
    text = (work / "up.log").read_text()
    parts = [f"{what}: {text[-3000:]}"]
    for line in text.splitlines():
        if "logs in " in line:
            folder = Path(line.split("logs in ", 1)[1].split(";", 1)[0].strip())
            for f in sorted(folder.glob("*.log")) if folder.is_dir() else []:
                parts.append(f"--- {f.name}: " + f.read_text(errors="replace")[-2000:])
            break
    return RuntimeError("\n".join(parts))


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", *args]


def _metrics_urls(up_log: str) -> list[str]:
    """Every process's /metrics URL from `tandem up`'s "metrics: INSTANCE at URL" lines."""
    return [line.rsplit(" at ", 1)[1].strip() for line in up_log.splitlines()
            if line.strip().startswith("metrics: ") and " at http" in line]


SPEC_COUNTERS = ("tandem_worker_spec_verify_steps", "tandem_worker_spec_emitted_tokens")
# the decode loop's cadence counters (docs/observability.md): steps, rows, wall and device seconds
DECODE_COUNTERS = ("tandem_worker_decode_steps", "tandem_worker_decode_step_rows", "tandem_worker_decode_busy_steps",
                   "tandem_worker_decode_step_seconds", "tandem_worker_decode_device_busy_seconds",
                   "tandem_worker_decode_device_wait_seconds", "tandem_worker_decode_device_idle_seconds",
                   "tandem_worker_decode_row_seconds", "tandem_worker_decode_launches",
                   "tandem_worker_decode_busy_step_rows")


# the decode worker's garbage collections (all generations): its pages alone carry DECODE_ONLY
GC_COUNTERS = ("tandem_worker_gc_seconds", "tandem_worker_gc_collections")
DECODE_ONLY = "tandem_worker_prefill_channels"  # a gauge only decode workers export


# every worker's prefill forwards (prefill workers', and a decode worker's local ones)
PREFILL_COUNTERS = ("tandem_worker_prefill_device_seconds", "tandem_worker_prefill_forwards")


def _prefill_figures(before: dict[str, float], after: dict[str, float], summary: dict) -> dict[str, float | None]:
    """The prefill forwards' device time over one bench: `prefill_device_share` of the bench's
    duration (on one GPU shared by the workers, the share of the device the decode steps could
    not have) and `prefill_device_ms_per_request` (per completed request)."""
    seconds = after[PREFILL_COUNTERS[0]] - before[PREFILL_COUNTERS[0]]
    duration, done = summary.get("duration_s"), summary.get("completed")
    return {"prefill_device_share": seconds / duration if duration else None,
            "prefill_device_ms_per_request": 1e3 * seconds / done if done else None,
            "prefill_forwards": after[PREFILL_COUNTERS[1]] - before[PREFILL_COUNTERS[1]]}


def _worker_counters(urls: list[str], names: tuple[str, ...], attempts: int = 10,
                     only_with: str | None = None) -> dict[str, float]:
    """Counters `names` (without _total) so far, summed over the processes (only a decode
    worker counts these; `only_with`: only the pages that have that family). A worker whose
    loop does not answer a scrape in time leaves its families out of that page
    (common/metrics.py); such a page is read again, up to `attempts` times, rather than
    counted as zero. Raises RuntimeError if no page has names[0]."""
    import urllib.request
    got = dict.fromkeys(names, 0.0)
    seen = 0
    for url in urls:
        for _ in range(attempts):
            text = urllib.request.urlopen(url, timeout=10).read().decode()  # noqa: S310 - loopback
            if "tandem_worker_" not in text:
                break  # the router's page
            if names[0] not in text:
                time.sleep(0.5)  # a worker's scrape that skipped its counters: read it again
                continue
            if only_with is not None and only_with not in text:
                break  # another role's page
            for line in text.splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")  # counters: NAME_total
                if name in got:
                    got[name] += float(line.rsplit(" ", 1)[1])
                    seen += 1
            break
    if not seen:
        raise RuntimeError(f"no {names[0]} on any of {urls}")
    return got


def _decode_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """The decode worker's own view of one bench: its mean batch, the wall time between busy
    steps (the cadence), the device time of a step (CUDA events; 0 off the overlap loop) and the
    host's wait for the device per step (a device-bound loop waits; a host-bound one does not)."""
    d = {k.removeprefix("tandem_worker_decode_"): after[k] - before[k] for k in DECODE_COUNTERS}
    if not d["steps"]:
        return {"decode_mean_batch": None, "decode_cadence_ms": None, "decode_device_ms_per_step": None,
                "decode_host_wait_ms_per_step": None, "decode_device_idle_ms_per_step": None,
                "decode_row_weighted_ms": None, "decode_steps_per_launch": None}
    return {"decode_mean_batch": d["step_rows"] / d["steps"],
            # --decode-steps-per-launch at work: steps / model-thread calls (0 calls: not the overlap loop)
            "decode_steps_per_launch": d["steps"] / d["launches"] if d["launches"] else None,
            "decode_cadence_ms": 1e3 * d["step_seconds"] / d["busy_steps"] if d["busy_steps"] else None,
            "decode_device_ms_per_step": 1e3 * d["device_busy_seconds"] / d["steps"],
            "decode_host_wait_ms_per_step": 1e3 * d["device_wait_seconds"] / d["steps"],
            # the device's gaps between steps, waiting for the host (CUDA events), per step: every
            # collected step but the first after an idle loop adds its gap (those inside a launch
            # ~0), so the divisor is every step, as for the device time (busy_steps, the cadence's
            # divisor, leaves out the last launch's steps before each idle period)
            "decode_device_idle_ms_per_step": 1e3 * d["device_idle_seconds"] / d["steps"],
            # the time per token as a stream sees it, from the worker's side (compare the clients' TPOT)
            "decode_row_weighted_ms": 1e3 * d["row_seconds"] / d["busy_step_rows"] if d["busy_step_rows"] else None}


@contextlib.contextmanager
def running_cluster(model_dir: Path, port: int, work: Path, env: dict[str, str],
                    up_args: tuple[str, ...] = ()) -> Iterator[tuple[subprocess.Popen, list[str]]]:
    """`tandem up --model DIR --insecure --metrics` on `port` with `env` (plus `up_args`, e.g.
    ("--prefill", "0")), its output in work/up.log; yields (the up process, every process's
    /metrics URL) once it is healthy and ready, and stops it (SIGINT, then SIGKILL) on exit."""
    log = open(work / "up.log", "w")  # noqa: SIM115 - closed below
    # --http-port -1: the bench speaks gRPC; the router's default HTTP port 8000 would collide with
    # any other cluster on the machine (the --port option exists to avoid exactly that)
    up = subprocess.Popen(_cli("up", "--model", str(model_dir), "--port", str(port),
                               "--metrics", "--insecure", "--http-port", "-1", *up_args,
                               "--ready-timeout", str(UP_TIMEOUT_S)),
                          cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + UP_TIMEOUT_S + 30
        while subprocess.run(_cli("health", f"127.0.0.1:{port}"), cwd=ROOT, env=env,
                             capture_output=True).returncode != 0:
            if up.poll() is not None or time.time() > deadline:
                raise _up_failure("tandem up did not become healthy", work)
            time.sleep(2)
        # `tandem up` prints its metrics lines after the router answers health, and its "ready"
        # line after them: wait for that line rather than reading a half-written log
        while "tandem up: ready to serve" not in (work / "up.log").read_text():
            if up.poll() is not None or time.time() > deadline:
                raise _up_failure("tandem up did not print its ready line", work)
            time.sleep(0.5)
        time.sleep(3)  # both workers registered with the router
        metrics_urls = _metrics_urls((work / "up.log").read_text())
        if not metrics_urls:
            raise RuntimeError("tandem up printed no metrics URLs: " + (work / "up.log").read_text()[-3000:])
        yield up, metrics_urls
    finally:
        try:
            os.killpg(up.pid, signal.SIGINT)
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()


def decode_phases(requests: list[dict], window_s: float) -> dict[str, float | None]:
    """Where a request's TPOT goes, from the bench's per-request chunks (seconds after the
    start, tokens): `first_gap_ms` from the first token (the prefill's) to the next message,
    which holds the wait to join the decode batch plus `--stream-interval` steps;
    `steady_ms_per_token` from that message to the last, per token (the decode steps it was in);
    `decoding_mean` the mean number of requests past their first token over the bench window
    (what the worker's batch could be at most). Means over the requests with 3+ messages."""
    gaps, steady, decoding = [], [], 0.0
    for r in requests:
        ch = r.get("chunks") or []
        if r.get("error") or len(ch) < 3:
            continue
        gaps.append(ch[1][0] - ch[0][0])
        steady.append((ch[-1][0] - ch[1][0]) / sum(n for _, n in ch[2:]))
        decoding += ch[-1][0] - ch[0][0]
    if not gaps:
        return {"first_gap_ms": None, "steady_ms_per_token": None, "decoding_mean": None}
    return {"first_gap_ms": 1e3 * sum(gaps) / len(gaps), "steady_ms_per_token": 1e3 * sum(steady) / len(steady),
            "decoding_mean": decoding / window_s if window_s > 0 else None}


def serve_and_bench(model_dir: Path, contexts: list[int], concurrencies: list[int], output_tokens: int,
                    port: int, work: Path, env_extra: dict[str, str], runs: list[tuple[int, int]] | None = None,
                    prefix_len: Callable[[int, int], int] = lambda ctx, c: ctx // 2,
                    num_requests: Callable[[int, int], int] | None = None, dataset: str = "synthetic-prefix",
                    spec: bool = False, routers: int = 1, connections: int = 1,
                    after: Callable[[int], Any] | None = None, prefill_workers: int = 1,
                    up_extra: tuple[str, ...] = (), profile_s: int = 0,
                    bench_extra: tuple[str, ...] = ("--temperature", "0", "--top-logprobs", "0")
                    ) -> dict[tuple[int, int], dict]:
    """`tandem up` once, then `tandem bench` for every (context, concurrency) — the product of
    `contexts` and `concurrencies`, or the pairs `runs` — with prompts of `prefix_len(context, c)`
    tokens shared by 8 groups plus fresh ones, `num_requests(context, concurrency)` requests
    (default 2c for short contexts, c for long, at least 4); summaries.

    dataset: synthetic-prefix (prompts of `context` tokens) or a text dataset such as mt-bench
    (its own prompts; context is then only a label). spec: also scrape the decode worker's MTP
    counters around each bench, adding "accept_length" (emitted tokens / verify steps). Each
    summary also gets the decode worker's own figures of the bench (`_decode_figures`) and its
    wall-clock window (bench_window_s).
    routers: router processes on the one port (`tandem up --routers`); connections: the bench's
    gRPC connections (`tandem bench --connections`), which the kernel spreads over them; after:
    called with the port once the benches ran, cluster still up (its result: out["after"]);
    prefill_workers: `tandem up --prefill` (0: the decode worker prefills every prompt itself,
    on its own CUDA stream beside the decode steps: one process on the GPU instead of two);
    up_extra: more `tandem up` flags (e.g. ("--mps",)); profile_s > 0: py-spy records the
    decode worker, the router and the (first) prefill worker from the start of the first bench to
    its end (profile_s seconds at most), and that summary gets "host_profile" (the decode
    worker's), "router_host_profile" and "prefill_host_profile" (tools/host_profile.py
    `Recording`: per thread, functions in ms per decode step of that window, all per step of the
    decode worker: a run's first requests after a cold start show there what the prefill
    worker's threads did while their TTFT grew)."""
    env = {**os.environ, "TANDEM_MAX_RUNNING": str(max(concurrencies)),
           "TANDEM_MEM_FRACTION_STATIC": os.environ.get("TANDEM_MEM_FRACTION_STATIC", "0.4"), "TANDEM_MAX_QUEUED": "4096", **env_extra}
    out: dict[tuple[int, int], dict] = {}
    with running_cluster(model_dir, port, work, env, ("--routers", str(routers), "--prefill", str(prefill_workers),
                                                      *up_extra)) as (up, metrics_urls):
        for ctx, c in runs if runs is not None else [(x, y) for x in contexts for y in concurrencies]:
            if up.poll() is not None:
                raise RuntimeError("tandem up exited: " + (work / "up.log").read_text()[-3000:])
            n = (num_requests(ctx, c) if num_requests is not None
                 else max(4, 2 * c) if ctx <= 2048 else max(4, c))
            res = work / f"bench_{ctx}_{c}.json"
            shared = prefix_len(ctx, c)
            shape = (["--groups", "8", "--prefix-len", str(shared), "--suffix-len", str(ctx - shared)]
                     if dataset == "synthetic-prefix" else [])
            cmd = _cli("bench", "--router", f"127.0.0.1:{port}", "--dataset", dataset, *shape,
                       "--arrival", "concurrency", "--concurrency", str(c), "--num-requests", str(n),
                       "--output-tokens", str(output_tokens), "--bench-seed", str(ctx + c), "--out", str(res),
                       "--connections", str(connections), *bench_extra)
            t0 = time.time()
            spec0 = _worker_counters(metrics_urls, SPEC_COUNTERS) if spec else {}
            decode0 = _worker_counters(metrics_urls, DECODE_COUNTERS + PREFILL_COUNTERS)
            gc0 = _worker_counters(metrics_urls, GC_COUNTERS, only_with=DECODE_ONLY)
            spies = {}
            if profile_s > 0 and not out:  # the first bench only: the decode worker, the router, a prefill worker
                # its own name: the recordings' threads call the lambda after `steps` below is rebound
                counter = "tandem_worker_decode_steps"
                spies = {f"{role}_host_profile" if role != "decode" else "host_profile":
                         host_profile.Recording(up.pid, role, profile_s, work,
                                                lambda: _worker_counters(metrics_urls, DECODE_COUNTERS)[counter],
                                                decode0[counter])
                         for role in ("decode", "router", *(("prefill",) if prefill_workers else ()))}
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            doc = json.loads(res.read_text()) if res.exists() else {}
            summary = doc.get("summary", {})
            if summary.get("duration_s"):
                summary.update(decode_phases(doc.get("requests", []), summary["duration_s"]))
            decode1 = _worker_counters(metrics_urls, DECODE_COUNTERS + PREFILL_COUNTERS)
            summary.update(_decode_figures(decode0, decode1))
            gc1 = _worker_counters(metrics_urls, GC_COUNTERS, only_with=DECODE_ONLY)
            summary.update(_prefill_figures(decode0, decode1, summary))
            steps = decode1["tandem_worker_decode_steps"] - decode0["tandem_worker_decode_steps"]
            summary["decode_gc_collections"] = gc1[GC_COUNTERS[1]] - gc0[GC_COUNTERS[1]]
            summary["decode_gc_ms_per_step"] = (1e3 * (gc1[GC_COUNTERS[0]] - gc0[GC_COUNTERS[0]]) / steps
                                                        if steps else None)
            for key, spy in spies.items():
                summary[key] = spy.result()
                print(json.dumps({key: {k: v for k, v in summary[key].items()
                                        if k in ("error", "warning", "samples", "steps")},
                                  "threads_ms_per_step": {t: v["ms_per_step"] for t, v in
                                                          summary[key].get("threads", {}).items()}}),
                      flush=True)
            if spec:
                spec1 = _worker_counters(metrics_urls, SPEC_COUNTERS)
                steps, emitted = (spec1[n] - spec0[n] for n in SPEC_COUNTERS)
                summary["accept_length"] = emitted / steps if steps > 0 else None
            summary["bench_window_s"] = [t0, time.time()]  # wall clock: which spans belong to it (--trace)
            out[(ctx, c)] = summary
            print(json.dumps({"served": [ctx, c], "rc": r.returncode, "wall_s": round(time.time() - t0, 1),
                              "output_throughput": summary.get("output_throughput"),
                              "mean_tpot_ms": summary.get("mean_tpot_ms"),
                              "mean_ttft_ms": summary.get("mean_ttft_ms"),
                              "failed": summary.get("failed"),
                              **{k: summary.get(k) for k in ("first_gap_ms", "steady_ms_per_token", "decoding_mean")},
                              **{k: v for k, v in summary.items() if k.startswith("decode_")}}), flush=True)
            if r.returncode != 0:
                print(r.stdout[-2000:], r.stderr[-2000:], flush=True)
            for png in work.glob("*.png"):
                png.unlink()
        if after is not None:
            out["after"] = after(port)
    return out


def devices_config(prefill_device: str, folder: Path, error: Callable[[str], Any]) -> Path:
    """A config file for `tandem up --config` placing the prefill workers on `prefill_device`
    (the decode worker keeps --device auto: the first GPU), written in `folder`; `error` is
    called with a message when this machine has no such device."""
    if os.environ.get("TANDEM_DEVICE", prefill_device) != prefill_device:
        error(f"--prefill-device {prefill_device}: TANDEM_DEVICE={os.environ['TANDEM_DEVICE']} is set, and the "
              "environment outranks a config file: unset it")
    if os.environ.get("TANDEM_CONFIG"):
        error(f"--prefill-device {prefill_device}: TANDEM_CONFIG is set; the bench passes a config file of its own")
    try:
        dev = torch.device(prefill_device)
    except RuntimeError as exc:
        return error(f"--prefill-device {prefill_device}: {exc}")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        error(f"--prefill-device {prefill_device}: this machine has "
              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA device(s)")
    path = folder / "bench_serving_devices.toml"
    path.write_text(f'[prefill]\ndevice = "{prefill_device}"\n')
    return path


def greedy_outputs(port: int, texts: list[str], max_tokens: int) -> list[list[int]]:
    """The token ids of greedy completions of `texts`, one request at a time, through the
    router on `port` (plaintext)."""
    from cli.client import frontend_stub, generate

    async def run() -> list[list[int]]:
        ch, stub = frontend_stub(f"127.0.0.1:{port}")
        try:
            return [(await generate(stub, text=t, max_tokens=max_tokens)).token_ids for t in texts]
        finally:
            await ch.close()
    return asyncio.run(run())


TRAINED = ROOT / "engine" / "assets" / "tandem-shakespeare"  # the shipped trained checkpoint (MTP module)


def mtp_served(model_dir: Path, ks: list[int], concurrencies: list[int], output_tokens: int, port: int,
               env_extra: dict[str, str], compare: int = 16, top_logprobs: int = 0,
               profile_s: int = 0) -> list[dict[str, Any]]:
    """MTP k = ks served (`tandem up` per k, `--speculative-num-steps k` through its variable) at
    each concurrency on MT-Bench prompts, greedy: tokens/s per user (1000 / mean TPOT) and the
    decode worker's accept length; then `compare` MT-Bench prompts once more, one at a time,
    whose greedy tokens are compared with k = 0's (k = 0 first in `ks`): the share of
    identical outputs and tokens, and each first divergence. Rows: {"k", "concurrency",
    "tok_s_per_user", "tpot_ms", "output_tok_s", "accept_length", "speedup_vs_k0",
    "identical_outputs", "identical_tokens", "first_divergences"}. top_logprobs: the bench asks
    for each token's k alternatives too (MTP workers report them, computed after the step's
    graph replay). profile_s > 0: py-spy on the processes of each k's first bench, as
    `serve_and_bench` records them; the row gets their "host_profile" keys."""
    from bench.traces import MT_BENCH, load_mt_bench
    texts = [r.text for r in load_mt_bench(MT_BENCH, output_tokens, limit=compare)]
    rows: list[dict[str, Any]] = []
    outputs: dict[int, list[list[int]]] = {}
    for k in ks:
        with tempfile.TemporaryDirectory() as tmp:
            served = serve_and_bench(model_dir, [0], concurrencies, output_tokens, port, Path(tmp),
                                     {**env_extra, "TANDEM_SPECULATIVE_NUM_STEPS": str(k)},
                                     dataset="mt-bench", spec=True, profile_s=profile_s,
                                     bench_extra=("--temperature", "0", "--top-logprobs", str(top_logprobs)),
                                     after=lambda p: greedy_outputs(p, texts, output_tokens) if texts else [])
        outputs[k] = served.get("after", [])
        same = _same_outputs(outputs.get(0), outputs[k])
        for c in concurrencies:
            s = served.get((0, c), {})
            tpot = s.get("mean_tpot_ms")
            rows.append({"k": k, "concurrency": c, "tpot_ms": tpot, "tok_s_per_user": 1e3 / tpot if tpot else None,
                         "output_tok_s": s.get("output_throughput"),
                         "accept_length": s.get("accept_length") if k else 1.0, "failed": s.get("failed"), **same,
                         **{key: s[key] for key in s if key.endswith("host_profile")}})
    for r in rows:  # the served speed-up over k = 0 at the same concurrency
        base = next((b for b in rows if b["k"] == 0 and b["concurrency"] == r["concurrency"]), None)
        ok = base is not None and base["tok_s_per_user"] and r["tok_s_per_user"]
        r["speedup_vs_k0"] = r["tok_s_per_user"] / base["tok_s_per_user"] if ok else None
        print(json.dumps({"mtp": {key: v for key, v in r.items() if not key.endswith("host_profile")}}), flush=True)
    return rows


def _same_outputs(base: list[list[int]] | None, got: list[list[int]]) -> dict[str, Any]:
    """How far `got` agrees with `base` (k = 0's outputs of the same prompts): {} without base."""
    if not base or len(base) != len(got):
        return {}
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b),
                   None if len(x) == len(y) else min(len(x), len(y))) for x, y in zip(base, got)]
    tokens = sum(len(x) for x in base)
    same_tokens = sum(len(x) if f is None else f for x, f in zip(base, firsts))
    return {"identical_outputs": sum(f is None for f in firsts) / len(base),
            "identical_tokens": same_tokens / tokens if tokens else None,
            "first_divergences": [f for f in firsts if f is not None]}


@torch.inference_mode()
def exactness(model: torch.nn.Module, cfg: ModelConfig, device: torch.device, prompts: int = 64,
              new: int = 64, block_size: int = 16) -> dict[str, Any]:
    """Greedy tokens of the fast decode step (graphs) against the plain path, same bf16 weights."""
    from engine.kv_pool import KvPool, KvPoolConfig, PagedKvCache
    from engine.runner import DecodeInput, ModelRunner
    g = torch.Generator().manual_seed(0)
    lens = [int(x) for x in torch.randint(32, 200, (prompts,), generator=g)]
    toks = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    width = -(-(max(lens) + new + 1) // block_size)
    from engine.model import HOT, MLAttention, MoE
    results = {}
    grouped = {m: m.grouped for m in model.modules() if isinstance(m, MoE)}
    projections = {m: m.fused_a for m in model.modules() if isinstance(m, MLAttention)}
    fused = dict(vars(HOT))
    for mode in ("plain", "fast"):
        for m, gr in grouped.items():  # plain: the per-expert loop; fast: the fused MoE kernels
            m.grouped = None if mode == "plain" else gr
        for m, fa in projections.items():  # plain: q and kv_a as two GEMMs; fast: one
            m.fused_a = None if mode == "plain" else fa
        if mode == "plain":
            HOT.reset()  # plain: the uncompiled functions too
        else:
            vars(HOT).update(fused)
        pool = KvPool(KvPoolConfig(num_blocks=2 + prompts * width, block_size=block_size,
                                   num_layers=cfg.num_hidden_layers, kv_dim=cfg.kv_dim,
                                   dtype=model.dtype), 1, device)
        runner = ModelRunner(model, pool, fast=None if mode == "fast" else False)
        if mode == "fast" and runner.fast:
            runner.capture_graphs(prompts, max(lens) + new + 1)
        tables = [pool.blocks.allocate(width) for _ in range(prompts)]
        seqs = []
        for t, p in zip(tables, toks):  # prefill through the plain path in both modes
            ids = torch.tensor(p, device=device)
            hidden = model(ids, torch.arange(len(p), device=device), [len(p)], PagedKvCache(pool, [(t, 0, len(p))]))
            seqs.append(p + [int(model.logits(hidden[-1:]).argmax())])
        first = None
        for _ in range(new - 1):
            logits = runner.decode([DecodeInput(t, len(s) - 1, s[-1]) for t, s in zip(tables, seqs)])
            if first is None:
                first = logits.float().clone()
            for s, x in zip(seqs, logits.argmax(-1).tolist()):
                s.append(x)
        results[mode] = ([s[n:] for s, n in zip(seqs, lens)], first)
        del runner, pool
    for m, gr in grouped.items():
        m.grouped = gr
    (plain, lp), (fast, lf) = results["plain"], results["fast"]
    logit_err = float((lf - lp).norm() / lp.norm())
    same = sum(a == b for pa, pf in zip(plain, fast) for a, b in zip(pa, pf))
    diverge = [next((i for i, (a, b) in enumerate(zip(pa, pf)) if a != b), None) for pa, pf in zip(plain, fast)]
    return {"prompts": prompts, "new_tokens": new, "identical_token_share": same / (prompts * new),
            "identical_sequences": sum(d is None for d in diverge), "first_divergence": diverge,
            "first_step_logit_rel_err": logit_err,
            "first_step_argmax_agree": float((lf.argmax(-1) == lp.argmax(-1)).float().mean())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="S", help="comma list of S, M")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--concurrency", default="1,8,64,256")
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--hbm-tbps", type=float, default=4.8)
    p.add_argument("--device", default="cuda")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--skip-served", action="store_true")
    p.add_argument("--skip-exactness", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny model (a CPU check of the script)")
    p.add_argument("--mtp", default="", help="comma list of k: MTP k served on --mtp-model at --mtp-concurrency "
                   "(tokens/s per user, accept length); with --configs '' only this")
    p.add_argument("--mtp-model", default=str(TRAINED), help="checkpoint folder with an MTP module")
    p.add_argument("--mtp-concurrency", default="1,8")
    p.add_argument("--stream-interval", default="1", help="comma list: the decode worker's --stream-interval "
                   "(tokens per stream message); one `tandem up` each, a row per value")
    p.add_argument("--routers", type=int, default=1, help="router processes on one port (tandem up --routers)")
    p.add_argument("--prefill-workers", type=int, default=1, help="tandem up --prefill: prefill workers on the "
                   "GPU beside the decode worker (0: the decode worker prefills locally, one process on the GPU)")
    p.add_argument("--connections", type=int, default=1, help="the bench's gRPC connections (tandem bench "
                   "--connections; with --routers N > 1, use several so that every router gets some)")
    p.add_argument("--top-logprobs", type=int, default=0, help="tandem bench --top-logprobs: every generated "
                   "token's k alternatives too (the served cost of top log-probabilities; in-process figures are "
                   "greedy without them)")
    p.add_argument("--temperature", type=float, default=0.0, help="tandem bench --temperature (seeded per request)")
    p.add_argument("--mps", action="store_true", help="tandem up --mps: the workers' kernels run side by side "
                   "on the GPU under CUDA MPS (the in-process figures are taken without it)")
    p.add_argument("--mps-prefill-percent", type=int, default=None, help="with --mps: tandem up "
                   "--mps-prefill-percent (the prefill worker's share of the GPU's multiprocessors; "
                   f"default {MPS_PREFILL_PERCENT}, tandem up's)")
    p.add_argument("--mps-prefill-priority", choices=("below", "normal"), default="below",
                   help="with --mps: tandem up --mps-prefill-priority")
    p.add_argument("--profile-decode-host", type=int, default=0, metavar="SECONDS",
                   help="py-spy (on PATH; it needs ptrace rights on the processes) records the decode worker, "
                   "the router and the first prefill worker from the start of each cluster's first bench to its "
                   "end, for SECONDS at most; its row gets host_profile, router_host_profile and "
                   "prefill_host_profile: per thread, the functions on the stack in ms per decode step of that "
                   "window (tools/host_profile.py)")
    p.add_argument("--profile-dir", default="", metavar="DIR",
                   help="the workers' --profile-dir: each writes a torch.profiler trace of model calls --profile-calls "
                        "of its first bench (give one --concurrency) and a summary of its CUDA streams' gaps")
    p.add_argument("--profile-calls", default="50:20", metavar="SKIP:COUNT", help="the workers' --profile-calls")
    p.add_argument("--waves", type=float, default=0, help="requests per bench as a multiple of its concurrency "
                   "(1: every request arrives at once and, once all are prefilled, the decode steps run with no "
                   "prefill beside them); 0 = the default (2 × concurrency at contexts up to 2K, else 1 ×)")
    p.add_argument("--prefill-device", default="", metavar="DEVICE",
                   help="the prefill workers' device (e.g. cuda:1: prefill and decode on GPUs of their own, as "
                        "disaggregated serving deploys them; written into a config file for tandem up --config); "
                        "default: the same GPU as the decode worker")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.profile_decode_host > 0 and shutil.which("py-spy") is None:
        p.error("--profile-decode-host needs py-spy on PATH (pip install py-spy, or put the bin folder of the "
                "environment that has it on PATH)")
    if args.mps_prefill_percent is not None and not args.mps:
        p.error("--mps-prefill-percent caps the prefill worker under MPS: give --mps too")
    if args.mps and args.mps_prefill_percent is None:
        args.mps_prefill_percent = MPS_PREFILL_PERCENT
    up_extra = ("--mps", "--mps-prefill-percent", str(args.mps_prefill_percent),
                "--mps-prefill-priority", args.mps_prefill_priority) if args.mps else ()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this machine has no CUDA device (torch {torch.__version__}); "
                "run on a GPU machine, or pass --device cpu (with --smoke for a quick check)")
    if args.prefill_device:
        up_extra += ("--config", str(devices_config(args.prefill_device, Path(tempfile.mkdtemp(prefix="bench-serving-")),
                                                      p.error)))
    contexts = [int(x) for x in args.contexts.split(",")]
    concs = [int(x) for x in args.concurrency.split(",")]
    doc: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args),
                           "rows": [], "exactness": {}, "params": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.mtp:
        mtp_env = {"TANDEM_NUM_BLOCKS": "4000"} if device.type != "cuda" else {}  # GPU: --mem-fraction-static
        doc["mtp"] = mtp_served(Path(args.mtp_model), [int(x) for x in args.mtp.split(",")],
                                [int(x) for x in args.mtp_concurrency.split(",")], args.output_tokens,
                                args.port, mtp_env, top_logprobs=args.top_logprobs,
                                profile_s=args.profile_decode_host)
        out.write_text(json.dumps(doc, indent=1) + "\n")
    for name in filter(None, args.configs.split(",")):
        cfg = smoke_config() if args.smoke else {"S": bench_config(False), "M": m_config()}[name]
        with tempfile.TemporaryDirectory() as tmp:
            work, model_dir = Path(tmp), Path(tmp) / "model"
            t0 = time.time()
            doc["params"][name] = write_checkpoint(cfg, model_dir, device)
            print(json.dumps({"config": name, "params": doc["params"][name], "checkpoint_s": time.time() - t0}),
                  flush=True)
            pool_env = {"TANDEM_NUM_BLOCKS": "4000"} if args.smoke else {}  # GPU: --mem-fraction-static
            if args.profile_dir:  # (read by both workers; each writes files of its own role and pid)
                pool_env.update(TANDEM_PROFILE_DIR=str(Path(args.profile_dir).resolve()),
                                TANDEM_PROFILE_CALLS=args.profile_calls)
            intervals = [int(x) for x in args.stream_interval.split(",")]
            served = {} if args.skip_served else {
                n: serve_and_bench(model_dir, contexts, concs, args.output_tokens, args.port, work,
                                   {**pool_env, "TANDEM_STREAM_INTERVAL": str(n)}, routers=args.routers,
                                   connections=args.connections, prefill_workers=args.prefill_workers,
                                   bench_extra=("--top-logprobs", str(args.top_logprobs),
                                                "--temperature", str(args.temperature)),
                                   up_extra=up_extra, profile_s=args.profile_decode_host,
                                   num_requests=(lambda ctx, c: max(1, round(args.waves * c))) if args.waves > 0 else None)
                for n in intervals}
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            model, _ = load_checkpoint(model_dir, dtype=dtype, device=device)
            elem = torch.empty((), dtype=dtype).element_size()
            hf_rates: dict[int, float] = {}
            for ctx in contexts:
                for c in concs:
                    try:
                        ip = bench_engine(model, cfg, device, dtype, c, ctx, 30 if ctx <= 2048 else 12, 16, True)
                    except torch.cuda.OutOfMemoryError as exc:
                        ip = {"tokens_per_s": 0.0, "ms_per_step": 0.0, "mode": f"OOM {exc}"[:80]}
                    bound_s = bytes_per_step(cfg, model, c, ctx, elem) / (args.hbm_tbps * 1e12)
                    for n in intervals:
                        s = served.get(n, {}).get((ctx, c), {})
                        row = {"config": name, "context": ctx, "concurrency": c, "stream_interval": n,
                               "served_tok_s": s.get("output_throughput"), "inprocess_tok_s": ip["tokens_per_s"],
                               "transformers_tok_s": None, "bound_tok_s": c / bound_s,
                               "tpot_ms": s.get("mean_tpot_ms"), "median_tpot_ms": s.get("median_tpot_ms"),
                               # the decode phase alone: concurrency / mean TPOT (output tok/s counts TTFT too)
                               "served_decode_tok_s": c * 1e3 / s["mean_tpot_ms"] if s.get("mean_tpot_ms") else None,
                               "mean_ttft_ms": s.get("mean_ttft_ms"), "inprocess_ms_per_step": ip["ms_per_step"],
                               "prefill_workers": args.prefill_workers, "mps": args.mps,
                               "top_logprobs": args.top_logprobs, "temperature": args.temperature,
                               "mps_prefill_percent": args.mps_prefill_percent if args.mps else None,
                               "mps_prefill_priority": args.mps_prefill_priority if args.mps else None,
                               **{k: s.get(k) for k in ("first_gap_ms", "steady_ms_per_token", "decoding_mean",
                                                        "prefill_device_share", "prefill_device_ms_per_request",
                                                        "prefill_forwards")},
                               "prefill_device": args.prefill_device or None,
                               "bound_ms_per_step": 1e3 * bound_s, "failed": s.get("failed"),
                               **{k: v for k, v in s.items() if k.startswith("decode_")},
                               **({k: s[k] for k in ("host_profile", "router_host_profile", "prefill_host_profile") if k in s})}
                        doc["rows"].append(row)
                        print(json.dumps({k: v for k, v in row.items() if not k.endswith("host_profile")}), flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            if not args.skip_exactness and name == "S":
                doc["exactness"][name] = exactness(model, cfg, device, prompts=8 if args.smoke else 64,
                                                   new=8 if args.smoke else 64)
                print(json.dumps({k: v for k, v in doc["exactness"][name].items() if k != "first_divergence"}),
                      flush=True)
            del model
            if not args.skip_transformers and name == "S":
                try:
                    import transformers
                    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).to(device)
                    for b in (1, 64):
                        hf_rates[b] = bench_hf(hf.eval(), cfg, device, b, contexts[0], 17)["tokens_per_s"]
                    del hf
                except Exception as exc:  # noqa: BLE001 - reported in the JSON, the rest still counts
                    doc["transformers_error"] = f"{type(exc).__name__}: {exc}"[:300]
                for row in doc["rows"]:
                    if row["config"] == name and row["context"] == contexts[0] and row["concurrency"] in hf_rates:
                        row["transformers_tok_s"] = hf_rates[row["concurrency"]]
            if device.type == "cuda":
                torch.cuda.empty_cache()
        out.write_text(json.dumps(doc, indent=1) + "\n")
    print("| config | context | concurrency | stream interval | served tok/s | served decode tok/s (c / TPOT) | "
          "in-process tok/s | served decode / in-process | worker's mean batch | transformers tok/s | bound tok/s | "
          "in-process/bound | TPOT ms | TTFT ms | prefill's device share |")
    for r in doc["rows"]:
        sv, sd, ip = r["served_tok_s"] or 0.0, r["served_decode_tok_s"] or 0.0, r["inprocess_tok_s"] or 0.0
        print(f"| {r['config']} | {r['context']} | {r['concurrency']} | {r['stream_interval']} | {sv:.0f} | {sd:.0f} | "
              f"{ip:.0f} | {sd / ip if ip else 0:.2f} | {r.get('decode_mean_batch') or 0:.1f} | "
              f"{'—' if r['transformers_tok_s'] is None else format(r['transformers_tok_s'], '.0f')} | {r['bound_tok_s']:.0f} | "
              f"{ip / r['bound_tok_s']:.2f} | {r['tpot_ms'] or 0:.2f} | {r['mean_ttft_ms'] or 0:.0f} | "
              f"{r.get('prefill_device_share') or 0:.2f} |")
    if doc.get("mtp"):
        print("| k | concurrency | tokens/s per user | × k = 0 | accept length | TPOT ms | identical outputs (tokens) vs k = 0 |")
        for r in doc["mtp"]:
            same = (f"{r['identical_outputs']:.0%} ({r['identical_tokens']:.1%})" if r.get("identical_outputs") is not None
                    else "—")
            print(f"| {r['k']} | {r['concurrency']} | {r['tok_s_per_user'] or 0:.1f} | {r['speedup_vs_k0'] or 0:.2f} | "
                  f"{r['accept_length'] or 0:.2f} | {r['tpot_ms'] or 0:.2f} | {same} |")
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()
