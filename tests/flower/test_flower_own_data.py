"""Nodes with their own data and models (``fedproto.flower.node``, ``fedproto.data.folder``):
three own-data nodes of two architectures give the Python API's numbers, a plain classifier from
a factory joins with its head, the weight-sharing baselines start from the lowest client id's
weights; what a node may send is checked (NaN prototypes dropped and logged, bad replies named,
a run whose every reply is dropped stops naming them) and every node refusal (labels outside the
classes, another embedding size, a failing model factory, bad node config keys) names the client
and the fix; client folders of images are read by class folder, grayscale or RGB, 8 or 16 bits."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower

from flower_helpers import (  # noqa: E402  (the Flower tests' grid, configs and node folders)
    LocalGrid,
    _own_config,
    flower_process,
    in_process_reference,
    node_configs,
    write_node_folders,
)

from fedproto.errors import ConfigError, TrainingError  # noqa: E402
from fedproto.flower.records import run_config  # noqa: E402
from fedproto.flower.server_app import FlowerEngine  # noqa: E402


@pytest.fixture(autouse=True)
def _flower_process(tmp_path, monkeypatch):
    """The ServerApp process's task identity and a node-state cache of this test's own
    (:func:`flower_helpers.flower_process`)."""
    yield from flower_process(tmp_path, monkeypatch)


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
