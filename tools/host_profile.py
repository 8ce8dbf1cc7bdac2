"""Where a worker process spends its host time: a summary of py-spy's raw stacks.

`py-spy record --threads --nonblocking -f raw -r RATE -d SECONDS -p PID -o FILE` writes one line
per distinct stack, "thread (TID): NAME;frame;frame;... COUNT", frames as "function (file:line)".
This script reads such a file and reports, per thread, the samples whose stack was not idle, and,
for each function, the samples in which it was on the stack (inclusive; a function counted once
per sample however deep it recurs), in milliseconds per decode step when --steps is given
(samples × 1000 / RATE / steps). py-spy counts a thread waiting for the GIL as busy in the frame
that waits, so under contention every torch call that releases and re-takes the GIL looks
longer than its own work, and an event loop waiting in `select` (epoll) may show as busy there:
the figures say where the thread is, not what each line costs alone.

    py-spy record --threads --nonblocking -f raw -r 1000 -d 5 -o spy.txt -p PID
    python tools/host_profile.py spy.txt --rate 1000 --steps 906 --top 30 [--json out.json]

(PID: the decode worker's, e.g. `pgrep -f "cli.main decode"`; --steps: the difference of its
`tandem_worker_decode_steps_total` on /metrics read just before and just after the recording.
py-spy needs ptrace rights on the process: root, or in a container `--cap-add SYS_PTRACE`.)

`tools/bench_serving_gpu.py --profile-decode-host SECONDS` records and summarises the decode
worker this way during the first bench of its run (`Recording`; py-spy must be on PATH).
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable


def _function(frame: str) -> str:
    """"name (path/file.py:12)" -> "name (file.py)"; other frames as they are."""
    name, sep, where = frame.partition(" (")
    if not sep:
        return frame
    return f"{name} ({where.rsplit(':', 1)[0].rsplit('/', 1)[-1]})"


def summarise(text: str, rate_hz: float, steps: int | None = None, top: int = 40) -> dict[str, Any]:
    """py-spy raw text -> {"samples", "rate_hz", "steps", "threads": {name: {"samples",
    "ms_per_step", "functions": [[function, samples, ms_per_step], ...]}}}: per thread (named
    without its id where py-spy knows its name; busiest first) its non-idle samples and its `top`
    functions by inclusive samples, leaving out those on every one of the thread's samples;
    ms_per_step is None without `steps`.

    Raises:
        ValueError: a line that is not "stack count", or rate_hz <= 0.
    """
    if rate_hz <= 0:
        raise ValueError(f"rate must be > 0 samples/s, got {rate_hz}")
    threads: collections.Counter[str] = collections.Counter()
    functions: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total = 0
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            raise ValueError(f"line {n}: not py-spy raw output (\"STACK COUNT\"): {line[:80]!r}")
        samples = int(count)
        frames = stack.split(";")
        head = frames[0]  # "thread (TID): NAME", or "thread (TID)" for a thread py-spy has no name for
        thread = head.split(": ", 1)[1] if ": " in head else head
        total += samples
        threads[thread] += samples
        for name in {_function(f) for f in frames[1:]}:
            functions[thread][name] += samples

    def per_step(s: int) -> float | None:
        return round(1e3 * s / rate_hz / steps, 4) if steps else None

    # a function on the stack of every sample of its thread (the thread's entry and its loop's
    # wrappers) says nothing the thread's own total does not: left out
    return {"samples": total, "rate_hz": rate_hz, "steps": steps,
            "threads": {t: {"samples": s, "ms_per_step": per_step(s),
                            "functions": [[f, n, per_step(n)] for f, n in
                                          [(f, n) for f, n in functions[t].most_common() if n < s][:top]]}
                        for t, s in threads.most_common()}}


def child_pid(ancestor: int, command: str) -> int:
    """The pid of a descendant of `ancestor` whose command line is `... -m cli.main COMMAND ...`
    (a `tandem COMMAND` process that `tandem up` started).

    Raises:
        RuntimeError: none found (Linux /proc only)."""
    def parent(pid: int) -> int:
        try:  # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after ")"
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "cli.main" in argv and argv[argv.index("cli.main") + 1:argv.index("cli.main") + 2] == [command]:
            pid = int(entry.name)
            while pid > 1:
                pid = parent(pid)
                if pid == ancestor:
                    return int(entry.name)
    raise RuntimeError(f"no `tandem {command}` process under pid {ancestor}")


RATE_HZ = 1000  # py-spy samples per second of a Recording


class Recording:
    """py-spy recording the `tandem COMMAND` process under `ancestor` for at most `seconds`,
    started now; `result()`, called once the work to profile ended, stops it if it still runs
    and summarises it per step of its own window: a thread reads `steps()` (the process's step
    counter, e.g. from its /metrics) once py-spy reports that it samples and again the moment
    it exits. `steps_before`: the counter read just before (used if py-spy never reports
    sampling). Files go to `work` (host_profile_COMMAND.txt, py-spy_COMMAND.log, so recordings of
two processes in one window keep apart). Never raises: a profile that
    could not be made is {"error": ...} in `result()`."""

    SAMPLING = "Sampling process"  # py-spy's line (on stdout) once it samples

    def __init__(self, ancestor: int, command: str, seconds: int, work: Path, steps: Callable[[], float],
                 steps_before: float) -> None:
        self.seconds, self.raw, self.log = seconds, work / f"host_profile_{command}.txt", work / f"py-spy_{command}.log"
        self._before, self._after, self._failed = steps_before, None, ""
        self._proc: subprocess.Popen | None = None
        self.raw.unlink(missing_ok=True)  # an earlier recording's is not this one's
        try:
            pid = child_pid(ancestor, command)
            with open(self.log, "w") as log:
                self._proc = subprocess.Popen(["py-spy", "record", "--nonblocking", "--threads", "-r", str(RATE_HZ),
                                               "-d", str(seconds), "-f", "raw", "-o", str(self.raw), "-p", str(pid)],
                                              stdout=log, stderr=subprocess.STDOUT)
        except (RuntimeError, OSError) as exc:
            self._failed = str(exc)
            return

        def window() -> None:
            try:
                deadline = time.time() + 10
                while self._proc.poll() is None and time.time() < deadline:
                    if self.SAMPLING in self.log.read_text(errors="replace"):
                        self._before = steps()
                        break
                    time.sleep(0.01)
                self._proc.wait()
                self._after = steps()
            except Exception as exc:  # noqa: BLE001 - reported in the result
                self._failed = f"reading the step counter: {type(exc).__name__}: {exc}"
        self._thread = threading.Thread(target=window, daemon=True)
        self._thread.start()

    def result(self) -> dict[str, Any]:
        """`summarise`'s dict with "steps" those of py-spy's window; {"error": ...} when no
        usable recording or counter came, and "warning" when the window held no sample or no step."""
        if self._proc is None:
            return {"error": self._failed}
        if self._proc.poll() is None:  # the work ended first: stop the recording here (py-spy writes
            self._proc.send_signal(signal.SIGINT)  # what it has on SIGINT), so the window is the work's
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._thread.join(timeout=60)
        if self._failed:
            return {"error": self._failed}
        if not self.raw.exists() or self._after is None:
            return {"error": "py-spy recorded nothing: " + self.log.read_text(errors="replace")[-500:]}
        steps = int(self._after - self._before)
        try:
            out = summarise(self.raw.read_text(errors="replace"), RATE_HZ, steps or None, 30)
        except ValueError as exc:  # a recording cut short (py-spy killed)
            return {"error": f"py-spy's output: {exc}"}
        if not out["samples"] or not steps:
            out["warning"] = (f"{out['samples']} samples and {steps} steps in the {self.seconds} s window: "
                              "the window missed the work (make it longer)")
        return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", type=Path, help="py-spy raw output (-f raw)")
    p.add_argument("--rate", type=float, required=True, help="the recording's -r (samples per second)")
    p.add_argument("--steps", type=int, default=None,
                   help="decode steps in the recording's window, for ms per step: the difference of the decode "
                   "worker's tandem_worker_decode_steps_total on its /metrics read just before and just after")
    p.add_argument("--top", type=int, default=40, help="functions listed per thread")
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be >= 1 (leave it out for samples only), got {args.steps}")
    try:
        out = summarise(args.raw.read_text(), args.rate, args.steps, args.top)
    except (OSError, ValueError) as exc:
        p.error(f"{args.raw}: {exc}")
    if not out["samples"]:
        print(f"{args.raw}: no samples (py-spy records only threads that are not idle: was the process busy "
              "during the recording?)", file=sys.stderr)
    for thread, t in out["threads"].items():
        print(f"thread {thread}: {t['samples']} samples" + ("" if t["ms_per_step"] is None else f", {t['ms_per_step']:.3f} ms/step"))
        for name, samples, ms in t["functions"]:
            print(f"  {samples:8d}  {'' if ms is None else f'{ms:7.3f} ms/step  '}{name}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
