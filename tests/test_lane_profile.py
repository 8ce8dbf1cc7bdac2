"""worker/lane_profile.py: the stream summary's busy, idle and gap arithmetic, the --profile-calls
window on a model lane, and the files a window leaves (CPU: the trace holds host activity only)."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest
import torch

from worker.lane_profile import Activity, LaneProfile, parse_calls, stream_summary
from worker.model_lane import ModelLane


def test_parse_calls_names_the_flag():
    assert parse_calls("50:20") == (50, 20) and parse_calls("0:1") == (0, 1)
    for bad in ("20", "a:b", "-1:3", "3:0", "1:2:3"):
        with pytest.raises(ValueError, match="--profile-calls"):
            parse_calls(bad)


def test_stream_summary_counts_busy_idle_and_the_longest_gaps():
    acts = [Activity(7, 0, 10, "Memcpy HtoD (Pinned -> Device)", "memcpy"),
            Activity(7, 10, 50, "_mla_stage1", "kernel"),
            Activity(7, 80, 100, "_gate_up_kernel", "kernel"),  # 30 µs after the MLA kernel
            Activity(7, 90, 95, "nested", "kernel"),  # inside the one before: no gap, no double count
            Activity(7, 105, 110, "_down_kernel", "kernel"),  # 5 µs after
            Activity(9, 1000, 1001, "other stream", "kernel")]
    s = stream_summary(acts, top=1)
    seven = s["7"]
    assert (seven["span_us"], seven["busy_us"], seven["idle_us"], seven["activities"]) == (110, 75, 35, 5)
    assert seven["kernel_us"] == 70 and seven["memcpy_us"] == 10
    assert seven["gaps"] == [{"us": 30, "after": "_mla_stage1", "before": "_gate_up_kernel"}]
    assert s["9"]["idle_us"] == 0 and s["9"]["gaps"] == []


def test_a_lane_records_its_window_once_and_writes_trace_and_summary(tmp_path):
    lane = ModelLane("model")
    lane.profile = LaneProfile(str(tmp_path / "prof"), "2:3", "decode", "model")
    x = torch.randn(64, 64)

    async def calls(n: int) -> None:
        for _ in range(n):
            await lane.run(torch.mm, x, x)
    try:
        asyncio.run(calls(4))
        assert not (tmp_path / "prof").exists()  # calls 3..5 are the window: not closed yet
        asyncio.run(calls(6))
    finally:
        lane.shutdown()
    stem = lane.profile.stem
    assert lane.profile.written.wait(60)  # (written off the lane's thread)
    assert stem.startswith("decode-model-") and lane.profile.done
    summary = json.loads((tmp_path / "prof" / f"{stem}.summary.json").read_text())
    assert summary["calls"] == 3 and summary["first_call"] == 3 and summary["streams"] == {}  # no CUDA here
    trace = json.loads(gzip.decompress((tmp_path / "prof" / f"{stem}.trace.json.gz").read_bytes()))
    mms = [e for e in trace["traceEvents"] if e.get("name") == "aten::mm"]
    assert len(mms) == 3, len(mms)  # the window's three calls, not the others
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == [f"{stem}.summary.json", f"{stem}.trace.json.gz"]


def test_a_window_that_cannot_be_written_leaves_the_lane_serving(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    lane = ModelLane("model")
    lane.profile = LaneProfile(str(blocker / "sub"), "0:1", "prefill", "model")  # a folder under a file
    try:
        assert asyncio.run(lane.run(lambda: 41 + 1)) == 42
        assert asyncio.run(lane.run(lambda: 43)) == 43 and lane.profile.done
        assert lane.profile.written.wait(60) and not blocker.with_name("sub").exists()
    finally:
        lane.shutdown()


def test_a_profiler_that_will_not_start_leaves_the_call_running(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("CUPTI unavailable")
    monkeypatch.setattr(torch.profiler, "profile", refuse)
    lane = ModelLane("model")
    lane.profile = LaneProfile(str(tmp_path), "0:2", "decode", "model")
    try:
        assert [asyncio.run(lane.run(lambda i=i: i)) for i in range(3)] == [0, 1, 2]
        assert lane.profile.done and not any(tmp_path.iterdir())
    finally:
        lane.shutdown()


def test_check_directory_makes_it_or_names_the_flag(tmp_path):
    LaneProfile(str(tmp_path / "a" / "b"), "0:1", "decode", "model").check_directory()
    assert (tmp_path / "a" / "b").is_dir() and not any((tmp_path / "a" / "b").iterdir())  # (no probe left)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"--profile-dir .*file/sub: cannot write there"):
        LaneProfile(str(tmp_path / "file" / "sub"), "0:1", "decode", "model").check_directory()
