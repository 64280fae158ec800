"""The generic batched path (torch.func ``functional_call`` + ``vmap`` over the clients'
stacked weights) gives the sequential path's weights for any model: a user CNN split at its head, a
projected CNN, ResNet18 with BatchNorm and a model with a frozen part (float64, 1e-9 relative)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import client_splits, digits_fewshot, flat_weights, float64_sim
from torch import nn

import fedproto.engine.executors.batched as simulation
from fedproto.config.run_config import build_config
from fedproto.federation import Client, federate
from fedproto.training import generic_batch_problem, generic_key

BOUND = 1e-9  # relative, as tests/test_fedproto.py's batched-vs-sequential checks


@pytest.fixture(scope="module")
def digits():
    return digits_fewshot(stdev=1)


def _splits(digits):
    return client_splits(*digits)


@pytest.fixture
def generic_calls(monkeypatch):
    """Sizes of the groups trained by :func:`fedproto.training.train_group_generic`."""
    sizes: list[int] = []
    orig = simulation.train_group_generic

    def counting(models, *a, **k):
        sizes.append(len(models))
        return orig(models, *a, **k)

    monkeypatch.setattr(simulation, "train_group_generic", counting)
    return sizes


class DropNet(nn.Module):
    """A plain classifier with both kinds of dropout (channel and element), split at ``fc``."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.ReLU(), nn.Dropout2d(0.3), nn.Flatten())
        self.hidden = nn.Sequential(nn.Linear(6 * 64, 16), nn.ReLU(), nn.Dropout(0.4))
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(self.hidden(self.body(x)))


class TupleCNN(nn.Module):
    """examples/own_federation.py's CNN, small: forward returns (logits, embedding)."""

    def __init__(self, width: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d((2, 2)), nn.Flatten())
        self.classifier = nn.Linear(2 * width * 4, 10)

    def forward(self, x):
        h = self.features(x)
        return self.classifier(h), h


class BNNet(nn.Module):
    """conv + BatchNorm body (frozen in the test), a hidden layer, a final ``fc``."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten())
        self.hidden = nn.Sequential(nn.Linear(6 * 64, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(self.hidden(self.body(x)))


def _federate_both(make_clients, modes=("sequential", "batched"), **options):
    """Run the same clients on both paths in float64; the two runs' clients and simulations."""
    out = {}
    for mode in modes:
        clients = make_clients()
        sim = federate(clients, 10, out=False, eval_every=0, threads=1, execution=mode, **options)
        sim.setup.to_dtype(torch.float64)
        sim.run()
        out[mode] = (clients, sim)
    return out


def _assert_same_weights(a, b):
    for i, (p, q) in enumerate(zip(flat_weights(a), flat_weights(b))):
        assert ((p - q).norm() / p.norm()).item() < BOUND, i


def test_user_cnn_with_head_and_dropout_matches_sequential(digits, generic_calls):
    """A plain nn.Module split with head=: dropout masks replayed per client match the sequential draws."""
    def make():
        out = []
        for i, (train, test) in enumerate(_splits(digits)):
            torch.manual_seed(i)
            out.append(Client(DropNet(), train, test, head="fc"))
        return out

    runs = _federate_both(make, rounds=2, lr=0.05)
    (_, s), (_, b) = runs["sequential"], runs["batched"]
    assert generic_calls == [4, 4]  # 4 clients, one group, 2 rounds
    _assert_same_weights(s, b)
    assert [m["acc"] for m in s.evaluate()] == [m["acc"] for m in b.evaluate()]
    w0 = flat_weights(s)[0]
    assert (w0 - flat_weights(b)[1]).norm() > 1e-3  # the clients differ: the bound is no trivial one


@pytest.mark.parametrize("options, widths, groups", [
    ({"algorithm": "fedproto"}, (8, 8, 4, 4), [2, 2, 2, 2]),
    ({"algorithm": "fedprox", "prox_mu": 0.1}, (8, 8, 8, 8), [4, 4]),  # weight averaging: one architecture
], ids=["fedproto", "fedprox"])
def test_projected_cnns_match_sequential(digits, generic_calls, options, widths, groups):
    """The guide's two-CNN federation (own_federation.py's models, small): Client(..., embedding_dim=)
    appends a projection; two widths form two groups; momentum 0.9 and batch 16 (trailing batches);
    FedProx's proximal term against the global weights."""
    def make():
        out = []
        for i, (train, test) in enumerate(_splits(digits)):
            torch.manual_seed(i)
            out.append(Client(TupleCNN(widths[i]), train, test, embedding_dim=12))
        return out

    runs = _federate_both(make, rounds=2, lr=0.05, momentum=0.9, batch_size=16, **options)
    assert sorted(generic_calls) == groups
    _assert_same_weights(runs["sequential"][1], runs["batched"][1])


def test_resnet18_batchnorm_matches_sequential(generic_calls):
    """ResNet18 (BatchNorm in train mode): per-client batch statistics, running statistics updated
    per client, trailing batches of other sizes than the rest of a step's (the trailing-batch rule)."""
    cfg = build_config(overrides=dict(dataset="digits", model="resnet18", clients=3, ways=2, shots=9, stdev=2,
                                      test_shots=4, rounds=1, eval_every=0, threads=1))
    sims = {}
    for mode in ("sequential", "batched"):
        sims[mode] = float64_sim(cfg.model_copy(update={"execution": mode}))
        sims[mode].run()
    s, b = sims["sequential"], sims["batched"]
    assert generic_calls == [3]
    sizes = {len(d.x) % 8 for d in s.setup.data}
    assert len(sizes) > 1  # the clients' trailing batches differ: steps run in sub-groups by sample count
    _assert_same_weights(s, b)
    for ms, mb in zip(s.models, b.models):
        bs, bb = dict(ms.named_buffers()), dict(mb.named_buffers())
        for k in bs:
            assert torch.allclose(bs[k].double(), bb[k].double(), rtol=1e-9, atol=1e-12), k
        assert not torch.equal(bs["bn1.running_mean"], torch.zeros_like(bs["bn1.running_mean"]))


def test_frozen_body_with_batchnorm_stays_frozen_and_matches_sequential(digits, generic_calls):
    """A frozen conv + BatchNorm body (eval mode, statistics kept) and a trained BatchNorm1d after it."""
    def make():
        out = []
        for i, (train, test) in enumerate(_splits(digits)):
            torch.manual_seed(i)
            m = BNNet()
            with torch.no_grad():
                m.body[1].running_mean.uniform_(-0.5, 0.5)
                m.body[1].running_var.uniform_(0.5, 2.0)
            for p in m.body.parameters():
                p.requires_grad_(False)
            out.append(Client(m, train, test, head="fc"))
        return out

    before = {k: v.clone() for k, v in make()[0].model.body.state_dict().items()}
    runs = _federate_both(make, rounds=2, lr=0.05)
    assert generic_calls == [4, 4]
    _assert_same_weights(runs["sequential"][1], runs["batched"][1])
    clients = runs["batched"][0]
    after = clients[0].model.body.state_dict()
    for k in before:
        assert torch.equal(after[k].to(before[k].dtype), before[k]), k  # weights and statistics bit for bit
    assert not any(p.requires_grad for p in clients[0].model.body.parameters())
    assert clients[0].model.hidden[1].num_batches_tracked.item() > 0  # the trained BatchNorm did update


def test_group_key_tells_configurations_apart():
    """Equal parameter shapes but another padding, dropout p or frozen set: other groups."""
    a, b = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(1, 4, 3, padding=0)
    from fedproto.federation import HeadSplitModel

    def wrap(conv, p=0.5):
        return HeadSplitModel(nn.Sequential(conv, nn.Flatten(), nn.Dropout(p), nn.Linear(4, 2)), "3", 4, 2)

    assert generic_key(wrap(a)) != generic_key(wrap(b))
    assert generic_key(wrap(nn.Conv2d(1, 4, 3, padding=1))) == generic_key(wrap(a))
    assert generic_key(wrap(a, 0.5)) != generic_key(wrap(a, 0.2))
    c = wrap(nn.Conv2d(1, 4, 3, padding=1))
    c.net[0].weight.requires_grad_(False)
    assert generic_key(c) != generic_key(wrap(a))
    assert generic_key(wrap(nn.Sequential(nn.AlphaDropout(0.2), a))) is None  # masks not replayable


class RandNet(nn.Module):
    """A forward that draws its own noise (torch.randn_like): vmap cannot batch it."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        h = self.fc1(x.flatten(1))
        return self.fc(h + 0.01 * torch.randn_like(h))


def test_models_vmap_cannot_batch_train_sequentially(digits, generic_calls, caplog):
    """A forward with its own random draws is refused by the check (once, logged) and trains sequentially."""
    clients = []
    for i, (train, test) in enumerate(_splits(digits)):
        torch.manual_seed(i)
        clients.append(Client(RandNet(), train, test, head="fc"))
    w0 = clients[0].model.fc1.weight.detach().clone()
    sim = federate(clients, 10, rounds=2, out=False, eval_every=0, threads=1, execution="batched")
    problem = generic_batch_problem(sim.models[0], sim.setup.data[0].x)
    assert problem is not None and "random" in problem.lower()
    with caplog.at_level(logging.INFO, logger="fedproto"):
        sim.run()
    assert generic_calls == []
    assert sum("vmap cannot batch them" in r.getMessage() for r in caplog.records) == 1  # checked once per run
    assert not torch.equal(clients[0].model.fc1.weight, w0)


def test_auto_batches_standard_layer_cnns_and_keeps_vmap_models_sequential(digits, generic_calls):
    """execution="auto" (the default) takes the generic path for CNNs of standard layers (grouped operations,
    measured faster than the sequential path) and gives the sequential run's weights; models that only vmap can
    batch (dropout, BatchNorm: measured slower) train one by one."""
    def tuple_cnns():
        out = []
        for i, (train, test) in enumerate(_splits(digits)):
            torch.manual_seed(i)
            out.append(Client(TupleCNN(4), train, test))
        return out

    runs = _federate_both(tuple_cnns, rounds=1, lr=0.05, momentum=0.9, batch_size=16, modes=("sequential", "auto"))
    assert generic_calls == [4]  # the auto run: one group of the 4 clients
    _assert_same_weights(runs["sequential"][1], runs["auto"][1])
    generic_calls.clear()
    clients = []
    for i, (train, test) in enumerate(_splits(digits)):
        torch.manual_seed(i)
        clients.append(Client(DropNet(), train, test, head="fc"))
    federate(clients, 10, rounds=1, out=False, eval_every=0, threads=1, execution="auto").run()
    assert generic_calls == []
