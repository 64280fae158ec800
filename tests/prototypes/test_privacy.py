"""Robust and private prototypes: trimmed mean, minimum contributors, outlier
exclusion, λ schedules, two-stage training, evaluation on the full test split, differential
privacy, and simulated misbehaving clients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import digits_config

from fedproto.algorithms.algorithm import Algorithm
from fedproto.algorithms.proto_term import ProtoTerm
from fedproto.engine.executors.in_process import client_step
from fedproto.engine.seeding import client_rng
from fedproto.errors import ConfigError
from fedproto.prototypes.dp import RELEASE_SENSITIVITY, clip_rows, deployment_fields, epsilon, noisy_prototypes
from fedproto.simulation import Simulation
from fedproto.training import (
    DPSGD,
    Objective,
    OptimConfig,
    Phase,
    embed_all,
    make_plan,
    poisson_plan,
    train_client,
)


# -- differential privacy ------------------------------------------------------------------------
def test_accountant_matches_opacus_published_value():
    # Opacus's own accountant test (opacus/tests/accountants_test.py): sigma 1.5, q 0.04, 2250 steps
    assert epsilon([(1.5, 0.04, 2250)], 1e-5) == pytest.approx(7.32911117143, abs=1e-8)
    assert epsilon([(1.5, 0.04, 1000), (1.5, 0.04, 1250)], 1e-5) == pytest.approx(7.32911117143, abs=1e-8)
    assert epsilon([(0.0, 1.0, 3)], 1e-5) == math.inf and epsilon([], 1e-5) == 0.0
    assert epsilon([(2.0, 1.0, 10)], 1e-5) > epsilon([(2.0, 1.0, 5)], 1e-5)
    with pytest.raises(ValueError, match="dp_delta=1.5"):
        epsilon([(1.0, 1.0, 1)], 1.5)


def test_noisy_prototypes_clip_and_noise():
    h = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 2.0]])
    y = torch.tensor([1, 1, 4])
    assert np.allclose(clip_rows(h, 1.0).numpy(), [[0.6, 0.8], [0.3, 0.4], [0.0, 1.0]])
    rng = np.random.default_rng(0)
    c, p, n = noisy_prototypes(h, y, np.array([1, 4]), 1.0, 0.0, rng)
    assert c.tolist() == [1, 4] and n.tolist() == [2, 1]
    assert np.allclose(p, [[0.45, 0.6], [0.0, 1.0]])
    # with noise: the sums get std sigma * sqrt(2) * C, the counts sigma * sqrt(2): measured over draws
    draws = [noisy_prototypes(h, y, np.array([1, 4]), 1.0, 2.0, np.random.default_rng(s)) for s in range(2000)]
    P = np.stack([d[1] for d in draws])
    assert np.isfinite(P).all() and not np.allclose(P[0], P[1])
    again = noisy_prototypes(h, y, np.array([1, 4]), 1.0, 2.0, np.random.default_rng(5))
    assert (again[1] == draws[5][1]).all()  # reproducible


def test_dp_sgd_with_full_batches_and_no_noise_is_plain_sgd():
    """q = 1 (the batch holds every sample), sigma 0 and a clip bound no gradient reaches: Opacus's
    DP-SGD step equals plain SGD on the whole batch (float64)."""
    torch.manual_seed(0)
    from fedproto.models.zoo import build_client_models

    m1 = build_client_models("cnn", 1, 1, 10, 8, 16, 0.0, 0)[0].double()
    m2 = build_client_models("cnn", 1, 1, 10, 8, 16, 0.0, 0)[0].double()
    m2.load_state_dict(m1.state_dict())
    x, y = torch.randn(12, 1, 8, 8, dtype=torch.float64), torch.arange(12) % 3
    opt = OptimConfig(batch_size=12)
    plan_p = poisson_plan(12, [Phase(3)], 12, {}, 0.0, np.random.default_rng(0))
    assert plan_p.order[0].shape == (3, 12) and bool((plan_p.weight[0] == 1).all())
    plan = make_plan(12, [Phase(3)], opt, {}, 0.0, np.random.default_rng(0))
    table = torch.randn(10, 16, dtype=torch.float64)
    mask = torch.ones(10, dtype=torch.bool)
    kw = dict(phases=[Phase(3)], terms=(ProtoTerm(0.5, table, mask),))
    r1 = train_client(m1, x, y, plan, Objective(**kw), opt)
    r2 = train_client(m2, x, y, plan_p, Objective(**kw, dp_sgd=DPSGD(0.0, 1e9, 12)), opt)
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.allclose(a, b, atol=1e-12, rtol=0), n
    assert r1.loss_ce == pytest.approx(r2.loss_ce, abs=1e-12)
    assert not any(hasattr(p, "grad_sample") for p in m2.parameters())  # Opacus's hooks and buffers are gone
    assert not m2._forward_hooks and not any(mod._forward_hooks or mod._backward_hooks for mod in m2.modules())


def test_dp_runs_report_epsilon_and_are_reproducible_with_seeded_noise():
    s1 = Simulation(digits_config(dp="full", dp_noise=1.0, rounds=2, dp_reproducible_noise=True), out=False).run()
    s2 = Simulation(digits_config(dp="full", dp_noise=1.0, rounds=2, dp_reproducible_noise=True), out=False).run()
    assert s1["accuracy"] == s2["accuracy"]
    pv = s1["privacy"]
    assert pv["delta"] == 1e-5 and 0 < pv["epsilon_mean"] <= pv["epsilon_max"] < math.inf
    sp = Simulation(digits_config(dp="prototypes", dp_noise=1.0, rounds=2), out=False).run()
    # two prototype releases, sigma 1: the Gaussian mechanism composed twice
    assert sp["privacy"]["epsilon_max"] == pytest.approx(epsilon([(1.0, 1.0, 2)], 1e-5))
    assert sp["privacy"]["epsilon_max"] < pv["epsilon_max"]
    assert "fixed feature extractor" in sp["privacy"]["neighbouring"]
    assert Simulation(digits_config(dp="prototypes", dp_noise=0.0, rounds=1),
                      out=False).run()["privacy"]["epsilon_max"] == math.inf


def _server_reconstruction(alg, state, message, n: int, seed: int, round: int, released) -> np.ndarray:
    """What a server recovers of a client's released prototypes (mode ``prototypes``) if the noise
    came from the run's seed: it knows the seed (it sets it in the Flower run config), the round,
    the client id, the sample count n and the architecture, so it replays the client's generator
    (:func:`client_rng`: the batch plan's draws, then the seed of the release noise), regenerates
    the noise, recovers each class count (the sent count less its noise, rounded) and subtracts
    the noise from the class sum (:func:`fedproto.prototypes.dp.noisy_prototypes`). (K, d)."""
    rng = client_rng(seed, round, state.cid)
    Algorithm.plan(alg, state, alg.local_objective(state, message), n, rng)
    noise = np.random.default_rng(int(rng.integers(2**62)))
    s = alg.dp_noise * RELEASE_SENSITIVITY * alg.dp_clip
    protos, counts = released["protos"].astype(np.float64), released["counts"]
    e_sum = noise.normal(0.0, s, protos.shape)
    e_count = noise.normal(0.0, s / alg.dp_clip, counts.shape)
    n_c = np.rint(counts - e_count)
    noisy_n = n_c + e_count
    return (protos * np.maximum(noisy_n, 1.0)[:, None] - e_sum) / n_c[:, None]


@pytest.mark.parametrize("reproducible", [False, True])
def test_the_server_cannot_subtract_the_dp_noise(reproducible, caplog):
    """With everything the server knows (seed, round, client id, n, architecture)
    the released prototypes of a client come back only up to the noise (sigma 4: about
    4 * sqrt(2) * C / n_c per coordinate, above 1 here), not to float precision, unless the run
    asks for seeded noise (``dp_reproducible_noise``), which the test shows voids the guarantee.
    The released prototypes themselves differ from the clean ones by about that level."""
    cfg = digits_config(dp="prototypes", dp_noise=4.0, rounds=1, execution="sequential",
                        dp_reproducible_noise=reproducible)
    sim = Simulation(cfg, out=False)
    alg, cid = sim.setup.algorithm, 0
    st, data = sim.setup.states[cid], sim.setup.data[cid]
    msg = alg.downlink(sim.loop.initial_message(), cid)
    out, _ = client_step(alg, st, msg, data, cfg.seed, 1)
    _, truth, true_counts = noisy_prototypes(embed_all(st.model, data.x), data.y, st.classes, cfg.dp_clip, 0.0, None)
    guess = _server_reconstruction(alg, st, msg, len(data.x), cfg.seed, 1, out)
    err = np.abs(guess - truth).max()
    level = 4.0 * math.sqrt(2.0) * cfg.dp_clip / true_counts.max()  # noise std of a prototype coordinate
    # the release itself is noisy: without noise the server would need to subtract nothing
    assert np.abs(out["protos"] - truth).max() > 0.3 * level
    assert ("guarantee does not hold against anyone who knows the seed" in caplog.text) == reproducible
    if reproducible:
        assert err < 1e-5  # seeded noise: the server recovers the exact prototypes
    else:
        assert err > 0.3 * level, (err, level)


@pytest.mark.parametrize("kw", [dict(dp="prototypes", execution="sequential"), dict(dp="prototypes",
                                execution="batched", group_size=3), dict(dp="full")])
def test_dp_noise_differs_between_runs_of_one_seed_unless_seeded(kw):
    """The release noise (and under ``full`` DP-SGD's sampling and gradient noise) is fresh in every
    run and engine by default; ``dp_reproducible_noise`` makes runs of one config bit-for-bit equal."""
    def protos(**extra):
        sim = Simulation(digits_config(rounds=1, dp_noise=1.0, **kw, **extra), out=False)
        sim.run()
        return sim.message["protos"], [p.detach().clone() for p in sim.setup.states[0].model.parameters()]

    (a, wa), (b, wb) = protos(), protos()
    assert np.abs(a - b).max() > 1e-3
    if kw["dp"] == "full":  # the DP-SGD noise and the Poisson batches differ too
        assert max(float((x - y).abs().max()) for x, y in zip(wa, wb)) > 1e-4
    (c, wc), (d, wd) = protos(dp_reproducible_noise=True), protos(dp_reproducible_noise=True)
    assert (c == d).all() and all(torch.equal(x, y) for x, y in zip(wc, wd))


def test_poisson_batches_of_dp_full_come_from_the_secure_source():
    """Under ``full`` the Poisson-sampled batches do not follow the client's seeded generator
    (with the option they do, and equal the plan drawn from it)."""
    sim = Simulation(digits_config(dp="full", rounds=1), out=False)
    alg, st = sim.setup.algorithm, sim.setup.states[0]
    obj = alg.local_objective(st, alg.downlink(sim.loop.initial_message(), 0))
    n = len(sim.setup.data[0].x)
    p1, p2 = (alg.plan(st, obj, n, client_rng(1234, 1, 0)) for _ in range(2))
    assert not torch.equal(p1.order[0], p2.order[0]) and p1.seed != p2.seed
    alg.dp_reproducible_noise = True
    p3, p4 = (alg.plan(st, obj, n, client_rng(1234, 1, 0)) for _ in range(2))
    assert torch.equal(p3.order[0], p4.order[0]) and p3.seed == p4.seed
    want = poisson_plan(n, obj.phases, alg.opt.batch_size, st.model.noise_widths(), st.model.dropout,
                        client_rng(1234, 1, 0))
    assert torch.equal(p3.order[0], want.order[0])


def test_under_dp_a_deployment_sends_only_the_release_and_public_values():
    """What a Flower node reports beside the algorithm message (fedproto.prototypes.dp.deployment_fields):
    everything without DP; under DP no sample counts, losses, norms or accuracies; ε only under
    ``prototypes`` (under ``full`` it depends on n)."""
    query = {"cid": 2, "classes": [1, 4], "train-samples": 31, "test-samples": 9, "params": 100, "embedding-dim": 50}
    train = {"loss_ce": 0.3, "loss_proto": 0.1, "steps": 4, "emb-norm-max": 3.2, "num-examples": 31}
    ev = {"acc": 0.9, "acc_proto": 0.8, "emb_norm": 2.0, "nonfinite": 0.0, "dp_epsilon": 3.5, "num-examples": 9}
    for kind, v in (("query", query), ("train", train), ("evaluate", ev)):
        assert deployment_fields("off", kind, v) == v
    for dp in ("prototypes", "full"):
        assert deployment_fields(dp, "query", query) == {"cid": 2, "classes": [1, 4], "params": 100,
                                                         "embedding-dim": 50}
        assert deployment_fields(dp, "train", train) == {}
    assert deployment_fields("prototypes", "evaluate", ev) == {"dp_epsilon": 3.5}
    assert deployment_fields("full", "evaluate", ev) == {}
    with pytest.raises(ValueError, match="kind='fit'"):
        deployment_fields("full", "fit", train)


def test_dp_full_refuses_batchnorm_models():
    with pytest.raises(ConfigError, match="BatchNorm"):
        Simulation(digits_config(dp="full", model="resnet18", embedding_dim=512), out=False)
