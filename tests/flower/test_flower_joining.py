"""Joining a Flower run and a run that cannot start: a second node with a live client's id is
refused, refused nodes and late joiners are recorded in the run folder; when too few nodes join,
the message and failure.json name the nodes online, those that failed their query and why, those
that never connected, and a restart app to paste (no longer wait suggested when a node was simply
not started); a node whose first query fails inside Flower is asked again during the join wait,
and the join wait grows when the nodes answer slowly."""

from __future__ import annotations

import csv
import json
import shlex
import time

import numpy as np
import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower

import tomllib  # noqa: E402  (flwr needs Python >= 3.11, which has it)
from flower_helpers import (  # noqa: E402  (the Flower tests' grid, configs and node folders)
    LocalGrid,
    _own_config,
    flower_process,
    node_configs,
    write_node_folders,
)
from flwr.app import Error, Message  # noqa: E402

from fedproto.errors import TrainingError  # noqa: E402
from fedproto.flower.records import run_config  # noqa: E402
from fedproto.flower.server_app import FlowerEngine  # noqa: E402


@pytest.fixture(autouse=True)
def _flower_process(tmp_path, monkeypatch):
    """The ServerApp process's task identity and a node-state cache of this test's own
    (:func:`flower_helpers.flower_process`)."""
    yield from flower_process(tmp_path, monkeypatch)


def test_a_second_node_with_a_live_clients_id_is_refused(tmp_path, caplog):
    """A node that claims the client-id of a connected node is refused (naming both nodes); the
    client keeps its node and its classes, and no take-over back and forth."""
    folders = write_node_folders(tmp_path)
    ncs = node_configs(folders)
    uc = _own_config(**{"rounds": 3})
    grid = LocalGrid(uc, node_configs=ncs)
    eng = FlowerEngine(run_config(uc), grid, out=tmp_path / "run", timeout_s=1)
    orig = eng.executor.available

    def sample(r):
        if r == 2:
            grid.add_node(1003, {**ncs[1], "data": str(folders[2])})
        return orig(r)

    eng.executor.available = sample
    eng.run()
    assert eng.nodes == {0: 1000, 1: 1001, 2: 1002}
    assert eng.executor.info[1]["classes"] == [2, 3, 4, 5]
    why = eng.executor.refused[1003]
    assert "client-id=1 is already taken by node 1001" in why and "node 1003" in why
    assert not any("is back on node" in r.getMessage() for r in caplog.records)
    assert grid.sent.count("query") == 4  # node 1003 asked once


def test_refused_nodes_and_late_joiners_are_recorded_in_the_run_folder(tmp_path):
    folders = write_node_folders(tmp_path)
    np.savez(folders[2] / "train.npz", x=np.zeros((4, 1, 8, 8), np.float32), y=np.array([1, 2, 12, 3]))
    late = write_node_folders(tmp_path / "late", labels=[(6, 7, 8)])[0]
    ncs = node_configs(folders)
    uc = _own_config(**{"rounds": 2, "clients": 4})
    grid = LocalGrid(uc, node_configs=ncs)
    eng = FlowerEngine(run_config(uc), grid, out=tmp_path / "run", wait_s=0)
    orig = eng.executor.available

    def sample(r):
        if r == 2:
            grid.add_node(1003, {"client-id": 3, "data": str(late), "model": "cnn"})
        return orig(r)

    eng.executor.available = sample
    eng.run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (ref,) = rows[0]["refused"]
    assert (ref["node_id"], ref["client_id"]) == (1002, 2) and "label 12 is outside" in ref["reason"]
    assert "refused" not in rows[1] and rows[1]["replied"] == [0, 1, 3]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["refused"][0]["client_id"] == 2 and sorted(config["nodes"]) == ["0", "1", "3"]
    with open(tmp_path / "run" / "clients.csv") as f:
        clients = {r["client"]: r for r in csv.DictReader(f)}
    assert (clients["3"]["ways"], clients["3"]["classes"], clients["3"]["train_samples"]) == ("3", "6 7 8", "36")
    assert clients["2"]["ways"] == "0"


class TokenFailureGrid(LocalGrid):
    """Every node online, but each ClientApp fails its task as under the drill's load ("Runtime task-token
    authentication failed"); node 1002 does not answer at all."""

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = f"m{next(self._ids)}"
            if msg.metadata.dst_node_id == 1002:
                continue
            replies.append(Message(Error(code=1, reason="Runtime task-token authentication failed"), reply_to=msg))
        return replies


def test_a_run_that_cannot_start_writes_failure_json_naming_the_nodes_seen(tmp_path):
    """The drill: three nodes online, each ClientApp failing under load, and the run stopped with "0 SuperNodes
    joined within 60 s" (as if none were there), an empty run folder and no failure.json. Now the message
    names the nodes online, those that failed and why, those that did not answer, and what to change; and
    failure.json records the same with the command that starts the run again."""
    from fedproto.flower.records import FlowerOptions

    folders = write_node_folders(tmp_path / "data")
    uc = _own_config(**{"min-replies": 2, "wait-nodes": 0, "round-timeout": 1})
    grid = TokenFailureGrid(uc, node_configs=node_configs(folders))
    out = tmp_path / "run"
    with pytest.raises(TrainingError) as err:
        FlowerEngine(run_config(uc), grid, out=out, options=FlowerOptions.from_user_config(uc), run_cfg=uc)
    msg = str(err.value)
    assert msg.startswith("0 SuperNodes joined within 0 s, but the run has clients=3 and needs 2: 3 node(s) were "
                          "online [1000, 1001, 1002] but not enough joined: on a loaded machine raise wait-nodes "
                          "(e.g. wait-nodes=300)"), msg
    assert "node 1000 did not join (failed its query: Runtime task-token authentication failed (code 1))" in msg
    assert "node 1002 did not join (no answer within the join wait (wait-nodes=0 s))" in msg
    failure = json.loads((out / "failure.json").read_text())
    assert failure["rounds_completed"] == 0 and failure["error"] == "TrainingError" and failure["message"] == msg
    assert failure["nodes_seen"] == {
        "online": [1000, 1001, 1002], "joined": {}, "refused": {},
        "unanswered": {"1000": "failed its query: Runtime task-token authentication failed (code 1)",
                       "1001": "failed its query: Runtime task-token authentication failed (code 1)",
                       "1002": "no answer within the join wait (wait-nodes=0 s)"}}
    assert failure["missing"] == {"clients": [0, 1, 2], "never_connected": 0, "online_not_joined": [1000, 1001, 1002]}
    assert failure["checkpoint"] is False and "resume" not in failure
    # a command to paste: the app folder written beside failure.json, the longer wait in its run config
    app = out.absolute() / "restart-app"
    assert failure["restart"] == shlex.join(["flwr", "run", str(app), "--stream"])
    got = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert got["wait-nodes"] == 300.0 and got["min-replies"] == 2 and got["resume-from"] == ""
    assert sorted(p.name for p in out.iterdir()) == ["failure.json", "restart-app"]
    # what the run folder holds is the server's alone, also for a run that never started
    modes = {p.relative_to(out).as_posix(): p.stat().st_mode & 0o777 for p in [out, *out.rglob("*")]}
    assert modes == {".": 0o700, "failure.json": 0o600, "restart-app": 0o700, "restart-app/pyproject.toml": 0o600}


def test_a_run_missing_a_node_says_which_and_does_not_suggest_a_longer_wait(tmp_path):
    """The drill's failure.json suggested wait-nodes=300 when a node was simply not started. Now it names the
    client that never connected, keeps the wait, and the join wait ends at wait-nodes, not at a query's deadline."""
    from fedproto.flower.records import FlowerOptions

    folders = write_node_folders(tmp_path / "data")
    uc = _own_config(**{"min-replies": 3, "wait-nodes": 2, "round-timeout": 60})
    grid = LocalGrid(uc, node_configs=node_configs(folders)[:2])  # client 2's SuperNode was never started
    out = tmp_path / "run"
    t0 = time.monotonic()
    with pytest.raises(TrainingError) as err:
        FlowerEngine(run_config(uc), grid, out=out, options=FlowerOptions.from_user_config(uc), run_cfg=uc)
    took = time.monotonic() - t0
    assert 2 <= took < 10, took  # wait-nodes is the limit (was: a fixed wait, a query's round-timeout on top)
    msg = str(err.value)
    assert "1 of 3 SuperNodes never connected (client-id 2 did not join): start them" in msg, msg
    assert "wait-nodes=300" not in msg
    failure = json.loads((out / "failure.json").read_text())
    assert failure["missing"] == {"clients": [2], "never_connected": 1, "online_not_joined": []}
    app = tomllib.loads((out / "restart-app" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert app["wait-nodes"] == 2 and "YOUR_APP_FOLDER" not in failure["restart"]
    assert (out / "failure.json").stat().st_mode & 0o777 == 0o600 and out.stat().st_mode & 0o777 == 0o700


class FirstQueryFailsGrid(LocalGrid):
    """Each node's first query fails as under the drill's load (Flower's own failure, no exception of the
    ClientApp); the second reaches the ClientApp."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.failed_once: set[int] = set()

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        first = [m for m in messages if m.metadata.dst_node_id not in self.failed_once]
        self.failed_once |= {m.metadata.dst_node_id for m in first}
        replies = super().send_and_receive([m for m in messages if m not in first], timeout=timeout)
        for m in first:
            m.metadata.__dict__["_message_id"] = f"m{next(self._ids)}"
            replies.append(Message(Error(code=1, reason="Runtime task-token authentication failed"), reply_to=m))
        return replies


def test_a_node_whose_first_query_fails_in_flower_is_asked_again_during_the_join_wait(tmp_path, caplog):
    """Was: a node whose query failed for a reason of Flower's own (not the ClientApp refusing its data) was
    refused for good, so three online nodes gave "0 SuperNodes joined". Now it is asked again while the join
    wait lasts, and the run starts with all three; a ClientApp's own refusal (an exception it raised) stays final."""
    folders = write_node_folders(tmp_path / "data")
    uc = _own_config(**{"wait-nodes": 10})
    grid = FirstQueryFailsGrid(uc, node_configs=node_configs(folders))
    eng = FlowerEngine(run_config(uc), grid, out=False)
    assert sorted(eng.executor.nodes) == [0, 1, 2] and eng.executor.refused == {}
    assert grid.sent.count("query") == 3  # the second query of each node (the first failed before the app)
    assert caplog.text.count("failed its query (Runtime task-token authentication failed (code 1)); asking it "
                             "again") == 3


class SlowAnswersGrid(LocalGrid):
    """Nodes that answer ``delay`` s after a message is pushed (a loaded machine); node ``late`` connects
    ``late_after`` s after the server first lists the nodes."""

    def __init__(self, *a, delay: float, late: int, late_after: float, **kw):
        super().__init__(*a, **kw)
        self.delay, self.late_after = delay, late_after
        self.late_config = self.contexts.pop(late).node_config
        self.late, self.first_look, self.pushed = late, None, {}

    def get_node_ids(self):
        now = time.monotonic()
        self.first_look = self.first_look or now
        if self.late not in self.contexts and now - self.first_look >= self.late_after:
            self.add_node(self.late, self.late_config)
        return list(self.contexts)

    def push_messages(self, messages):
        for m in messages:
            m.metadata.__dict__["_message_id"] = f"m{next(self._ids)}"
            self.pushed[m.metadata.message_id] = (time.monotonic(), m)
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids):
        out = []
        for i in list(message_ids):
            at, m = self.pushed.get(i, (None, None))
            if at is not None and time.monotonic() - at >= self.delay:
                del self.pushed[i]
                ids = self._ids
                out += LocalGrid.send_and_receive(self, [m])
                m.metadata.__dict__["_message_id"] = i  # send_and_receive numbered it anew
                for r in out:
                    if r.metadata.reply_to_message_id != i and r.metadata.src_node_id == m.metadata.dst_node_id:
                        r.metadata.__dict__["_reply_to_message_id"] = i
                self._ids = ids
        return out


def test_the_join_wait_grows_when_the_nodes_answer_slowly(tmp_path):
    """wait-nodes=1 on a machine where a node answers its query in 2 s: the join wait grows to 3 x the measured
    answer (as the round deadlines do), so the node that connects a moment later still joins; the run starts with
    all three and the server prints no "starting with 2 of 3"."""
    from fedproto.flower.records import FlowerOptions

    folders = write_node_folders(tmp_path / "data")
    uc = _own_config(**{"wait-nodes": 1, "round-timeout": 30, "rounds": 1})
    grid = SlowAnswersGrid(uc, node_configs=node_configs(folders), delay=2.0, late=1002, late_after=0.5)
    t0 = time.monotonic()
    eng = FlowerEngine(run_config(uc), grid, out=False, options=FlowerOptions(poll_interval=0.05, round_timeout=30,
                                                                             wait_nodes=1))
    took = time.monotonic() - t0
    assert sorted(eng.nodes) == [0, 1, 2], (eng.executor.nodes_seen(), took)
    assert eng.executor.join_wait_s < 3 * max(eng.executor.deadline.measured) + 1, eng.executor.join_wait_s
