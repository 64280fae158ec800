"""`fedproto reproduce --jobs N` leaves no process behind when it exits: after a normal finish,
after SIGTERM to the command (as `kill`, `timeout` or a scheduler sends it), after Ctrl-C at a
terminal (SIGINT to the whole process group) and after SIGKILL of the command alone (its workers
get a parent-death signal). The command runs as a real subprocess, in a session of its own, and
the process table (/proc) is read for everything it started. About 20-50 s each (torch starts in
three processes); SIGINT and SIGKILL are marked slow.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table in /proc")

TINY = ["clients=4", "shots=20", "stdev=1", "test_shots=8", "model=projcnn:8-16,cnn"]


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks) of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def descendants(root: int) -> dict[int, int]:
    """Every process below ``root``: pid -> its start time (so a reused pid is not mistaken for it)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None:
            children.setdefault(st[1], []).append(int(d))
            starts[int(d)] = st[2]
    out, todo = {}, list(children.get(root, []))
    while todo:
        p = todo.pop()
        if p in starts:
            out[p] = starts[p]
            todo.extend(children.get(p, []))
    return out


def still_alive(procs: dict[int, int]) -> dict[int, str]:
    """Those of ``procs`` still running (a zombie has ended: it only waits to be reaped): pid -> command."""
    alive = {}
    for pid, start in procs.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[0] not in ("Z", "X"):
            alive[pid] = _cmdline(pid)
    return alive


def start_grid(out: Path, rounds: int) -> subprocess.Popen:
    """`fedproto reproduce --jobs 2` on a tiny grid of 4 digits cells, in a session of its own."""
    args = [sys.executable, "-m", "fedproto", "reproduce", "--grid", "hetero", "--datasets", "digits", "--methods",
            "local,fedproto", "--seeds", "1,2", "--rounds", str(rounds), "--threads", "2", "--jobs", "2",
            "--out", str(out)]
    for kv in TINY:
        args += ["--set", kv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(out.parent / f"{out.name}.log", "wb")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def log_of(out: Path) -> str:
    return (out.parent / f"{out.name}.log").read_text(errors="replace")[-3000:]


def wait_for_cells(proc: subprocess.Popen, out: Path, timeout: float = 240.0) -> dict[int, int]:
    """Wait until two cells run, each in a worker process; returns every process below the command then."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, f"the grid ended before it could be interrupted:\n{log_of(out)}"
        started = list((out / "runs").glob("*/config.json"))
        procs = descendants(proc.pid)
        workers = [p for p in procs if "multiprocessing" in _cmdline(p) and "resource_tracker" not in _cmdline(p)]
        if len(started) >= 2 and len(workers) >= 2:
            return procs
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"two cells did not start within {timeout:.0f} s:\n{log_of(out)}")


def assert_none_left(procs: dict[int, int], within: float = 10.0) -> None:
    t0 = time.monotonic()
    while (alive := still_alive(procs)) and time.monotonic() - t0 < within:
        time.sleep(0.2)
    assert not alive, f"processes left behind {within:.0f} s after the command ended: {alive}"


@pytest.mark.parametrize("how", ["sigterm", pytest.param("sigint-to-group", marks=pytest.mark.slow),
                                 pytest.param("sigkill", marks=pytest.mark.slow)])
def test_reproduce_jobs_leaves_no_process_behind(how, tmp_path):
    out = tmp_path / "grid"
    proc = start_grid(out, rounds=5000)  # cells far longer than the test: they are interrupted mid-run
    try:
        procs = wait_for_cells(proc, out)
        assert len(procs) >= 2  # the workers (and multiprocessing's resource tracker) are below the command
        t_signal = time.monotonic()
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        elif how == "sigint-to-group":  # Ctrl-C at a terminal: every process of the foreground group gets it
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.kill()
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the command was still running 60 s after the signal (waiting for its cells?):\n"
                        f"{log_of(out)}")
        ended_in = time.monotonic() - t_signal
        procs.update(descendants(proc.pid))  # (none: the command is gone; kept for a pid started late)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_of(out)
    if how == "sigkill":
        assert code == -signal.SIGKILL
    else:  # the command ends at once (it does not wait for the running cells) and says how to resume
        assert code == (143 if how == "sigterm" else 130), text  # 128 + the signal, as a shell reports it
        assert ended_in < 30, f"the command took {ended_in:.1f} s to end after the signal:\n{text}"
        assert "interrupted; the cells finished so far are in" in text, text
    assert_none_left(procs)


def test_reproduce_jobs_leaves_no_process_behind_after_a_normal_finish(tmp_path):
    out = tmp_path / "grid"
    proc = start_grid(out, rounds=1)
    seen: dict[int, int] = {}
    try:
        while proc.poll() is None:  # every process the command starts while it runs
            seen.update(descendants(proc.pid))
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.wait() == 0, log_of(out)
    assert "4 cells: 4 run, 0 skipped, 0 failed" in log_of(out)
    assert len(seen) >= 2, "the command should have started its 2 worker processes"
    assert_none_left(seen, within=5.0)
