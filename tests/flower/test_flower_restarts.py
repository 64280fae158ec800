"""Nodes that restart during a run (``fedproto.flower.node_state``, the ClientApp's instance ids):
a restarted own-data node reloads its state file and keeps its instance (and draws a new one
without a usable file: none, another run's, a damaged one, another model's tensors), a state file
is keyed by run, client, result fields and node config, and the server detects a restarted client
from its reply, records it (``rejoined``, clients.csv's ``state_lost_round``) and leaves one that
lost its state out of the headline accuracy."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower

from flower_helpers import (  # noqa: E402  (the Flower tests' grid, configs and node folders)
    LocalGrid,
    RecordingGrid,
    _own_config,
    flower_process,
    node_configs,
    write_node_folders,
)
from flwr.app import Context, Message, RecordDict  # noqa: E402

from fedproto.errors import ConfigError  # noqa: E402
from fedproto.flower import client_app  # noqa: E402
from fedproto.flower.records import run_config, to_record  # noqa: E402
from fedproto.flower.server_app import FlowerEngine  # noqa: E402


@pytest.fixture(autouse=True)
def _flower_process(tmp_path, monkeypatch):
    """The ServerApp process's task identity and a node-state cache of this test's own
    (:func:`flower_helpers.flower_process`)."""
    yield from flower_process(tmp_path, monkeypatch)


def _evaluate_on(context, eng, cid: int, nid: int, run_key: str | None = None) -> dict:
    """Send the server's evaluate message of client ``cid`` to the ClientApp with ``context`` (node
    ``nid``), with the server's run key (or ``run_key``); the reply's metrics."""
    from flwr.app import ConfigRecord

    from fedproto.flower.records import CONFIG, MESSAGE, METRICS, SCHEMA

    r = eng.executor.round
    msg = Message(RecordDict({MESSAGE: to_record(eng.algorithm.downlink(eng.loop.message, cid)),
                              CONFIG: ConfigRecord({"round": r, "cid": cid, "run-key": run_key or eng.run_key,
                                                    "schema": SCHEMA})}),
                  dst_node_id=nid, message_type="evaluate", group_id=str(r))
    msg.metadata.__dict__["_message_id"] = f"restart-{nid}"
    return dict(client_app.app(msg, context).content[METRICS])


def test_a_restarted_node_reloads_its_state_file_and_keeps_its_instance(tmp_path, caplog):
    """Every reply carries ``instance`` (one per SuperNode process), ``restored`` and
    ``state-round``; an own-data node saves its client's state after each train round and, when it
    restarts with an empty ``context.state``, reloads it: same instance, ``restored`` 1, the saved
    model, the same accuracy. Without a usable state file (none, another run, a damaged file) the
    restarted node draws a new instance and says ``restored`` 0."""
    from fedproto.flower import node_state

    folders = write_node_folders(tmp_path)
    uc = _own_config()
    ncs = node_configs(folders, extra={0: {"state-dir": str(tmp_path / "s0")}, 1: {"state-dir": ""}})
    grid = RecordingGrid(uc, node_configs=ncs)  # node 1002 (client 2): the default folder, the user cache
    eng = FlowerEngine(run_config(uc), grid, out=tmp_path / "run")
    eng.run()
    inst = {}
    for kind, replies in grid.replies.items():
        for rep in replies:
            m = rep.content["fedproto.metrics"]
            nid = rep.metadata.src_node_id
            assert inst.setdefault(nid, m["instance"]) == m["instance"] and 1 <= m["instance"] < 2**53
            assert m["restored"] == 0
            assert m["state-round"] == (int(rep.metadata.group_id) if kind != "query" else 0)
    assert sorted(inst) == [1000, 1001, 1002] and len(set(inst.values())) == 3
    files = {0: list((tmp_path / "s0").glob("*.pt")),
             2: list((tmp_path / "cache" / "fedproto" / "node-state").glob("*.pt"))}
    assert [f.name.startswith(f"run-{eng.run_key}-client-{i}-") for i in files for f in files[i]] == [True, True]
    assert not any(Path(tmp_path).glob("**/run-1-client-1-*.pt"))  # state-dir="": no file
    before = {nid: {k: v for k, v in rep.content["fedproto.metrics"].items()}
              for nid, rep in zip(range(1000, 1003), grid.replies["evaluate"])}

    old = {nid: grid.contexts[nid] for nid in (1000, 1001)}
    client_app.forget_clients()  # a new SuperNode process: the model is built afresh from the seed
    for nid in (1000, 1001):
        grid.add_node(nid, ncs[nid - 1000])
    got = _evaluate_on(grid.contexts[1000], eng, 0, 1000)
    assert got["instance"] == inst[1000] and got["restored"] == 1 and got["state-round"] == 2
    assert got["acc"] == before[1000]["acc"] and got["acc_proto"] == before[1000]["acc_proto"]
    saved = grid.contexts[1000].state[client_app.STATE_MODEL].to_torch_state_dict()
    want = old[1000].state[client_app.STATE_MODEL].to_torch_state_dict()
    assert saved.keys() == want.keys() and all(torch.equal(saved[k], want[k]) for k in want)
    assert "fedproto client 0: restored its state of round 2 from" in caplog.text

    got = _evaluate_on(grid.contexts[1001], eng, 1, 1001)  # no state file: a new instance
    assert got["instance"] != inst[1001] and got["restored"] == 0 and got["state-round"] == 0
    assert client_app.STATE_MODEL not in grid.contexts[1001].state

    other_run = Context(run_id=2, node_id=1000, node_config=dict(ncs[0]), state=RecordDict(), run_config=dict(uc))
    got = _evaluate_on(other_run, eng, 0, 1000, run_key="another-run")
    assert got["instance"] != inst[1000] and got["restored"] == 0
    files[0][0].write_bytes(b"not a state file")  # damaged: ignored with a warning naming it
    client_app.forget_clients()
    grid.add_node(1000, ncs[0])
    got = _evaluate_on(grid.contexts[1000], eng, 0, 1000)
    assert got["restored"] == 0 and got["instance"] != inst[1000]
    assert f"ignoring the node state file {files[0][0]}: it cannot be read" in caplog.text
    key = node_state.state_key(eng.run_key, 0, run_config(uc), ncs[0])  # its key, but another model's tensors
    node_state.save_state(files[0][0], key, inst[1000], 2, {"fc.weight": torch.zeros(2, 2)}, {})
    client_app.forget_clients()
    grid.add_node(1000, ncs[0])
    got = _evaluate_on(grid.contexts[1000], eng, 0, 1000)
    assert got["restored"] == 0 and got["instance"] != inst[1000]
    assert "it does not fit this node's model (tensors [" in caplog.text


def test_a_state_file_is_keyed_by_run_client_result_fields_and_node_config():
    from fedproto.flower.node_state import state_dir, state_key

    cfg = run_config(_own_config())
    nc = {"client-id": 0, "data": "/d0", "model": "cnn"}
    key = state_key(7, 0, cfg, nc)
    assert key["run_id"] == 7 and key["client_id"] == 0 and len(key["hash"]) == 16
    assert state_key(7, 0, cfg.model_copy(update={"threads": 2}), {**nc, "state-dir": "/x"}) == key  # neutral
    for other in (state_key(8, 0, cfg, nc), state_key(7, 1, cfg, nc), state_key(7, 0, cfg, {**nc, "model": "lenet"}),
                  state_key(7, 0, cfg.model_copy(update={"lr": 0.01}), nc)):
        assert other != key
    assert state_dir({"partition-id": 0}, own_data=False) is None  # Flower's simulation nodes: none by default
    assert state_dir({"state-dir": ""}, own_data=True) is None
    with pytest.raises(ConfigError, match=r"node config state-dir=5 is not a folder path; give a string"):
        state_dir({"state-dir": 5}, own_data=True)


@pytest.mark.parametrize("keep_state", [False, True])
def test_a_restarted_client_is_detected_recorded_and_not_silently_scored(keep_state, tmp_path, caplog):
    """A node that restarts before round 4 of 4 (same node id, as under node
    authentication) is detected from its reply's instance id. Without its state file it trains a
    fresh model in round 4 only: the metrics row says so (``rejoined``), clients.csv marks it
    (``state_lost_round``), and the headline accuracy leaves it out (``left_out``; all clients in
    ``accuracy_all_clients``). With its state file it comes back with its model: recorded as restored,
    scored as the others."""
    folders = write_node_folders(tmp_path)
    uc = _own_config(rounds=4)
    state = {"state-dir": str(tmp_path / "s1")} if keep_state else {"state-dir": ""}
    ncs = node_configs(folders, extra={1: state})
    grid = LocalGrid(uc, node_configs=ncs)

    def restart(grid, kind, group):
        if kind == "train" and group == "4":
            client_app.forget_clients()  # a new SuperNode process: nothing of the old one in memory
            grid.add_node(1001, ncs[1])

    grid.on_send = restart
    with caplog.at_level("WARNING"):
        summary = FlowerEngine(run_config(uc), grid, out=tmp_path / "run").run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("rejoined" not in r for r in rows[:3])
    clients = list(csv.DictReader(open(tmp_path / "run" / "clients.csv")))
    if keep_state:
        assert rows[3]["rejoined"] == {"1": "restarted with its state restored from its state file"}
        assert summary["left_out"] == {} and clients[1]["state_lost_round"] == "" and clients[1]["left_out"] == ""
        assert "client 1 (node 1001) restarted and reloaded its state from its state file" in caplog.text
        return
    assert rows[3]["rejoined"] == {"1": "restarted without its state: a fresh model"}
    assert [c["state_lost_round"] for c in clients] == ["", "4", ""]
    assert [c["left_out"] for c in clients] == ["", summary["left_out"]["1"], ""]
    assert summary["left_out"] == {"1": "its node lost its state in round 4; it trained in 1 round(s) from then on, "
                                        "fewer than 2"}
    accs = [float(c["acc"]) for c in clients]
    assert summary["accuracy"]["acc"]["mean"] == pytest.approx(np.mean([accs[0], accs[2]]), abs=1e-12)
    assert summary["accuracy_all_clients"]["acc"]["mean"] == pytest.approx(np.mean(accs), abs=1e-12)
    assert "client 1 (node 1001) restarted and lost its state" in caplog.text
