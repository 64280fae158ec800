"""Issue #21 items 2, 3, 4, 8: your own models after a run (the trained objects, a public handle,
saved on request), frozen parameters and BatchNorm statistics left alone on every path, labels
read from what a Dataset yields, and the errors users hit with their own models and data."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedproto.data.datasets import load_dataset
from fedproto.data.partition import fewshot_partition
from fedproto.federation import Client, federate
from fedproto.models.cnn import PaperCNN


@pytest.fixture(scope="module")
def digits():
    ds = load_dataset("digits")
    part = fewshot_partition(ds.train_y.numpy(), ds.test_y.numpy(), 10, 4, 3, 25, 0, 10, seed=5)
    return ds, part


def _splits(digits):
    ds, part = digits
    for tr, te in zip(part.train_idx, part.test_idx):
        tr, te = torch.as_tensor(tr), torch.as_tensor(te)
        yield (ds.train_x[tr], ds.train_y[tr]), (ds.test_x[te], ds.test_y[te])


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
    for i, (train, test) in enumerate(_splits(digits)):
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
    for i, (train, test) in enumerate(_splits(digits)):
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
