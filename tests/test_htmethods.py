"""Drafts of the model-heterogeneous methods (issue #24 item 2) end to end on digits with two
architectures (projcnn:8-16 and the paper CNN, alternating over clients)."""

import numpy as np
import pytest
import torch
from conftest import flat_weights, float64_sim

from fedproto.algorithms import ALGORITHMS, FD, FedGH, FedTGP, LGFedAvg
from fedproto.algorithms.lgfedavg import head_message
from fedproto.config import build_config
from fedproto.htmath import lg_aggregate, tgp_generate
from fedproto.models.base import count_parameters
from fedproto.simulation import Simulation

BASE = dict(dataset="digits", clients=4, ways=3, shots=25, stdev=1, test_shots=10, rounds=10,
            model="projcnn:8-16,cnn", eval_every=0, lr=0.05, threads=1)
C, D = 10, 50  # digits' classes; the zoo models' default embedding size


def _cfg(**kw):
    return build_config(overrides={**BASE, **kw})


def _run(algorithm, **kw) -> Simulation:
    sim = Simulation(_cfg(algorithm=algorithm, **kw), out=False)
    sim.run()
    return sim


def test_registered_with_their_options():
    assert {ALGORITHMS[n] for n in ("fedtgp", "fd", "fedgh", "lgfedavg")} == {FedTGP, FD, FedGH, LGFedAvg}
    tgp = FedTGP.from_config(_cfg(algorithm="fedtgp"), D)
    assert (tgp.server_epochs, tgp.server_lr, tgp.server_batch_size, tgp.margin_threshold) == (100, 0.1, 10, 100.0)
    gh = FedGH.from_config(_cfg(algorithm="fedgh", server_epochs=3), D)
    assert (gh.server_epochs, gh.server_lr, gh.server_batch_size) == (3, 0.01, 1)
    fd = FD.from_config(_cfg(algorithm="fd", fd_lambda=0.5, fd_temperature=2.0), D)
    assert (fd.fd_lambda, fd.fd_temperature) == (0.5, 2.0)


@pytest.mark.parametrize("algorithm", ["fedtgp", "fd", "fedgh", "lgfedavg"])
def test_runs_with_heterogeneous_models_and_counts_its_messages(algorithm):
    sim = _run(algorithm)
    states = sim.setup.states
    sizes = [count_parameters(s.model) for s in states]
    assert sizes[0] == sizes[2] != sizes[1] == sizes[3]  # two architectures, alternating
    K = [len(s.classes) for s in states]
    up = {"fedtgp": sum(k * (D + 2) for k in K),  # classes, protos, counts
          "fedgh": sum(k * (D + 2) for k in K),
          "fd": sum(k * (C + 2) for k in K),  # classes, per-class mean logits, counts
          "lgfedavg": len(states) * (C * D + C + 1)}[algorithm]  # head weight, bias, count
    h = sim.history[-1]
    assert h["up_params"] == up
    if algorithm in ("fedgh", "lgfedavg"):
        assert h["down_params"] == len(states) * (C * D + C)
    if algorithm == "fedtgp":
        assert h["down_params"] == len(states) * (C * D + C)  # every class's generated prototype
    # above chance (clients hold 2-4 classes; the mean of 1/K_i is below .4)
    assert h["acc_mean"] > max(0.6, float(np.mean([1 / k for k in K])) + 0.2), h


def test_lgfedavg_broadcasts_the_sample_weighted_mean_of_the_clients_heads():
    sim = _run("lgfedavg", rounds=2)
    heads = [head_message(s.model) for s in sim.setup.states]  # as sent after the last local training
    counts = [len(d.y) for d in sim.setup.data]
    assert len(set(counts)) > 1  # the weights matter
    want = lg_aggregate(heads, counts)
    for k in ("head/weight", "head/bias"):
        np.testing.assert_allclose(sim.message[k], want[k], rtol=1e-6, atol=1e-7)
        assert not np.allclose(sim.message[k], np.mean([hd[k] for hd in heads], axis=0), atol=1e-7)


def test_fedtgp_broadcasts_the_generators_prototypes_and_fedgh_its_head():
    sim = _run("fedtgp", rounds=2)
    alg = sim.setup.algorithm
    np.testing.assert_allclose(sim.message["protos"], tgp_generate(alg.tgp_state).numpy(), rtol=1e-6)
    assert sim.history[-1]["tgp_margin"] > 0
    sim = _run("fedgh", rounds=2)
    np.testing.assert_array_equal(sim.message["head/weight"], sim.setup.algorithm.head_w.astype(np.float32))
    # the client trained from the global head: its head moved away from it in its local epoch
    assert not np.allclose(head_message(sim.setup.states[0].model)["head/weight"], sim.message["head/weight"])


def test_fd_distillation_acts_and_the_batched_path_matches_the_sequential_one_in_float64():
    runs = {}
    for name, kw in (("sequential", {}), ("batched", {}), ("no_term", {"fd_lambda": 0.0})):
        mode = "sequential" if name == "no_term" else name
        sim = float64_sim(_cfg(algorithm="fd", rounds=3, execution=mode, **kw))
        sim.run()
        runs[name] = flat_weights(sim)
    for p, q in zip(runs["sequential"], runs["batched"]):
        assert ((p - q).norm() / p.norm()).item() < 1e-9
    # the term changes the training (rounds 2 and 3 distil toward the global logits)
    assert max(((p - q).norm() / p.norm()).item() for p, q in zip(runs["sequential"], runs["no_term"])) > 1e-4
    assert all(torch.isfinite(p).all() for p in runs["batched"])
