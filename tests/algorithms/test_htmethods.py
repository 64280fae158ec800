"""The model-heterogeneous methods end to end on digits with two
architectures (projcnn:8-16 and the paper CNN, alternating over clients)."""

import copy

import numpy as np
import pytest
import torch
from conftest import flat_weights, float64_sim

from fedproto.algorithms import ALGORITHMS, FD, FedGH, FedTGP, LGFedAvg
from fedproto.algorithms.hetero_math import lg_aggregate, tgp_generate, tgp_init
from fedproto.algorithms.lgfedavg import head_message
from fedproto.algorithms.server_state import ServerState
from fedproto.config.run_config import build_config
from fedproto.engine.loop import Observer
from fedproto.models.proto_model import count_parameters
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


class Uploads(Observer):
    """Per round: the clients' messages as the server receives them (client order) and a copy of
    FedTGP's generator state before that round's server step."""

    def __init__(self):
        self.rounds = {}

    def replies(self, loop, round, replies):
        held = loop.server.checkpoint.get("tgp_state")  # the server state after the round before
        state = None if held is None else {k: v.copy() for k, v in held.items()}
        self.rounds[round] = ([replies.replies[i][0] for i in sorted(replies.replies)], state)


def tgp_round_by_hand(msgs, state, seed, epochs=100, lr=0.1, batch_size=10, tau=100.0):
    """FedTGP's server step written here from the paper (arXiv 2401.03230, eq. 5-8) in float64:
    margin δ = min(max_c min_{c' != c} ||Q_c - Q_c'||, τ) over the class centres Q_c (unweighted
    mean of the clients' prototypes of class c); generator P̂_c = W2 relu(W1 e_c + b1) + b2; loss
    the mean over rows of -log softmax(-(||p - P̂_c|| + δ [c = y]))_y; plain SGD over mini-batches
    of the rows, shuffled per epoch with torch.randperm seeded (seed x 1,000,003 + epoch)."""
    cls = np.concatenate([m["classes"] for m in msgs])
    rows = np.concatenate([m["protos"] for m in msgs]).astype(np.float64)
    present = np.unique(cls)
    Q = np.stack([rows[cls == c].mean(0) for c in present])
    gap = np.linalg.norm(Q[:, None] - Q[None], axis=-1)
    np.fill_diagonal(gap, np.inf)
    delta = min(gap.min(1).max(), tau)
    p = {k: torch.tensor(np.asarray(v), dtype=torch.float64, requires_grad=True) for k, v in state.items()}
    X, Y = torch.tensor(rows), torch.tensor(cls)

    def generate():
        return torch.relu(p["embedding"] @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]

    for epoch in range(epochs):
        order = torch.randperm(len(Y), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        for s in range(0, len(Y), batch_size):
            i = order[s:s + batch_size]
            dist = ((X[i, None, :] - generate()[None]) ** 2).sum(-1).sqrt()
            logits = -dist
            logits[torch.arange(len(i)), Y[i]] -= delta
            loss = (torch.logsumexp(logits, 1) - logits[torch.arange(len(i)), Y[i]]).mean()
            grads = torch.autograd.grad(loss, list(p.values()))
            with torch.no_grad():
                for t, g in zip(p.values(), grads):
                    t -= lr * g
    with torch.no_grad():
        return generate().numpy(), delta


def test_fedtgp_broadcasts_the_generators_prototypes_and_fedgh_its_head():
    """FedTGP's broadcast equals the server step recomputed here from the paper's equations on the
    prototypes the clients sent; FedGH broadcasts its head."""
    sim = Simulation(_cfg(algorithm="fedtgp", rounds=2), out=False)
    up = Uploads()
    sim.loop.observers.append(up)
    sim.run()
    msgs, state = up.rounds[2]
    want, delta = tgp_round_by_hand(msgs, state, seed=sim.cfg.seed * 100_003 + 2)
    assert sim.history[-1]["tgp_margin"] == pytest.approx(delta, rel=1e-6) and 0 < delta < 100
    assert sim.message["protos"].shape == (C, D)
    np.testing.assert_allclose(sim.message["protos"], want, rtol=1e-3, atol=1e-4)
    assert np.abs(want - tgp_generate(state).numpy()).max() > 1e-2  # the step moved them
    sim = _run("fedgh", rounds=2)
    np.testing.assert_array_equal(sim.message["head/weight"], sim.loop.server.checkpoint["head_w"].astype(np.float32))
    assert np.isfinite(sim.history[-1]["server_loss"]) and sim.history[-1]["server_loss"] > 0
    # the client trained from the global head: its head moved away from it in its local epoch
    assert not np.allclose(head_message(sim.setup.states[0].model)["head/weight"], sim.message["head/weight"])


@pytest.fixture
def generic_calls(monkeypatch):
    """Sizes of the groups trained by the batched executor's generic path."""
    import fedproto.engine.executors.batched as batched

    sizes: list[int] = []
    orig = batched.train_group_generic

    def counting(models, *a, **k):
        sizes.append(len(models))
        return orig(models, *a, **k)

    monkeypatch.setattr(batched, "train_group_generic", counting)
    return sizes


@pytest.mark.parametrize("algorithm", ["fedtgp", "fd", "fedgh", "lgfedavg"])
def test_batched_generic_path_matches_the_sequential_one_in_float64(algorithm, generic_calls):
    """Both architectures (two clients each) train batched (projcnn on the generic torch.func path), and
    every client's weights, the server message and the accuracies equal the sequential path's in
    float64 (1e-9 relative: rounding, not logic)."""
    runs = {}
    for mode in ("sequential", "batched"):
        generic_calls.clear()
        sim = float64_sim(_cfg(algorithm=algorithm, rounds=3, execution=mode))
        summary = sim.run()
        runs[mode] = (flat_weights(sim), sim.message, summary, sim.history)
        if mode == "batched":
            # projcnn's two clients on the generic path, the paper CNN's two on its hand-written one
            assert generic_calls == [2] * 3
    (w_s, m_s, s_s, h_s), (w_b, m_b, s_b, h_b) = runs["sequential"], runs["batched"]
    for p, q in zip(w_s, w_b):
        assert ((p - q).norm() / p.norm()).item() < 1e-9
    assert set(m_s) == set(m_b)
    for k in m_s:
        np.testing.assert_allclose(m_b[k], m_s[k], rtol=1e-6, atol=1e-7)  # float32 on the wire
    for key, v in s_s["accuracy"].items():
        assert s_b["accuracy"][key]["mean"] == pytest.approx(v["mean"], abs=1e-12), key
    for a, b in zip(h_s, h_b):
        assert (a["up_params"], a["down_params"]) == (b["up_params"], b["down_params"])
        assert a["loss_ce"] == pytest.approx(b["loss_ce"], rel=1e-9)


def test_fd_distillation_acts():
    """FD's term changes the training (rounds 2 and 3 distil toward the global logits)."""
    runs = {}
    for name, kw in (("fd", {}), ("no_term", {"fd_lambda": 0.0})):
        sim = float64_sim(_cfg(algorithm="fd", rounds=3, execution="sequential", **kw))
        sim.run()
        runs[name] = flat_weights(sim)
    assert max(((p - q).norm() / p.norm()).item() for p, q in zip(runs["fd"], runs["no_term"])) > 1e-4


@pytest.mark.parametrize("algorithm", ["fedgh", "lgfedavg"])
def test_acc_global_is_the_servers_head_on_the_clients_own_body(algorithm):
    """``acc_global``: each client's body after its last local training with the server's last head,
    on its own test set; the client's own head is left as it was."""
    from fedproto.algorithms.lgfedavg import load_head
    from fedproto.training import predict

    sim = _run(algorithm, rounds=3)
    alg, states, data = sim.setup.algorithm, sim.setup.states, sim.setup.data
    assert "acc_global" in alg.eval_protocols() and "head" in alg.eval_protocols()["acc_global"]
    got, own = [], []
    for s, d in zip(states, data):
        before = head_message(s.model)
        res = alg.evaluate(s, sim.message, d)
        after = head_message(s.model)
        assert all(np.array_equal(before[k], after[k]) for k in before)  # restored
        want_own = float((predict(s.model, d.test_x)[0].argmax(1) == d.test_y).float().mean())
        m = copy.deepcopy(s.model)
        load_head(m, sim.message)
        want = float((predict(m, d.test_x)[0].argmax(1) == d.test_y).float().mean())
        assert res["acc_global"] == pytest.approx(want, abs=1e-12)
        assert res["acc"] == pytest.approx(want_own, abs=1e-12)
        got.append(res["acc_global"])
        own.append(res["acc"])
    assert got != own  # the global head is not the client's own (after its local epoch)
    last = sim.history[-1]
    assert last["acc_global_mean"] == pytest.approx(float(np.mean(got)), abs=1e-9)


@pytest.mark.parametrize("algorithm", ["fedtgp", "fedgh"])
def test_resumed_run_equals_the_uninterrupted_one(tmp_path, algorithm):
    """The server state (FedTGP's generator in its ServerState, FedGH's head) is checkpointed: a
    run stopped after round 3 (checkpoint after round 2) and resumed gives the uninterrupted run's
    numbers, server message and server state."""

    class Stop(Exception):
        pass

    def stop_at_3(row):
        if row["round"] == 3:
            raise Stop

    cfg = _cfg(algorithm=algorithm, rounds=4, checkpoint_every=2, eval_every=2, server_epochs=5)
    whole = Simulation(cfg, out=tmp_path / "whole")
    s_whole = whole.run()
    with pytest.raises(Stop):
        Simulation(cfg, out=tmp_path / "part", on_round=stop_at_3).run()
    resumed = Simulation(cfg, out=tmp_path / "part")
    s_res = resumed.run(resume=True)
    times = ("train_time_s", "eval_time_s")
    assert [{k: v for k, v in r.items() if k not in times} for r in resumed.history] == \
        [{k: v for k, v in r.items() if k not in times} for r in whole.history]
    assert s_res["accuracy"] == s_whole["accuracy"]
    assert set(whole.message) == set(resumed.message)
    assert all(np.array_equal(whole.message[k], resumed.message[k]) for k in whole.message)
    if algorithm == "fedtgp":
        a, b = whole.loop.server.checkpoint["tgp_state"], resumed.loop.server.checkpoint["tgp_state"]
        assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
        # the generator trained away from its initial state, so a resume that lost it would differ
        assert not np.allclose(a["w1"], tgp_init(C, D, seed=cfg.seed)["w1"])
    else:
        a, b = whole.loop.server.checkpoint, resumed.loop.server.checkpoint
        assert np.array_equal(a["head_w"], b["head_w"]) and np.array_equal(a["head_b"], b["head_b"])


def test_fedgh_keeps_the_upload_order_in_the_papers_regime_and_shuffles_as_the_reference_otherwise():
    """FedGH's server: one pass, one pair per step in upload order (paper) by default; with more
    epochs or a larger batch it shuffles every epoch (PFLlib/HtFLlib), seeded from seed and round."""
    from fedproto.algorithms.hetero_math import fedgh_train_head
    from fedproto.training import OptimConfig

    rng = np.random.default_rng(0)
    msgs = {i: {"classes": np.array([i, i + 1], np.int64), "protos": rng.normal(size=(2, 4)).astype(np.float32),
                "counts": np.array([3, 4], np.int64)} for i in range(3)}
    w0, b0 = rng.normal(size=(5, 4)).astype(np.float32), np.zeros(5, np.float32)
    for epochs, batch, shuffle in ((1, 1, False), (3, 2, True), (1, 2, True)):
        gh = FedGH(5, OptimConfig(), server_epochs=epochs, server_batch_size=batch, server_lr=0.5, seed=7)
        before = ServerState({"head/weight": w0.copy(), "head/bias": b0.copy()})
        got = gh.aggregate(2, msgs, before).message
        want_w, _, _ = fedgh_train_head([m["classes"] for m in msgs.values()], [m["protos"] for m in msgs.values()],
                                        w0, b0, epochs, 0.5, batch, shuffle=shuffle, seed=7 * 100_003 + 2)
        other_w, _, _ = fedgh_train_head([m["classes"] for m in msgs.values()], [m["protos"] for m in msgs.values()],
                                         w0, b0, epochs, 0.5, batch, shuffle=not shuffle, seed=7 * 100_003 + 2)
        np.testing.assert_allclose(got["head/weight"], want_w.astype(np.float32), rtol=1e-6)
        if batch == 1 or epochs > 1:  # one full batch of 6 pairs in one epoch is order-free
            assert not np.allclose(got["head/weight"], other_w.astype(np.float32), rtol=1e-6), (epochs, batch)
