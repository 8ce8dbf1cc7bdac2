"""tools/host_profile.py: py-spy raw stacks summarised per thread, inclusive per function."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import host_profile  # noqa: E402

RAW = """\
thread (11): MainThread;run (asyncio/runners.py:44);OverlapLoop.run (decode_worker/overlap.py:147) 30
thread (11): MainThread;run (asyncio/runners.py:44);_generate (decode_worker/service.py:390) 10
thread (12): model_0;step (engine/overlap_runner.py:80);launch (engine/overlap_runner.py:57);f (a.py:1);f (a.py:2) 40
thread (12): model_0;step (engine/overlap_runner.py:80);collect (engine/overlap_runner.py:84) 20
"""


def test_per_thread_inclusive_and_per_step() -> None:
    out = host_profile.summarise(RAW, rate_hz=1000, steps=10, top=10)
    assert out["samples"] == 100
    assert list(out["threads"]) == ["model_0", "MainThread"]  # busiest first
    model = out["threads"]["model_0"]
    assert model["samples"] == 60 and model["ms_per_step"] == 6.0  # 60 samples at 1 kHz over 10 steps
    funcs = {name: (n, ms) for name, n, ms in model["functions"]}
    assert "step (overlap_runner.py)" not in funcs  # on every sample of its thread: left out
    assert funcs["launch (overlap_runner.py)"] == (40, 4.0)
    assert funcs["f (a.py)"] == (40, 4.0)  # a function recursing in one sample counts once
    main = {name: n for name, n, _ in out["threads"]["MainThread"]["functions"]}
    assert main == {"OverlapLoop.run (overlap.py)": 30, "_generate (service.py)": 10}
    assert host_profile.summarise(RAW, rate_hz=1000)["threads"]["model_0"]["ms_per_step"] is None


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="line 1: not py-spy raw output"):
        host_profile.summarise("thread (1): x;y (a.py:1) many\n", rate_hz=100)
    with pytest.raises(ValueError, match="rate must be > 0"):
        host_profile.summarise(RAW, rate_hz=0)


def test_unnamed_thread_keeps_its_id_and_cli_errors_are_one_line(tmp_path, capsys) -> None:
    out = host_profile.summarise("thread (16585);f (a.py:1) 5\n", rate_hz=100)
    assert list(out["threads"]) == ["thread (16585)"]
    with pytest.raises(SystemExit):
        host_profile.main([str(tmp_path / "missing.txt"), "--rate", "100"])
    assert "missing.txt" in capsys.readouterr().err
    raw = tmp_path / "spy.txt"
    raw.write_text(RAW)
    with pytest.raises(SystemExit):
        host_profile.main([str(raw), "--rate", "100", "--steps", "0"])
    assert "--steps must be >= 1" in capsys.readouterr().err
    raw.write_text("")
    host_profile.main([str(raw), "--rate", "100"])
    assert "no samples" in capsys.readouterr().err


def test_recording_of_a_missing_process_is_an_error_not_an_exception(tmp_path) -> None:
    # `tandem up`'s pid with no `tandem decode` under it: the bench goes on, the row says why
    rec = host_profile.Recording(2**22 + 12345, "decode", 3, tmp_path, steps=lambda: 0.0, steps_before=0.0)
    assert rec.result() == {"error": f"no `tandem decode` process under pid {2**22 + 12345}"}
