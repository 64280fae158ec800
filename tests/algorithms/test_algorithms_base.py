"""Clients' data as index views into one copy of each split (memory that scales with clients)."""

from __future__ import annotations

import pytest
import torch
from conftest import flat_weights, needs_mnist

from fedproto.algorithms.algorithm import ClientData, SharedInputs
from fedproto.config.run_config import build_config
from fedproto.engine.setup import prepare
from fedproto.simulation import Simulation

DIGITS = dict(dataset="digits", clients=6, ways=3, shots=25, stdev=1, test_shots=10, rounds=2, eval_every=1, threads=1)


def _with_copies(setup):
    """The same setup with every client holding its own copies (the layout before views)."""
    setup.data = [ClientData(d.x, d.y, d.test_x, d.test_y) for d in setup.data]
    return setup


def _run(cfg, copies: bool, dtype=torch.float32):
    setup = prepare(cfg, progress=False).to_dtype(dtype)
    sim = Simulation(cfg, setup=_with_copies(setup) if copies else setup, out=False)
    sim.run()
    return sim


@pytest.mark.parametrize("execution,workers", [("sequential", 0), ("batched", 1), ("batched", 2)])
def test_views_train_bit_for_bit_like_copies(execution, workers):
    """Views and per-client copies give identical weights and metrics: sequential, batched in one
    process and batched with a worker process (its shared block is filled from the views)."""
    cfg = build_config(overrides=dict(DIGITS, execution=execution, workers=workers, threads=max(1, workers)))
    a, b = _run(cfg, copies=False), _run(cfg, copies=True)
    assert all(d.is_view for d in a.setup.data) and not any(d.is_view for d in b.setup.data)
    for i, (p, q) in enumerate(zip(flat_weights(a), flat_weights(b))):
        assert torch.equal(p, q), i
    for k in ("acc_mean", "acc_proto_mean", "loss_ce", "loss_proto"):
        assert a.history[-1][k] == b.history[-1][k], k
    assert 0.4 < a.history[-1]["acc_mean"] <= 1.0  # trained: chance is 1/3 or less (3 ways on average)


def test_views_float64_match_copies():
    """``to_dtype(float64)`` on views casts each gathered batch (the shared split stays float32),
    with the same numbers as copies cast whole."""
    cfg = build_config(overrides=dict(DIGITS, rounds=2, execution="batched"))
    a, b = _run(cfg, copies=False, dtype=torch.float64), _run(cfg, copies=True, dtype=torch.float64)
    assert a.setup.data[0].x.dtype == torch.float64 and a.setup.data[0].test_x.dtype == torch.float64
    assert a.setup.data[0].shared_inputs()[0].tensor.dtype == torch.float32
    for i, (p, q) in enumerate(zip(flat_weights(a), flat_weights(b))):
        assert torch.equal(p, q), i
    assert a.history[-1]["acc_mean"] == b.history[-1]["acc_mean"]


def test_clients_hold_indices_not_images():
    """Every client reads its rows of the dataset's one train and one test tensor; no client holds
    an image tensor of its own, and each read gathers exactly the partition's rows."""
    setup = prepare(build_config(overrides=DIGITS), progress=False)
    ds, part = setup.dataset, setup.partition
    for i, d in enumerate(setup.data):
        train, test = d.shared_inputs()
        assert train.tensor is ds.train_x and test.tensor is ds.test_x
        assert [k for k, v in vars(d).items() if isinstance(v, torch.Tensor) and v.is_floating_point()] == []
        tr, te = torch.as_tensor(part.train_idx[i]), torch.as_tensor(part.test_idx[i])
        assert torch.equal(d.x, ds.train_x[tr]) and torch.equal(d.test_x, ds.test_x[te])
        assert torch.equal(d.y, ds.train_y[tr]) and torch.equal(d.test_y, ds.test_y[te])
        assert d.x.data_ptr() != d.x.data_ptr()  # a new tensor on every read, let go after use
    assert len({id(s) for d in setup.data for s in d.shared_inputs()}) == 2


def test_assigning_inputs_replaces_the_view():
    setup = prepare(build_config(overrides=DIGITS), progress=False)
    d, row = setup.data[0], int(setup.partition.train_idx[0][0])
    before = setup.dataset.train_x[row].clone()
    x = d.x
    x[0] = 7.0
    assert not torch.equal(d.x, x)  # changing a read leaves the view and the dataset alone
    assert torch.equal(setup.dataset.train_x[row], before)
    d.x = x
    assert not d.is_view and d.x is x and torch.equal(d.x[0], torch.full_like(x[0], 7.0))
    assert torch.equal(setup.dataset.train_x[row], before)


def test_view_refuses_bad_indices():
    shared = SharedInputs(torch.zeros(10, 1, 2, 2))
    y = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"train: indices 8\.\.10 outside the split's 10 rows; index rows 0\.\.9"):
        ClientData.view(shared, [8, 9, 10], y, shared, [0, 1, 2], y)
    with pytest.raises(ValueError, match="test: 2 indices but 3 labels; give one label per index"):
        ClientData.view(shared, [0, 1, 2], y, shared, [0, 1], y)


@needs_mnist
@pytest.mark.slow
@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_views_match_copies_on_real_mnist(execution):
    """The default MNIST setting (20 clients, shots 100), 2 rounds: views and copies bit for bit."""
    cfg = build_config(overrides=dict(rounds=2, eval_every=1, execution=execution, threads=1))
    a, b = _run(cfg, copies=False), _run(cfg, copies=True)
    for i, (p, q) in enumerate(zip(flat_weights(a), flat_weights(b))):
        assert torch.equal(p, q), i
    assert a.history[-1]["acc_mean"] == b.history[-1]["acc_mean"] > 0.8
    assert a.history[-1]["acc_proto_mean"] == b.history[-1]["acc_proto_mean"]
