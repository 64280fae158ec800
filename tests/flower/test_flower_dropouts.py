"""Nodes that stop answering during a run (the real ClientApp in this process, silenced or
marked gone by :class:`flower_helpers.LocalGrid`): a node that drops out is recorded as timed out
and takes part again when back, one the SuperLink knows is gone is recorded as unavailable (not
timed out), a round below ``min-replies`` is retried and then stops the run keeping the earlier
rounds, and a node gone at the final evaluation is counted out of the accuracy with the headline
saying "2 of 3" (summary.json's ``left_out``, clients.csv)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower

from flower_helpers import (  # noqa: E402  (the Flower tests' grid, configs and node folders)
    LocalGrid,
    _own_config,
    flower_process,
    node_configs,
    write_node_folders,
)

from fedproto.errors import TrainingError  # noqa: E402
from fedproto.flower.records import run_config  # noqa: E402
from fedproto.flower.server_app import FlowerEngine  # noqa: E402


@pytest.fixture(autouse=True)
def _flower_process(tmp_path, monkeypatch):
    """The ServerApp process's task identity and a node-state cache of this test's own
    (:func:`flower_helpers.flower_process`)."""
    yield from flower_process(tmp_path, monkeypatch)


def test_a_node_that_drops_out_is_recorded_and_takes_part_again_when_back(tmp_path):
    folders = write_node_folders(tmp_path)
    uc = _own_config(**{"rounds": 3})
    ncs = node_configs(folders)

    def script(grid, kind, group):  # node 1002 (client 2) is gone in round 2, back on a new node in round 3
        if kind == "train" and group == "2":
            grid.silent.add(1002)
        if kind == "train" and group == "3" and 1003 not in grid.contexts:
            pass

    grid = LocalGrid(uc, node_configs=ncs)
    grid.on_send = script
    eng = FlowerEngine(run_config(uc), grid, out=tmp_path / "run", timeout_s=1)
    orig = eng.executor.available

    def sample(r):
        if r == 3:
            grid.contexts.pop(1002)
            grid.add_node(1003, ncs[2])
        return orig(r)

    eng.executor.available = sample
    eng.run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["replied"] == [0, 1, 2] and rows[0]["timed_out"] == []
    assert rows[1]["sampled"] == [0, 1, 2] and rows[1]["replied"] == [0, 1] and rows[1]["timed_out"] == [2]
    assert rows[2]["replied"] == [0, 1, 2] and eng.nodes[2] == 1003
    # clients.csv counts the rounds a client trained and replied in, not those it was asked in
    trained = {r["client"]: r["rounds_trained"] for r in csv.DictReader(open(tmp_path / "run" / "clients.csv"))}
    assert trained == {"0": "3", "1": "3", "2": "2"}
    assert rows[1]["up_params"] == 2 / 3 * rows[0]["up_params"]


def test_an_unavailable_node_is_recorded_as_unavailable_not_timed_out(tmp_path, caplog):
    """The SuperLink answers at once for a node it knows is gone, with an error reply
    whose source is the SuperLink (node 0); matched by source node it would never be matched, and the
    round would record a timeout ("sent no reply within 90 s"). Matched by the message it answers."""
    folders = write_node_folders(tmp_path)
    uc = _own_config(**{"rounds": 2})
    grid = LocalGrid(uc, node_configs=node_configs(folders))

    def script(grid, kind, group):
        if kind == "train" and group == "2":
            grid.gone.add(1002)

    grid.on_send = script
    FlowerEngine(run_config(uc), grid, out=tmp_path / "run", timeout_s=1).run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["unavailable"] == {} and rows[0]["replied"] == [0, 1, 2]
    assert rows[1]["replied"] == [0, 1] and rows[1]["timed_out"] == [] and rows[1]["failed"] == {}
    assert rows[1]["unavailable"] == {"2": "Error: Node Unavailable (code 5)"}
    assert any("client 2 (node 1002) is unavailable" in r.getMessage() for r in caplog.records)
    assert not any("sent no reply" in r.getMessage() for r in caplog.records)


def test_below_min_replies_the_round_is_retried_then_the_run_stops_keeping_earlier_rounds(tmp_path, monkeypatch):
    from fedproto.flower import executor
    from fedproto.flower.records import FlowerOptions

    monkeypatch.setattr(executor, "RETRY_PAUSE_S", 0.0)
    folders = write_node_folders(tmp_path)
    uc = _own_config(**{"rounds": 3})
    grid = LocalGrid(uc, node_configs=node_configs(folders))

    def script(grid, kind, group):
        if kind == "train" and group == "2":
            grid.silent.update({1000, 1001})

    grid.on_send = script
    eng = FlowerEngine(run_config(uc), grid, out=tmp_path / "run", timeout_s=1,
                       options=FlowerOptions(min_replies=2, round_retries=1))
    with pytest.raises(TrainingError, match=r"round 2: 1 valid replies, fewer than min-replies=2, after 1 retries .*"
                                            r"rounds 1..1 are in .*metrics.jsonl"):
        eng.run()
    assert grid.sent.count("train") == 3 + 3 + 2  # round 1, round 2, its retry (the silent two)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1]


def test_a_node_gone_at_the_final_evaluation_is_counted_out(tmp_path):
    """Client 2's node stops answering from round 2 on: the summary says 2 of 3 clients were
    evaluated, and the mean is over those two."""
    folders = write_node_folders(tmp_path)
    uc = _own_config(**{"rounds": 2})
    grid = LocalGrid(uc, node_configs=node_configs(folders))

    def script(grid, kind, group):
        if group == "2":
            grid.silent.add(1002)

    grid.on_send = script
    summary = FlowerEngine(run_config(uc), grid, out=tmp_path / "run", timeout_s=1).run()
    assert summary["clients"] == 3 and summary["clients_evaluated"] == 2
    rows = list(csv.DictReader(open(tmp_path / "run" / "clients.csv")))
    accs = [float(r["acc"]) for r in rows if r["acc"]]
    assert len(accs) == 2 and summary["accuracy"]["acc"]["mean"] == pytest.approx(sum(accs) / 2)


def test_a_node_missing_the_final_evaluation_is_left_out_and_the_headline_says_so(tmp_path, caplog):
    """Client 1's node trains in both rounds and is gone when the final evaluation is asked for: it is in
    summary.json's ``left_out`` with why, the headline and the closing log line say "2 of 3", the mean is over
    the two that answered, and clients.csv and summary.json have the keys an intact run has."""
    from fedproto.engine.summary import over_clients

    folders = write_node_folders(tmp_path)
    uc = _own_config(**{"rounds": 2, "eval-every": 0})
    intact = FlowerEngine(run_config(uc), LocalGrid(uc, node_configs=node_configs(folders)),
                          out=tmp_path / "intact", timeout_s=1).run()
    grid = LocalGrid(uc, node_configs=node_configs(folders))

    def gone_at_the_end(grid, kind, group):
        if kind == "evaluate":
            grid.silent.add(1001)

    grid.on_send = gone_at_the_end
    with caplog.at_level("WARNING"):
        summary = FlowerEngine(run_config(uc), grid, out=tmp_path / "run", timeout_s=1).run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [sorted(r.get("replied", [0, 1, 2])) for r in rows] == [[0, 1, 2], [0, 1, 2]]  # it trained throughout
    assert summary["left_out"] == {"1": "not evaluated at the end: its node did not answer the final evaluation"}
    assert summary["clients"] == 3 and summary["clients_evaluated"] == 2 and summary["clients_in_accuracy"] == 2
    assert over_clients(summary) == "2 of 3" and over_clients(intact) == "3"
    clients = list(csv.DictReader(open(tmp_path / "run" / "clients.csv")))
    accs = [float(c["acc"]) for c in clients if c["acc"]]
    assert len(accs) == 2 and clients[1]["acc"] == "" and clients[1]["left_out"] == summary["left_out"]["1"]
    assert summary["accuracy"]["acc"]["mean"] == pytest.approx(np.mean(accs), abs=1e-12)
    assert "the accuracy is over 2 of 3 clients: it leaves out client 1" in caplog.text
    assert set(summary) == set(intact)  # the same keys whatever happened
    assert list(clients[0]) == list(next(csv.DictReader(open(tmp_path / "intact" / "clients.csv"))))
    assert intact["left_out"] == {} and intact["clients_in_accuracy"] == 3
