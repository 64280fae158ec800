"""What the Flower tests share (tests/flower/test_flower_*.py, and the Flower tests of other folders:
tests/engine/test_method_executors.py, tests/prototypes/test_dp_noise.py, tests/algorithms/test_plugins.py),
imported as ``from flower_helpers import ...`` (a plain module, not a conftest.py: a second conftest.py would
shadow tests/conftest.py's ``from conftest import ...``; tests/conftest.py puts this folder on ``sys.path``).

The ServerApp's engine and the real ClientApp talk through :class:`LocalGrid`, a Flower
``Grid`` that delivers each message to the ClientApp of its node in this process (one
``Context`` per node, kept across rounds as a SuperNode keeps it), so the tests need neither a
SuperLink nor Ray. Messages cross as Flower records (arrays serialized to bytes). Beside it: the
run configs of the benchmark mode (``_user_config``) and of own-data nodes (``_own_config``,
:func:`write_node_folders`, :func:`node_configs`, :func:`in_process_reference`), grids that keep
replies or push and pull, and :func:`flower_process`, which a test module's autouse fixture yields
from. It imports Flower: a test module imports it after ``pytest.importorskip("flwr")``.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from fedproto.flower import client_app

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


def flower_process(tmp_path, monkeypatch):
    """Play the ServerApp process: Flower's runtime sets the task identity that new messages
    carry; give torch's thread count back afterwards (``threads=1`` is process-wide). Own-data
    nodes keep their state files in the user cache (fedproto.flower.node_state): a test's own, so
    that no test reads another's (the contexts here all have run id 1) and none writes to the
    user's. A generator: each Flower test module has an autouse fixture that yields from it."""
    for k, v in {"_run_id": 1, "_node_id": 0, "_task_id": 0}.items():
        monkeypatch.setattr(TaskIdentity, k, v)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


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
