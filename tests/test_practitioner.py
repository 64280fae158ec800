"""FedProto's practitioner options (practitioner's guide §4.2-4.3; none is in the paper): λ warm-up,
prototype momentum, normalization, client filtering by sample count, prototype-distance monitoring."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from fedproto.algorithms.fedproto import FedProto
from fedproto.config import build_config
from fedproto.errors import ConfigError
from fedproto.prototypes import client_distances, lambda_at, momentum_prototypes, nearest_prototype, proto_loss
from fedproto.simulation import Simulation
from fedproto.training import OptimConfig


def _cfg(**kw):
    base = dict(dataset="digits", clients=6, ways=3, shots=25, stdev=1, test_shots=10, rounds=4, eval_every=0,
                threads=1)
    return build_config(overrides={**base, **kw})


def test_lambda_warmup_values():
    assert [lambda_at(r, 2.0, 4) for r in (1, 2, 3, 5, 9)] == [0.0, 0.5, 1.0, 2.0, 2.0]
    assert [lambda_at(r, 2.0, 0) for r in (1, 2, 50)] == [2.0, 2.0, 2.0]


def test_lambda_warmup_is_sent_and_used():
    plain = Simulation(_cfg(), out=False)
    plain.run()
    warm = Simulation(_cfg(lambda_warmup=4), out=False)
    warm.run()
    assert float(warm.message["lambda"][0]) == pytest.approx(1.0)  # round 5 would use the full λ = 1
    # the server sends one more number per client from round 2 on (round 1's message is empty)
    m = 6
    assert [w["down_params"] - p["down_params"] for w, p in zip(warm.history, plain.history)] == [0, m, m, m]
    # a smaller λ in rounds 2-4 pulls less: the prototype loss the clients see stays larger
    assert warm.history[1]["loss_ce"] != plain.history[1]["loss_ce"]
    obj = warm.setup.algorithm.objective(warm.setup.states[0], {**warm.message, "lambda": np.array([0.25], np.float32)})
    assert obj.lambda_proto == 0.25


def test_momentum_prototypes_values():
    cls, protos = momentum_prototypes(np.array([0, 1]), np.array([[0.0, 0.0], [2.0, 2.0]]),
                                      np.array([1, 2]), np.array([[4.0, 4.0], [6.0, 6.0]]), 0.5)
    assert cls.tolist() == [0, 1, 2]
    assert protos.tolist() == [[0.0, 0.0], [3.0, 3.0], [6.0, 6.0]]  # kept, 0.5*2+0.5*4, new
    cls0, p0 = momentum_prototypes(np.array([0]), np.array([[1.0]]), np.array([0]), np.array([[3.0]]), 0.0)
    assert p0.tolist() == [[3.0]]
    with pytest.raises(ValueError, match="outside"):
        momentum_prototypes(np.array([0]), np.array([[1.0]]), np.array([0]), np.array([[3.0]]), 1.0)


def _msg(classes, protos, counts):
    return {"classes": np.array(classes, np.int64), "protos": np.array(protos, np.float32),
            "counts": np.array(counts, np.int64)}


def test_server_momentum_filtering_and_monitoring():
    alg = FedProto(3, OptimConfig(), proto_momentum=0.75, min_proto_samples=5, embedding_dim=2)
    r1 = alg.aggregate(1, {0: _msg([0, 1], [[0, 0], [4, 0]], [10, 10]), 1: _msg([1], [[8, 0]], [10])})
    assert r1["classes"].tolist() == [0, 1] and r1["protos"].tolist() == [[0, 0], [6, 0]]
    # round 2: client B's class-1 prototype rests on 3 samples and is ignored (min_proto_samples=5)
    r2 = alg.aggregate(2, {0: _msg([0, 1], [[4, 0], [10, 0]], [10, 10]), 1: _msg([1, 2], [[100, 0], [2, 2]], [3, 9])})
    assert r2["classes"].tolist() == [0, 1, 2]
    assert r2["protos"].tolist() == [[1, 0], [7, 0], [2, 2]]  # 0.75*0+0.25*4, 0.75*6+0.25*10, new class
    assert alg.last_contributors.tolist() == [1, 1, 1]
    # monitoring covers every client's sent prototypes, the ignored one included
    np.testing.assert_allclose(alg.last_distances, [(3 + 3) / 2, (93 + 0) / 2])
    # λ the clients used in round 2 (no warm-up: the full λ = 1)
    assert alg.round_metrics() == {"lambda": 1.0, "proto_dist": 24.75, "proto_dist_max": 46.5, "proto_dist_argmax": 1}


def test_client_distances_and_outlier_warning(caplog):
    d = client_distances([np.array([0]), np.array([0, 1]), np.array([2])],
                         [np.array([[3.0, 4.0]]), np.array([[0.0, 0.0], [1.0, 1.0]]), np.array([[1.0, 1.0]])],
                         np.array([0, 1]), np.array([[0.0, 0.0], [1.0, 1.0]]))
    np.testing.assert_allclose(d[:2], [5.0, 0.0])
    assert np.isnan(d[2])  # none of its classes has a global prototype
    alg = FedProto(2, OptimConfig(), embedding_dim=1, proto_dist_alert=3.0)
    alg.aggregate(1, {i: _msg([0], [[v]], [5]) for i, v in enumerate((0.0, 1.0, 1.2, 0.8, 20.0))})
    assert [i for i, _, _ in alg.outliers()] == [4]
    sim = Simulation(_cfg(rounds=2), out=False)
    sim.setup.algorithm.proto_dist_alert = 1e-9  # every client above the median is flagged
    with caplog.at_level(logging.WARNING, logger="fedproto"):
        sim.run()
    assert "prototypes lie" in caplog.text and "check its data" in caplog.text
    assert all(k in sim.history[-1] for k in ("proto_dist", "proto_dist_max", "proto_dist_argmax"))
    assert sim.history[-1]["proto_dist_max"] >= sim.history[-1]["proto_dist"] > 0


def test_normalized_loss_and_inference():
    h = torch.tensor([[3.0, 4.0]])
    table, mask = torch.tensor([[0.0, 2.0]]), torch.tensor([True])
    y = torch.tensor([0])
    # (0.6, 0.8) vs (0, 1): squared distance 0.4, over B * d = 2
    assert float(proto_loss(h, y, table, mask, "mse", normalize=True)) == pytest.approx(0.2)
    assert float(proto_loss(h, y, table, mask, "mse")) == pytest.approx((9 + 4) / 2)
    protos, allowed = torch.tensor([[1.0, 0.1], [9.0, 5.0]]), torch.tensor([True, True])
    x = torch.tensor([[10.0, 0.0]])
    assert nearest_prototype(x, protos, allowed).tolist() == [1]  # Euclidean: (9, 5) is nearer
    assert nearest_prototype(x, protos, allowed, normalize=True).tolist() == [0]  # direction: (1, 0.1)
    # measured at seed 1234: acc 0.83, acc_proto 0.64 (clients hold 2-4 classes), loss_proto 0.008
    sim = Simulation(_cfg(proto_normalize=True, rounds=6, lr=0.05), out=False)
    sim.run()
    assert sim.history[-1]["loss_proto"] < 0.05  # unit vectors: squared distances at most 4 / d
    assert sim.history[-1]["acc_mean"] > 0.7 and sim.history[-1]["acc_proto_mean"] > 0.5


def test_options_validated_and_resumable(tmp_path):
    for bad in ({"proto_momentum": 1.0}, {"lambda_warmup": -1}, {"min_proto_samples": 0}, {"proto_dist_alert": -1}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            _cfg(**bad)
    cfg = _cfg(proto_momentum=0.5, lambda_warmup=3, checkpoint_every=2)
    whole = Simulation(cfg, out=tmp_path / "a")
    whole.run()

    class Stop(Exception):
        pass

    def stop(row):
        if row["round"] == 3:
            raise Stop

    with pytest.raises(Stop):
        Simulation(cfg, out=tmp_path / "b", on_round=stop).run()
    resumed = Simulation(cfg, out=tmp_path / "b")
    resumed.run(resume=True)
    drop = ("train_time_s", "eval_time_s")
    assert [{k: v for k, v in r.items() if k not in drop} for r in resumed.history] == [
        {k: v for k, v in r.items() if k not in drop} for r in whole.history]


def test_options_of_other_algorithms_are_warned_about(caplog):
    """The engine names options that act on other algorithms only (the owners of each option, fedproto.algorithms.options.owners),
    without knowing any algorithm by name."""
    from fedproto.engine.setup import prepare

    with caplog.at_level(logging.WARNING, logger="fedproto"):
        prepare(_cfg(algorithm="fedavg", proto_momentum=0.5, personal_layers="head"), progress=False)
    assert "fedavg ignores personal_layers, proto_momentum" in caplog.text
    assert "proto_momentum acts on fedproto only" in caplog.text
    assert "personal_layers acts on fedper, fedrep" in caplog.text
