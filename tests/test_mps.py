"""`tandem up --mps` (cli/mps.py MpsDaemon, cli/cluster.py): the control daemon's start and stop
calls and the workers' environments. The machines CI runs on have no GPU and no MPS, so a
stand-in `nvidia-cuda-mps-control` on PATH records how it was called (a unit test of one class);
the GPU figures are in docs/benchmarks.md (run 12)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli import mps
from cli.cluster import LocalCluster
from cli.mps import MpsDaemon, MpsError

STAND_IN = """#!{python}
import json, os, sys, time
args = sys.argv[1:]
stdin = "" if args else sys.stdin.read()
with open({calls!r}, "a") as f:
    f.write(json.dumps({{"args": args, "stdin": stdin,
                        "pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
                        "log": os.environ.get("CUDA_MPS_LOG_DIRECTORY"),
                        "percent": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")}}) + "\\n")
mode = {mode!r}
if args == ["-d"] and mode == "hang-start" or not args and mode == "hang-quit":
    time.sleep(60)
if args == ["-d"] and mode != "no-socket":
    open(os.path.join(os.environ["CUDA_MPS_PIPE_DIRECTORY"], "control"), "w").close()  # the daemon's socket
sys.exit({code})
"""


def stand_in(tmp_path: Path, monkeypatch, code: int = 0, mode: str = "ok") -> Path:
    """Put a recording nvidia-cuda-mps-control first on PATH; returns the file of its calls.
    mode: ok, hang-start (-d never returns), no-socket (-d returns 0, no daemon appears),
    hang-quit (quit never returns)."""
    bindir, calls = tmp_path / "bin", tmp_path / "calls.jsonl"
    bindir.mkdir(exist_ok=True)
    exe = bindir / "nvidia-cuda-mps-control"
    exe.write_text(STAND_IN.format(python=sys.executable, calls=str(calls), code=code, mode=mode))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return calls


def read_calls(calls: Path) -> list[dict]:
    return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def test_daemon_starts_in_its_own_folders_and_quits_once(tmp_path, monkeypatch):
    calls = stand_in(tmp_path, monkeypatch)
    d = MpsDaemon(tmp_path / "mps")
    d.start()
    assert (tmp_path / "mps" / "pipe").is_dir() and (tmp_path / "mps" / "log").is_dir()
    d.stop()
    d.stop()  # idempotent: a second stop sends nothing
    got = read_calls(calls)
    assert [c["args"] for c in got] == [["-d"], []]
    assert got[1]["stdin"] == "quit\n"
    assert {c["pipe"] for c in got} == {str(tmp_path / "mps" / "pipe")}  # never the machine-wide default
    assert {c["log"] for c in got} == {str(tmp_path / "mps" / "log")}


def test_a_hung_or_absent_daemon_is_a_one_line_error_and_nothing_is_left(tmp_path, monkeypatch):
    monkeypatch.setattr(mps, "START_TIMEOUT_S", 1.0)
    stand_in(tmp_path, monkeypatch, mode="hang-start")
    t0 = time.monotonic()
    with pytest.raises(MpsError, match=r"-d did not return in 1 s") as err:
        MpsDaemon(tmp_path / "a").start()
    assert time.monotonic() - t0 < 5 and "\n" not in str(err.value)
    calls = stand_in(tmp_path, monkeypatch, mode="no-socket")  # -d says 0, but no daemon comes up
    d = MpsDaemon(tmp_path / "b")
    with pytest.raises(MpsError, match="made no control socket"):
        d.start()
    assert not d.running
    assert [c["args"] for c in read_calls(calls)][-1] == []  # it was asked to quit all the same


def test_a_daemon_that_does_not_quit_gets_sigterm(tmp_path, monkeypatch):
    monkeypatch.setattr(mps, "QUIT_TIMEOUT_S", 1.0)
    stand_in(tmp_path, monkeypatch, mode="hang-quit")
    d = MpsDaemon(tmp_path / "mps")
    d.start()
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # stands for the daemon
    try:
        (d.pipe / "nvidia-cuda-mps-control.pid").write_text(f"{daemon.pid}\n")
        t0 = time.monotonic()
        d.stop()
        assert daemon.wait(5) != 0 and time.monotonic() - t0 < 5
        assert not d.running
    finally:
        daemon.kill()


def test_a_long_log_folder_puts_the_pipe_under_tmp(tmp_path, monkeypatch):
    calls = stand_in(tmp_path, monkeypatch)
    deep = tmp_path / ("x" * 60) / ("y" * 40)
    d = MpsDaemon(deep)
    assert len(str(d.pipe / "control_privileged")) <= 107 and str(d.pipe).startswith("/tmp/tandem-mps-")
    d.start()
    assert (d.pipe / "control").exists() and (deep / "log").is_dir()
    d.stop()
    assert not d.pipe.exists()  # its own short folder goes with it
    assert {c["pipe"] for c in read_calls(calls)} == {str(d.pipe)}


def test_client_environment_and_the_sm_cap():
    d = MpsDaemon("/x/mps")
    assert d.env() == {"CUDA_MPS_PIPE_DIRECTORY": "/x/mps/pipe", "CUDA_MPS_LOG_DIRECTORY": "/x/mps/log"}
    assert d.env(100) == d.env()  # 100 % is no cap
    assert d.env(40)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert d.env(below_normal=True)["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert "CUDA_MPS_CLIENT_PRIORITY" not in d.env(40)


def test_missing_or_failing_control_binary_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    with pytest.raises(MpsError, match="--mps: nvidia-cuda-mps-control is not on PATH"):
        MpsDaemon(tmp_path / "a").start()
    stand_in(tmp_path, monkeypatch, code=3)
    d = MpsDaemon(tmp_path / "b")
    with pytest.raises(MpsError, match="exited 3"):
        d.start()
    assert not d.running


def test_cluster_gives_workers_the_daemon_and_caps_prefill_only(tmp_path, monkeypatch):
    calls = stand_in(tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "20")  # the caller's own: not the cluster's
    monkeypatch.setenv("CUDA_MPS_CLIENT_PRIORITY", "1")
    envs: dict[str, dict[str, str]] = {}

    class FakePopen:  # records each child's environment instead of starting it
        def __init__(self, cmd, **kwargs) -> None:
            envs[cmd[3]] = kwargs["env"]

    c = LocalCluster(log_dir=str(tmp_path / "logs"), etcd="127.0.0.1:1", mps=True, mps_prefill_percent=30)
    c.mps.start()  # the stand-in runs through the real subprocess.run
    real_popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    for role in ("router", "prefill", "decode"):
        c.spawn(role, role)
    monkeypatch.setattr(subprocess, "Popen", real_popen)
    pipe = str(tmp_path / "logs" / "mps" / "pipe")
    assert envs["prefill"]["CUDA_MPS_PIPE_DIRECTORY"] == envs["decode"]["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    assert envs["prefill"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in envs["decode"]
    assert envs["prefill"]["CUDA_MPS_CLIENT_PRIORITY"] == "1"  # --mps-prefill-priority below, the default
    assert "CUDA_MPS_CLIENT_PRIORITY" not in envs["decode"]  # the decode steps stay normal
    assert "CUDA_MPS_PIPE_DIRECTORY" not in envs["router"]  # the router opens no CUDA context
    c.procs.clear()  # nothing real was started
    asyncio.run(c.stop())
    got = read_calls(calls)
    assert [x["args"] for x in got] == [["-d"], []]  # started once, quit with the cluster
    assert {x["percent"] for x in got} == {None}  # nor does the daemon get the caller's cap as its default
    with pytest.raises(ValueError, match="--mps-prefill-percent must be between 1 and 100"):
        LocalCluster(log_dir=str(tmp_path), mps=True, mps_prefill_percent=0)
    with pytest.raises(ValueError, match="give --mps too"):
        LocalCluster(log_dir=str(tmp_path), mps_prefill_percent=50)
    # not given: half the SMs under MPS (the measured default); without MPS the cluster sets no
    # cap (the caller's own variable passes through untouched)
    assert LocalCluster(log_dir=str(tmp_path), mps=True).mps_prefill_percent == 50
    plain = LocalCluster(log_dir=str(tmp_path / "p"), etcd="127.0.0.1:1")
    plain.log_dir.mkdir(parents=True)  # start() makes it
    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    plain.spawn("prefill", "prefill")
    monkeypatch.setattr(subprocess, "Popen", real_popen)
    plain.procs.clear()
    assert envs["prefill"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20" and "CUDA_MPS_PIPE_DIRECTORY" not in envs["prefill"]
    with pytest.raises(ValueError, match="--mocker runs simulated workers"):
        LocalCluster(log_dir=str(tmp_path), mps=True, num_mocker=2)
    with pytest.raises(ValueError, match="'below' or 'normal', got 'low'"):
        LocalCluster(log_dir=str(tmp_path), mps=True, mps_prefill_priority="low")
    with pytest.raises(ValueError, match="priority under MPS: give --mps too"):
        LocalCluster(log_dir=str(tmp_path), mps_prefill_priority="normal")
    normal = LocalCluster(log_dir=str(tmp_path / "n"), mps=True, mps_prefill_priority="normal")
    assert not normal.mps_prefill_below_normal


def test_tandem_up_mps_without_the_daemon_fails_before_starting_anything(tmp_path):
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}  # python, but no MPS control binary
    r = subprocess.run([sys.executable, "-m", "cli.main", "up", "--mps", "--insecure", "--http-port", "-1",
                        "--port", "0"], cwd=Path(__file__).resolve().parent.parent, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--mps: nvidia-cuda-mps-control is not on PATH" in r.stderr + r.stdout
    assert "Traceback" not in r.stderr


def test_tandem_up_refuses_a_prefill_cap_without_mps(tmp_path):
    env = {**os.environ, "TANDEM_MPS_PREFILL_PERCENT": "30"}  # the variable, as the flag would
    r = subprocess.run([sys.executable, "-m", "cli.main", "up", "--insecure", "--http-port", "-1", "--port", "0"],
                       cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--mps-prefill-percent caps the prefill worker under MPS: give --mps too" in r.stderr + r.stdout
    assert "Traceback" not in r.stderr
