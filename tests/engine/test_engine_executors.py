"""fedproto.engine.executors: the sequential and the batched executor give the same numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import (
    digits_config,
    digits_eval_config,
    flat_weights,
    float64_sim,
    needs_mnist,
    saved_resnet18_weights,
)

from fedproto.config.run_config import build_config
from fedproto.engine.setup import prepare
from fedproto.errors import ModelError
from fedproto.simulation import Simulation


def test_attack_and_dp_runs_match_in_float64_across_paths():
    """The prototype release with noise and the simulated attackers act after training, so the
    batched path still equals the sequential one (float64)."""
    kw = dict(dp="prototypes", dp_noise=0.5, attack="random", attackers=1, rounds=3, aggregation="trimmed",
              dp_reproducible_noise=True)
    a = float64_sim(digits_config(execution="sequential", **kw))
    b = float64_sim(digits_config(execution="batched", **kw))
    a.run()
    b.run()
    assert np.abs(a.message["protos"] - b.message["protos"]).max() < 1e-6  # float32 messages


@pytest.mark.usefixtures("one_thread")
def test_resnet18_runs_in_the_simulation_sequentially(tmp_path):
    """resnet18-mh with --pretrained through the engine (8x8 grey digits: conv1 differs from the
    file's 3-channel conv1, which is never loaded)."""
    path, saved = saved_resnet18_weights(tmp_path)
    cfg = build_config(overrides=dict(dataset="digits", model="resnet18-mh", clients=2, ways=2, shots=5, stdev=0,
                                      test_shots=5, rounds=1, pretrained=str(path)))
    sim = Simulation(cfg, out=False)
    # _groups gives (clients, process) pairs: each client alone, in the main process
    assert sim.setup.embedding_dim == 512 and sim.executor.groups([0, 1]) == [([0], 0), ([1], 0)]
    assert [s.model.strides for s in sim.setup.states] == [(1, 4), (2, 2)]
    assert all(torch.equal(s.model.layer2[1].conv2.weight, saved["layer2.1.conv2.weight"]) for s in sim.setup.states)
    summary = sim.run()
    assert summary["clients"] == 2 and sim.history[0]["loss_ce"] > 0
    with pytest.raises(ModelError, match="resnet18"):
        prepare(cfg.model_copy(update={"model": "cnn"}))


def test_batched_and_sequential_runs_give_equal_accuracies():
    """float64: the two paths agree within 1e-9 relative after 2 rounds (round 2 trains against
    round 1's global prototypes), with equal accuracies."""
    res = {}
    for mode in ("sequential", "batched"):
        sim = float64_sim(digits_eval_config(rounds=2, execution=mode))
        sim.run()
        res[mode] = sim
    s, b = res["sequential"], res["batched"]
    for i, (p, q) in enumerate(zip(flat_weights(s), flat_weights(b))):
        assert ((p - q).norm() / p.norm()).item() < 1e-9, i
    assert s.history[-1]["acc_mean"] == b.history[-1]["acc_mean"]
    assert s.history[-1]["acc_proto_mean"] == b.history[-1]["acc_proto_mean"]
    assert s.history[-1]["loss_proto"] == pytest.approx(b.history[-1]["loss_proto"], rel=1e-9)


@needs_mnist
@pytest.mark.parametrize("seed", [1, 1234])
def test_batched_matches_sequential_after_one_round_on_real_mnist(seed):
    """Default MNIST setting, 20 clients, float64: per-client weights within 1e-9 relative after a
    round (measured below 2e-16), the same accuracies.

    Why float64: in float32, on AMD EPYC, clients 3 and 10 (seed 1234) and 18 (seed 1) differed by
    1e-2. The cause is no logic difference: after 23 steps client 10's weights differ by ~1e-6
    (float32 rounding of two kernels); at step 24 one conv2 unit's pre-activation is -7.8e-7 on one
    path and +3.0e-6 on the other, so the ReLU passes the gradient on one path only, and the
    steps after carry the difference on. In float64 no such near-tie decides anything."""
    sims = {}
    for mode in ("sequential", "batched"):
        cfg = build_config(overrides=dict(rounds=1, eval_every=0, execution=mode, seed=seed))
        sims[mode] = float64_sim(cfg)
        sims[mode].run()
    s, b = sims["sequential"], sims["batched"]
    for i, (p, q) in enumerate(zip(flat_weights(s), flat_weights(b))):
        assert ((p - q).norm() / p.norm()).item() < 1e-9, i
    assert [m["acc"] for m in s.evaluate()] == [m["acc"] for m in b.evaluate()]
