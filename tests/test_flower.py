"""The Flower engine (fedproto.flower): same numbers as the simulation, clear errors.

The ServerApp's engine and the real ClientApp talk through :class:`LocalGrid`, a Flower
``Grid`` that delivers each message to the ClientApp of its node in this process (one
``Context`` per node, kept across rounds as a SuperNode keeps it), so the tests need neither a
SuperLink nor Ray. Messages cross as Flower records (arrays serialized to bytes).
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

import tomllib  # noqa: E402  (flwr needs Python >= 3.11, which has it)
from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedproto.config import build_config  # noqa: E402
from fedproto.errors import ConfigError, TrainingError  # noqa: E402
from fedproto.flower import client_app  # noqa: E402
from fedproto.flower.common import from_record, run_config, to_record  # noqa: E402
from fedproto.flower.server_app import FlowerEngine  # noqa: E402
from fedproto.simulation import Simulation  # noqa: E402

BASE = dict(dataset="digits", clients=4, ways=3, shots=20, stdev=1, test_shots=10, rounds=3, model="cnn",
            eval_every=0, lr=0.05, threads=1)


class LocalGrid(Grid):
    """A Flower Grid whose nodes are ClientApp contexts in this process (test double for a
    SuperLink): ``partition_ids[k]`` is node k's ``partition-id``."""

    def __init__(self, run_config: dict, partition_ids: list[int], num_partitions: int | None = None):
        self.contexts = {}
        for k, pid in enumerate(partition_ids):
            nid = 1000 + k
            node_config = {"partition-id": pid, "num-partitions": num_partitions or len(partition_ids)}
            self.contexts[nid] = Context(run_id=1, node_id=nid, node_config=node_config, state=RecordDict(),
                                         run_config=dict(run_config))
        self._ids = itertools.count()
        self.sent: list[str] = []

    def set_run(self, run):
        pass

    @property
    def run(self):
        return None

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id)

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        raise NotImplementedError

    def pull_messages(self, message_ids):
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = f"m{next(self._ids)}"
            self.sent.append(msg.metadata.message_type)
            try:
                replies.append(client_app.app(msg, self.contexts[msg.metadata.dst_node_id]))
            except Exception as e:  # a SuperNode turns a ClientApp exception into an error reply
                replies.append(Message(Error(code=1, reason=f"{type(e).__name__}: {e}"), reply_to=msg))
        return replies


def _user_config(**kw) -> dict:
    """A Flower run config (``-`` spelling, as in ``[tool.flwr.app.config]``)."""
    return {k.replace("_", "-"): v for k, v in {**BASE, **kw}.items()}


@pytest.fixture(autouse=True)
def _server_process(monkeypatch):
    """Play the ServerApp process: Flower's runtime sets the task identity that new messages
    carry; give torch's thread count back afterwards (``threads=1`` is process-wide)."""
    for k, v in {"_run_id": 1, "_node_id": 0, "_task_id": 0}.items():
        monkeypatch.setattr(TaskIdentity, k, v)
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("algorithm", ["fedproto", "fesem", "fedrep"])
def test_flower_engine_matches_the_simulation(algorithm):
    """Same config and seed: the Flower engine (every client step on its node, state kept in the
    node's context) gives the sequential simulation's accuracies, losses and message sizes."""
    uc = _user_config(algorithm=algorithm)
    cfg = run_config(uc)
    ref = Simulation(build_config(overrides={**BASE, "algorithm": algorithm, "execution": "sequential"}), out=False)
    want = ref.run()
    # nodes connect in another order than their partition ids
    grid = LocalGrid(uc, [2, 0, 3, 1])
    eng = FlowerEngine(cfg, grid, out=False)
    got = eng.run()
    assert eng.nodes == {0: 1001, 1: 1003, 2: 1000, 3: 1002}
    for key in want["accuracy"]:
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
        assert got["accuracy"][key]["std"] == pytest.approx(want["accuracy"][key]["std"], abs=1e-9)
    assert got["accuracy"]["acc"]["mean"] > 0.5  # learned something (chance is 1/3 on 3 classes)
    for a, b in zip(eng.history, ref.history):
        assert a["loss_ce"] == pytest.approx(b["loss_ce"], rel=1e-6)
        assert a["loss_proto"] == pytest.approx(b["loss_proto"], rel=1e-6, abs=1e-12)
        assert (a["up_params"], a["down_params"], a["up_bytes"]) == (b["up_params"], b["down_params"], b["up_bytes"])
    assert grid.sent.count("query") == 4 and grid.sent.count("train") == 4 * BASE["rounds"]
    assert grid.sent.count("evaluate") == 4
    # the client models stayed on the nodes: the server's copies were never trained
    w_node = grid.contexts[1001].state[client_app.STATE_MODEL].to_torch_state_dict()
    w_ref = ref.setup.states[0].model.state_dict()
    for k in w_ref:
        torch.testing.assert_close(w_node[k], w_ref[k], rtol=1e-6, atol=1e-7)


def test_records_round_trip_every_dtype_and_shape():
    msg = {"protos": np.arange(6, dtype=np.float32).reshape(2, 3), "classes": np.array([3, 7]),
           "lambda": np.array(0.5, np.float32), "empty": np.zeros((0, 4), np.float32)}
    back = from_record(to_record(msg))
    assert set(back) == set(msg)
    for k in msg:
        assert back[k].dtype == msg[k].dtype and back[k].shape == msg[k].shape
        np.testing.assert_array_equal(back[k], msg[k])


def test_run_config_accepts_flower_spelling_and_names_unknown_keys():
    cfg = run_config({"local-epochs": 2, "lambda-proto": 0.5, "dataset": "digits"})
    assert (cfg.local_epochs, cfg.lambda_proto) == (2, 0.5)
    with pytest.raises(ConfigError, match="Flower run config: .*unknown option 'num_rounds'"):
        run_config({"num-rounds": 3})
    with pytest.raises(ConfigError, match="lr=-1"):
        run_config({"lr": -1})


def test_duplicate_and_missing_partition_ids_are_refused():
    uc = _user_config()
    with pytest.raises(ConfigError, match=r"nodes \[1000, 1001\] all have partition-id=0"):
        FlowerEngine(run_config(uc), LocalGrid(uc, [0, 0, 1, 2]), out=False)


def test_too_few_nodes_and_wrong_num_partitions_fail_clearly():
    uc = _user_config()
    with pytest.raises(TrainingError, match="3 SuperNodes connected within 0 s, but the run has clients=4"):
        FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2]), out=False, wait_s=0)
    with pytest.raises(TrainingError, match="num-partitions=5 but the run has clients=4"):
        FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2, 3], num_partitions=5), out=False)


def test_checkpoints_and_resume_are_refused_under_flower():
    uc = _user_config(checkpoint_every=1)
    with pytest.raises(ConfigError, match="checkpoint_every=1: under Flower"):
        FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2, 3]), out=False)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_flower_deployment_on_localhost_gives_the_simulation_numbers(tmp_path):
    """The real thing: a SuperLink and two SuperNodes on 127.0.0.1, ``flwr run`` of the example
    Flower app (examples/flower) with its run config overridden; every ClientApp call runs in
    its own process, client state persists in the SuperNode. Same numbers as the simulation."""
    import os
    import shutil
    import subprocess
    import time
    from pathlib import Path

    if shutil.which("flower-superlink") is None:
        pytest.fail("flwr is installed but its flower-superlink command is not on PATH")
    app_dir = Path(__file__).resolve().parents[1] / "examples" / "flower"
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}
    (tmp_path / "home").mkdir()
    link = _free_port()
    (tmp_path / "home" / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{link}"\ninsecure = true\n')
    procs = []

    def start(args, log):
        procs.append(subprocess.Popen(args, env=env, cwd=tmp_path, stdout=open(tmp_path / log, "w"),
                                      stderr=subprocess.STDOUT))

    try:
        start(["flower-superlink", "--insecure", "--port", str(link), "--database", str(tmp_path / "link.db"),
               "--disable-runtime-dependency-installation"], "superlink.log")
        deadline = time.time() + 120
        while not _listening(link):
            if time.time() > deadline or procs[0].poll() is not None:
                pytest.fail("the SuperLink did not start:\n" + (tmp_path / "superlink.log").read_text()[-3000:])
            time.sleep(0.5)
        for i in range(2):
            start(["flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{link}", "--port", str(_free_port()),
                   "--node-config", f"partition-id={i} num-partitions=2"], f"node{i}.log")
        out = tmp_path / "out"
        over = f"clients=2 rounds=2 out-dir='{out}'"
        t0 = time.time()
        res = subprocess.run(["flwr", "run", str(app_dir), "local", "--stream", "--run-config", over], env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=400)
        logs = res.stdout + res.stderr
        assert "fedproto: fedproto on digits: accuracy" in logs, logs[-3000:]
        summaries = list(out.glob("*/summary.json"))
        assert len(summaries) == 1, logs[-3000:]
        got = json.loads(summaries[0].read_text())
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    print(f"flwr run took {time.time() - t0:.0f} s")
    app_cfg = {k: v for k, v in tomllib.loads((app_dir / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
               ["config"].items() if k != "out-dir"}
    cfg = run_config({**app_cfg, "clients": 2, "rounds": 2, "execution": "sequential"})
    want = Simulation(cfg, out=False).run()
    assert got["clients"] == 2 and got["rounds"] == 2
    for key in want["accuracy"]:
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
    assert got["params_per_round"] == want["params_per_round"]


def test_server_app_logs_a_user_mistake_in_one_line(caplog):
    """Reported: every user mistake under Flower printed a ServerApp traceback."""
    from fedproto.flower import server_app

    uc = _user_config(checkpoint_every=1)
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=uc)
    server_app.main(LocalGrid(uc, [0, 1, 2, 3]), ctx)  # returns instead of raising
    assert any("fedproto: checkpoint_every=1: under Flower" in r.getMessage() for r in caplog.records)


def test_a_fractional_partition_id_is_refused():
    """Reported: partition-id=2.5 was silently truncated to client 2."""
    uc = _user_config()
    with pytest.raises(TrainingError, match=r"partition-id=2.5 is not a whole number"):
        FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2.5, 3]), out=False)
