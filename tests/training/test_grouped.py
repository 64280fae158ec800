"""The grouped forward of the generic batched path (fedproto.training.grouped_forward): G stacked models of standard
layers run as grouped convolutions and batched matrix products give each model's own forward and
gradients (float64), it refuses what it cannot run, and the batched engine uses it."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import client_splits, digits_fewshot, flat_weights
from torch import nn

import fedproto.training as training
from fedproto.federation import Client, TupleModel, federate, with_projection
from fedproto.models.cnn import PaperCNN, ProjectedCNN
from fedproto.training.grouped_forward import grouped_call, grouped_graph


class TupleCNN(nn.Module):
    """examples/own_federation.py's CNN, small (ceil-mode pooling, a flatten method call)."""

    def __init__(self, width: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
            nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.ReLU(), nn.AvgPool2d(2),
            nn.AdaptiveAvgPool2d((2, 2)))
        self.classifier = nn.Linear(2 * width * 4, 10)

    def forward(self, x):
        h = self.features(x).flatten(1)
        return self.classifier(torch.relu(h)), h


class CatNet(nn.Module):
    """Concatenates along channels: an operation the grouped layout would get wrong."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(1, 2, 3, padding=1), nn.Conv2d(1, 2, 3, padding=1)
        self.fc = nn.Linear(4 * 49, 10)

    def forward(self, x):
        h = torch.cat([self.a(x), self.b(x)], 1).flatten(1)
        return self.fc(h), h


def _models(build, G):
    out = []
    for g in range(G):
        torch.manual_seed(g)
        out.append(build().double())
    return out


@pytest.mark.parametrize("build, shape", [
    (lambda: ProjectedCNN(1, 10, (4, 6), 12), (1, 13, 13)),  # odd sides: ceil-mode pooling, adaptive 4x4
    (lambda: with_projection(TupleModel(TupleCNN(3), 24, 10), 5), (1, 9, 9)),
], ids=["projcnn", "tuple-cnn-projected"])
def test_grouped_forward_and_gradients_match_each_model(build, shape):
    G, B = 3, 5
    models = _models(build, G)
    gm, why = grouped_graph(models[0])
    assert gm is not None, why
    names = [k for k, _ in models[0].named_parameters()]
    P = {k: torch.stack([dict(m.named_parameters())[k].detach() for m in models]).requires_grad_() for k in names}
    X = torch.randn(G, B, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits, h = grouped_call(gm, P, X)
    assert logits.shape == (G, B, 10) and h.shape == (G, B, models[0].embedding_dim)
    (logits.square().sum() + h.sin().sum()).backward()
    for g, m in enumerate(models):
        lg, hg = m(X[g])
        torch.testing.assert_close(logits[g], lg, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(h[g], hg, rtol=1e-12, atol=1e-12)
        (lg.square().sum() + hg.sin().sum()).backward()
        for k, p in m.named_parameters():
            if p.grad is None:  # the inner classifier Projected does not use
                assert P[k].grad is None, k
                continue
            torch.testing.assert_close(P[k].grad[g], p.grad, rtol=1e-10, atol=1e-12, msg=k)


@pytest.mark.parametrize("model, reason", [
    (TupleModel(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten()), 2, 10), "buffers"),
    (TupleModel(CatNet(), 196, 10), "unsupported operation call_function <built-in method cat"),
    (ProjectedCNN(1, 10, (4,), 8, dropout=0.2), "unsupported operation call_module drop"),
    (PaperCNN(1, 10, 6, 8, 8, dropout=0.5), "explicit dropout masks"),
    (ProjectedCNN(1, 10, (4,), 8, dropout=0.0).requires_grad_(True), None),
], ids=["batchnorm", "channel-cat", "dropout", "noise-masks", "plain"])
def test_grouped_graph_refuses_what_it_cannot_run(model, reason):
    gm, why = grouped_graph(model)
    if reason is None:
        assert gm is not None and why is None
    else:
        assert gm is None and why.startswith(reason), why


def test_batched_engine_runs_standard_layer_models_grouped(monkeypatch):
    """Two projcnn widths on digits, batch 16 (trailing batches), momentum: the batched run calls the
    grouped forward (not vmap) and gives the sequential run's float64 weights."""
    calls = []
    orig = training.generic.grouped_forward
    monkeypatch.setattr(training.generic, "grouped_forward", lambda *a: calls.append(a[3]) or orig(*a))
    digits = digits_fewshot(stdev=1)
    runs = {}
    for mode in ("sequential", "batched"):
        clients = []
        for i, (train, test) in enumerate(client_splits(*digits)):
            torch.manual_seed(i)
            clients.append(Client(ProjectedCNN(1, 10, (4, 6) if i % 2 else (6, 4), 12), train, test))
        sim = federate(clients, 10, out=False, eval_every=0, threads=1, execution=mode, rounds=2, lr=0.05,
                       momentum=0.9, batch_size=16)
        sim.setup.to_dtype(torch.float64)
        sim.run()
        runs[mode] = sim
    assert calls and max(calls) == 2  # two clients per architecture
    # one grouped forward per step of the group's longest client: trailing batches are padded with weight-0
    # samples (as the hand-written batched path does), not run as sub-groups of their own
    sim = runs["batched"]
    steps = [math.ceil(len(d.y) / 16) for d in sim.setup.data]
    assert len(set(len(d.y) % 16 for d in sim.setup.data) - {0}) > 1  # trailing batches of different sizes
    assert len(calls) == 2 * (max(steps[0::2]) + max(steps[1::2]))  # 2 rounds, 2 architectures
    for i, (p, q) in enumerate(zip(flat_weights(runs["sequential"]), flat_weights(runs["batched"]))):
        assert ((p - q).norm() / p.norm()).item() < 1e-9, i


def _order(gm):
    return [n.target if n.op != "call_module" else type(dict(gm.named_modules())[n.target]).__name__
            for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


class TwoUsers(nn.Module):
    """A ReLU read by a max-pool and by the embedding: it cannot move behind the pool."""

    def __init__(self):
        super().__init__()
        self.conv, self.pool, self.fc = nn.Conv2d(1, 2, 3, padding=1), nn.MaxPool2d(2), nn.Linear(2 * 16, 10)

    def forward(self, x):
        a = torch.relu(self.conv(x))
        return self.fc(self.pool(a).flatten(1)), a.flatten(1)


def test_grouped_graph_pools_before_relu_and_drops_dead_layers():
    """ReLU -> max-pool becomes max-pool -> ReLU (the same numbers on a quarter of the map) where the ReLU feeds
    only the pool; layers whose output no result reads (a wrapped model's own classifier) are not run."""
    gm, _ = grouped_graph(ProjectedCNN(1, 10, (4, 6), 12))
    assert _order(gm)[:6] == ["Conv2d", "MaxPool2d", "ReLU", "Conv2d", "MaxPool2d", "ReLU"]
    gm, _ = grouped_graph(TwoUsers())
    assert _order(gm)[:3] == ["Conv2d", torch.relu, "MaxPool2d"]
    wrapped = with_projection(TupleModel(TupleCNN(3), 24, 10), 5)
    gm, _ = grouped_graph(wrapped)
    called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    assert any(k.endswith("features.0") for k in called) and not any(k.endswith("classifier") for k in called), called
    # the rewritten graphs still compute each model's forward: TwoUsers, with its shared ReLU, too
    models = _models(TwoUsers, 2)
    gm, _ = grouped_graph(models[0])
    names = [k for k, _ in models[0].named_parameters()]
    P = {k: torch.stack([dict(m.named_parameters())[k].detach() for m in models]) for k in names}
    X = torch.randn(2, 3, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    logits, h = grouped_call(gm, P, X)
    for g, m in enumerate(models):
        torch.testing.assert_close((logits[g], h[g]), m(X[g]), rtol=1e-12, atol=1e-12)


def test_frozen_first_block_stays_frozen_on_the_grouped_path(monkeypatch):
    """A projected CNN with a frozen first convolution, FedProx (proximal term on the trained part), momentum,
    trailing batches: the default (auto) run trains it grouped, keeps the frozen weights bit for bit and gives
    the sequential run's float64 weights."""
    calls = []
    orig = training.generic.grouped_forward
    monkeypatch.setattr(training.generic, "grouped_forward", lambda *a: calls.append(a[3]) or orig(*a))
    digits = digits_fewshot(stdev=1)
    runs, frozen = {}, None
    for mode in ("sequential", "auto"):
        clients = []
        for i, (train, test) in enumerate(client_splits(*digits)):
            torch.manual_seed(i)
            m = ProjectedCNN(1, 10, (4, 6), 12)
            m.features[0].requires_grad_(False)
            clients.append(Client(m, train, test))
        frozen = [c.model.features[0].weight.detach().clone() for c in clients]
        sim = federate(clients, 10, out=False, eval_every=0, threads=1, execution=mode, rounds=2, lr=0.05,
                       momentum=0.9, batch_size=16, algorithm="fedprox", prox_mu=0.1)
        sim.setup.to_dtype(torch.float64)
        sim.run()
        runs[mode] = sim
        for c, w in zip(clients, frozen):
            assert torch.equal(c.model.features[0].weight.float(), w)
            assert not c.model.features[0].weight.requires_grad
    assert calls and max(calls) == 4  # one architecture: the 4 clients in one group
    moved = False
    for i, (p, q) in enumerate(zip(flat_weights(runs["sequential"]), flat_weights(runs["auto"]))):
        assert ((p - q).norm() / p.norm()).item() < 1e-9, i
    for s in runs["auto"].setup.states:
        moved |= not torch.equal(s.model.proj.weight, runs["auto"].setup.states[0].model.proj.weight)
    assert moved  # the trained part differs between clients: the bound compares real training
