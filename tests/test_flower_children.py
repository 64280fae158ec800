"""fedproto.flower.children: no child of the warm executor outlives its executor, its run or a stop signal.

The drill: after the SuperLink was killed and restarted, the executor forked a child for the dead run's
message; the child was alive 8.5 minutes later, was re-parented to PID 1 when its executor got SIGTERM,
ignored SIGTERM itself (Flower's graceful exit hung, and Flower ignores a second signal) and kept retrying.
Here the children are real processes; the process table is read from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytestmark = [pytest.mark.flower,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table in /proc")]

SRC = str(Path(__file__).resolve().parents[1] / "src")


def alive(pid: int) -> bool:
    """``pid`` is a running process (not gone, not a zombie waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_gone(pid: int, within: float) -> float:
    """Seconds until ``pid`` is no longer alive; fails after ``within``."""
    t0 = time.monotonic()
    while alive(pid):
        assert time.monotonic() - t0 < within, f"process {pid} still alive after {within} s"
        time.sleep(0.05)
    return time.monotonic() - t0


# An executor stand-in: forks one child that does what the executor's child does first (bind_to_parent,
# start_watchdog), then hangs as the drill's child did: a SIGTERM handler that never returns (Flower's
# graceful exit stuck in a push) and a main loop that keeps going.
EXECUTOR = """
import os, sys, time, signal
from fedproto.flower.children import bind_to_parent, start_watchdog
out = sys.argv[1]
parent = os.getpid()
pid = os.fork()
if pid == 0:
    armed = bind_to_parent(parent)
    start_watchdog(parent=parent, stop_grace=0.5, tick=0.05, first_limit=600)
    signal.signal(signal.SIGTERM, lambda *a: time.sleep(1000))  # stuck in its graceful exit
    signal.signal(signal.SIGINT, lambda *a: None)  # and ignoring the next signal
    open(out + ".child", "w").write(f"{os.getpid()} {int(armed)}")
    while True:
        time.sleep(0.1)
while not os.path.exists(out + ".child"):
    time.sleep(0.01)
_, status = os.waitpid(pid, 0)
open(out + ".status", "w").write(str(os.waitstatus_to_exitcode(status)))
time.sleep(1000)
"""


def _start(tmp_path):
    out = tmp_path / "x"
    ex = subprocess.Popen([sys.executable, "-c", EXECUTOR, str(out)], env={**os.environ, "PYTHONPATH": SRC},
                          stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not (tmp_path / "x.child").is_file() or not (tmp_path / "x.child").read_text():
        assert time.monotonic() - t0 < 30 and ex.poll() is None, "the stand-in executor did not start its child"
        time.sleep(0.02)
    pid, armed = map(int, (tmp_path / "x.child").read_text().split())
    return ex, pid, armed


def test_a_child_whose_graceful_exit_hangs_ends_after_a_stop_signal(tmp_path):
    ex, child, armed = _start(tmp_path)
    try:
        assert armed == 1  # Linux: the parent-death signal is set
        os.kill(child, signal.SIGTERM)
        took = wait_gone(child, 10)
        assert 0.4 < took < 5  # its watchdog's stop_grace (0.5 s), not never
        t0 = time.monotonic()
        while not (tmp_path / "x.status").is_file():
            assert time.monotonic() - t0 < 10
            time.sleep(0.02)
        assert (tmp_path / "x.status").read_text() == str(128 + signal.SIGTERM)
    finally:
        ex.kill()
        ex.wait()
    assert not alive(child)


def test_no_child_outlives_its_executor(tmp_path):
    """SIGKILL of the executor: its child (which ignores SIGINT and hangs on SIGTERM) is gone within a second."""
    ex, child, _ = _start(tmp_path)
    try:
        assert alive(child)
        ex.kill()
        ex.wait()
        assert wait_gone(child, 5) < 2
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_stopped_executor_ends_its_children_and_kills_those_that_ignore_sigterm():
    from fedproto.flower.children import end_children

    obeys = subprocess.Popen(["sleep", "60"])
    ignores = subprocess.Popen(["sh", "-c", 'trap "" TERM; while :; do sleep 0.1; done'])
    time.sleep(0.2)  # the trap is set
    t0 = time.monotonic()
    end_children({obeys.pid, ignores.pid}, grace=0.5)
    took = time.monotonic() - t0
    assert not alive(obeys.pid) and not alive(ignores.pid)
    assert 0.4 < took < 5
