"""Your own federation (fedproto.federation) with frozen layers: a frozen body and BatchNorm stay
unchanged on every executor, weight sharing keeps each client's frozen tensors, and the trained
models handle reproduces the reported accuracies."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
from conftest import SmallCNN, client_splits, digits_clients_partition
from torch import nn

from fedproto.errors import ConfigError
from fedproto.federation import Client, federate
from fedproto.models.cnn import PaperCNN


@pytest.fixture(scope="module")
def digits():
    return digits_clients_partition()


class BNNet(nn.Module):
    """A pretrained-style classifier: conv + BatchNorm body, a hidden layer, a final ``fc``."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten())
        self.hidden = nn.Sequential(nn.Linear(6 * 64, 16), nn.ReLU())
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(self.hidden(self.body(x)))


def _freeze(module: nn.Module) -> dict[str, torch.Tensor]:
    """Freeze ``module`` (parameters and, through the BatchNorm rule, its statistics); its state."""
    for p in module.parameters():
        p.requires_grad_(False)
    return {k: v.clone() for k, v in module.state_dict().items()}


def _bn_clients(digits, seed=0):
    out, bodies = [], []
    for i, (train, test) in enumerate(client_splits(*digits)):
        torch.manual_seed(seed + i)
        m = BNNet()
        with torch.no_grad():  # "pretrained" statistics, not the init's zeros and ones
            m.body[1].running_mean.uniform_(-0.5, 0.5)
            m.body[1].running_var.uniform_(0.5, 2.0)
        bodies.append(_freeze(m.body))
        out.append(Client(m, train, test, head="fc"))
    return out, bodies


def _assert_frozen_kept(clients, bodies, attr="body"):
    for c, before in zip(clients, bodies):
        body = getattr(c.model, attr)
        after = body.state_dict()
        assert after.keys() == before.keys()
        for k in before:
            assert torch.equal(after[k], before[k]), k  # bit for bit: weights and BatchNorm statistics
        assert not any(p.requires_grad for p in body.parameters())  # the user's flags are unchanged
        assert all(p.requires_grad for n, p in c.model.named_parameters() if not n.startswith(attr))


@pytest.mark.parametrize("options", [{}, {"dp": "full", "dp_noise": 0.5}, {"freeze_after": 1}],
                         ids=["sequential", "dp-full", "two-stage"])
def test_frozen_body_and_batchnorm_unchanged_sequential(digits, options):
    clients, bodies = _bn_clients(digits)
    fc0 = [c.model.fc.weight.detach().clone() for c in clients]
    hid0 = [c.model.hidden[0].weight.detach().clone() for c in clients]
    sim = federate(clients, 10, rounds=2, lr=0.05, out=False, eval_every=0, threads=1, **options)
    sim.run()
    _assert_frozen_kept(clients, bodies)
    assert all(not torch.equal(c.model.fc.weight, w) for c, w in zip(clients, fc0))  # the head trained
    if "freeze_after" not in options:  # (two-stage: round 2 trains the head alone; round 1 everything)
        assert all(not torch.equal(c.model.hidden[0].weight, w) for c, w in zip(clients, hid0))


def _cnn_clients(digits):
    out, bodies = [], []
    for i, (train, test) in enumerate(client_splits(*digits)):
        torch.manual_seed(i)
        m = PaperCNN(1, 10, 8, 16, 8, dropout=0.0, conv1_channels=4)
        bodies.append({k: v.detach().clone() for k, v in m.named_parameters() if k.startswith(("conv1", "conv2"))})
        for n, p in m.named_parameters():
            p.requires_grad_(not n.startswith(("conv1", "conv2")))
        out.append(Client(m, train, test))
    return out, bodies


@pytest.mark.parametrize("workers", [1, 2])
def test_frozen_convolutions_unchanged_batched_and_in_workers(digits, workers):
    clients, bodies = _cnn_clients(digits)
    fc1 = [c.model.fc1.weight.detach().clone() for c in clients]
    sim = federate(clients, 10, rounds=2, lr=0.05, out=False, eval_every=0, execution="batched", workers=workers,
                   threads=workers)  # one thread per process
    summary = sim.run()
    assert summary["processes"] == workers
    for c, before in zip(clients, bodies):
        named = dict(c.model.named_parameters())
        for k, v in before.items():
            assert torch.equal(named[k], v), k
            assert not named[k].requires_grad
        assert named["fc1.weight"].requires_grad and named["fc2.bias"].requires_grad
    assert all(not torch.equal(c.model.fc1.weight, w) for c, w in zip(clients, fc1))


def test_clients_with_other_frozen_layers_are_not_batched_together(digits):
    """A group shares one set of frozen parameters; clients that differ train apart, each kept."""
    clients, bodies = _cnn_clients(digits)
    for p in clients[1].model.parameters():  # client 1 trains everything
        p.requires_grad_(True)
    before1 = clients[1].model.conv1.weight.detach().clone()
    federate(clients, 10, rounds=1, lr=0.05, out=False, eval_every=0, execution="batched", threads=1).run()
    assert torch.equal(clients[0].model.conv1.weight, bodies[0]["conv1.weight"])
    assert not torch.equal(clients[1].model.conv1.weight, before1)


# weight sharing (FedAvg and its family) with frozen bodies: the frozen tensors stay each client's own
SHARING = {"fedavg": {}, "fedprox": {"prox_mu": 0.1}, "fedper": {"personal_layers": "head"},
           "fedrep": {"personal_layers": "head", "rep_head_epochs": 1}, "fesem": {"fesem_clusters": 2}}


@pytest.mark.parametrize("algorithm", list(SHARING))
def test_weight_sharing_keeps_each_clients_frozen_body(digits, algorithm, caplog):
    """Each client's frozen body (its own values: weights and BatchNorm statistics) is neither sent
    nor overwritten; the trainable part is averaged (sample-weighted) and loaded on download; the
    cost counts only what is sent."""
    clients, bodies = _bn_clients(digits)
    assert not torch.equal(bodies[0]["0.weight"], bodies[1]["0.weight"])  # the frozen values differ per client
    sim = federate(clients, 10, rounds=2, lr=0.05, out=False, eval_every=0, threads=1, algorithm=algorithm,
                   **SHARING[algorithm])
    with caplog.at_level("WARNING"):
        sim.run()
    assert "share no tensor" not in caplog.text
    _assert_frozen_kept(clients, bodies)
    alg, states = sim.setup.algorithm, sim.setup.states
    personal = algorithm in ("fedper", "fedrep")
    shared = {n: p for n, p in states[0].model.named_parameters() if "body" not in n and not (personal and "fc" in n)}
    sent = {k.removeprefix("w/") for k in sim.message if k.startswith("w/")}
    assert sent == set(shared)  # no body tensor, no BatchNorm statistic (nor the personal head)
    n_shared = sum(p.numel() for p in shared.values())
    assert [row["up_params"] for row in sim.history] == [len(clients) * (n_shared + 1)] * 2  # weights + count
    if algorithm != "fesem":
        assert [row["down_params"] for row in sim.history] == [len(clients) * n_shared] * 2
        n = np.array([len(c.train[1]) for c in clients], np.float64)
        for k in shared:  # the server's message: the sample-weighted average of the last local weights
            local = np.stack([dict(s.model.named_parameters())[k].detach().numpy() for s in states])
            assert np.allclose(sim.message["w/" + k], np.tensordot(n / n.sum(), local, 1), atol=1e-6), k
    before = [{k: v.detach().clone() for k, v in s.model.named_parameters()} for s in states]
    for s in states:  # the next round's download
        alg.prepare(s, alg.downlink(sim.message, s.cid))
    _assert_frozen_kept(clients, bodies)
    for s, old in zip(states, before):
        for k, v in s.model.named_parameters():
            centre = alg.downlink(sim.message, s.cid).get("w/" + k)
            if k in shared:
                assert np.array_equal(v.detach().numpy(), centre), k  # the global (FeSEM: its cluster's) value
            else:
                assert torch.equal(v, old[k]) and centre is None, k  # frozen or personal: the client's own
    if algorithm == "fedavg":
        w = [s.model.net.hidden[0].weight for s in states]
        assert all(torch.equal(w[0], x) for x in w[1:])  # one global trainable part after the download
    if algorithm == "fedprox":  # the proximal term covers the trained parameters (frozen ones have no reference)
        obj = alg.local_objective(states[0], alg.downlink(sim.message, 0))
        assert obj.anchor.mu == 0.1 and set(obj.anchor.ref) == set(shared)


def test_nothing_left_to_share_is_warned(digits, caplog):
    """FedPer on the paper CNN keeps every fully connected layer; with its convolutions frozen nothing
    is shared: said so, and only the sample counts go up."""
    clients, bodies = _cnn_clients(digits)
    sim = federate(clients, 10, rounds=1, out=False, eval_every=0, threads=1, algorithm="fedper")
    with caplog.at_level("WARNING"):
        sim.run()
    assert "fedper: the clients share no tensor" in caplog.text
    assert sim.history[0]["up_params"] == len(clients)
    for c, before in zip(clients, bodies):
        named = dict(c.model.named_parameters())
        assert all(torch.equal(named[k], v) for k, v in before.items())


def test_fedprox_frozen_convolutions_batched(digits):
    """The batched path's stacked FedProx references leave out the frozen parameters, which stay."""
    clients, bodies = _cnn_clients(digits)
    sim = federate(clients, 10, rounds=2, lr=0.05, out=False, eval_every=0, execution="batched", threads=1,
                   algorithm="fedprox", prox_mu=0.1)
    sim.run()
    for c, before in zip(clients, bodies):
        named = dict(c.model.named_parameters())
        assert all(torch.equal(named[k], v) and not named[k].requires_grad for k, v in before.items())
    assert not any("conv" in k for k in sim.message)
    assert {k.removeprefix("w/") for k in sim.message} == {n for n in dict(sim.setup.states[0].model.named_parameters())
                                                           if "conv" not in n}


@pytest.mark.parametrize("algorithm", ["fedavg", "fesem"])
def test_weight_sharing_refuses_clients_that_freeze_other_tensors(digits, algorithm):
    """A tensor some clients freeze and others share has no one global value: refused at the start,
    naming the clients on each side and the tensor; the Flower server (messages only) says the same."""
    from fedproto.algorithms import FedAvg
    from fedproto.training import OptimConfig

    clients, bodies = _bn_clients(digits)
    for p in clients[2].model.body.parameters():  # client 2 trains its body
        p.requires_grad_(True)
    with pytest.raises(ConfigError, match=r"clients \[0, 1, 3\] froze '[\w.]*body\.0\.weight'.*clients \[2\] train "
                                          r"and share it.*freeze the same parameters on every client"):
        federate(clients, 10, rounds=1, out=False, eval_every=0, threads=1, algorithm=algorithm).run()
    _assert_frozen_kept(clients[:2], bodies[:2])
    joins = {0: {"w/a": np.zeros(2, np.float32), "w/b": np.zeros(3, np.float32)}, 1: {"w/a": np.zeros(2, np.float32)}}
    with pytest.raises(ConfigError, match=r"clients \[1\] do not send 'b' \(frozen.*clients \[0\] train and share"):
        FedAvg(10, OptimConfig(0.1, 0.0, 0.0, 8, False)).initial_message_from(joins)


def _acc(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(x)[0].argmax(1) == y).double().mean())


def test_trained_models_handle_reproduces_the_reported_accuracies(digits, tmp_path):

    from fedproto.federation import HeadSplitModel, Projected
    from fedproto.outputs.run_folder import load_models

    def clients():
        out = []
        for i, (train, test) in enumerate(client_splits(*digits)):
            torch.manual_seed(i)
            out.append(Client(SmallCNN(8, 20) if i % 2 else SmallCNN(12), train, test, head="fc",
                              embedding_dim=16 if i % 2 else None))
        return out

    cs = clients()
    sim = federate(cs, 10, rounds=3, lr=0.05, out=tmp_path / "run", eval_every=0, threads=1, save_models=True)
    summary = sim.run()
    models = sim.models
    assert [type(m) for m in models] == [HeadSplitModel, Projected, HeadSplitModel, Projected]
    assert models[0].net is cs[0].model and models[1].inner.net is cs[1].model  # the user's objects inside
    with open(tmp_path / "run" / "clients.csv") as f:
        reported = [float(r["acc"]) for r in csv.DictReader(f)]
    tests = [test for _, test in client_splits(*digits)]
    accs = [_acc(m, x, y) for m, (x, y) in zip(models, tests)]
    assert accs == pytest.approx(reported, abs=1e-6)  # the same correct counts (reported in float32)
    assert float(np.mean(accs)) == pytest.approx(summary["accuracy"]["acc"]["mean"], abs=1e-6)
    assert min(accs) > 0.6  # 3 classes per client: chance 1/3
    # a projected client's own object: its body trained, its own fc untouched (not used)
    own = cs[1].model
    assert _acc(models[1], *tests[1]) == accs[1]
    own.eval()
    with torch.no_grad():
        own_acc = float((own(tests[1][0]).argmax(1) == tests[1][1]).double().mean())
    assert own_acc < accs[1]
    # models.pt: loaded into freshly built clients it gives the same numbers
    fresh = federate(clients(), 10, out=False, threads=1).models
    saved = load_models(tmp_path / "run")
    assert len(saved) == 4
    for m, sd in zip(fresh, saved):
        m.load_state_dict(sd)
    assert [_acc(m, x, y) for m, (x, y) in zip(fresh, tests)] == accs
