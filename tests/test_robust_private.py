"""Robust and private prototypes (issue #14): trimmed mean, minimum contributors, outlier
exclusion, λ schedules, two-stage training, evaluation on the full test split, differential
privacy, and simulated misbehaving clients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import float64_sim

from fedproto.algorithms.base import Algorithm
from fedproto.algorithms.fedproto import FedProto
from fedproto.attacks import attacker_ids, corrupt_message
from fedproto.config import ADDED_FIELDS, build_config, result_fields
from fedproto.engine.executors.local import client_step
from fedproto.engine.seeding import client_rng
from fedproto.errors import ConfigError, TrainingError
from fedproto.privacy import RELEASE_SENSITIVITY, clip_rows, deployment_fields, epsilon, noisy_prototypes
from fedproto.prototypes import aggregate_prototypes, class_check, lambda_at, robust_z
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


def _cfg(**kw):
    base = dict(dataset="digits", clients=6, ways=3, shots=25, stdev=1, test_shots=10, rounds=4, eval_every=0,
                threads=1)
    return build_config(overrides={**base, **kw})


# -- aggregation rules ---------------------------------------------------------------------------
def test_trimmed_mean_and_min_contributors_values():
    vals = [1.0, 2.0, 3.0, 4.0, 100.0]
    classes = [np.array([0]) for _ in vals] + [np.array([1])]
    protos = [np.array([[v, -v]]) for v in vals] + [np.array([[7.0, 7.0]])]
    counts = [np.array([1])] * 6
    cls, p, n = aggregate_prototypes(classes, protos, counts, 3, "trimmed", trim=0.2)
    assert cls.tolist() == [0, 1] and n.tolist() == [5, 1]
    assert p.tolist() == [[3.0, -3.0], [7.0, 7.0]]  # 1 cut from each end (int(0.2 * 5)): mean of 2, 3, 4
    _, p, _ = aggregate_prototypes(classes, protos, counts, 3, "trimmed", trim=0.1)  # int(0.5) = 0: plain mean
    assert p[0].tolist() == [22.0, -22.0]
    cls, p, n = aggregate_prototypes(classes, protos, counts, 3, "median", min_contributors=2)
    assert cls.tolist() == [0] and p.tolist() == [[3.0, -3.0]] and n.tolist() == [5]  # class 1: one client only
    with pytest.raises(ValueError, match="trim=0.5"):
        aggregate_prototypes(classes, protos, counts, 3, "trimmed", trim=0.5)


def test_robust_z_values():
    z = robust_z(np.array([1.0, 2.0, 3.0, 4.0, 100.0, np.nan]))
    mad = 1.482602218505602  # median |x - 3| = 1, scaled to a normal standard deviation
    assert z[:5] == pytest.approx([-2 / mad, -1 / mad, 0.0, 1 / mad, 97 / mad])
    assert math.isnan(z[5])
    assert robust_z(np.array([1.0, 1.0, 1.0, 5.0])).tolist() == [0.0, 0.0, 0.0, math.inf]


def test_lambda_schedules():
    assert [lambda_at(r, 2.0, 4, "cosine") for r in (1, 3, 5, 9)] == pytest.approx([0.0, 1.0, 2.0, 2.0])
    assert lambda_at(2, 2.0, 4, "cosine") == pytest.approx(2.0 * (1 - math.cos(math.pi / 4)) / 2)  # 0.2929
    assert lambda_at(2, 2.0, 4, "linear") == 0.5
    with pytest.raises(ValueError, match="'step'"):
        lambda_at(2, 1.0, 4, "step")


def test_the_lambda_used_each_round_is_in_the_metrics():
    sim = Simulation(_cfg(lambda_warmup=2, lambda_schedule="cosine", rounds=4), out=False)
    sim.run()
    assert [h["lambda"] for h in sim.history] == pytest.approx([0.0, 0.5, 1.0, 1.0])


# -- misbehaving clients -------------------------------------------------------------------------
def test_corrupt_message_kinds():
    msg = {"classes": np.array([0, 3, 9]), "protos": np.arange(6, dtype=np.float32).reshape(3, 2) + 1,
           "counts": np.array([5, 6, 7])}
    rng = np.random.default_rng(0)
    assert (corrupt_message(msg, "scale", rng, 10)["protos"] == msg["protos"] * 100).all()
    assert np.isnan(corrupt_message(msg, "nan", rng, 10)["protos"]).all()
    r = corrupt_message(msg, "random", rng, 10)["protos"]
    assert np.linalg.norm(r, axis=1) == pytest.approx(np.linalg.norm(msg["protos"], axis=1), rel=1e-6)
    assert not np.allclose(r, msg["protos"])
    f = corrupt_message(msg, "flip", rng, 10)
    assert f["classes"].tolist() == [0, 1, 4]  # 9 -> 0, 0 -> 1, 3 -> 4, kept sorted
    assert f["protos"].tolist() == [[5.0, 6.0], [1.0, 2.0], [3.0, 4.0]] and f["counts"].tolist() == [7, 5, 6]
    assert msg["protos"][0].tolist() == [1.0, 2.0]  # the honest message is untouched
    assert attacker_ids(1234, 20, 4) == attacker_ids(1234, 20, 4) and len(set(attacker_ids(1234, 20, 4))) == 4
    with pytest.raises(ValueError, match="attack 'loud'"):
        corrupt_message(msg, "loud", rng, 10)


def test_bad_replies_are_dropped_and_named(caplog):
    alg = FedProto(10, OptimConfig(), embedding_dim=2)
    good = {"classes": np.array([1, 2]), "protos": np.ones((2, 2), np.float32), "counts": np.array([3, 3])}
    bad = {"classes": np.array([1, 2, 11]), "protos": np.array([[np.nan, 0], [5, 5], [1, 1]], np.float32),
           "counts": np.array([3, 0, 3])}
    wrong = {"classes": np.array([1]), "protos": np.ones((1, 3), np.float32), "counts": np.array([1])}
    out = alg.aggregate(1, {0: good, 4: bad, 7: wrong})
    assert out["classes"].tolist() == [1, 2] and out["protos"].tolist() == [[1, 1], [1, 1]]
    assert alg.round_metrics()["dropped"] == [4, 7]
    text = caplog.text
    assert "client 4's reply" in text and "class 1: values that are not finite" in text
    assert "count 0 below 1" in text and "class 11 outside 0..9" in text and "(K, 2)" in text


def _replies(rng, refs, clients):
    """Honest replies near the references: per client (classes, protos (K, 2), counts)."""
    out = []
    for cls in clients:
        cls = np.array(cls)
        out.append((cls, refs[cls] + rng.normal(0, 0.3, (len(cls), 2)), np.full(len(cls), 5)))
    return out


REFS = np.array([[0.0, 4.0], [4.0, 0.0], [0.0, -4.0], [-4.0, 0.0]])  # global prototypes of 4 classes


def test_class_check_flags_flipped_and_scaled_prototypes_not_honest_ones():
    rng = np.random.default_rng(0)
    honest = _replies(rng, REFS, [[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    flipped = [(c, p, n) for c, p, n in _replies(rng, REFS, [[0, 1], [2, 3]])]
    flipped = [((c + 1) % 4, p, n) for c, p, n in flipped]  # class c's prototype sent as c + 1
    scaled = [(c, p * 100, n) for c, p, n in _replies(rng, REFS, [[1, 2]])]
    replies = honest + flipped + scaled
    flags, acted = class_check([r[0] for r in replies], [r[1] for r in replies], np.arange(4), REFS)
    assert acted
    assert [f.tolist() for f in flags] == [[False, False]] * 6 + [[True, True]] * 3
    # a prototype at its own class's reference but 10x as far out as the others: the distance test alone
    far = [(np.array([0]), REFS[[0]] * 10, np.array([5]))]
    flags, _ = class_check([r[0] for r in honest + far], [r[1] for r in honest + far], np.arange(4), REFS)
    assert [f.any() for f in flags] == [False] * 6 + [True]
    # no reference yet (first round): the norms alone, so the 100x rows are flagged, the flipped ones cannot be
    flags, acted = class_check([r[0] for r in replies], [r[1] for r in replies], np.zeros(0, np.int64),
                               np.zeros((0, 2)))
    assert not acted and [f.any() for f in flags] == [False] * 8 + [True]
    # embeddings not aligned with the references (most rows nearer another class): the nearer test waits
    rotated = [(c, p @ np.array([[0.0, 1.0], [-1.0, 0.0]]), n) for c, p, n in honest]  # 90 degrees: class c -> c+1
    flags, acted = class_check([r[0] for r in rotated], [r[1] for r in rotated], np.arange(4), REFS, z=1e6)
    assert not acted and not any(f.any() for f in flags)  # (z 1e6: the distance test off)
    with pytest.raises(ValueError, match="z=0"):
        class_check([np.array([0])], [REFS[[0]]], np.arange(4), REFS, z=0)


def test_class_check_keeps_flipped_prototypes_out_of_the_aggregate():
    """The server with class_check: the global prototypes from the honest replies only, the
    flipping clients named in the metrics; without it, the flipped prototypes move the global ones."""
    rng = np.random.default_rng(1)
    honest = _replies(rng, REFS, [[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    flipped = [((c + 1) % 4, p, n) for c, p, n in _replies(rng, REFS, [[0, 1], [2, 3]])]
    msgs = {i: {"classes": c, "protos": p.astype(np.float32), "counts": n} for i, (c, p, n) in
            enumerate(honest + flipped)}
    clean = aggregate_prototypes([c for c, _, _ in honest], [p for _, p, _ in honest],
                                 [n for _, _, n in honest], 4)[1]
    for z, expect_flagged in ((3.0, [6, 7]), (0.0, None)):
        alg = FedProto(4, OptimConfig(), embedding_dim=2, class_check=z)
        alg.global_classes, alg.global_protos = np.arange(4), REFS.astype(np.float32)
        out = alg.aggregate(2, msgs)
        if expect_flagged:
            assert np.allclose(out["protos"], clean, atol=1e-6)
            assert alg.round_metrics()["flagged"] == [6, 7] and alg.round_metrics()["flagged_rows"] == 4
        else:
            assert np.abs(out["protos"] - clean).max() > 1.0  # 2 of 5 contributors of each class flipped
            assert "flagged" not in alg.round_metrics()


DIGITS20 = dict(dataset="digits", clients=20, ways=3, shots=8, stdev=1, test_shots=10, rounds=20, eval_every=0,
                threads=1)


def _honest(sim, attackers=None):
    per = sim.evaluate()
    bad = sim.attackers if attackers is None else attackers
    return np.mean([m["acc_proto"] for i, m in enumerate(per) if i not in bad])


def test_poisoning_small_version():
    """2 of 20 digits clients send scaled or NaN prototypes (the README's MNIST table, small)."""
    clean = Simulation(build_config(overrides=DIGITS20), out=False)
    clean.run()
    ref = _honest(clean, set(attacker_ids(1234, 20, 2)))
    for rule in ("mean", "weighted", "median", "trimmed"):  # NaN never reaches a global prototype
        sim = Simulation(build_config(overrides={**DIGITS20, "attack": "nan", "attackers": 2, "aggregation": rule}),
                         out=False)
        sim.run()
        assert np.isfinite(sim.message["protos"]).all() and len(sim.message["classes"]) == 10
        assert sorted(sim.history[-1]["dropped"]) == sorted(sim.attackers)
    # the mean follows 100x prototypes until honest clients blow up
    with pytest.raises(TrainingError, match=r"diverged(.|\n)*class_check=3"):  # the hint names the class check
        Simulation(build_config(overrides={**DIGITS20, "attack": "scale", "attackers": 2}), out=False).run()
    for kw in ({"aggregation": "median"}, {"aggregation": "trimmed", "trim": 0.4}, {"exclude_outliers": 3.0}):
        sim = Simulation(build_config(overrides={**DIGITS20, "attack": "scale", "attackers": 2, **kw}), out=False)
        s = sim.run()
        assert abs(_honest(sim) - ref) < 0.03, kw
        assert s["attack"]["clients"] == sorted(sim.attackers)
        if "exclude_outliers" in kw:
            assert all(sim.attackers <= set(h["excluded"]) for h in sim.history)  # every round
            assert np.mean([len(h["excluded"]) for h in sim.history]) < 3  # few honest clients left out


# -- two stages, full test split -----------------------------------------------------------------
@pytest.mark.parametrize("algorithm,execution", [("fedproto", "sequential"), ("fedproto", "batched"),
                                                 ("fedavg", "batched"), ("local", "sequential")])
def test_second_stage_trains_the_head_only(algorithm, execution):
    cfg = _cfg(algorithm=algorithm, execution=execution, rounds=3, freeze_after=2)
    sim = Simulation(cfg, out=False)
    before = {}

    def snap(row):
        if row["round"] == 2:
            before.update({n: p.detach().clone() for n, p in sim.setup.states[0].model.named_parameters()})

    msgs = []
    sim.on_round = lambda row: (snap(row), msgs.append(dict(sim.message)))
    sim.run()
    model = sim.setup.states[0].model
    if algorithm == "fedavg":  # clients load the global model: its body stays as it was after round 2
        body = [n for n, _ in model.named_parameters() if not model.is_head_param(n)]
        assert body and all(np.array_equal(msgs[1]["w/" + n], msgs[2]["w/" + n]) for n in body)
        assert not all(np.array_equal(msgs[1]["w/" + n], msgs[2]["w/" + n]) for n, _ in model.named_parameters()
                       if model.is_head_param(n))
    else:
        for n, p in model.named_parameters():
            changed = not torch.equal(before[n], p.detach())
            assert changed == model.is_head_param(n), n
    assert "head_only" in sim.message and "head_only" not in msgs[0]


def test_freeze_after_refused_where_it_cannot_work():
    with pytest.raises(ConfigError, match="fedrep"):
        _cfg(algorithm="fedrep", freeze_after=2)


def test_full_test_split_and_ensemble():
    sim = Simulation(_cfg(rounds=3, eval_full_test=True), out=False)
    s = sim.run()
    full = s["accuracy_full_test"]
    ds = sim.setup.dataset
    assert "full test split" in full["test_set"] and str(len(ds.test_y)) in full["test_set"]
    from fedproto.training import predict

    outs = [predict(st.model, ds.test_x)[0].double() for st in sim.setup.states]
    probs = sum(torch.softmax(o, 1) for o in outs)
    assert full["ensemble_softmax"] == pytest.approx(float((probs.argmax(1) == ds.test_y).double().mean()), abs=1e-12)
    accs = [float((o.argmax(1) == ds.test_y).double().mean()) for o in outs]
    assert full["acc"]["mean"] == pytest.approx(np.mean(accs), abs=1e-12)
    assert 0 <= full["acc_proto"]["mean"] <= 1 and 0 <= full["ensemble_vote"] <= 1


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
    kw = dict(phases=[Phase(3)], lambda_proto=0.5, table=table, mask=mask)
    r1 = train_client(m1, x, y, plan, Objective(**kw), opt)
    r2 = train_client(m2, x, y, plan_p, Objective(**kw, dp_sgd=DPSGD(0.0, 1e9, 12)), opt)
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.allclose(a, b, atol=1e-12, rtol=0), n
    assert r1.loss_ce == pytest.approx(r2.loss_ce, abs=1e-12)
    assert not any(hasattr(p, "grad_sample") for p in m2.parameters())  # Opacus's hooks and buffers are gone
    assert not m2._forward_hooks and not any(mod._forward_hooks or mod._backward_hooks for mod in m2.modules())


def test_dp_runs_report_epsilon_and_are_reproducible_with_seeded_noise():
    s1 = Simulation(_cfg(dp="full", dp_noise=1.0, rounds=2, dp_reproducible_noise=True), out=False).run()
    s2 = Simulation(_cfg(dp="full", dp_noise=1.0, rounds=2, dp_reproducible_noise=True), out=False).run()
    assert s1["accuracy"] == s2["accuracy"]
    pv = s1["privacy"]
    assert pv["delta"] == 1e-5 and 0 < pv["epsilon_mean"] <= pv["epsilon_max"] < math.inf
    sp = Simulation(_cfg(dp="prototypes", dp_noise=1.0, rounds=2), out=False).run()
    # two prototype releases, sigma 1: the Gaussian mechanism composed twice
    assert sp["privacy"]["epsilon_max"] == pytest.approx(epsilon([(1.0, 1.0, 2)], 1e-5))
    assert sp["privacy"]["epsilon_max"] < pv["epsilon_max"]
    assert "fixed feature extractor" in sp["privacy"]["neighbouring"]
    assert Simulation(_cfg(dp="prototypes", dp_noise=0.0, rounds=1), out=False).run()["privacy"]["epsilon_max"] == \
        math.inf


def _server_reconstruction(alg, state, message, n: int, seed: int, round: int, released) -> np.ndarray:
    """What a server recovers of a client's released prototypes (mode ``prototypes``) if the noise
    came from the run's seed: it knows the seed (it sets it in the Flower run config), the round,
    the client id, the sample count n and the architecture, so it replays the client's generator
    (:func:`client_rng`: the batch plan's draws, then the seed of the release noise), regenerates
    the noise, recovers each class count (the sent count less its noise, rounded) and subtracts
    the noise from the class sum (:func:`fedproto.privacy.noisy_prototypes`). (K, d)."""
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
    """Issue #21 (1): with everything the server knows (seed, round, client id, n, architecture)
    the released prototypes of a client come back only up to the noise (sigma 4: about
    4 * sqrt(2) * C / n_c per coordinate, above 1 here), not to float precision, unless the run
    asks for seeded noise (``dp_reproducible_noise``), which the test shows voids the guarantee."""
    cfg = _cfg(dp="prototypes", dp_noise=4.0, rounds=1, execution="sequential", dp_reproducible_noise=reproducible)
    sim = Simulation(cfg, out=False)
    alg, cid = sim.setup.algorithm, 0
    st, data = sim.setup.states[cid], sim.setup.data[cid]
    msg = alg.downlink(sim.loop.initial_message(), cid)
    out, _ = client_step(alg, st, msg, data, cfg.seed, 1)
    _, truth, true_counts = noisy_prototypes(embed_all(st.model, data.x), data.y, st.classes, cfg.dp_clip, 0.0, None)
    guess = _server_reconstruction(alg, st, msg, len(data.x), cfg.seed, 1, out)
    err = np.abs(guess - truth).max()
    level = 4.0 * math.sqrt(2.0) * cfg.dp_clip / true_counts.max()  # noise std of a prototype coordinate
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
        sim = Simulation(_cfg(rounds=1, dp_noise=1.0, **kw, **extra), out=False)
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
    sim = Simulation(_cfg(dp="full", rounds=1), out=False)
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
    """What a Flower node reports beside the algorithm message (fedproto.privacy.deployment_fields):
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


def test_seeded_dp_noise_option_is_result_relevant_only_under_dp():
    assert "dp_reproducible_noise" not in _cfg().result_fields()
    assert _cfg(dp="prototypes").result_fields()["dp_reproducible_noise"] is False
    # results stored before the option existed had seeded noise
    assert result_fields({**ADDED_FIELDS, "dp": "prototypes"})["dp_reproducible_noise"] is True


@pytest.mark.parametrize("kw,match", [
    (dict(dp="prototypes", algorithm="fedavg"), "sends model weights"),
    (dict(dp="full", execution="batched"), "sequential"),
    (dict(dp="full", distance="l2"), "per-sample"),
    (dict(attack="scale"), "give both"),
    (dict(attackers=2), "give both"),
    (dict(attack="nan", attackers=7), "attackers=7 is more than clients=6"),
    (dict(aggregation="trimmed", trim=0.5), "trim"),
    (dict(class_check=-1), "class_check"),
    (dict(dp="full", dp_noise=-1.0), "dp_noise"),
])
def test_bad_options_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**kw)


def test_dp_full_refuses_batchnorm_models():
    with pytest.raises(ConfigError, match="BatchNorm"):
        Simulation(_cfg(dp="full", model="resnet18", embedding_dim=512), out=False)


def test_attack_and_dp_runs_match_in_float64_across_paths():
    """The prototype release with noise and the simulated attackers act after training, so the
    batched path still equals the sequential one (float64)."""
    kw = dict(dp="prototypes", dp_noise=0.5, attack="random", attackers=1, rounds=3, aggregation="trimmed",
              dp_reproducible_noise=True)
    a = float64_sim(_cfg(execution="sequential", **kw))
    b = float64_sim(_cfg(execution="batched", **kw))
    a.run()
    b.run()
    assert np.abs(a.message["protos"] - b.message["protos"]).max() < 1e-6  # float32 messages


def test_a_second_run_into_a_finished_run_folder_says_so(tmp_path, caplog):
    """Variants of an option share the derived run name: the second run warns that it replaces the
    finished one (found by a new user running the README's attack command after the default run)."""
    Simulation(_cfg(rounds=1), out=tmp_path / "run").run()
    assert "holds a finished run" not in caplog.text
    Simulation(_cfg(rounds=1, attack="nan", attackers=1), out=tmp_path / "run").run()
    assert f"{tmp_path / 'run'} holds a finished run" in caplog.text and "--name" in caplog.text
    import csv

    rows = list(csv.DictReader(open(tmp_path / "run" / "clients.csv")))
    attackers = set(attacker_ids(1234, 6, 1))
    assert [int(r["attacker"]) for r in rows] == [int(i in attackers) for i in range(6)]


def test_breaker_findings_on_the_robust_and_private_options(caplog):
    """Issue #14's breaker: ε never below 0; exclusion does not drop sole holders of a class (MAD 0)
    and says it cannot act; BatchNorm statistics stay frozen in the second stage; attacks that would
    change nothing, all-attacker runs and unreachable min_contributors are refused; λ is 0 in the
    metrics while no global prototype exists; the attackers are marked in clients.csv."""
    assert epsilon([(5.0, 1.0, 1)], 0.1) >= 0.0
    with pytest.raises(ConfigError, match="dp_delta"):
        _cfg(dp="prototypes", dp_delta=0.5)
    for kw, match in ((dict(algorithm="fedavg", attack="flip", attackers=1), "without class ids"),
                      (dict(algorithm="local", attack="scale", attackers=1), "sends nothing"),
                      (dict(attack="scale", attackers=6), "no honest")):
        with pytest.raises(ConfigError, match=match):
            _cfg(**kw)
    with pytest.raises(ConfigError, match="min_contributors=7 is more than any class"):
        Simulation(_cfg(min_contributors=7), out=False)
    with pytest.raises(ConfigError, match="min_contributors=3"):  # 2 of 6 clients per round
        Simulation(_cfg(min_contributors=3, participation=2.0), out=False)
    # sole holders of a class are not outliers: 2 clients, nobody comparable
    alg = FedProto(4, OptimConfig(), embedding_dim=2, exclude_outliers=3.0)
    msgs = {i: {"classes": np.array([i]), "protos": np.full((1, 2), float(i), np.float32),
                "counts": np.array([5])} for i in range(4)}
    out = alg.aggregate(1, msgs)
    assert out["classes"].tolist() == [0, 1, 2, 3] and alg.last_excluded == []
    assert "exclude_outliers cannot act" in caplog.text
    # BatchNorm running statistics of the body stay as they were in the second stage
    sim = Simulation(_cfg(model="resnet18", embedding_dim=512, rounds=2, freeze_after=1, clients=2, shots=10),
                     out=False)
    snap = {}
    sim.on_round = lambda row: snap.update({k: v.clone() for k, v in sim.setup.states[0].model.state_dict().items()}
                                           if row["round"] == 1 else {})
    sim.run()
    after = sim.setup.states[0].model.state_dict()
    body = [k for k in after if not sim.setup.states[0].model.is_head_param(k)]
    assert any("running_var" in k for k in body) and all(torch.equal(snap[k], after[k]) for k in body)
    # λ reported 0 while no prototype existed; attackers marked
    s = Simulation(_cfg(rounds=2, attack="nan", attackers=1, lambda_warmup=0), out=False)
    s.run()
    assert [h["lambda"] for h in s.history] == [0.0, 1.0]


def test_prototype_distance_warnings_are_not_repeated_without_end(caplog):
    """A misbehaving client is flagged by the distance monitor every round; the log names it
    ALERTS_PER_CLIENT times, the metrics every round."""
    from fedproto.engine.observers.health import ALERTS_PER_CLIENT

    sim = Simulation(_cfg(rounds=6, attack="scale", attackers=1, aggregation="median"), out=False)
    sim.run()
    (bad,) = sim.attackers
    lines = [r.getMessage() for r in caplog.records if f"client {bad}'s prototypes lie" in r.getMessage()]
    assert len(lines) == ALERTS_PER_CLIENT == 3 and "not repeated" in lines[-1]
    assert sum(h.get("proto_dist_argmax") == bad for h in sim.history) > ALERTS_PER_CLIENT  # flagged in more rounds
