"""Round deadlines that follow the measured round times, and a deployment under a CPU hog."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower

from fedproto.flower.deadline import FACTOR, RoundDeadline  # noqa: E402


def test_the_round_deadline_is_the_floor_until_rounds_are_measured_then_three_medians():
    d = RoundDeadline(60.0)
    assert d.seconds() == 60.0  # nothing measured: round-timeout
    for s in (10.0, 30.0, 50.0):
        d.record(s)
    assert FACTOR == 3.0 and d.seconds() == 90.0  # 3 x median(10, 30, 50)
    d.record(400.0)  # one slow exchange moves the median to 40, not the deadline to 1200
    assert d.seconds() == 120.0
    d.record(-1.0)  # ignored
    assert d.measured == [10.0, 30.0, 50.0, 400.0]
    fast = RoundDeadline(60.0)
    fast.record(2.0)
    assert fast.seconds() == 60.0  # never below the floor
    with pytest.raises(ValueError, match="floor=0"):
        RoundDeadline(0)


@pytest.mark.slow
def test_rounds_survive_a_cpu_hog(tmp_path):
    """Three own-data SuperNodes under Flower's default isolation (a ClientApp process per
    message: the slow path) on 127.0.0.1, while busy processes (two per core) hog the CPU for the
    whole run: every round gets the replies of all three clients and the run finishes."""
    from flower_helpers import node_configs, write_node_folders

    from fedproto.deploy.local_federation import LocalFederation

    app = Path(__file__).resolve().parents[2] / "examples" / "flower" / "own_data"
    src = str(Path(__file__).resolve().parents[2] / "src")
    folders = write_node_folders(tmp_path / "data")
    out = tmp_path / "runs"
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        with LocalFederation(tmp_path / "fed", env={"PYTHONPATH": src}) as fed:
            fed.start_superlink()
            for nc in node_configs(folders):
                fed.start_supernode(nc)
            res = fed.flwr_run(app, {"rounds": 3, "out-dir": str(out), "seed": 7}, timeout=1500)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    logs = res.stdout + res.stderr
    summaries = list(out.glob("*/summary.json"))
    assert summaries, logs[-3000:]
    rows = [json.loads(x) for x in (summaries[0].parent / "metrics.jsonl").read_text().splitlines()]
    assert [r["replied"] for r in rows] == [[0, 1, 2]] * 3, rows
    assert json.loads(summaries[0].read_text())["clients_in_accuracy"] == 3


def test_the_join_wait_grows_with_the_measured_answers_and_keeps_wait_nodes_otherwise():
    """The join wait adapts as the round deadlines do (wait-nodes, or 3 x the median answer when that is longer),
    without the round deadline's floor (round-timeout): wait-nodes=10 stays 10 s while answers take 2 s."""
    from fedproto.flower.deadline import RoundDeadline

    d = RoundDeadline(60.0)
    assert d.adapted(10.0) == 10.0  # nothing measured: wait-nodes
    d.record(2.0)
    assert d.adapted(10.0) == 10.0 and d.seconds() == 60.0
    d.record(30.0)
    d.record(40.0)
    assert d.adapted(10.0) == 90.0  # 3 x the median (30 s): a loaded machine's nodes get the time they need
    assert d.adapted(120.0) == 120.0
