"""Optimizers, the lr schedule over rounds and shared initial weights."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import client_splits, digits_fewshot, flat_weights, float64_sim
from torch import nn

import fedproto.engine.executors.batched as batched
import fedproto.simulation as simulation
import fedproto.training as training
from fedproto.config.run_config import build_config
from fedproto.errors import ConfigError
from fedproto.federation import Client, federate, share_initial_weights
from fedproto.models.cnn import PaperCNN
from fedproto.models.zoo import build_client_models
from fedproto.training import Objective, OptimConfig, Phase, make_plan, train_client, train_group

TIGHT = 1e-9
"""Relative bound for two paths in float64 (rounding near 1e-15)."""


def _rel(a, b):
    return ((a - b).norm() / a.norm()).item()


def _clients(G=4, seed=0, size=28):
    torch.manual_seed(seed)
    models = [PaperCNN(input_size=size).double() for _ in range(G)]
    xs = [torch.randn(21 + 4 * g, 1, size, size, dtype=torch.float64) for g in range(G)]  # 3-5 steps: compaction
    ys = [torch.randint(0, 10, (len(x),)) for x in xs]
    return models, xs, ys


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adam_batched_matches_sequential_float64(optimizer):
    """PaperCNN's hand-written batched path (torch.optim.adam.adam on stacked rows) gives the weights of
    torch.optim.Adam/AdamW per client, within 1e-9 relative, in round 3 of a step schedule (lr 0.0025),
    with weight decay, two phases (a fresh optimizer each) and clients leaving the stacked steps early."""
    models, xs, ys = _clients(4)
    start = [copy.deepcopy(m) for m in models]
    ref = [copy.deepcopy(m) for m in models]
    opt = OptimConfig(lr=0.01, weight_decay=0.01, optimizer=optimizer, lr_schedule="step", lr_step_rounds=1,
                      lr_gamma=0.5, rounds=5).at_round(3)
    assert opt.round_lr == pytest.approx(0.0025)
    obj = Objective([Phase(1, trains=lambda n: n.startswith("fc2.")), Phase(1)])
    plans = [make_plan(len(x), obj.phases, opt, m.noise_widths(), m.dropout, np.random.default_rng([0, g]))
             for g, (m, x) in enumerate(zip(models, xs))]
    seq = [train_client(ref[g], xs[g], ys[g], plans[g], obj, opt) for g in range(4)]
    bat = train_group(models, xs, ys, plans, obj, opt)
    for g in range(4):
        assert seq[g].steps == bat[g].steps
        for (name, a), (_, b) in zip(ref[g].named_parameters(), models[g].named_parameters()):
            assert _rel(a, b) < TIGHT, (g, name)
    # the bound is no trivial one: Adam moved the weights, and not as SGD at the same lr would have
    sgd = copy.deepcopy(start[0])
    train_client(sgd, xs[0], ys[0], plans[0], obj, OptimConfig(lr=0.0025, weight_decay=0.01))
    w_adam, w_sgd, w0 = (torch.cat([p.flatten() for p in m.parameters()]) for m in (models[0], sgd, start[0]))
    assert (w_adam - w0).norm() > 1e-2 and _rel(w_adam, w_sgd) > 1e-3


def _tuple_clients(digits, width=8):
    class TupleCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                          nn.Flatten())
            self.classifier = nn.Linear(width * 16, 10)

        def forward(self, x):
            h = self.features(x)
            return self.classifier(h), h

    out = []
    for i, (train, test) in enumerate(client_splits(*digits)):
        torch.manual_seed(i)
        out.append(Client(TupleCNN(), train, test, embedding_dim=12))
    return out


@pytest.fixture(scope="module")
def digits():
    return digits_fewshot(stdev=1)


def test_adamw_cosine_generic_path_matches_sequential(digits, monkeypatch):
    """Your own models on the generic (vmap / grouped) batched path train with AdamW and a cosine schedule as
    the sequential path does (float64, 1e-9); the metrics rows log the lr of each round."""
    calls = []
    orig = batched.train_group_generic
    monkeypatch.setattr(batched, "train_group_generic", lambda models, *a, **k: calls.append(len(models))
                        or orig(models, *a, **k))
    sims = {}
    for mode in ("sequential", "batched"):
        sim = federate(_tuple_clients(digits), 10, out=False, eval_every=0, threads=1, execution=mode, rounds=3,
                       lr=0.01, optimizer="adamw", weight_decay=0.05, lr_schedule="cosine", lr_min=0.001,
                       batch_size=16)
        sim.setup.to_dtype(torch.float64)
        sim.run()
        sims[mode] = sim
    assert calls == [4, 4, 4]
    for a, b in zip(flat_weights(sims["sequential"]), flat_weights(sims["batched"])):
        assert _rel(a, b) < TIGHT
    lrs = [row["lr"] for row in sims["batched"].history]
    assert lrs == pytest.approx([0.01, 0.0055, 0.001])
    assert [row["lr"] for row in sims["sequential"].history] == lrs


def test_workers_adam_match_one_process_float64(monkeypatch):
    """The worker processes (fedproto.engine.executors.worker_pool) step Adam with the round's lr as the main
    process does."""
    from fedproto.engine.executors.worker_pool import WorkerPool

    sent = []
    submit = WorkerPool.submit
    monkeypatch.setattr(WorkerPool, "submit", lambda self, w, items, models, opt: sent.append(opt.round_lr)
                        or submit(self, w, items, models, opt))
    base = dict(dataset="digits", clients=4, ways=3, shots=10, stdev=1, test_shots=10, rounds=2, model="cnn",
                eval_every=0, lr=0.01, threads=2, execution="batched", optimizer="adam", lr_schedule="step",
                lr_step_rounds=1, lr_gamma=0.3)
    weights = {}
    for workers in (1, 2):
        sim = float64_sim(build_config(overrides={**base, "workers": workers}))
        sim.run()
        weights[workers] = flat_weights(sim)
    assert sent == pytest.approx([0.01, 0.003])  # a worker trained clients in both rounds, at the round's lr
    assert max(_rel(a, b) for a, b in zip(weights[2], weights[1])) < 1e-12
    start = flat_weights(float64_sim(build_config(overrides=base)))
    assert min((a - s).norm().item() for a, s in zip(weights[2], start)) > 1e-3


def test_sequential_path_uses_the_round_lr(monkeypatch):
    """Each round's optimizer is built with lr_of_round(round) (sequential engine, FedAvg on 3 digits clients)."""
    seen = []
    orig = training.sequential.make_optimizer

    def record(params, opt):
        seen.append((opt.round, opt.round_lr))
        return orig(params, opt)

    monkeypatch.setattr(training.sequential, "make_optimizer", record)
    cfg = build_config(overrides=dict(dataset="digits", clients=3, ways=3, shots=10, test_shots=5, rounds=3,
                                      eval_every=0, threads=1, execution="sequential", algorithm="fedavg",
                                      lr=0.04, lr_schedule="step", lr_step_rounds=2, lr_gamma=0.25))
    sim = simulation.Simulation(cfg, out=False)
    sim.run()
    assert sorted(set(seen)) == [(1, 0.04), (2, 0.04), (3, 0.01)]
    assert len(seen) == 9  # 3 clients x 3 rounds
    assert [r["lr"] for r in sim.history] == [0.04, 0.04, 0.01]


def test_lr_of_round_values_and_errors():
    step = OptimConfig(lr=0.1, lr_schedule="step", lr_step_rounds=3, lr_gamma=0.5, rounds=10)
    assert [step.lr_of_round(r) for r in (1, 3, 4, 6, 7)] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025])
    cos = OptimConfig(lr=0.1, lr_schedule="cosine", lr_min=0.02, rounds=5)
    assert [cos.lr_of_round(r) for r in range(1, 7)] == pytest.approx(
        [0.1, 0.02 + 0.08 * (1 + np.cos(np.pi / 4)) / 2, 0.06, 0.02 + 0.08 * (1 + np.cos(3 * np.pi / 4)) / 2,
         0.02, 0.02])
    assert OptimConfig(lr=0.1, lr_schedule="cosine", rounds=1).lr_of_round(1) == 0.1
    assert OptimConfig(lr=0.3).lr_of_round(50) == 0.3
    assert OptimConfig(lr=0.3).round_lr == 0.3 and cos.at_round(3).round_lr == pytest.approx(0.06)
    with pytest.raises(ValueError, match=r"lr_gamma=0.0: .*in \(0, 1\]"):
        OptimConfig(lr_schedule="step", lr_gamma=0.0)
    with pytest.raises(ValueError, match=r"lr_gamma=2.0: .*in \(0, 1\]"):
        OptimConfig(lr_schedule="step", lr_gamma=2.0)
    with pytest.raises(ValueError, match="optimizer='rmsprop'.*sgd, adam, adamw"):
        OptimConfig(optimizer="rmsprop")
    with pytest.raises(ValueError, match="lr_min=0.5"):
        OptimConfig(lr=0.1, lr_min=0.5)
    with pytest.raises(ValueError, match="round 0"):
        step.lr_of_round(0)


def test_config_checks_and_run_names():
    with pytest.raises(ConfigError, match="lr_min.*0.5.*above.*lr.*0.1"):
        build_config(overrides={"lr": 0.1, "lr_schedule": "cosine", "lr_min": 0.5})
    with pytest.raises(ConfigError, match="lr.gamma"):
        build_config(overrides={"lr_schedule": "step", "lr_gamma": 0.0})
    # a growing "decay" was accepted (up to 1e6): lr 0.05 x 1e6 per round, a non-finite loss in round 2
    with pytest.raises(ConfigError, match=r"lr_gamma=1000000.0.*less than or equal to 1"):
        build_config(overrides={"lr_schedule": "step", "lr_step_rounds": 1, "lr_gamma": 1e6})
    assert build_config(overrides={"lr_schedule": "step", "lr_gamma": 1.0}).lr_gamma == 1.0
    with pytest.raises(ConfigError, match="optimizer"):
        build_config(overrides={"optimizer": "rmsprop"})
    assert build_config().run_name() == "fedproto-mnist-n3-k100-s1234"
    assert build_config(overrides={"shared_init": True}).run_name() == "fedproto-mnist-n3-k100-s1234-shared_initon"
    # momentum does not act under adam, the step options only under step: not in the name
    name = build_config(overrides={"optimizer": "adam", "momentum": 0.9, "lr_gamma": 0.5}).run_name()
    assert name == "fedproto-mnist-n3-k100-s1234-optimizeradam"
    name = build_config(overrides={"lr_schedule": "step", "lr_gamma": 0.5}).run_name()
    assert name == "fedproto-mnist-n3-k100-s1234-lr_schedulestep-lr_gamma0.5"
    assert "tensorboard" not in build_config(overrides={"tensorboard": True}).result_fields()


def _flat(m):
    return torch.cat([v.flatten().double() for v in m.state_dict().values()])


def test_shared_init_zoo_models_identical_per_architecture():
    """shared_init: clients of one architecture start identical (client 0's weights for cnn), other
    architectures from their own; off: every client differs (today's per-client seeding)."""
    shared = build_client_models("cnn,projcnn:8-16", 4, 1, 10, 28, seed=7, shared_init=True)
    apart = build_client_models("cnn,projcnn:8-16", 4, 1, 10, 28, seed=7)
    assert torch.equal(_flat(shared[0]), _flat(shared[2])) and torch.equal(_flat(shared[1]), _flat(shared[3]))
    assert torch.equal(_flat(shared[0]), _flat(apart[0]))  # client 0 keeps its weights
    assert not torch.equal(_flat(apart[0]), _flat(apart[2]))
    assert _flat(shared[0]).shape != _flat(shared[1]).shape


def test_shared_init_run_records_it_and_starts_clients_identical(tmp_path):
    over = dict(dataset="digits", clients=4, ways=3, shots=10, test_shots=5, rounds=1, eval_every=0, threads=1,
                shared_init=True, out_dir=str(tmp_path))
    cfg = build_config(overrides=over)
    sim = simulation.Simulation(cfg)
    w = [_flat(s.model) for s in sim.setup.states]
    assert all(torch.equal(w[0], x) for x in w[1:])
    sim.run()
    import json

    assert json.loads((sim.run_dir.path / "config.json").read_text())["shared_init"] is True
    assert "-shared_initon" in sim.run_dir.path.name


def test_share_initial_weights_for_your_own_models_respects_frozen_layers():
    def net(width, seed, freeze=False):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.Linear(width, 3))
        m[1].running_mean.normal_()
        if freeze:
            for p in [*m[0].parameters(), *m[1].parameters()]:
                p.requires_grad_(False)
        return m

    a, b, c = net(5, 0, True), net(5, 1, True), net(6, 2)
    d, e = net(5, 3), net(5, 4)  # same shapes as a, b but nothing frozen: a group of their own
    before_b, before_c = copy.deepcopy(b.state_dict()), copy.deepcopy(c.state_dict())
    groups = share_initial_weights([a, b, c, d, e])
    assert groups == [[0, 1], [2], [3, 4]]
    assert torch.equal(b[2].weight, a[2].weight)  # trainable: copied
    assert torch.equal(b[0].weight, before_b["0.weight"])  # frozen: kept, flag kept
    assert torch.equal(b[1].running_mean, before_b["1.running_mean"])  # frozen BatchNorm's statistics kept
    assert not b[0].weight.requires_grad and b[2].weight.requires_grad
    assert all(torch.equal(v, before_c[k]) for k, v in c.state_dict().items())
    assert torch.equal(_flat(d), _flat(e)) and not torch.equal(d[0].weight, a[0].weight)


def test_federate_shared_init_copies_the_first_clients_weights(digits):
    sim = federate(_tuple_clients(digits), 10, out=False, shared_init=True, rounds=1)
    w = [_flat(s.model) for s in sim.setup.states]
    assert all(torch.equal(w[0], x) for x in w[1:])
    sim = federate(_tuple_clients(digits), 10, out=False, rounds=1)
    assert not torch.equal(_flat(sim.setup.states[0].model), _flat(sim.setup.states[1].model))
