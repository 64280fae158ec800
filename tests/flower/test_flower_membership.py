"""`fedproto.flower.membership`: nodes refused at join are recorded under their true reason in the
server's log, summary.json's ``left_out`` and clients.csv (not as unanswered, not as scored at
their initial weights); a node's bad array is named. Nodes are the real ClientApp in this process
(tests/flower/flower_helpers.py's :class:`LocalGrid`)."""

from __future__ import annotations

import csv
import json
import logging

import numpy as np
import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower

from flower_helpers import (  # noqa: E402  (the Flower tests' grid and node folders)
    LocalGrid,
    _own_config,
    flower_process,
    node_configs,
    write_node_folders,
)

from fedproto.flower.records import run_config  # noqa: E402
from fedproto.flower.server_app import FlowerEngine  # noqa: E402


@pytest.fixture(autouse=True)
def _flower_process(tmp_path, monkeypatch):
    """The ServerApp process's task identity and a node-state cache of this test's own
    (:func:`flower_helpers.flower_process`)."""
    yield from flower_process(tmp_path, monkeypatch)


def test_flower_nodes_refused_at_join_are_recorded_as_refused(tmp_path, caplog):
    folders = write_node_folders(tmp_path, labels=[(0, 1), (1, 2), (2, 3)])
    np.savez(folders[1] / "train.npz", x=np.zeros((4, 1, 8, 8), np.float32), y=np.array([1, 2, 12, 1]))
    x = np.zeros((4, 1, 8, 8), np.float32)
    x[2, 0, 3, 3] = np.nan
    np.savez(folders[2] / "train.npz", x=x, y=np.array([2, 3, 2, 3]))
    uc = _own_config(rounds=1)
    with caplog.at_level(logging.WARNING):
        eng = FlowerEngine(run_config(uc), LocalGrid(uc, node_configs=node_configs(folders)), out=tmp_path / "run",
                           wait_s=0)
        summary = eng.run()
    log = " ".join(r.getMessage() for r in caplog.records)
    why = {str(r["client_id"]): r["reason"] for r in json.loads((tmp_path / "run" / "config.json").read_text())
           ["refused"]}
    assert sorted(why) == ["1", "2"] and "label 12 is outside" in why["1"]
    # the bad array is named, with the sample, not only the file
    assert "train.npz': array 'x': 1 sample(s) hold NaN or infinite values (the first: sample 2)" in why["2"]
    left = {c: f"its node was refused at join: {why[c]}" for c in ("1", "2")}
    assert summary["left_out"] == left and summary["clients_in_accuracy"] == 1
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["left_out"] == left
    with open(tmp_path / "run" / "clients.csv") as f:
        rows = {r["client"]: r for r in csv.DictReader(f)}
    assert [rows[c]["left_out"] for c in ("0", "1", "2")] == ["", left["1"], left["2"]]
    # the log says why they are left out, and never that they are scored or did not answer
    assert "client 1 (its node was refused at join" in log and "client 2 (its node was refused at join" in log
    assert "scored at their initial weights" not in log and "did not answer the final evaluation" not in log
