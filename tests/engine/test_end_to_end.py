"""End-to-end runs on real data (cross-cutting: data, models, algorithm, engine)."""




import json

import numpy as np
import pytest
import torch
from conftest import DATA, needs_cifar, needs_mnist

from fedproto.config.run_config import build_config
from fedproto.models.cnn import PaperCNN
from fedproto.simulation import Simulation


@pytest.mark.usefixtures("one_thread")
@needs_cifar
def test_cifar10_paper_cnn_one_round_end_to_end(tmp_path):
    cfg = build_config(overrides=dict(dataset="cifar10", model="cnn", clients=4, ways=3, shots=20, stdev=1,
                                      test_shots=10, rounds=1, augment=True, data_dir=DATA, download=False,
                                      out_dir=str(tmp_path)))
    sim = Simulation(cfg, out=False)
    assert isinstance(sim.setup.states[0].model, PaperCNN) and sim.setup.states[0].model.in_channels == 3
    summary = sim.run()
    assert summary["clients"] == 4
    # the reported accuracies are the clients' models scored here on their own test sets: the
    # classifier's argmax, and the nearest global prototype among the client's own classes
    msg = sim.message
    table = dict(zip(msg["classes"].tolist(), torch.as_tensor(msg["protos"], dtype=torch.float64)))
    acc, acc_proto = [], []
    for st, data in zip(sim.setup.states, sim.setup.data):
        st.model.eval()
        with torch.no_grad():
            logits, h = st.model(data.test_x)
        acc.append(float((logits.argmax(1) == data.test_y).double().mean()))
        own = [int(c) for c in st.classes]
        d = torch.stack([(h.double() - table[c]).norm(dim=1) for c in own], 1)
        acc_proto.append(float((torch.as_tensor(own)[d.argmin(1)] == data.test_y).double().mean()))
    assert summary["accuracy"]["acc"]["mean"] == pytest.approx(np.mean(acc), abs=1e-6)  # float32 means
    assert summary["accuracy"]["acc_proto"]["mean"] == pytest.approx(np.mean(acc_proto), abs=1e-6)
    # (no accuracy floor here: one round of 20 shots does not beat chance yet, seeds 1-7 and 1234
    # measured -0.09 to +0.07 around the mean of 1/ways; the floors are in the MNIST runs)
    assert sim.history[0]["loss_ce"] > 0


@needs_mnist
@pytest.mark.slow
def test_end_to_end_real_mnist_beats_chance(tmp_path):
    cfg = build_config(overrides=dict(clients=6, rounds=4, eval_every=2, out_dir=str(tmp_path), name="e2e"))
    summary = Simulation(cfg).run()
    acc = summary["accuracy"]
    # clients hold 2-5 classes (chance <= 0.5); after 4 rounds FedProto is far above it
    assert acc["acc"]["mean"] > 0.85 and acc["acc_proto"]["mean"] > 0.8
    run = tmp_path / "e2e"
    for f in ("config.json", "metrics.jsonl", "summary.json", "clients.csv", "prototypes.npz"):
        assert (run / f).is_file(), f
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    protos = np.load(run / "prototypes.npz")
    assert protos["protos"].shape[1] == 50 and len(protos["classes"]) == len(protos["contributors"])
    assert (run / "clients.csv").read_text().count("\n") == 7
