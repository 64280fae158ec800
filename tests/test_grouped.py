"""The grouped forward of the generic batched path (fedproto.grouped): G stacked models of standard
layers run as grouped convolutions and batched matrix products give each model's own forward and
gradients (float64), it refuses what it cannot run, and the batched engine uses it."""

from __future__ import annotations

import pytest
import torch
from conftest import client_splits, digits_fewshot, flat_weights
from torch import nn

import fedproto.training as training
from fedproto.federation import Client, TupleModel, federate, with_projection
from fedproto.grouped import grouped_call, grouped_graph
from fedproto.models.cnn import PaperCNN, ProjectedCNN


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
    orig = training.grouped_call
    monkeypatch.setattr(training, "grouped_call", lambda *a: calls.append(a[2].shape[0]) or orig(*a))
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
    for i, (p, q) in enumerate(zip(flat_weights(runs["sequential"]), flat_weights(runs["batched"]))):
        assert ((p - q).norm() / p.norm()).item() < 1e-9, i
