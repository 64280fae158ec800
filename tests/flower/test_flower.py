"""The Flower engine (fedproto.flower): same numbers as the simulation, clear errors.

The ServerApp's engine and the real ClientApp talk through :class:`LocalGrid`, a Flower
``Grid`` that delivers each message to the ClientApp of its node in this process (one
``Context`` per node, kept across rounds as a SuperNode keeps it), so the tests need neither a
SuperLink nor Ray. Messages cross as Flower records (arrays serialized to bytes).
"""

from __future__ import annotations

import csv
import itertools
import json
import shlex
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower

import tomllib  # noqa: E402  (flwr needs Python >= 3.11, which has it)
from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedproto.config.run_config import build_config  # noqa: E402
from fedproto.errors import ConfigError, TrainingError  # noqa: E402
from fedproto.flower import client_app  # noqa: E402
from fedproto.flower.node_state import INSTANCE_KEYS  # noqa: E402
from fedproto.flower.records import MESSAGE, from_record, run_config, to_record  # noqa: E402
from fedproto.flower.server_app import FlowerEngine  # noqa: E402
from fedproto.prototypes.dp import epsilon  # noqa: E402
from fedproto.secagg import codec as secagg_codec  # noqa: E402
from fedproto.simulation import Simulation  # noqa: E402

BASE = dict(dataset="digits", clients=4, ways=3, shots=20, stdev=1, test_shots=10, rounds=3, model="cnn",
            eval_every=0, lr=0.05, threads=1)


class LocalGrid(Grid):
    """A Flower Grid whose nodes are ClientApp contexts in this process (test double for a
    SuperLink): ``partition_ids[k]`` is node k's ``partition-id``."""

    def __init__(self, run_config: dict, partition_ids: list[int] | None = None, num_partitions: int | None = None,
                 node_configs: list[dict] | None = None):
        self.run_config = dict(run_config)
        self.contexts = {}
        configs = node_configs or [{"partition-id": pid, "num-partitions": num_partitions or len(partition_ids)}
                                   for pid in partition_ids]
        for k, nc in enumerate(configs):
            self.add_node(1000 + k, nc)
        self._ids = itertools.count()
        self.sent: list[str] = []
        self.silent: set[int] = set()  # nodes whose replies never arrive (a SuperNode that went away)
        self.gone: set[int] = set()  # nodes the SuperLink knows are offline: it answers for them at once
        self.on_send = None  # called with (message type, group id) before each batch

    def add_node(self, nid: int, node_config: dict) -> None:
        """A SuperNode connects (a fresh context: a restarted node has lost its state)."""
        self.contexts[nid] = Context(run_id=1, node_id=nid, node_config=dict(node_config), state=RecordDict(),
                                     run_config=self.run_config)

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
        messages = list(messages)
        if self.on_send and messages:
            self.on_send(self, messages[0].metadata.message_type, messages[0].metadata.group_id)
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = f"m{next(self._ids)}"
            self.sent.append(msg.metadata.message_type)
            if msg.metadata.dst_node_id in self.silent:
                continue
            if msg.metadata.dst_node_id in self.gone:  # as the SuperLink answers: from node 0, code 5
                rep = Message(Error(code=5, reason="Error: Node Unavailable"), reply_to=msg)
                rep.metadata.__dict__["_src_node_id"] = 0
                replies.append(rep)
                continue
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


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Own-data nodes keep their state files in the user cache (fedproto.flower.node_state): a
    test's own, so that no test reads another's (the contexts here all have run id 1) and none
    writes to the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


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


@pytest.mark.parametrize("algorithm", ["fedtgp", "fd", "fedgh", "lgfedavg"])
def test_heterogeneous_methods_give_the_simulation_numbers_under_flower(algorithm):
    """The model-heterogeneous methods on nodes of two architectures: the Flower engine
    gives the sequential simulation's accuracies (classifier, nearest prototype, global head),
    losses, server message and message sizes for the same clients and seed."""
    over = dict(algorithm=algorithm, model="projcnn:8-16,cnn", server_epochs=5)
    uc = _user_config(**over)
    ref = Simulation(build_config(overrides={**BASE, **over, "execution": "sequential"}), out=False)
    want = ref.run()
    eng = FlowerEngine(run_config(uc), LocalGrid(uc, [2, 0, 3, 1]), out=False)
    got = eng.run()
    assert set(got["accuracy"]) == set(want["accuracy"]) and len(want["accuracy"]) >= (
        2 if algorithm in ("fedtgp", "fedgh", "lgfedavg") else 1)
    for key in want["accuracy"]:
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9), key
    assert got["params_per_round"] == want["params_per_round"]
    for a, b in zip(eng.history, ref.history):
        assert a["loss_ce"] == pytest.approx(b["loss_ce"], rel=1e-6)
        assert (a["up_params"], a["down_params"], a["up_bytes"]) == (b["up_params"], b["down_params"], b["up_bytes"])
    assert set(eng.loop.message) == set(ref.message)
    for k in ref.message:
        np.testing.assert_allclose(eng.loop.message[k], ref.message[k], rtol=1e-5, atol=1e-6)


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
    with pytest.raises(TrainingError, match="3 SuperNodes joined within 0 s, but the run has clients=4 and needs 4"):
        FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2], num_partitions=4), out=False, wait_s=0)
    with pytest.raises(TrainingError, match="num-partitions=5 but the run has clients=4"):
        FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2, 3], num_partitions=5), out=False)


def test_resume_needs_the_folder_of_an_interrupted_run(tmp_path):
    from fedproto.flower.records import FlowerOptions

    uc = _user_config()
    for where, why in ((tmp_path / "none", "is not a folder"), (tmp_path, "is not the config.json of a Flower run")):
        with pytest.raises(ConfigError, match=why):
            FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2, 3]), options=FlowerOptions(resume_from=str(where)))
    # a finished run (no checkpoint left): refused before any node is asked
    done = tmp_path / "done"
    FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2, 3]), out=done).run()
    grid = LocalGrid(uc, [0, 1, 2, 3])
    with pytest.raises(ConfigError, match="holds no checkpoint.pt: nothing to resume"):
        FlowerEngine(run_config(uc), grid, options=FlowerOptions(resume_from=str(done)))
    assert grid.sent == []


def _benchmark_run_matches_the_simulation(tmp_path, simulation: bool):
    """``flwr run`` of the benchmark app (examples/flower, digits, partition-id nodes) with
    clients=2 rounds=2, on a deployment of 2 SuperNodes or on the simulation runtime: the
    simulator's numbers."""
    from pathlib import Path

    from fedproto.deploy.local_federation import LocalFederation

    app_dir = Path(__file__).resolve().parents[2] / "examples" / "flower"
    src = str(Path(__file__).resolve().parents[2] / "src")
    out = tmp_path / "out"
    t0 = time.time()
    with LocalFederation(tmp_path / "fed", simulation=simulation, env={"PYTHONPATH": src}) as fed:
        fed.start_superlink()
        if not simulation:
            for i in range(2):
                fed.start_supernode({"partition-id": i, "num-partitions": 2})
        res = fed.flwr_run(app_dir, {"clients": 2, "rounds": 2, "out-dir": str(out)}, timeout=400,
                           num_supernodes=2 if simulation else None)
    logs = res.stdout + res.stderr
    assert "fedproto: fedproto on digits: accuracy" in logs, logs[-3000:]
    summaries = list(out.glob("*/summary.json"))
    assert len(summaries) == 1, logs[-3000:]
    got = json.loads(summaries[0].read_text())
    print(f"flwr run took {time.time() - t0:.0f} s")
    app_cfg = {k: v for k, v in tomllib.loads((app_dir / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
               ["config"].items() if k != "out-dir"}
    cfg = run_config({**app_cfg, "clients": 2, "rounds": 2, "execution": "sequential"})
    want = Simulation(cfg, out=False).run()
    assert got["clients"] == 2 and got["rounds"] == 2
    for key in want["accuracy"]:
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
    assert got["params_per_round"] == want["params_per_round"]


@pytest.mark.slow
def test_flower_deployment_on_localhost_gives_the_simulation_numbers(tmp_path):
    """The benchmark mode on a real deployment: a SuperLink and two SuperNodes on 127.0.0.1;
    every ClientApp call runs in its own process, client state persists in the SuperNode."""
    _benchmark_run_matches_the_simulation(tmp_path, simulation=False)


@pytest.mark.slow
def test_flower_simulation_runtime_gives_the_simulation_numbers(tmp_path):
    """Flower's simulation runtime (a SuperLink started with --simulation, Ray backend,
    ``--federation-config num-supernodes=2``): the simulator's numbers."""
    pytest.importorskip("ray", reason="Flower's simulation runtime needs Ray: pip install \"fedproto[flower-sim]\"")
    _benchmark_run_matches_the_simulation(tmp_path, simulation=True)


class RecordingGrid(LocalGrid):
    """A LocalGrid that keeps every reply a node sends, by message type (what crosses the wire)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.replies: dict[str, list[Message]] = {"query": [], "train": [], "evaluate": []}

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        for m, r in zip(messages, replies):
            self.replies[m.metadata.message_type].append(r)
        return replies


def _reply_keys(rep: Message) -> dict[str, set[str]]:
    """Record name (``config``, ``message``, ``metrics``) -> the keys of that record, for one reply."""
    return {name.removeprefix("fedproto."): set(rec.keys()) for name, rec in rep.content.items()}


@pytest.mark.parametrize("dp", ["off", "prototypes", "full"])
def test_under_dp_a_node_sends_only_the_noised_release(dp, tmp_path, caplog):
    """Under DP the replies of a node carry no sample counts (query, train), no
    losses, step count or embedding norm (train), no accuracy or test count (evaluate): only the
    noised release, the public label set and architecture size, and ε under ``prototypes``."""
    uc = _user_config(dp=dp, dp_noise=1.0, rounds=2, clients=3)
    grid = RecordingGrid(uc, [0, 1, 2])
    summary = FlowerEngine(run_config(uc), grid, out=tmp_path / "run").run()
    q, t, e = (grid.replies[k] for k in ("query", "train", "evaluate"))
    assert len(q) == 3 and len(t) == 6 and len(e) == 3
    query_keys = {"cid", "classes", "params", "embedding-dim", "schema"} | (
        {"train-samples", "test-samples"} if dp == "off" else set())
    assert all(_reply_keys(r)["config"] == query_keys for r in q)
    inst = set(INSTANCE_KEYS)  # random or the server's own round numbers, sent under every dp
    assert all(_reply_keys(r)["metrics"] == inst for r in q)
    if dp == "off":
        sent = {"loss_ce", "loss_proto", "steps", "emb-norm-max", "loss-terms", "num-examples"} | inst
        assert all(_reply_keys(r)["metrics"] == sent for r in t)
        assert summary["accuracy"]["acc"]["mean"] > 0.5
        return
    assert all(set(_reply_keys(r)) == {"message", "metrics"} and _reply_keys(r)["metrics"] == inst
               for r in t)  # the release alone, and the instance keys
    assert all(_reply_keys(r)["message"] == {"classes", "protos", "counts"} for r in t)
    assert all(_reply_keys(r)["metrics"] == ({"dp_epsilon"} if dp == "prototypes" else set()) | inst for r in e)
    assert summary["accuracy"] == {} and summary["clients_evaluated"] == 0 and summary["left_out"] == {}
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss_ce"] for r in rows] == [None, None]
    if dp == "prototypes":
        assert summary["privacy"]["epsilon_max"] == pytest.approx(epsilon([(1.0, 1.0, 2)], 1e-5))
    else:
        assert summary["privacy"]["epsilon_max"] is None and "sample count" in summary["privacy"]["epsilon_note"]
        assert "keeps on this node: acc" in caplog.text and "dp_epsilon" in caplog.text


def test_seeded_dp_noise_is_refused_under_flower():
    with pytest.raises(ConfigError, match="dp_reproducible_noise=True draws the DP noise from the run's seed"):
        run_config(_user_config(dp="prototypes", dp_reproducible_noise=True))


def test_server_app_logs_a_user_mistake_in_one_line(caplog):
    """Reported: every user mistake under Flower printed a ServerApp traceback."""
    from fedproto.flower import server_app

    uc = {**_user_config(), "resume-from": "/no/such/run"}
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=uc)
    server_app.main(LocalGrid(uc, [0, 1, 2, 3]), ctx)  # returns instead of raising
    assert any("fedproto: resume-from='/no/such/run' is not a folder" in r.getMessage() for r in caplog.records)


def test_a_fractional_partition_id_is_refused():
    """Reported: partition-id=2.5 was silently truncated to client 2."""
    uc = _user_config()
    with pytest.raises(TrainingError, match=r"partition-id=2.5 is not a whole number"):
        FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2.5, 3]), out=False)


# --- nodes with their own data and models (fedproto.flower.node) ------------------------------

NODE_CLASSES = [(0, 1, 2, 3), (2, 3, 4, 5), (4, 5, 0, 1)]  # neighbours share classes
NODE_MODELS = ["cnn", "projcnn:16-32", "cnn"]  # two architectures
OWN = dict(dataset="custom", classes=10, embedding_dim=50, clients=3, rounds=2, lr=0.05, threads=1, seed=7,
           execution="sequential", eval_every=0)


def _own_config(**kw) -> dict:
    """The Flower run config of a federation of own-data nodes."""
    return {k.replace("_", "-"): v for k, v in {**OWN, **kw}.items()}


def write_node_folders(root, shots=12, test_shots=4, labels=NODE_CLASSES) -> list:
    """One folder per node with train.npz / test.npz of digits samples of its classes."""
    from fedproto.data.datasets import load_dataset

    ds = load_dataset("digits")
    rng = np.random.default_rng(0)
    folders = []
    for i, classes in enumerate(labels):
        folder = root / f"node{i}"
        folder.mkdir(parents=True)
        for split, x, y, k in (("train", ds.train_x, ds.train_y, shots), ("test", ds.test_x, ds.test_y, test_shots)):
            idx = np.concatenate([rng.choice(np.flatnonzero(y.numpy() == c), k, replace=False) for c in classes])
            np.savez(folder / f"{split}.npz", x=x.numpy()[idx], y=y.numpy()[idx])
        folders.append(folder)
    return folders


def node_configs(folders, models=NODE_MODELS, extra: dict | None = None) -> list[dict]:
    """``--node-config`` of each node: client-id, data folder, model (plus ``extra[i]``)."""
    return [{"client-id": i, "data": str(f), "model": models[i], **(extra or {}).get(i, {})}
            for i, f in enumerate(folders)]


def in_process_reference(folders, models=NODE_MODELS, **options):
    """The same clients through the Python API: fedproto.federation.federate, models built by the
    zoo with the node's seeding rule (model_seed(seed, client-id))."""
    from fedproto.federation import Client, federate
    from fedproto.models.zoo import build_model

    opts = {k: v for k, v in {**OWN, **options}.items() if k not in ("dataset", "classes", "clients", "embedding_dim")}
    clients = []
    for i, f in enumerate(folders):
        tr, te = np.load(f / "train.npz"), np.load(f / "test.npz")
        model = build_model(models[i], i, 1, 10, 8, 50, 0.5, opts["seed"])
        clients.append(Client(model, (tr["x"], tr["y"]), (te["x"], te["y"])))
    return federate(clients, num_classes=10, out=False, **opts)


def test_own_data_nodes_give_the_python_api_numbers(tmp_path):
    """Three nodes, each with its own .npz folder and model (two architectures), a server with no
    data: the numbers of federate() with the same clients and seed."""
    folders = write_node_folders(tmp_path)
    uc = _own_config()
    grid = LocalGrid(uc, node_configs=node_configs(folders))
    eng = FlowerEngine(run_config(uc), grid, out=tmp_path / "run")
    # the server holds no client model and no data: nothing to checkpoint, no data to fingerprint
    assert eng.executor.client_states() is None and eng.executor.data_fingerprint() is None
    got = eng.run()
    ref = in_process_reference(folders)
    want = ref.run()
    for key in ("acc", "acc_proto"):
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
        assert got["accuracy"][key]["std"] == pytest.approx(want["accuracy"][key]["std"], abs=1e-9)
    for a, b in zip(eng.history, ref.history):
        assert a["loss_ce"] == pytest.approx(b["loss_ce"], rel=1e-6)
        assert a["loss_proto"] == pytest.approx(b["loss_proto"], rel=1e-6, abs=1e-12)
        assert a["up_params"] == b["up_params"]
    assert eng.history[1]["loss_proto"] > 0  # global prototypes mix clients (shared classes)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["sampled"] == rows[0]["replied"] == [0, 1, 2] and rows[0]["failed"] == {}
    assert got["model_params"][0] != got["model_params"][1]  # cnn and projcnn:16-32


def test_a_node_sending_nan_prototypes_is_dropped_and_logged(tmp_path, caplog):
    folders = write_node_folders(tmp_path)
    uc = _own_config()
    grid = LocalGrid(uc, node_configs=node_configs(folders, extra={1: {"misbehave": "nan"}}))
    got = FlowerEngine(run_config(uc), grid, out=tmp_path / "run").run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    why = "the prototype of class 2: values that are not finite; the prototype of class 3: values that are not finite"
    assert all(r["dropped"] == [1] and r["dropped_why"]["1"].startswith(why) for r in rows)
    assert any(f"dropped the reply of client 1 (node 1001): {why}" in r.getMessage() for r in caplog.records)
    assert np.isfinite(got["accuracy"]["acc_proto"]["mean"]) and np.isfinite(got["accuracy"]["acc"]["mean"])
    protos = np.load(tmp_path / "run" / "prototypes.npz")
    assert np.isfinite(protos["protos"]).all()
    # the global prototypes come from clients 0 and 2 only: classes 0..5, none from client 1 alone
    assert sorted(protos["classes"].tolist()) == [0, 1, 2, 3, 4, 5]


def test_messages_expire_with_their_round_and_an_expired_one_is_not_run(tmp_path, caplog):
    """The nodes kept starting ClientApps for a run that had stopped: Flower's default ttl is
    12 hours. Every message now lives the exchange's deadline plus TTL_MARGIN (the SuperLink drops
    it after that), and a ClientApp that gets one late refuses it before any handler runs."""
    from flwr.app import ConfigRecord

    from fedproto.flower.client_app import EXPIRY, MessageExpired
    from fedproto.flower.exchange import TTL_MARGIN
    from fedproto.flower.records import FlowerOptions

    folders = write_node_folders(tmp_path)
    uc = _own_config(**{"rounds": 2})
    grid = LocalGrid(uc, node_configs=node_configs(folders))
    ttls: list = []
    grid.on_send = lambda g, kind, group: ttls.append(kind)
    orig = grid.send_and_receive

    def keep(messages, *, timeout=None):
        ttls.extend(m.metadata.ttl for m in messages)
        return orig(messages, timeout=timeout)

    grid.send_and_receive = keep
    FlowerEngine(run_config(uc), grid, out=tmp_path / "run", options=FlowerOptions(round_timeout=45)).run()
    assert [k for k in ttls if isinstance(k, str)] == ["query", "train", "train", "evaluate"]
    assert [t for t in ttls if not isinstance(t, str)] == [45 + TTL_MARGIN] * 12  # 3 nodes x 4 exchanges
    assert EXPIRY["at"] > time.time() + 40  # the last message's expiry, noted for the executor's child

    late = Message(RecordDict({"fedproto.config": ConfigRecord({"round": 2})}), dst_node_id=1000,
                   message_type="train", ttl=75)
    late.metadata.__dict__["_created_at"] = time.time() - 200  # sent 200 s ago, expired 125 s ago
    called = []
    with pytest.raises(MessageExpired, match=r"the train message of round 2 expired 12[5-9]\.\d s before it "
                                             r"reached the ClientApp .* not run"):
        client_app.drop_expired(late, grid.contexts[1000], lambda m, c: called.append(m))
    assert called == [] and "a train message of round 2 expired" in caplog.text
    fresh = Message(RecordDict({"fedproto.config": ConfigRecord({"round": 2})}), dst_node_id=1000,
                    message_type="train", ttl=75)
    client_app.drop_expired(fresh, grid.contexts[1000], lambda m, c: called.append(m))
    assert called == [fresh] and EXPIRY["at"] == pytest.approx(fresh.metadata.created_at + 75)
    for ttl in (float("nan"), float("inf")):  # no expiry known (a NaN turned the child's watchdog off silently)
        fresh.metadata.__dict__["_ttl"] = ttl
        client_app.drop_expired(fresh, grid.contexts[1000], lambda m, c: called.append(m))
        assert called[-1] is fresh and EXPIRY["at"] == float("inf")


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


def test_nodes_with_labels_outside_the_classes_or_another_embedding_size_are_refused(tmp_path, monkeypatch, caplog):
    folders = write_node_folders(tmp_path, labels=[(0, 1), (1, 2), (2, 3)])
    np.savez(folders[2] / "train.npz", x=np.zeros((4, 1, 8, 8), np.float32), y=np.array([1, 2, 12, 3]))
    (tmp_path / "mymodels.py").write_text(
        "import torch.nn as nn\n"
        "def wide(num_classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_classes))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ncs = node_configs(folders, models=["cnn", "mymodels:wide", "cnn"], extra={1: {"head": "3"}})
    uc = _own_config()
    eng = FlowerEngine(run_config(uc), LocalGrid(uc, node_configs=ncs), out=False, wait_s=0)
    msgs = " ".join(r.getMessage() for r in caplog.records)
    assert ("node client-id=1: its model 'mymodels:wide' has embedding size 32, but the run's embedding-dim is 50"
            in msgs)
    assert "node client-id=2" in msgs and "label 12 is outside the run's classes 0..9" in msgs
    assert sorted(eng.nodes) == [0]
    assert eng.run()["clients"] == 3  # the run goes on with the node that joined


def test_a_plain_classifier_from_a_factory_joins_with_its_head(tmp_path, monkeypatch):
    folders = write_node_folders(tmp_path, labels=[(0, 1), (1, 2)])
    (tmp_path / "mymodels2.py").write_text(
        "import torch.nn as nn\n"
        "def mlp(num_classes, embedding_dim):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, embedding_dim), nn.ReLU(), "
        "nn.Linear(embedding_dim, num_classes))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ncs = node_configs(folders, models=["cnn", "mymodels2:mlp"], extra={1: {"head": "3"}})
    uc = _own_config(**{"clients": 2})
    got = FlowerEngine(run_config(uc), LocalGrid(uc, node_configs=ncs), out=False).run()
    assert got["accuracy"]["acc"]["mean"] > 0.5


def test_weight_sharing_baselines_start_from_the_lowest_client_ids_weights(tmp_path):
    folders = write_node_folders(tmp_path)
    uc = _own_config(**{"algorithm": "fedavg"})
    models = ["cnn", "cnn", "cnn"]
    eng = FlowerEngine(run_config(uc), LocalGrid(uc, node_configs=node_configs(folders, models=models)), out=False)
    got = eng.run()
    want = in_process_reference(folders, models=models, algorithm="fedavg").run()
    assert got["accuracy"]["acc"]["mean"] == pytest.approx(want["accuracy"]["acc"]["mean"], abs=1e-9)
    # the evaluate message carries the server's aggregate, so each node scores the global model too
    assert got["accuracy"]["acc_global"]["mean"] == pytest.approx(want["accuracy"]["acc_global"]["mean"], abs=1e-9)
    assert got["accuracy"]["acc_global"]["mean"] != pytest.approx(got["accuracy"]["acc"]["mean"], abs=1e-6)
    assert got["evaluation"] == want["evaluation"] and set(got["evaluation"]) == {"acc", "acc_global"}
    uc = _own_config(**{"algorithm": "fedavg"})
    with pytest.raises(ConfigError, match=r"fedavg averages model weights.*clients \[1\] differ from client 0"):
        FlowerEngine(run_config(uc), LocalGrid(uc, node_configs=node_configs(folders)), out=False).run()


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


def test_reply_checks_name_what_is_wrong():
    from fedproto.algorithms import FedAvg, FedProto
    from fedproto.engine.checks import reply_problem
    from fedproto.training import OptimConfig

    fp = FedProto(10, OptimConfig(), embedding_dim=5)
    good = {"classes": np.array([1, 4]), "protos": np.ones((2, 5), np.float32), "counts": np.array([3, 2])}
    assert reply_problem(fp, good, {}, 5) == ""
    cases = {"prototypes have shape (2, 5) and dtype float32, expected (2, 6) floats": ({}, 6),
             "repeats a class id": ({"classes": np.array([4, 4])}, 5),
             "unexpected entries ['x']": ({"x": np.zeros(1)}, 5),
             "entry 'protos' is a list": ({"protos": [[1.0] * 5] * 2}, 5)}
    for want, (change, d) in cases.items():
        assert want in reply_problem(fp, {**good, **change}, {}, d)
    # bad rows are dropped, the rest kept (Algorithm.reply_problems)
    bad = {"classes": np.array([1, 12, 4, 5]), "protos": np.ones((4, 5), np.float32),
           "counts": np.array([3, 2, 2, 1.5])}
    bad["protos"][2, 0] = np.nan
    clean, why = fp.reply_problems(0, bad)
    assert clean["classes"].tolist() == [1]
    assert why == ["the prototype of class 12: class 12 outside 0..9", "the prototype of class 4: values that are not "
                   "finite", "the prototype of class 5: count 1.5 not a whole number"]
    fa = FedAvg(10, OptimConfig())
    sent = {"w/a": np.zeros((2, 3), np.float32)}
    assert reply_problem(fa, {"w/a": np.ones((2, 3), np.float32), "n": np.array([5])}, sent, 5) == ""
    wrong = {"w/a": np.ones((3, 2), np.float32), "n": np.array([5])}
    assert "shape (3, 2), expected (2, 3)" in reply_problem(fa, wrong, sent, 5)
    assert "'n' is not one positive whole number" in reply_problem(fa, {"w/a": np.ones((2, 3), np.float32),
                                                                         "n": np.array([0])}, sent, 5)


def test_client_folder_of_images_is_read_by_class_folder(tmp_path):
    from PIL import Image

    from fedproto.data.folder import load_client_folder
    from fedproto.errors import DataError

    for split in ("train", "test"):
        for c in ("3", "cat"):
            (tmp_path / split / c).mkdir(parents=True)
            Image.fromarray(np.full((6, 6), 255 if c == "3" else 0, np.uint8)).save(tmp_path / split / c / "a.png")
    (x, y), (tx, ty) = load_client_folder(tmp_path, 10, ["zero", "one", "two", "three", "cat"])
    assert x.shape == (2, 1, 6, 6) and sorted(y.tolist()) == [3, 4] and float(x.max()) == 1.0
    with pytest.raises(DataError, match="sub-folder 'cat' is not a class id 0..9"):
        load_client_folder(tmp_path, 10)


def test_deployment_of_three_own_data_nodes_on_localhost_gives_the_python_api_numbers(tmp_path):
    """The real thing (a CI test): a SuperLink and 3 SuperNodes on 127.0.0.1 (free ports), each
    with its own .npz folder and model (cnn, projcnn:16-32, cnn), ``flwr run`` of the own-data
    Flower App (examples/flower/own_data), whose ServerApp has no dataset. Same numbers as
    federate() with the same clients; every process is stopped at the end."""
    from pathlib import Path

    from fedproto.deploy.local_federation import LocalFederation
    from fedproto.flower.records import FLOWER_KEYS

    app = Path(__file__).resolve().parents[2] / "examples" / "flower" / "own_data"
    src = str(Path(__file__).resolve().parents[2] / "src")
    app_cfg = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    folders = write_node_folders(tmp_path / "data")
    out = tmp_path / "runs"
    with LocalFederation(tmp_path / "fed", env={"PYTHONPATH": src}) as fed:
        fed.start_superlink()
        for nc in node_configs(folders):
            fed.start_supernode(nc)
        res = fed.flwr_run(app, {"rounds": 2, "out-dir": str(out), "seed": 7}, timeout=300)
        procs = list(fed.procs.values())
    assert all(p.poll() is not None for p in procs)  # all stopped
    logs = res.stdout + res.stderr
    assert "fedproto: fedproto on custom: accuracy" in logs, logs[-3000:] + fed.log("superlink")[-2000:]
    run = next(out.glob("*/summary.json")).parent
    got = json.loads((run / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["replied"] for r in rows] == [[0, 1, 2], [0, 1, 2]]
    opts = {k.replace("-", "_"): v for k, v in app_cfg.items()
            if k.replace("-", "_") not in (*FLOWER_KEYS, "dataset", "classes", "clients", "embedding_dim", "out_dir")}
    ref = in_process_reference(folders, **{**opts, "rounds": 2, "seed": 7})
    want = ref.run()
    for key in ("acc", "acc_proto"):
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
        assert got["accuracy"][key]["std"] == pytest.approx(want["accuracy"][key]["std"], abs=1e-9)
    for a, b in zip(rows, ref.history):
        assert a["loss_ce"] == pytest.approx(b["loss_ce"], rel=1e-6)
        assert a["loss_proto"] == pytest.approx(b["loss_proto"], rel=1e-6, abs=1e-12)
    assert got["params_per_round"] == want["params_per_round"]


@pytest.mark.slow
def test_an_authenticated_node_killed_mid_run_is_restarted_by_its_supervisor_and_rejoins_with_its_state(tmp_path):
    """On 127.0.0.1 with TLS and SuperNode authentication: node 1 runs under
    ``python -m fedproto.deploy.supervisor``; SIGKILLed in round 2, the supervisor deactivates its
    node id at the SuperLink (signed with its key), so its restart is let in at once, not refused
    for up to 60 s until its heartbeat expires ("Failed to activate SuperNode", Flower exit code
    305, before); it activates under the same node id, reloads its state file (same instance,
    restored 1) and takes part again; the run finishes."""
    import os
    import signal
    import threading

    from fedproto.deploy.local_federation import LocalFederation

    app = Path(__file__).resolve().parents[2] / "examples" / "flower" / "own_data"
    src = str(Path(__file__).resolve().parents[2] / "src")
    folders = write_node_folders(tmp_path / "data")
    out, state = tmp_path / "runs", tmp_path / "state1"
    ncs = node_configs(folders, extra={1: {"state-dir": str(state)}})
    got: dict = {}
    with LocalFederation(tmp_path / "fed", tls=True, auth=True, env={"PYTHONPATH": src}) as fed:
        fed.start_superlink()
        for i, nc in enumerate(ncs):
            fed.start_supernode(nc, restart=(1.0, 4.0) if i == 1 else None)
        run = threading.Thread(target=lambda: got.update(res=fed.flwr_run(
            app, {"rounds": 4, "out-dir": str(out), "seed": 7, "round-timeout": 60, "min-replies": 1},
            timeout=1200)))
        run.start()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not list(out.glob("*/metrics.jsonl")):
            time.sleep(0.5)
        metrics = next(out.glob("*/metrics.jsonl"))
        while time.monotonic() < deadline and not metrics.read_text().strip():  # until round 1 is logged
            time.sleep(0.5)
        time.sleep(0.5)  # round 2 is under way
        os.kill(fed.supernode_pids("node1")[-1], signal.SIGKILL)
        before = torch.load(next(state.glob("*.pt")), weights_only=True)
        run.join(1200)
        node_log = fed.log("node1")
    res = got["res"]
    logs = res.stdout + res.stderr
    assert "fedproto: fedproto on custom: accuracy" in logs, logs[-3000:] + node_log[-3000:]
    assert len(fed.supernode_pids("node1")) >= 2, node_log[-3000:]  # restarted
    assert "(Fleet API DeactivateNode): it can rejoin at once" in node_log and "restart 1 in 1 s" in node_log
    assert "Failed to activate SuperNode" not in node_log  # not refused: the heartbeat was not waited for
    assert node_log.count("SuperNode ID:") == 2
    run_dir = next(out.glob("*/summary.json")).parent
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    missed = [r["round"] for r in rows if 1 not in r["replied"]]
    assert 1 in rows[0]["replied"] and missed[:1] == [2], rows  # killed in round 2
    assert before["round"] in (1, 2)  # its state file when it was killed
    assert 1 in rows[-1]["replied"], rows  # back, under the same node id
    after = torch.load(next(state.glob("*.pt")), weights_only=True)
    assert after["instance"] == before["instance"] and after["round"] == rows[-1]["round"]
    # the server saw it come back with its state: recorded, logged, and scored as the others
    rejoined = [r["rejoined"] for r in rows if "rejoined" in r]
    assert rejoined == [{"1": "restarted with its state restored from its state file"}], rows
    assert "restarted and reloaded its state from its state file" in logs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["left_out"] == {}
    assert [c["state_lost_round"] for c in csv.DictReader(open(run_dir / "clients.csv"))] == ["", "", ""]


def test_flower_options_are_read_and_checked():
    from fedproto.flower.records import FlowerOptions

    o = FlowerOptions.from_user_config({"round-timeout": 5, "min-replies": 2, "class-names": "cat, dog", "lr": 0.1})
    assert (o.round_timeout, o.min_replies, o.round_retries, o.class_names) == (5.0, 2, 2, ("cat", "dog"))
    with pytest.raises(ConfigError, match=r"min-replies=0; give a whole number >= 1"):
        FlowerOptions.from_user_config({"min-replies": 0})
    with pytest.raises(ConfigError, match=r"round-timeout=0; give a number of seconds > 0"):
        FlowerOptions.from_user_config({"round_timeout": 0})
    for key in ("round-timeout", "wait-nodes", "min-replies", "round-retries"):
        for bad in (float("nan"), float("inf")):
            with pytest.raises(ConfigError, match=rf"Flower run config: {key}={bad!r}; give .*not NaN or infinity"):
                FlowerOptions.from_user_config({key: bad})
    assert run_config({"dataset": "custom", "classes": 4, "round-timeout": 3}).model == "custom"


def test_credentials_for_tls_and_node_authentication(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from fedproto.deploy.local_federation import LocalFederation, config_arg, make_credentials

    c = make_credentials(tmp_path, 2)
    cert = x509.load_pem_x509_certificate(c.server_cert.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "127.0.0.1" in [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    assert cert.issuer == x509.load_pem_x509_certificate(c.ca_cert.read_bytes()).subject
    priv, pub = c.node_keys[1]
    key = serialization.load_ssh_private_key(priv.read_bytes(), None)
    assert key.curve.name == "secp384r1" and pub.read_text().startswith("ecdsa-sha2-nistp384 ")
    assert config_arg({"client-id": 0, "data": "/a b", "x": 1.5}) == 'client-id=0 data="/a b" x=1.5'
    with pytest.raises(ConfigError, match="SuperNode authentication needs TLS"):
        LocalFederation(tmp_path / "fed", auth=True)


def test_credentials_keep_private_keys_private_and_renew_under_the_same_ca(tmp_path):
    """server.key was written with mode 0644, the CA key was not kept (no renewal), certificates lasted 30 days."""
    import datetime
    import stat

    from cryptography import x509

    from fedproto.deploy.local_federation import make_credentials

    folder = tmp_path / "creds"
    c = make_credentials(folder, 2, days=90)
    ca_key = tmp_path / "creds-ca" / "ca.key"
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert [mode(p) for p in (c.server_key, ca_key, c.node_keys[0][0], c.node_keys[1][0])] == [0o600] * 4
    assert mode(ca_key.parent) == 0o700 and not any(p.name.endswith(".key") and p.name != "server.key"
                                                    for p in folder.iterdir())  # the CA key is not in the folder
    cert = x509.load_pem_x509_certificate(c.server_cert.read_bytes())
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert life == datetime.timedelta(days=90)
    ca_before, node_before = c.ca_cert.read_bytes(), c.node_keys[1][1].read_bytes()
    r = make_credentials(folder, 3, days=30)  # renewal: same CA and node keys, a new server certificate, node 2 added
    renewed = x509.load_pem_x509_certificate(r.server_cert.read_bytes())
    assert r.ca_cert.read_bytes() == ca_before and r.node_keys[1][1].read_bytes() == node_before
    assert renewed.serial_number != cert.serial_number and len(r.node_keys) == 3
    ca = x509.load_pem_x509_certificate(r.ca_cert.read_bytes())
    renewed.verify_directly_issued_by(ca)  # raises if the renewed certificate is not the kept CA's
    ca_key.unlink()
    with pytest.raises(ConfigError, match="a CA is renewed from its certificate and its key together"):
        make_credentials(folder, 1)
    with pytest.raises(ConfigError, match="days=0"):
        make_credentials(tmp_path / "other", 1, days=0)


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


def test_when_every_reply_is_dropped_the_stop_message_names_them(tmp_path, monkeypatch, caplog):
    from fedproto.flower import executor
    from fedproto.flower.records import FlowerOptions

    monkeypatch.setattr(executor, "RETRY_PAUSE_S", 0.0)
    folders = write_node_folders(tmp_path)
    uc = _own_config()
    ncs = node_configs(folders, extra={i: {"misbehave": "nan"} for i in range(3)})
    eng = FlowerEngine(run_config(uc), LocalGrid(uc, node_configs=ncs), out=tmp_path / "run",
                       options=FlowerOptions(round_retries=0))
    with pytest.raises(TrainingError) as e:
        eng.run()
    msg = str(e.value)
    assert msg.startswith("round 1: 0 valid replies, fewer than min-replies=1, after 0 retries (failed: none; "
                          "unavailable: none; timed out: none; dropped: {'0': 'the prototype of class 0: values that "
                          "are not finite")
    assert "check the data and models of the nodes whose replies were dropped" in msg
    assert "restart" not in msg
    logged = [r.getMessage() for r in caplog.records if "dropped the reply of client" in r.getMessage()]
    assert len(logged) == 3 and "client 1 (node 1001): the prototype of class 2" in logged[1]


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


_BAD_MODELS = """
import torch.nn as nn
def raises(num_classes):
    raise RuntimeError("boom in factory")
class Tuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Flatten(), nn.Linear(64, 50))
        self.h = nn.Linear(50, 10)
    def forward(self, x):
        e = self.f(x)
        return self.h(e), e
def tuple_model():
    return Tuple()
"""


@pytest.mark.parametrize("extra, data, want", [
    ({"model": "badmodels_t:raises"}, None, r"model factory 'badmodels_t:raises' failed \(RuntimeError: boom"),
    ({"model": "importboom_t:f"}, None, r"'importboom_t:f' failed while importing \(RuntimeError: import-time boom"),
    ({"model": ":"}, None, r"model ':' is neither a zoo model .* nor an import path package.module:factory"),
    ({"model": ".mod:f"}, None, r"model '.mod:f' is neither a zoo model"),
    ({"model": "projcnn:abc"}, None, r"bad model spec 'projcnn:abc': write projcnn:<channels>-<channels>"),
    ({"model": "badmodels_t:tuple_model", "head": "h"}, None,
     r"failed on a training input .*; if its forward returns \(logits, embedding\) itself, leave out head='h'"),
    ({"model": "cnn"}, "small", r"model 'cnn' cannot be built for inputs of shape \(1, 2, 2\) .*give larger images"),
    ({"model": "cnn"}, "scalar", r"x has shape \(\) and y \(1,\); give one row of x"),
    ({"hed": "fc"}, None, r"unknown node config key\(s\) 'hed'; the known keys are client-id, data, model, head"),
    ({"clientid": 2, "modle": "cnn"}, None, r"unknown node config key\(s\) 'clientid', 'modle'"),
])
def test_every_node_refusal_names_the_client_and_the_fix(tmp_path, monkeypatch, extra, data, want):
    from fedproto.flower.node import load_local_client

    (tmp_path / "badmodels_t.py").write_text(_BAD_MODELS)
    (tmp_path / "importboom_t.py").write_text("raise RuntimeError('import-time boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    folder = tmp_path / "node"
    folder.mkdir()
    x = {"small": np.zeros((4, 1, 2, 2), np.float32), "scalar": np.float32(3)}.get(data)
    x = np.random.default_rng(0).normal(size=(4, 1, 8, 8)).astype(np.float32) if x is None else x
    for split in ("train", "test"):
        np.savez(folder / f"{split}.npz", x=x, y=np.array([0, 1, 2, 3]) if x.ndim else np.array([0]))
    nc = {"client-id": 4, "data": str(folder), "model": "cnn", **extra}
    if "clientid" in extra:
        del nc["client-id"]
    prefix = "this SuperNode" if "clientid" in extra else "node client-id=4"
    with pytest.raises(ConfigError, match=rf"^{prefix}: .*{want}"):
        load_local_client(nc, run_config(_own_config()))


def test_images_are_grayscale_or_rgb_per_client_and_16_bit_images_are_scaled(tmp_path):
    from PIL import Image

    from fedproto.data.folder import load_client_folder

    mixed, deep = tmp_path / "mixed", tmp_path / "deep"
    for split in ("train", "test"):
        for root in (mixed, deep):
            (root / split / "0").mkdir(parents=True)
    Image.fromarray(np.full((4, 4), 255, np.uint8)).save(mixed / "train" / "0" / "a.png")  # grayscale
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(mixed / "test" / "0" / "a.png")  # RGB
    (x, _), (tx, _) = load_client_folder(mixed, 2)
    assert x.shape == tx.shape == (1, 3, 4, 4) and float(x.min()) == 1.0
    for split, v in (("train", 65535), ("test", 32768)):
        Image.fromarray(np.full((4, 4), v, np.uint16)).save(deep / split / "0" / "a.png")  # 16-bit PNG
    (x, _), (tx, _) = load_client_folder(deep, 2)
    assert x.shape == (1, 1, 4, 4) and float(x.max()) == 1.0 and float(tx.max()) == pytest.approx(32768 / 65535)


def test_min_replies_above_clients_is_refused_up_front():
    from fedproto.flower.records import FlowerOptions

    uc = _own_config()
    grid = LocalGrid(uc, partition_ids=[])
    with pytest.raises(ConfigError, match=r"min-replies=5 is larger than clients=3.*give min-replies <= clients"):
        FlowerEngine(run_config(uc), grid, out=False, options=FlowerOptions(min_replies=5), wait_s=0)
    assert grid.sent == []


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


def test_a_run_stopped_by_a_lost_superlink_resumes_on_a_new_one_with_every_round_kept(tmp_path, caplog):
    """The SuperLink goes away in round 3 of 4. The server has written a checkpoint
    after every round and writes failure.json (the round, the error, the resume command). A new
    SuperLink (new Flower run id, new node contexts, nodes restarted: their state comes from their
    state files, keyed by the server's run key) continues the run with ``resume-from``: rounds 1-2
    kept, the numbers of a run that was never interrupted."""
    from fedproto.flower.records import FlowerOptions

    folders = write_node_folders(tmp_path)
    uc = _own_config(rounds=4)
    want = FlowerEngine(run_config(uc), LocalGrid(uc, node_configs=node_configs(folders)), out=False).run()
    client_app.forget_clients()

    def superlink_dies(grid, kind, group):
        if kind == "train" and group == "3":
            raise RuntimeError("StatusCode.UNAVAILABLE: the SuperLink went away")

    grid = LocalGrid(uc, node_configs=node_configs(folders))
    grid.on_send = superlink_dies
    run = tmp_path / "run"
    eng = FlowerEngine(run_config(uc), grid, out=run)
    eng.run_cfg = uc  # as the ServerApp's main sets it
    with pytest.raises(RuntimeError, match="SuperLink went away"):
        eng.run()
    failure = json.loads((run / "failure.json").read_text())
    assert (failure["round"], failure["rounds_completed"], failure["error"]) == (3, 2, "RuntimeError")
    app_dir = str(run.absolute() / "resume-app")
    assert failure["checkpoint"] and failure["resume"] == f"flwr run {shlex.quote(app_dir)} --stream"
    assert "flwr uses the default connection of FLWR_HOME/config.toml" in failure["resume_note"]
    app_cfg = tomllib.loads((run / "resume-app" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert app_cfg == {**uc, "resume-from": str(run.absolute()), "wait-nodes": 180.0}
    assert [r["round"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [1, 2]
    assert not (run / "summary.json").exists()

    client_app.forget_clients()  # new SuperNode processes
    grid = LocalGrid(uc, node_configs=node_configs(folders))
    for nid, c in grid.contexts.items():  # a new SuperLink: a new Flower run id
        grid.contexts[nid] = Context(run_id=2, node_id=nid, node_config=c.node_config, state=RecordDict(),
                                     run_config=c.run_config)
    resumed = {**uc, "resume-from": str(run)}
    with caplog.at_level("WARNING"):
        got = FlowerEngine(run_config(resumed), grid, options=FlowerOptions.from_user_config(resumed)).run()
    # the nodes join the resumed run before its first round (the drill saw "round 0" in the log)
    assert "at the start: client 1 (node 1001) restarted and reloaded its state from its state file" in caplog.text
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert not (run / "failure.json").exists() and not (run / "checkpoint.pt").exists()
    assert not (run / "resume-app").exists()  # the stopped run's record goes with failure.json
    assert all(r["rejoined"] == {str(i): "restarted with its state restored from its state file" for i in range(3)}
               for r in rows[2:3])
    for key in want["accuracy"]:
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)


@pytest.mark.slow
def test_a_superlink_killed_mid_run_is_restarted_and_the_resume_command_finishes_the_run(tmp_path):
    """On 127.0.0.1 with TLS and SuperNode authentication: three own-data nodes
    (each under ``python -m fedproto.deploy.supervisor``), FedProto, 4 rounds. The SuperLink is
    SIGKILLed in round 2 (its process only: the ServerApp it started lives on, as after a crash);
    the run folder then holds failure.json and a checkpoint of round 1 (or 2). The SuperLink is
    started again on the same port and database file (the node keys stay registered); the nodes
    reconnect, and ``flwr run ... --run-config "resume-from='<run folder>'"`` (the same overrides
    plus resume-from) finishes the run: rounds 1..4 each once in metrics.jsonl, failure.json gone,
    summary.json written, and every node whose SuperNode restarted recorded as restored."""
    import os
    import signal
    import threading

    from fedproto.deploy.local_federation import LocalFederation
    from fedproto.outputs.checkpoint import load_checkpoint

    app = Path(__file__).resolve().parents[2] / "examples" / "flower" / "own_data"
    src = str(Path(__file__).resolve().parents[2] / "src")
    folders = write_node_folders(tmp_path / "data")
    out = tmp_path / "runs"
    ncs = node_configs(folders, extra={i: {"state-dir": str(tmp_path / f"state{i}")} for i in range(3)})
    overrides = {"rounds": 4, "out-dir": str(out), "seed": 7, "round-timeout": 60, "min-replies": 1}
    got: dict = {}
    with LocalFederation(tmp_path / "fed", tls=True, auth=True, env={"PYTHONPATH": src}) as fed:
        fed.start_superlink()
        for nc in ncs:
            fed.start_supernode(nc, restart=(1.0, 4.0))
        first = threading.Thread(target=lambda: got.update(first=fed.flwr_run(app, overrides, timeout=900)))
        first.start()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not list(out.glob("*/metrics.jsonl")):
            time.sleep(0.5)
        metrics = next(out.glob("*/metrics.jsonl"))
        run_dir = metrics.parent
        while time.monotonic() < deadline and not metrics.read_text().strip():  # until round 1 is logged
            time.sleep(0.5)
        time.sleep(0.5)  # round 2 is under way
        os.kill(fed.procs["superlink"].pid, signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() < deadline and not (run_dir / "failure.json").exists():  # within round-timeout
            time.sleep(0.5)
        noticed = time.monotonic() - killed
        failure = json.loads((run_dir / "failure.json").read_text())
        stopped = [json.loads(x)["round"] for x in metrics.read_text().splitlines()]
        assert failure["rounds_completed"] == len(stopped) and stopped in ([1], [1, 2]), (failure, stopped)
        assert failure["checkpoint"] and (run_dir / "checkpoint.pt").is_file()
        assert load_checkpoint(run_dir / "checkpoint.pt")["round"] == len(stopped)
        assert failure["resume"] == f"flwr run {shlex.quote(str(run_dir.absolute() / 'resume-app'))} --stream"
        resume_app = tomllib.loads((run_dir / "resume-app" / "pyproject.toml").read_text())
        assert {k: resume_app["tool"]["flwr"]["app"]["config"][k] for k in ("rounds", "seed", "out-dir",
                                                                            "resume-from", "wait-nodes")} == \
            {"rounds": 4, "seed": 7, "out-dir": str(out), "resume-from": str(run_dir.absolute()), "wait-nodes": 180.0}
        assert not (run_dir / "summary.json").exists()
        starts = {f"node{i}": len(fed.supernode_pids(f"node{i}")) for i in range(3)}
        fed.start_superlink(name="superlink2")
        res = fed.run_printed(failure["resume"], timeout=900)  # as printed: no placeholder to fill in
        restarted = {i for i in range(3) if len(fed.supernode_pids(f"node{i}")) > 1}
        first.join(60)  # the first flwr run (its stream retries the SuperLink, then sees its run finished)
        logs = {name: fed.log(name) for name in fed.procs}
    text = res.stdout + res.stderr
    assert "fedproto: fedproto on custom: accuracy" in text, (text[-3000:], {k: v[-1500:] for k, v in logs.items()})
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4], rows
    assert not (run_dir / "failure.json").exists() and (run_dir / "summary.json").is_file()
    assert not (run_dir / "checkpoint.pt").exists()
    rejoined = {}
    for r in rows[len(stopped):]:
        rejoined.update(r.get("rejoined", {}))
    # a new Flower run: every node starts from a fresh context (restarted SuperNode or not) and reloads its state file
    assert rejoined == {str(i): "restarted with its state restored from its state file" for i in range(3)}, rows
    assert "did not answer" in failure["message"] and noticed < 60 + 30, (failure, noticed)  # round-timeout=60
    print(f"failure.json {noticed:.0f} s after the kill: {failure['message'][:80]}; stopped after rounds {stopped}; "
          f"SuperNode starts when the SuperLink was killed: {starts}; restarted by the end: {sorted(restarted)}; "
          f"first flwr run: {got['first'].returncode if 'first' in got else 'still running'}")


def test_the_warm_executor_gives_the_numbers_of_the_default_path(tmp_path):
    """A CI test (45-55 s on 2 loaded cores): the three own-data SuperNodes started with
    ``--isolation process`` and ``python -m fedproto.deploy.warm_executor`` each (one warm process
    that forks per message) give the in-process numbers, as the default path does in the test
    above; every executor decoded its node's data and warmed up before the first task, ran one
    forked ClientApp per message (query, 2 x train, evaluate) and is stopped at the end."""
    from pathlib import Path

    from fedproto.deploy.local_federation import LocalFederation
    from fedproto.flower.records import FLOWER_KEYS

    app = Path(__file__).resolve().parents[2] / "examples" / "flower" / "own_data"
    src = str(Path(__file__).resolve().parents[2] / "src")
    app_cfg = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    folders = write_node_folders(tmp_path / "data")
    out = tmp_path / "runs"
    with LocalFederation(tmp_path / "fed", env={"PYTHONPATH": src}) as fed:
        fed.start_superlink()
        for nc in node_configs(folders):
            fed.start_supernode(nc, executor="fedproto")
        res = fed.flwr_run(app, {"rounds": 2, "out-dir": str(out), "seed": 7}, timeout=300)
        procs = list(fed.procs.values())
        logs = {name: fed.log(name) for name in fed.procs}
    assert sorted(logs) == ["node0", "node0-executor", "node1", "node1-executor", "node2", "node2-executor",
                            "superlink"]
    assert all(p.poll() is not None for p in procs)  # all stopped
    text = res.stdout + res.stderr
    assert "fedproto: fedproto on custom: accuracy" in text, text[-3000:] + logs["node0-executor"][-3000:]
    for i in range(3):
        ex = logs[f"node{i}-executor"]
        assert "ready in" in ex and "64 samples decoded, warm-up done" in ex, ex[-2000:]  # 4 classes x (12 + 4)
        assert ex.count("ClientApp in process") == 4, ex[-3000:]  # query, train x 2, evaluate: one fork each
        assert "exited with" not in ex, ex[-3000:]
    run = next(out.glob("*/summary.json")).parent
    got = json.loads((run / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["replied"] for r in rows] == [[0, 1, 2], [0, 1, 2]]
    opts = {k.replace("-", "_"): v for k, v in app_cfg.items()
            if k.replace("-", "_") not in (*FLOWER_KEYS, "dataset", "classes", "clients", "embedding_dim", "out_dir")}
    want = in_process_reference(folders, **{**opts, "rounds": 2, "seed": 7}).run()
    for key in ("acc", "acc_proto"):
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
        assert got["accuracy"][key]["std"] == pytest.approx(want["accuracy"][key]["std"], abs=1e-9)


def test_executor_options_are_checked_with_the_fix(tmp_path):
    from fedproto.deploy.local_federation import LocalFederation
    from fedproto.deploy.warm_executor import parse_node_config, preload, serve

    assert parse_node_config('client-id=0 data="/d" model="cnn"') == {"client-id": 0, "data": "/d", "model": "cnn"}
    assert parse_node_config(None) == {} == parse_node_config("  ")
    with pytest.raises(ConfigError, match=r"--node-config 'client-id=0 data=/d' cannot be parsed"):
        parse_node_config("client-id=0 data=/d")
    with pytest.raises(ConfigError, match=r"give --insecure .* or --root-certificates CA.pem"):
        serve("127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"poll_interval=0.0: give seconds between 0.01 and 60"):
        serve("127.0.0.1:1", insecure=True, poll_interval=0.0)
    with pytest.raises(ConfigError, match=r"executor='warm': choose None \(Flower's default\), 'fedproto' or 'flower'"):
        LocalFederation(tmp_path / "fed").start_supernode({"client-id": 0}, executor="warm")
    # what cannot be preloaded is said, not fatal: the ClientApp then reads the data per message
    from fedproto.data.folder import keep_decoded

    try:
        info = preload({"client-id": 0, "data": str(tmp_path / "missing"), "model": "cnn"})
    finally:
        keep_decoded(False)  # preload keeps decoded folders for the whole process: not for the tests after this
    assert info["samples"] is None and info["warm"] is False
    assert "does not exist" in info["skipped"][0] and "each message decodes it" in info["skipped"][0]


class PushPullGrid(LocalGrid):
    """A grid with push/pull (as a SuperLink's): each reply is ready only at the second pull."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.pulls, self._ready = 0, {}

    def push_messages(self, messages):
        messages = list(messages)
        replies = LocalGrid.send_and_receive(self, messages)
        for m in messages:
            self._ready[m.metadata.message_id] = [r for r in replies if r.metadata.reply_to_message_id ==
                                                  m.metadata.message_id]
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids):
        self.pulls += 1
        out = []
        for i in list(message_ids):
            if self._ready.get(i) is not None and self.pulls % 2 == 0:
                out += self._ready.pop(i)
        return out

    def send_and_receive(self, messages, *, timeout=None):
        raise AssertionError("the server pushes and pulls itself")


def test_the_server_pulls_replies_at_its_own_poll_interval():
    """Flower's Grid.send_and_receive sleeps 3 s between pulls; the server pushes and pulls itself
    every ``poll-interval`` seconds, with the numbers of the default exchange."""
    from fedproto.flower.records import FlowerOptions

    uc = _user_config()
    want = FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2, 3]), out=False).run()
    grid = PushPullGrid(uc, [0, 1, 2, 3])
    t0 = time.perf_counter()
    got = FlowerEngine(run_config(uc), grid, out=False, options=FlowerOptions(poll_interval=0.01)).run()
    assert time.perf_counter() - t0 < 20 and grid.pulls >= 2 * (1 + BASE["rounds"] + 1)
    assert got["accuracy"] == want["accuracy"]
    with pytest.raises(ConfigError, match=r"poll-interval=0; give a number of seconds > 0"):
        FlowerOptions.from_user_config({"poll-interval": 0})


class OneBehindGrid(PushPullGrid):
    """Node 1001 is one reply behind (the drill's node after a SuperLink restart): each pull brings its reply to the
    message before, never to the one asked."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.held: list = []

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        late = [m for m in messages if m.metadata.dst_node_id == 1001]
        for m in late:  # its reply to this message comes with the next one
            self._ready[m.metadata.message_id], self.held[:] = list(self.held), self._ready[m.metadata.message_id]
        return ids

    def pull_messages(self, message_ids):
        self.pulls += 1
        out = []
        for i in list(message_ids):
            out += self._ready.pop(i, None) or []
        return out


def test_a_reply_to_an_earlier_message_is_not_counted_for_the_next_one(tmp_path):
    """A reply counts only for the message (id and run) it answers: the late reply of a node one message behind
    was matched by its source node and counted as the next round's."""
    from fedproto.flower.records import FlowerOptions

    folders = write_node_folders(tmp_path / "data")
    uc = _own_config(**{"round-timeout": 30, "rounds": 1})  # a push runs the ClientApps here: room for a loaded CPU
    grid = OneBehindGrid(uc, node_configs=node_configs(folders))
    eng = FlowerEngine(run_config(uc), grid, out=False, options=FlowerOptions(poll_interval=0.01, round_timeout=30.0,
                                                                             wait_nodes=3))
    assert sorted(eng.nodes) == [0, 2]  # node 1001's query reply never came back as the query's
    eng.run()
    assert [row["replied"] for row in eng.history] == [[0, 2]]


def test_a_poll_interval_that_floods_the_superlink_or_outlasts_the_round_is_refused():
    """poll-interval=1e-6 (a million pulls a second) and 1e9 were accepted; one not below
    round-timeout made every round last the whole round-timeout."""
    from fedproto.flower.records import FlowerOptions

    for bad in (1e-6, 0.001, 61, 1e9):
        with pytest.raises(ConfigError, match=rf"poll-interval={bad!r}; give seconds between 0.01 and 60"):
            FlowerOptions.from_user_config({"poll-interval": bad})
    with pytest.raises(ConfigError, match=r"poll-interval=5 is not below round-timeout=2; every round would last"):
        FlowerOptions.from_user_config({"poll-interval": 5, "round-timeout": 2})
    with pytest.raises(ConfigError, match=r"poll-interval=0.2 is not below round-timeout=0.1.*longer round-timeout"):
        FlowerOptions.from_user_config({"round-timeout": 0.1})
    o = FlowerOptions.from_user_config({"poll-interval": 0.01, "round-timeout": 0.5})
    assert (o.poll_interval, o.round_timeout) == (0.01, 0.5)
    assert FlowerOptions.from_user_config({"poll-interval": 60}).poll_interval == 60.0


class HangingGrid(PushPullGrid):
    """A SuperLink that dies during round ``hang_round``: from then on a pull never returns (as
    Flower's ServerApp retries a SuperLink it cannot reach, without end)."""

    def __init__(self, *a, hang_round: int = 2, **kw):
        super().__init__(*a, **kw)
        self.hang_round, self.release = hang_round, threading.Event()
        self.hanging = False

    def push_messages(self, messages):
        messages = list(messages)
        if messages and messages[0].metadata.message_type == "train" and \
                messages[0].metadata.group_id == str(self.hang_round):
            self.hanging = True  # the SuperLink is gone: the messages are never delivered
            return [f"lost{i}" for i in range(len(messages))]
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        if self.hanging:
            self.release.wait(120)
            raise RuntimeError("released")
        return super().pull_messages(message_ids)


def test_a_superlink_that_stops_answering_stops_the_run_within_round_timeout_with_failure_json(tmp_path):
    """A call to the SuperLink that does not return (Flower retries a dead SuperLink
    without end) stops the run after ``round-timeout`` s with a TrainingError naming the call;
    failure.json and the checkpoint of round 1 are in the run folder, and its lock is released."""
    from fedproto.flower.records import FlowerOptions

    uc = _user_config()
    grid = HangingGrid(uc, [0, 1, 2, 3], hang_round=2)
    run = tmp_path / "run"
    t0 = time.monotonic()
    try:
        # round-timeout 10 s: this grid's push runs the ClientApps in this process (their set-up and
        # training: seconds on a loaded machine); the wait in round 2 is max(10 s, 3 x round 1's exchange)
        with pytest.raises(TrainingError, match=r"the SuperLink did not answer pull_messages within [\d.]+ s "
                                                r"\(round-timeout; Flower keeps retrying it\)"):
            FlowerEngine(run_config(uc), grid, out=run, options=FlowerOptions(poll_interval=0.01,
                                                                              round_timeout=10)).run()
    finally:
        grid.release.set()
    assert time.monotonic() - t0 < 120
    failure = json.loads((run / "failure.json").read_text())
    assert (failure["round"], failure["rounds_completed"], failure["error"], failure["checkpoint"]) == \
        (2, 1, "TrainingError", True)
    assert "did not answer pull_messages" in failure["message"]
    assert [json.loads(x)["round"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert not (run / ".lock").exists()  # released: the resumed run (another ServerApp) may write here


def test_a_signal_to_the_server_app_writes_failure_json_before_flowers_handler(tmp_path):
    """Flower ends the ServerApp on SIGINT/SIGTERM (also when a restarted SuperLink refuses its
    token) and may end it with os._exit: failure_on_signal writes failure.json first (error
    Stopped, naming the signal), then hands the signal on; the handlers are put back afterwards."""
    import os
    import signal

    from fedproto.flower.server_app import failure_on_signal

    seen = []

    def flowers_handler(signum, frame):  # stands for Flower's graceful_exit_handler
        seen.append(signum)
        raise SystemExit(1)

    def stop(grid, kind, group):
        if kind == "train" and group == "3":
            os.kill(os.getpid(), signal.SIGTERM)

    uc = _user_config()
    grid = LocalGrid(uc, [0, 1, 2, 3])
    grid.on_send = stop
    run = tmp_path / "run"
    before = signal.signal(signal.SIGTERM, flowers_handler)
    try:
        engine = FlowerEngine(run_config(uc), grid, out=run)
        with pytest.raises(SystemExit), failure_on_signal(engine):
            engine.run()
        assert signal.getsignal(signal.SIGTERM) is flowers_handler
    finally:
        signal.signal(signal.SIGTERM, before)
    assert seen == [signal.SIGTERM]
    failure = json.loads((run / "failure.json").read_text())
    assert (failure["round"], failure["rounds_completed"], failure["error"]) == (3, 2, "Stopped")
    assert failure["message"] == "the ServerApp process got SIGTERM" and failure["checkpoint"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pathspec's, inside Flower's FAB build
def test_the_resume_app_holds_every_option_of_the_stopped_run_and_flower_builds_it(tmp_path):
    """failure.json's command had placeholders (``<app folder> <connection>``): it is now
    ``flwr run '<run folder>/resume-app' --stream``, an app whose config is the stopped run's
    whole run config with ``resume-from`` (absolute) and ``wait-nodes`` >= 180 s; Flower validates
    and builds it as it would the user's own app."""
    from flwr.cli.build import build_fab_from_disk
    from flwr.common.config import validate_fields_in_config

    from fedproto.flower.server_app import write_resume_app

    cfg = {"rounds": 4, "lr": 0.05, "out-dir": "/r uns/a", "name": "it's \\ \"q\"", "tensorboard": False,
           "resume-from": "", "wait-nodes": 60.0}
    run = tmp_path / "run s"
    run.mkdir()
    app = write_resume_app(run, cfg)
    assert app == run.absolute() / "resume-app"
    text = tomllib.loads((app / "pyproject.toml").read_text())
    assert text["tool"]["flwr"]["app"]["config"] == {**cfg, "resume-from": str(run.absolute()), "wait-nodes": 180.0}
    ok, errors, warnings = validate_fields_in_config(text)
    assert ok and errors == [] and warnings == [], (errors, warnings)
    assert len(build_fab_from_disk(app)) > 100  # a FAB, as `flwr run` builds it
    assert tomllib.loads((write_resume_app(run, {**cfg, "wait-nodes": 600}) / "pyproject.toml").read_text())[
        "tool"]["flwr"]["app"]["config"]["wait-nodes"] == 600.0
    # from the breaker: a DEL character made invalid TOML; a value Flower cannot hold is refused, nothing written
    odd = {"s": "a\x7fb\x00c\n\"'\\", "k y": 1, "nan": float("nan"), "wait-nodes": float("nan")}
    got = tomllib.loads((write_resume_app(run, odd) / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert got["s"] == odd["s"] and got["k y"] == 1 and got["wait-nodes"] == 180.0 and got["nan"] != got["nan"]
    before = (app / "pyproject.toml").read_bytes()
    for bad, why in (({"x": None}, "x=None: a Flower run config holds bools, numbers and strings only"),
                     ({"x": [1]}, "x=\\[1\\]"), ({"x": "\ud800"}, "cannot be written as TOML")):
        with pytest.raises(ValueError, match=why):
            write_resume_app(run, bad)
        assert (app / "pyproject.toml").read_bytes() == before


def test_the_resume_command_gives_every_option_of_the_stopped_run_as_flower_parses_it():
    """failure.json's command lists the stopped run's whole run config (so that the resumed run
    has its options, whatever its --run-config was), in the form ``flwr run --run-config`` parses."""
    from flwr.common.config import parse_config_args

    from fedproto.flower.server_app import resume_config

    cfg = {"rounds": 4, "lr": 0.05, "out-dir": "/r uns/a", "name": "it's", "tensorboard": False, "resume-from": "/x"}
    text = resume_config(cfg)
    assert text == "rounds=4 lr=0.05 out-dir='/r uns/a' name=\"it's\" tensorboard=false "
    assert parse_config_args([text + "resume-from='/r uns/a/run'"]) == {**cfg, "resume-from": "/r uns/a/run"}


# --- secure aggregation (fedproto.flower.secagg_messages) ---------------------------------------------------

class WireGrid(LocalGrid):
    """A LocalGrid that keeps every reply the server receives (what the server process holds)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.received: list[Message] = []

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        self.received += replies
        return replies


def _plain_replies(monkeypatch) -> dict:
    """(round, client id) -> the reply each node's client step made, before anything masks it."""
    got: dict = {}
    step = client_app.client_step

    def spy(alg, state, message, data, seed, r):
        out, res = step(alg, state, message, data, seed, r)
        got[(r, state.cid)] = {k: np.array(v) for k, v in out.items()}
        return out, res

    monkeypatch.setattr(client_app, "client_step", spy)
    return got


def _secagg_run(tmp_path, monkeypatch, name="sa", extra=None, **kw):
    folders = write_node_folders(tmp_path / name)
    uc = _own_config(**kw)
    grid = WireGrid(uc, node_configs=node_configs(folders, extra=extra))
    plain = _plain_replies(monkeypatch)
    eng = FlowerEngine(run_config(uc), grid, out=tmp_path / f"run-{name}")
    return eng, grid, plain, folders, eng.run()


def test_secagg_server_sees_no_individual_prototype_on_flower(tmp_path, monkeypatch):
    eng, grid, plain, _, _ = _secagg_run(tmp_path, monkeypatch, secagg=True)
    rows = [np.asarray(p, np.float32) for m in plain.values() for p in m["protos"]]
    assert len(plain) == 6 and len(rows) == 24  # 3 nodes x 2 rounds x 4 classes
    wire = [from_record(r.content[MESSAGE]) for r in grid.received if MESSAGE in r.content]
    assert len(wire) == len(grid.received) - 3  # every reply but the 3 final evaluations (metrics only)
    kinds = {r.metadata.message_type for r in grid.received}
    assert kinds == {"query", "query.secagg", "train", "evaluate"}
    for msg in wire:  # no prototype row of any client, in any reply the server got (keys, shares, vectors)
        for v in msg.values():
            blob = np.ascontiguousarray(v).tobytes()
            assert not any(row.tobytes() in blob for row in rows)
    trains = [from_record(r.content[MESSAGE]) for r in grid.received if r.metadata.message_type == "train"]
    assert len(trains) == 6 and all(list(m) == ["secagg"] and m["secagg"].dtype == np.uint64 for m in trains)
    C, d = 10, 50
    for m in trains:  # decoded alone, a masked vector is noise of the ring's scale, not a prototype
        assert np.median(np.abs(secagg_codec.decode(m["secagg"])[:C * d])) > 1e6
    assert "sum" not in eng.loop.server.checkpoint and "secagg_bytes" in eng.history[0]


def test_secagg_matches_plain_aggregation_on_flower(tmp_path, monkeypatch):
    eng, _, plain, folders, got = _secagg_run(tmp_path, monkeypatch, secagg=True)
    want = in_process_reference(folders).run()
    for key in ("acc", "acc_proto"):
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
    protos = np.load(tmp_path / "run-sa" / "prototypes.npz")
    sums: dict = {}
    for (r, _), m in plain.items():  # eq. 6 (unweighted mean) of round 2's plain replies, by hand
        for c, p in zip(m["classes"].tolist(), m["protos"].astype(np.float64)):
            if r == 2:
                sums.setdefault(c, []).append(p)
    assert protos["classes"].tolist() == sorted(sums)
    for c, p in zip(protos["classes"].tolist(), protos["protos"]):
        assert np.abs(p - np.mean(sums[c], axis=0)).max() <= 1e-6
    assert protos["contributors"].tolist() == [len(sums[c]) for c in sorted(sums)]
    assert got["secure_aggregation"]["dropouts"] == 0


def test_flower_secagg_with_a_dropout_gives_the_plain_prototypes(tmp_path, monkeypatch):
    """Node 1 sends its keys and shares each round, then fails its train step: 2 of 3 are left
    (t = 2). The global prototypes and contributor counts are eq. 6 of the survivors' plain
    replies for the classes both hold (0, 1); the classes each survivor holds alone (2, 3 and 4, 5)
    are withheld: never decoded (no seed of theirs reached the server), named in metrics.jsonl."""
    eng, grid, plain, _, got = _secagg_run(tmp_path, monkeypatch, extra={1: {"misbehave": "vanish"}}, secagg=True)
    rows = [json.loads(x) for x in (tmp_path / "run-sa" / "metrics.jsonl").read_text().splitlines()]
    assert [r["replied"] for r in rows] == [[0, 2], [0, 2]] and [r["secagg_dropped"] for r in rows] == [[1], [1]]
    assert [r["secagg_withheld"] for r in rows] == [[2, 3, 4, 5], [2, 3, 4, 5]]
    assert set(plain) == {(1, 0), (1, 2), (2, 0), (2, 2)}
    protos = np.load(tmp_path / "run-sa" / "prototypes.npz")
    assert protos["classes"].tolist() == [0, 1] and protos["contributors"].tolist() == [2, 2]
    for c, p in zip(protos["classes"].tolist(), protos["protos"]):
        rows2 = [m["protos"][m["classes"].tolist().index(c)].astype(np.float64)
                 for (r, _), m in plain.items() if r == 2]
        assert np.abs(p - np.mean(rows2, axis=0)).max() <= 1e-6
    # the server's view: every step-5 request and answer names only the classes 0 and 1 (groups 1, 2)
    reveals = [from_record(r.content[MESSAGE]) for r in grid.received
               if r.metadata.message_type == "query.secagg" and MESSAGE in r.content]
    lengths = [len(v) for m in reveals for k, v in m.items() if k.startswith("s.")]
    # step 4: one chunk (group 0's seed); step 5: two chunks (classes 0 and 1); never 3 or more
    assert set(lengths) == {4 + 16, 4 + 16 * 2}
    assert got["secure_aggregation"]["dropouts"] == 2
    assert got["secure_aggregation"]["withheld_rounds"] == {"1": [2, 3, 4, 5], "2": [2, 3, 4, 5]}


def test_secagg_a_class_with_too_few_contributors_stays_masked_on_flower(tmp_path, monkeypatch):
    """Without a dropout: node 2 alone holds class 6. The server's whole view (every reply it
    received) holds no seed of class 6's group, its sum stays masked in what the server can
    subtract, and prototypes.npz has no class 6; metrics.jsonl names it each round."""
    folders = write_node_folders(tmp_path / "d", labels=[(0, 1, 2, 3), (2, 3, 4, 5), (4, 5, 0, 1, 6)])
    uc = _own_config(secagg=True)
    grid = WireGrid(uc, node_configs=node_configs(folders))
    plain = _plain_replies(monkeypatch)
    eng = FlowerEngine(run_config(uc), grid, out=tmp_path / "run")
    eng.run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["secagg_withheld"] for r in rows] == [[6], [6]]
    protos = np.load(tmp_path / "run" / "prototypes.npz")
    assert protos["classes"].tolist() == [0, 1, 2, 3, 4, 5] and (protos["contributors"] == 2).all()
    lengths = {len(v) for r in grid.received if r.metadata.message_type == "query.secagg" and MESSAGE in r.content
               for k, v in from_record(r.content[MESSAGE]).items() if k.startswith("s.")}
    assert lengths == {4 + 16, 4 + 16 * 6}  # group 0 at step 4; the six classes 0-5 at step 5, never class 6
    d = 50
    rnd = eng.loop.algorithm._session.last
    trains = [from_record(r.content[MESSAGE])["secagg"] for r in grid.received if r.metadata.message_type == "train"]
    total = secagg_codec.decode(sum(trains[-3:]) - rnd.masks)
    mine = plain[(2, 2)]
    p6 = mine["protos"][mine["classes"].tolist().index(6)]
    assert np.abs(total[6 * d:7 * d] - p6).min() > 1.0  # class 6's sum: still masked


def test_flower_secagg_hides_label_sets_from_the_server(tmp_path, monkeypatch):
    """Under secagg (secagg_hide_labels, the default) no node's join, train or evaluate reply carries
    its label set, sample counts or step count; clients.csv says 'hidden'. With secagg_hide_labels
    false they are sent."""
    eng, grid, _, _, _ = _secagg_run(tmp_path, monkeypatch, secagg=True)
    queries = [dict(r.content["fedproto.config"]) for r in grid.received if r.metadata.message_type == "query"
               and "fedproto.config" in r.content]
    assert len(queries) == 3 and all(not {"classes", "train-samples", "test-samples"} & set(q) for q in queries)
    trains = [r for r in grid.received if r.metadata.message_type == "train"]
    assert trains and all(not {"num-examples", "steps"} & set(r.content["fedproto.metrics"]) for r in trains)
    evals = [r for r in grid.received if r.metadata.message_type == "evaluate"]
    assert evals and all("num-examples" not in r.content["fedproto.metrics"] for r in evals)
    rows = list(csv.DictReader((tmp_path / "run-sa" / "clients.csv").open()))
    assert [r["classes"] for r in rows] == ["hidden"] * 3
    _, grid2, _, _, _ = _secagg_run(tmp_path, monkeypatch, name="sent", secagg=True, secagg_hide_labels=False)
    sent = [dict(r.content["fedproto.config"]) for r in grid2.received if r.metadata.message_type == "query"
            and "fedproto.config" in r.content]
    assert sorted(tuple(q["classes"]) for q in sent) == sorted(tuple(sorted(c)) for c in NODE_CLASSES)


def test_a_second_unmask_request_in_a_round_is_refused_by_a_flower_node(tmp_path, monkeypatch):
    """The Flower node keeps its answers in its context: asked again in the round (the second time
    with a survivor marked dropped, to collect both its shares), it refuses; so it does a second
    masked vector and new keys for a round it keyed already; a node that restarted (a fresh
    context) holds nothing to reveal; a site's node-config floor is not lowered by the run config."""
    from fedproto.flower.secagg_messages import STATE, masked_reply, step
    from fedproto.secagg.protocol import Client, Server

    folders = write_node_folders(tmp_path)
    uc = _own_config(secagg=True)
    grid = LocalGrid(uc, node_configs=node_configs(folders))
    FlowerEngine(run_config(uc), grid, out=False).run()
    ctx = grid.contexts[1000]
    n = client_app.node(ctx)
    srv = Server([0, 1, 2])
    others = {j: Client() for j in (1, 2)}
    key1 = {"stage": np.array([1]), "round": np.array([9]), "parties": np.array([3]), "group": np.array([0, 1, 2]),
            "t": np.array([2])}
    pk = {0: step(n, key1, ctx)}
    pk.update({j: c.keys(j, 9, **srv.setup(j)) for j, c in others.items()})
    cts = {0: step(n, {"stage": np.array([2]), "groups": np.array([11]), **srv.keys_for(0, pk)}, ctx)}
    cts.update({j: c.shares(srv.keys_for(j, pk), 11) for j, c in others.items()})
    routed = srv.route(cts)
    down = {"secagg.ct.1": routed[0]["ct.1"], "secagg.ct.2": routed[0]["ct.2"]}
    _, finish = masked_reply(n, dict(down), ctx, 9)
    finish({})  # an empty reply: zeros, masked
    with pytest.raises(TrainingError, match="masked its vector of round 9 already"):
        masked_reply(n, dict(down), ctx, 9)
    groups = secagg_codec.codec_of(n.algorithm).groups({})
    for j, c in others.items():
        c.masked(np.zeros(len(groups), np.uint64), routed[j], groups)
    view = {"stage": np.array([4]), "alive": np.array([0, 1, 2]), "dead": np.array([], np.int64)}
    tags = {0: step(n, view, ctx), **{j: c.view([0, 1, 2], [], 2) for j, c in others.items()}}
    to0 = srv.route_tags(tags)[0]
    first = step(n, {"stage": np.array([5]), **to0}, ctx)
    assert sorted(first) == ["s.0", "s.1", "s.2"]
    with pytest.raises(TrainingError, match="a second unmask request in round 9"):
        step(n, {"stage": np.array([4]), "alive": np.array([0, 1]), "dead": np.array([2])}, ctx)
    with pytest.raises(TrainingError, match="a second unmask request in round 9"):
        step(n, {"stage": np.array([5]), **to0}, ctx)
    with pytest.raises(TrainingError, match="refuses new keys for round 9"):
        step(n, key1, ctx)
    fresh = Context(run_id=1, node_id=1000, node_config=ctx.node_config, state=RecordDict(),
                    run_config=ctx.run_config)
    with pytest.raises(TrainingError, match="holds no shares of the round"):
        step(n, {"stage": np.array([4]), "alive": np.array([0, 1]), "dead": np.array([2])}, fresh)
    # a site's floor: node config secagg-threshold 0.9 makes t = 2 of 3 too low for this node
    strict = Context(run_id=1, node_id=1000, node_config={**ctx.node_config, "secagg-threshold": 0.9},
                     state=RecordDict(), run_config=ctx.run_config)
    with pytest.raises(TrainingError, match="threshold must be at least 3 of 3"):
        step(n, key1, strict)
    assert STATE in ctx.state


def test_secagg_refuses_median_and_class_check_on_flower(tmp_path):
    folders = write_node_folders(tmp_path)
    for bad, why in ((dict(aggregation="median"), "aggregation='median' needs each client's prototype"),
                     (dict(class_check=3.0), "class_check=3(.0)? checks each client's prototype rows")):
        uc = _own_config(secagg=True, **bad)
        with pytest.raises(ConfigError, match=why):
            FlowerEngine(run_config(uc), LocalGrid(uc, node_configs=node_configs(folders)), out=False)


@pytest.fixture(scope="module")
def secagg_deployment(tmp_path_factory):
    """Two federations on 127.0.0.1 with TLS and SuperNode authentication, 3 own-data nodes each
    (the second's node 1 fails every train step: ``misbehave = "vanish"``); ``flwr run`` of the
    own-data app for one round under ``secagg`` on each, and with ``aggregation = "median"`` on the
    first. Returns the runs' folders and outputs, and each client's plain reply of that round made
    by the Python API with the same clients (round 1 needs no global prototype, so a node's reply
    is the same with and without secagg)."""
    from fedproto.deploy.local_federation import LocalFederation

    root = tmp_path_factory.mktemp("secagg-deployment")
    app = Path(__file__).resolve().parents[2] / "examples" / "flower" / "own_data"
    src = str(Path(__file__).resolve().parents[2] / "src")
    folders = write_node_folders(root / "data")
    runs: dict = {}
    for fed_name, extra in (("fed", None), ("fed-vanish", {1: {"misbehave": "vanish"}})):
        with LocalFederation(root / fed_name, tls=True, auth=True, env={"PYTHONPATH": src}) as fed:
            fed.start_superlink()
            for nc in node_configs(folders, extra=extra):
                fed.start_supernode(nc)
            todo = {"secagg": {}, **({"median": {"aggregation": "median"}} if extra is None else {})}
            for name, opts in todo.items():
                out = root / "runs" / f"{fed_name}-{name}"
                res = fed.flwr_run(app, {"rounds": 1, "out-dir": str(out), "seed": 7, "round-timeout": 600,
                                         "secagg": True, **opts}, timeout=1200)
                runs[f"{fed_name}-{name}"] = (next(iter(out.glob("*/")), None), res.stdout + res.stderr)
    ref = in_process_reference(folders, rounds=1)
    plain: dict = {}
    step = ref.executor.train

    def spy(r, sent, downlink=None):
        got = step(r, sent, downlink)
        plain.update({i: m for i, (m, _) in got.replies.items()})
        return got

    ref.executor.train = spy
    summary = ref.run()
    return runs, plain, summary


def _run_files(run_dir) -> tuple[dict, list[dict]]:
    return (json.loads((run_dir / "summary.json").read_text()),
            [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()])


def _class_means(replies: dict) -> dict:
    """Eq. 6 (unweighted mean) of the replies' prototypes, per class, by hand."""
    rows: dict = {}
    for m in replies.values():
        for c, p in zip(m["classes"].tolist(), m["protos"].astype(np.float64)):
            rows.setdefault(c, []).append(p)
    return {c: np.mean(v, axis=0) for c, v in rows.items()}


@pytest.mark.slow
def test_secagg_server_sees_no_individual_prototype_on_a_tls_deployment(secagg_deployment):
    runs, plain, _ = secagg_deployment
    run_dir, logs = runs["fed-secagg"]
    assert run_dir is not None and "fedproto: fedproto on custom: accuracy" in logs, logs[-3000:]
    _, rows = _run_files(run_dir)
    C, d = 10, 50
    # what reached the server's round loop: one masked (C * (d + 2),) uint64 vector per node
    assert rows[0]["up_bytes"] == 3 * 8 * C * (d + 2) and rows[0]["secagg_bytes"] > 0
    rows_plain = [np.asarray(p, np.float32).tobytes() for m in plain.values() for p in m["protos"]]
    assert len(rows_plain) == 12  # 3 nodes x 4 classes
    for f in run_dir.rglob("*"):  # nothing the server process wrote holds a node's prototype
        if f.is_file():
            blob = f.read_bytes()
            assert not any(row in blob for row in rows_plain), f


@pytest.mark.slow
def test_secagg_matches_plain_aggregation_on_a_tls_deployment(secagg_deployment):
    runs, plain, want = secagg_deployment
    got, _ = _run_files(runs["fed-secagg"][0])
    for key in ("acc", "acc_proto"):
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
    protos, means = np.load(runs["fed-secagg"][0] / "prototypes.npz"), _class_means(plain)
    assert protos["classes"].tolist() == sorted(means)
    for c, p in zip(protos["classes"].tolist(), protos["protos"]):
        assert np.abs(p - means[c]).max() <= 1e-6
    assert got["secure_aggregation"]["dropouts"] == 0


@pytest.mark.slow
def test_flower_secagg_with_a_dropout_gives_the_plain_prototypes_on_a_tls_deployment(secagg_deployment):
    runs, plain, _ = secagg_deployment
    run_dir, logs = runs["fed-vanish-secagg"]
    assert run_dir is not None and "fedproto: fedproto on custom: accuracy" in logs, logs[-3000:]
    got, rows = _run_files(run_dir)
    assert rows[0]["replied"] == [0, 2] and rows[0]["secagg_dropped"] == [1] and "1" in rows[0]["failed"]
    assert got["secure_aggregation"]["dropouts"] == 1
    # the global prototypes are the mean of clients 0 and 2 alone (node 1's masks rebuilt from their shares)
    # for the classes both hold; the classes one survivor holds alone stay masked (secagg_min_contributors 2)
    protos, means = np.load(run_dir / "prototypes.npz"), _class_means({i: plain[i] for i in (0, 2)})
    assert protos["classes"].tolist() == [0, 1] and protos["contributors"].tolist() == [2, 2]
    assert rows[0]["secagg_withheld"] == [2, 3, 4, 5]
    for c, p in zip(protos["classes"].tolist(), protos["protos"]):
        assert np.abs(p - means[c]).max() <= 1e-6


@pytest.mark.slow
def test_secagg_refuses_median_and_class_check_on_a_tls_deployment(secagg_deployment):
    runs, _, _ = secagg_deployment
    run_dir, logs = runs["fed-median"]
    assert 'aggregation="median" needs each client\'s prototype' in logs, logs[-3000:]
    assert run_dir is None or not (run_dir / "metrics.jsonl").exists()


def test_secagg_with_dp_sends_only_the_masked_noised_sums_on_flower(tmp_path, monkeypatch):
    """Under secagg and dp prototypes a node's train reply is its masked vector alone (no losses),
    and the summary states epsilon for the sum and for each node's own noise."""
    from fedproto.prototypes.dp import epsilon

    folders = write_node_folders(tmp_path)
    uc = _own_config(secagg=True, dp="prototypes", aggregation="weighted", secagg_honest=2, dp_noise=1.0)
    grid = WireGrid(uc, node_configs=node_configs(folders))
    got = FlowerEngine(run_config(uc), grid, out=tmp_path / "run").run()
    trains = [r for r in grid.received if r.metadata.message_type == "train"]
    assert len(trains) == 6 and all(list(from_record(r.content[MESSAGE])) == ["secagg"] for r in trains)
    assert all(set(r.content["fedproto.metrics"]) <= set(INSTANCE_KEYS) for r in trains)
    dp = got["secure_aggregation"]["dp"]
    assert dp["epsilon_sum"] == pytest.approx(epsilon([(1.0, 1.0, 2)], 1e-5))
    assert dp["epsilon_client_max"] == pytest.approx(epsilon([(1.0 / np.sqrt(2), 1.0, 2)], 1e-5))
    protos = np.load(tmp_path / "run" / "prototypes.npz")  # classes 0..5, each from its 2 holders' noised sums
    assert protos["classes"].tolist() == [0, 1, 2, 3, 4, 5] and np.isfinite(protos["protos"]).all()


def test_the_fallback_resume_command_is_one_shell_word_per_argument(tmp_path, monkeypatch):
    """When the resume app cannot be written, the command for the user's own app folder is printed:
    it broke in a shell on a value with a single quote, and would have run a ``$(...)`` in a value.
    (A value holding both quotes cannot be given by ``--run-config`` at all: Flower's parser takes
    no escaped quote; the resume app holds it.)"""
    from flwr.common.config import parse_config_args

    from fedproto.flower import server_app

    def unwritable(*a):
        raise OSError("read-only file system")

    monkeypatch.setattr(server_app, "write_resume_app", unwritable)
    eng = server_app.FlowerEngine.__new__(server_app.FlowerEngine)
    eng.run_cfg = {"data-dir": "it's x", "note": "a$(id) `b`", "rounds": 4}
    eng.run_dir = type("R", (), {"path": tmp_path / "ru n's"})()
    args = shlex.split(eng._resume_command())
    assert args[:5] == ["flwr", "run", "YOUR_APP_FOLDER", "--stream", "--run-config"] and len(args) == 6
    assert parse_config_args([args[5]]) == {**eng.run_cfg, "resume-from": str((tmp_path / "ru n's").absolute())}


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


def test_every_file_of_a_flower_run_folder_is_private(tmp_path):
    """The drill: config.json, metrics.jsonl and failure.json of the server's run folder were 0644 in a 0755
    folder (what the nodes sent, readable by every user of the SuperLink's machine). Now the folder is 0700 and
    every file in it 0600, with the usual umask, as the simulator's models and prototypes are."""
    import os

    uc = _user_config(rounds=2, tensorboard=True)
    out = tmp_path / "run"
    old = os.umask(0o022)
    try:
        eng = FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2, 3]), out=out)
        assert out.stat().st_mode & 0o777 == 0o700  # from its creation, before any round
        eng.run()
    finally:
        os.umask(old)
    modes = {p.relative_to(out).as_posix(): p.stat().st_mode & 0o777 for p in out.rglob("*")}
    assert {"config.json", "metrics.jsonl", "summary.json", "clients.csv", "prototypes.npz"} <= set(modes), modes
    assert any(name.startswith("tensorboard/") for name in modes), modes
    assert {name: m for name, m in modes.items() if m != (0o700 if (out / name).is_dir() else 0o600)} == {}
    assert out.stat().st_mode & 0o777 == 0o700
