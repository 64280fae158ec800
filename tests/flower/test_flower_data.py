"""Flower nodes whose data files hold several named input arrays (``x.input_ids``,
``x.attention_mask``): read with their integer dtypes, checked with clear refusals, and the
numbers of the Python API with the same clients; the keyboard use case (examples/
keyboard_prediction.py) as a deployment of three nodes on 127.0.0.1."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower

from flower_helpers import LocalGrid, _own_config, flower_process  # noqa: E402

from fedproto.data.folder import load_client_folder  # noqa: E402
from fedproto.data.inputs import Inputs  # noqa: E402
from fedproto.errors import ConfigError, DataError  # noqa: E402
from fedproto.flower.records import run_config  # noqa: E402
from fedproto.flower.server_app import FlowerEngine  # noqa: E402


@pytest.fixture(autouse=True)
def _flower_process(tmp_path, monkeypatch):
    """The ServerApp process's task identity and a node-state cache of this test's own
    (:func:`flower_helpers.flower_process`)."""
    yield from flower_process(tmp_path, monkeypatch)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
KEYBOARD = dict(classes=10, embedding_dim=32, clients=3, rounds=2, lr=0.1, batch_size=16, seed=7)
MODELS = ["keyboard_prediction:bag_model", "keyboard_prediction:gru_model", "keyboard_prediction:bag_model"]


@pytest.fixture
def keyboard(monkeypatch):
    """The keyboard example's module (examples/ on sys.path, as a node's PYTHONPATH would have it)."""
    pytest.importorskip("gensim")  # its package holds the corpus
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import keyboard_prediction

    return keyboard_prediction


def write_token_folders(root: Path, kb, seed: int = 7) -> list[Path]:
    """One folder per node: train.npz / test.npz with x.input_ids, x.attention_mask (int64) and y."""
    folders = []
    for i, (train, test) in enumerate(kb.brand_split(seed, clients=3, train=96, test=32)):
        folder = root / f"node{i}"
        folder.mkdir(parents=True)
        for split, (x, y) in (("train", train), ("test", test)):
            np.savez(folder / f"{split}.npz", **{f"x.{k}": v.numpy() for k, v in x.items()}, y=y.numpy())
        folders.append(folder)
    return folders


def reference(kb, folders, **options):
    """The same clients through the Python API, each model built after the node's seed."""
    from fedproto.federation import Client, federate
    from fedproto.models.zoo import init_seed

    opts = {**KEYBOARD, **options}
    clients = []
    for i, f in enumerate(folders):
        splits = []
        for split in ("train", "test"):
            z = np.load(f / f"{split}.npz")
            splits.append(({k[2:]: torch.from_numpy(z[k]) for k in z.files if k.startswith("x.")},
                           torch.from_numpy(z["y"])))
        torch.manual_seed(init_seed(opts["seed"], i))
        model = getattr(kb, MODELS[i].split(":")[1])(num_classes=10, embedding_dim=32)
        clients.append(Client(model, *splits, head="fc"))
    skip = ("classes", "clients", "embedding_dim")
    return federate(clients, 10, out=False, execution="sequential", eval_every=0, threads=1,
                    **{k: v for k, v in opts.items() if k not in skip})


def node_configs(folders, models=MODELS):
    return [{"client-id": i, "data": str(f), "model": models[i], "head": "fc"} for i, f in enumerate(folders)]


def test_flower_node_reads_token_data(tmp_path, keyboard):
    """Three nodes with token ids and masks in their npz files and their own models (an embedding
    bag, a GRU): the files are read as int64 named arrays and the run gives federate()'s numbers;
    files with a short array, other names in the two splits, or a zoo model are refused naming
    the file or the node and the fix."""
    folders = write_token_folders(tmp_path / "data", keyboard)
    (x, y), (tx, _) = load_client_folder(folders[0], 10)
    assert isinstance(x, Inputs) and sorted(x.tree) == ["attention_mask", "input_ids"]
    assert x.tree["input_ids"].dtype == torch.int64 and x.tree["input_ids"].shape == (96, 6) and len(y) == 96
    want_ids = np.load(folders[0] / "train.npz")["x.input_ids"]
    assert np.array_equal(x.tree["input_ids"].numpy(), want_ids)  # read as stored, never cast to float

    uc = _own_config(**KEYBOARD)
    eng = FlowerEngine(run_config(uc), LocalGrid(uc, node_configs=node_configs(folders)), out=tmp_path / "run")
    got = eng.run()
    ref = reference(keyboard, folders)
    want = ref.run()
    for key in ("acc", "acc_proto"):
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
    for a, b in zip(eng.history, ref.history):
        assert a["loss_ce"] == pytest.approx(b["loss_ce"], rel=1e-6)
        assert a["loss_proto"] == pytest.approx(b["loss_proto"], rel=1e-6, abs=1e-12)
    assert eng.history[1]["loss_proto"] > 0
    assert got["model_params"][0] != got["model_params"][1]  # an embedding bag and a GRU

    bad = tmp_path / "bad"
    bad.mkdir()
    z = dict(np.load(folders[0] / "train.npz"))
    np.savez(bad / "train.npz", **{**z, "x.attention_mask": z["x.attention_mask"][:-1]})
    np.savez(bad / "test.npz", **dict(np.load(folders[0] / "test.npz")))
    with pytest.raises(DataError, match=r"train\.npz.*'x\.attention_mask' has shape \(95, 6\) but there are 96 labels"):
        load_client_folder(bad, 10)
    np.savez(bad / "train.npz", **z)
    t = dict(np.load(folders[0] / "test.npz"))
    np.savez(bad / "test.npz", **{"x.tokens": t["x.input_ids"], "y": t["y"]})
    with pytest.raises(DataError, match=r"train inputs are the arrays \['attention_mask', 'input_ids'\] but test "
                                        r"inputs \['tokens'\]"):
        load_client_folder(bad, 10)
    from fedproto.flower.node import load_local_client

    with pytest.raises(ConfigError, match=r"node client-id=0: model 'cnn' takes images .*named arrays"):
        load_local_client({"client-id": 0, "data": str(folders[0]), "model": "cnn"},
                          run_config(_own_config(**KEYBOARD)))


def test_deployment_of_three_keyboard_nodes_on_localhost(tmp_path, keyboard):
    """The keyboard use case deployed: a SuperLink and 3 SuperNodes on 127.0.0.1, each with its own
    token files and model (examples/keyboard_prediction.py's factories on the nodes' PYTHONPATH),
    ``flwr run`` of the own-data App; federate()'s numbers, every process stopped at the end."""
    from fedproto.deploy.local_federation import LocalFederation

    app = EXAMPLES / "flower" / "own_data"
    src = str(Path(__file__).resolve().parents[2] / "src")
    folders = write_token_folders(tmp_path / "data", keyboard)
    out = tmp_path / "runs"
    sep = ";" if sys.platform == "win32" else ":"
    with LocalFederation(tmp_path / "fed", env={"PYTHONPATH": f"{src}{sep}{EXAMPLES}"}) as fed:
        fed.start_superlink()
        for nc in node_configs(folders):
            fed.start_supernode(nc)
        cfg = {"rounds": 2, "out-dir": str(out), "seed": 7, "classes": 10, "embedding-dim": 32, "lr": 0.1,
               "batch-size": 16}
        res = fed.flwr_run(app, cfg, timeout=600)  # each ClientApp process starts python and torch
        procs = list(fed.procs.values())
    assert all(p.poll() is not None for p in procs)
    logs = res.stdout + res.stderr
    assert "fedproto: fedproto on custom: accuracy" in logs, logs[-3000:]
    run = next(out.glob("*/summary.json")).parent
    got = json.loads((run / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["replied"] for r in rows] == [[0, 1, 2], [0, 1, 2]]
    import tomllib

    app_cfg = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    want = reference(keyboard, folders, dropout=app_cfg["dropout"], local_epochs=app_cfg["local-epochs"],
                     momentum=0.5, lambda_proto=app_cfg["lambda-proto"]).run()
    assert got["accuracy"]["acc"]["mean"] == pytest.approx(want["accuracy"]["acc"]["mean"], abs=1e-9)
    assert got["params_per_round"] == want["params_per_round"]
