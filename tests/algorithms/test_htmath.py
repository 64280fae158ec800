"""The model-heterogeneous methods' math (fedproto.algorithms.hetero_math) on hand-checked cases."""

import math

import numpy as np
import pytest
import torch

from fedproto.algorithms.hetero_math import (
    TGP_KEYS,
    class_centers,
    class_mean_logits,
    fd_distill_loss,
    fd_global_logits,
    fedgh_train_head,
    lg_aggregate,
    tgp_generate,
    tgp_init,
    tgp_loss,
    tgp_margin,
    tgp_server_train,
)

# FedTGP's 2 classes x 2 clients in 2-d: class centers Q0 = (0, 0), Q1 = (3, 4), 5 apart
TGP_CLASSES = [np.array([0, 1]), np.array([0, 1])]
TGP_PROTOS = [np.array([[1.0, 0.0], [3.0, 4.0]]), np.array([[-1.0, 0.0], [3.0, 4.0]])]


# ------------------------------------------------------------------------------------ FedTGP


def test_tgp_margin_is_the_largest_nearest_class_gap_capped_at_tau():
    margin, gaps = tgp_margin(TGP_CLASSES, TGP_PROTOS, 2, threshold=100.0)
    assert margin == pytest.approx(5.0)
    np.testing.assert_allclose(gaps, [5.0, 5.0])
    assert tgp_margin(TGP_CLASSES, TGP_PROTOS, 2, threshold=2.0)[0] == pytest.approx(2.0)
    # a third class at (3, 5), 1 from class 1 and sqrt(34) from class 0: the gaps are 5, 1, 1; the
    # margin is the largest nearest-class gap (5), not the largest distance between classes (sqrt 34)
    margin, gaps = tgp_margin(TGP_CLASSES + [np.array([2])], TGP_PROTOS + [np.array([[3.0, 5.0]])], 3, 100.0)
    np.testing.assert_allclose(gaps, [5.0, 1.0, 1.0])
    assert margin == pytest.approx(5.0)
    # one class only: no gap, no margin
    assert tgp_margin([np.array([0])], [np.array([[1.0, 1.0]])], 2, 100.0)[0] == 0.0
    with pytest.raises(ValueError, match="tau=0"):
        tgp_margin(TGP_CLASSES, TGP_PROTOS, 2, threshold=0.0)


def test_tgp_loss_matches_the_adaptive_margin_contrastive_loss_by_hand():
    protos = torch.tensor(np.concatenate(TGP_PROTOS))  # rows (1,0)/0, (3,4)/1, (-1,0)/0, (3,4)/1
    labels = torch.tensor([0, 1, 0, 1])
    G = torch.tensor([[0.0, 0.0], [3.0, 4.0]], dtype=torch.float64)  # global prototypes
    delta = 2.0
    # per row: -log(exp(-(d_own + delta)) / (exp(-(d_own + delta)) + exp(-d_other)))
    #        = log(1 + exp(d_own + delta - d_other))
    rows = [(1.0, math.sqrt(20.0)), (0.0, 5.0), (1.0, math.sqrt(32.0)), (0.0, 5.0)]
    expected = np.mean([math.log1p(math.exp(own + delta - other)) for own, other in rows])
    assert tgp_loss(protos, labels, G, delta).item() == pytest.approx(expected, rel=1e-12)
    # without the margin it is the plain distance softmax
    expected0 = np.mean([math.log1p(math.exp(own - other)) for own, other in rows])
    assert tgp_loss(protos, labels, G, 0.0).item() == pytest.approx(expected0, rel=1e-12)
    # a row exactly at its target keeps a finite gradient
    G.requires_grad_(True)
    tgp_loss(protos, labels, G, delta).backward()
    assert torch.isfinite(G.grad).all()
    with pytest.raises(ValueError, match="negative"):
        tgp_loss(protos, labels, G, -1.0)


def _np_generate(theta: dict) -> np.ndarray:
    mid = np.maximum(theta["embedding"] @ theta["w1"].T + theta["b1"], 0.0)
    return mid @ theta["w2"].T + theta["b2"]


def _np_tgp_loss(theta: dict, P: np.ndarray, y: np.ndarray, delta: float) -> float:
    G = _np_generate(theta)
    dist = np.sqrt(((P[:, None, :] - G[None, :, :]) ** 2).sum(-1))
    z = -(dist + delta * np.eye(G.shape[0])[y])
    z = z - z.max(1, keepdims=True)
    return float(np.mean(-(z[np.arange(len(y)), y] - np.log(np.exp(z).sum(1)))))


def test_tgp_server_step_is_one_sgd_step_on_the_loss_independently_differentiated():
    state = tgp_init(2, 2, hidden=3, seed=4, dtype=torch.float64)
    assert set(state) == set(TGP_KEYS) and state["w1"].shape == (3, 2) and state["w2"].shape == (2, 3)
    lr = 0.1
    # one epoch, one batch holding every row: exactly one SGD step on the mean loss
    G, new, info = tgp_server_train(TGP_CLASSES, TGP_PROTOS, None, state, 2, epochs=1, lr=lr,
                                    margin_threshold=100.0, batch_size=4, seed=0)
    assert info["margin"] == pytest.approx(5.0)
    P, y = np.concatenate(TGP_PROTOS), np.array([0, 1, 0, 1])
    assert info["loss"] == pytest.approx(_np_tgp_loss(state, P, y, 5.0), rel=1e-10)
    eps = 1e-6
    for k in TGP_KEYS:  # central finite differences of an independent numpy forward
        grad = np.zeros_like(state[k])
        for idx in np.ndindex(state[k].shape):
            plus = {n: v.copy() for n, v in state.items()}
            minus = {n: v.copy() for n, v in state.items()}
            plus[k][idx] += eps
            minus[k][idx] -= eps
            grad[idx] = (_np_tgp_loss(plus, P, y, 5.0) - _np_tgp_loss(minus, P, y, 5.0)) / (2 * eps)
        np.testing.assert_allclose(new[k], state[k] - lr * grad, atol=1e-8)
        assert new[k].dtype == np.float64
    np.testing.assert_allclose(G, _np_generate(new), rtol=1e-12)
    # the step moved the generator and lowered the loss
    assert not np.allclose(new["embedding"], state["embedding"])
    assert _np_tgp_loss(new, P, y, 5.0) < _np_tgp_loss(state, P, y, 5.0)


def test_tgp_training_pulls_each_global_prototype_to_its_class():
    state = tgp_init(2, 2, seed=1, dtype=torch.float64)
    counts = [np.array([3, 3]), np.array([5, 5])]
    first = tgp_server_train(TGP_CLASSES, TGP_PROTOS, counts, state, 2, epochs=1, lr=0.2, batch_size=2, seed=3)[2]
    G, _, info = tgp_server_train(TGP_CLASSES, TGP_PROTOS, counts, state, 2, epochs=300, lr=0.2, batch_size=2, seed=3)
    dist = np.linalg.norm(G[:, None, :] - np.array([[0.0, 0.0], [3.0, 4.0]])[None], axis=-1)
    assert dist.argmin(1).tolist() == [0, 1]  # each global prototype nearest its own class center
    assert dist[0, 0] < 1.0 and dist[1, 1] < 1.0
    # the margin (5, the classes' whole gap) keeps the loss above 0; training cut it to a fraction
    assert first["loss"] > 5.0 and info["loss"] < 0.3 * first["loss"]
    # epochs=0 only generates
    G0, same, info0 = tgp_server_train(TGP_CLASSES, TGP_PROTOS, None, state, 2, epochs=0)
    np.testing.assert_array_equal(G0, tgp_generate(state).numpy())
    np.testing.assert_array_equal(same["w1"], state["w1"])
    assert math.isnan(info0["loss"])


def test_tgp_float64_determinism_and_seed_dependence():
    state = tgp_init(3, 4, seed=0, dtype=torch.float64)
    rng = np.random.default_rng(0)
    classes = [np.array([0, 1]), np.array([1, 2]), np.array([0, 2])]
    protos = [rng.normal(size=(2, 4)) for _ in classes]
    a = tgp_server_train(classes, protos, None, state, 3, epochs=5, lr=0.1, batch_size=2, seed=7)
    b = tgp_server_train(classes, protos, None, state, 3, epochs=5, lr=0.1, batch_size=2, seed=7)
    c = tgp_server_train(classes, protos, None, state, 3, epochs=5, lr=0.1, batch_size=2, seed=8)
    np.testing.assert_array_equal(a[0], b[0])
    for k in TGP_KEYS:
        np.testing.assert_array_equal(a[1][k], b[1][k])
    assert not np.array_equal(a[0], c[0])  # the shuffling seed matters with several batches
    assert a[0].dtype == np.float64
    np.testing.assert_array_equal(tgp_init(3, 4, seed=0)["w1"], tgp_init(3, 4, seed=0)["w1"])
    assert not np.array_equal(tgp_init(3, 4, seed=0)["w1"], tgp_init(3, 4, seed=1)["w1"])


def test_tgp_bad_input_is_named():
    state = tgp_init(2, 2, seed=0)
    with pytest.raises(ValueError, match="size 3"):
        tgp_server_train([np.array([0])], [np.ones((1, 3))], None, state, 2)
    with pytest.raises(ValueError, match="class id 5"):
        tgp_server_train([np.array([5])], [np.ones((1, 2))], None, state, 2)
    with pytest.raises(ValueError, match="generator has 2 classes"):
        tgp_server_train([np.array([0])], [np.ones((1, 2))], None, state, 3)
    with pytest.raises(ValueError, match="server lr 0"):
        tgp_server_train([np.array([0])], [np.ones((1, 2))], None, state, 2, lr=0)
    with pytest.raises(ValueError, match="counts give 2 numbers for 1"):
        tgp_server_train([np.array([0])], [np.ones((1, 2))], [np.array([1, 2])], state, 2)


# ------------------------------------------------------------------------------------ FD


def test_class_mean_logits_and_global_logits():
    z = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [0.0, 6.0, 0.0]])
    c, m, n = class_mean_logits(z, torch.tensor([0, 0, 2]), 3)
    assert c.tolist() == [0, 2] and n.tolist() == [2, 1]
    np.testing.assert_allclose(m, [[2.0, 2.0, 2.0], [0.0, 6.0, 0.0]])
    # the server: class 0 from clients A and B, class 2 from A only; class 1 from nobody
    classes = [c, np.array([0])]
    logits = [m, np.array([[4.0, 0.0, 0.0]])]
    counts = [n, np.array([6])]
    gc, gl, k = fd_global_logits(classes, logits, counts, 3)
    assert gc.tolist() == [0, 2] and k.tolist() == [2, 1]
    np.testing.assert_allclose(gl, [[3.0, 1.0, 1.0], [0.0, 6.0, 0.0]])  # unweighted mean (PFLlib)
    _, gw, _ = fd_global_logits(classes, logits, counts, 3, rule="weighted")
    np.testing.assert_allclose(gw[0], [(2 * 2 + 6 * 4) / 8, 2 * 2 / 8, 2 * 2 / 8])
    # the paper's leave-one-out teacher for client B: client A's rows only
    lc, ll, _ = fd_global_logits(classes, logits, counts, 3, leave_out=1)
    assert lc.tolist() == [0, 2]
    np.testing.assert_allclose(ll, m)
    with pytest.raises(ValueError, match="width 2"):
        fd_global_logits([np.array([0])], [np.ones((1, 2))], None, 3)
    with pytest.raises(ValueError, match="needs the per-class sample counts"):
        class_centers(classes, logits, None, 3, rule="weighted")


def _np_soft_ce(z: np.ndarray, t: np.ndarray, T: float) -> float:
    p = np.exp(t / T) / np.exp(t / T).sum()
    logq = z / T - np.log(np.exp(z / T).sum())
    return float(-(p * logq).sum())


def test_fd_distill_loss_on_a_2x3_case():
    z = torch.tensor([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]], dtype=torch.float64)  # 2 samples x 3 classes
    y = torch.tensor([0, 1])
    table = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([True, True, False])
    zn, tn = z.numpy(), table.numpy()
    expected = (_np_soft_ce(zn[0], tn[0], 1.0) + _np_soft_ce(zn[1], tn[1], 1.0)) / 2
    assert fd_distill_loss(z, y, table, mask).item() == pytest.approx(expected, rel=1e-12)
    # by hand for sample 0: target softmax(2, 0, 0) = (e², 1, 1) / (e² + 2); log q = z - log(e + 1 + 1/e)
    t0 = np.array([math.e**2, 1.0, 1.0]) / (math.e**2 + 2)
    lq0 = np.array([1.0, 0.0, -1.0]) - math.log(math.e + 1 + 1 / math.e)
    assert _np_soft_ce(zn[0], tn[0], 1.0) == pytest.approx(-(t0 * lq0).sum(), rel=1e-12)
    # KL = CE - entropy(target): zero when the logits match the target's
    ent = sum(-(np.exp(t) / np.exp(t).sum() * np.log(np.exp(t) / np.exp(t).sum())).sum() for t in tn[:2])
    assert fd_distill_loss(z, y, table, mask, form="kl").item() == pytest.approx(expected - ent / 2, rel=1e-10)
    assert fd_distill_loss(table[:2], y, table, mask, form="kl").item() == pytest.approx(0.0, abs=1e-12)
    # temperature T: softmax(./T) on both sides, times T²
    T = 2.0
    expected_t = T**2 * (_np_soft_ce(zn[0], tn[0], T) + _np_soft_ce(zn[1], tn[1], T)) / 2
    assert fd_distill_loss(z, y, table, mask, temperature=T).item() == pytest.approx(expected_t, rel=1e-12)
    # a sample of a class without global logits adds 0 and counts in the denominator
    y2 = torch.tensor([0, 2])
    assert fd_distill_loss(z, y2, table, mask).item() == pytest.approx(_np_soft_ce(zn[0], tn[0], 1.0) / 2)
    # padding weight: the second sample is not there
    w = torch.tensor([1.0, 0.0], dtype=torch.float64)
    assert fd_distill_loss(z, y, table, mask, weight=w).item() == pytest.approx(_np_soft_ce(zn[0], tn[0], 1.0))
    with pytest.raises(ValueError, match="temperature 0"):
        fd_distill_loss(z, y, table, mask, temperature=0.0)
    with pytest.raises(ValueError, match="'mse'"):
        fd_distill_loss(z, y, table, mask, form="mse")


# ------------------------------------------------------------------------------------ FedGH


def test_fedgh_head_after_one_sgd_step_on_two_prototypes():
    classes = [np.array([0]), np.array([1])]
    protos = [np.array([[1.0, 0.0]]), np.array([[0.0, 2.0]])]
    W0, b0 = np.zeros((2, 2)), np.zeros(2)
    # one batch of both: softmax = (1/2, 1/2) for each; grad W = 1/2 [(-1/2, 1/2)ᵀ(1, 0) + (1/2, -1/2)ᵀ(0, 2)]
    # = [[-1/4, 1/2], [1/4, -1/2]], grad b = 0; lr 1/2
    W, b, info = fedgh_train_head(classes, protos, W0, b0, epochs=1, lr=0.5, batch_size=2)
    np.testing.assert_allclose(W, [[0.125, -0.25], [-0.125, 0.25]], atol=1e-15)
    np.testing.assert_allclose(b, [0.0, 0.0], atol=1e-15)
    assert info["loss"] == pytest.approx(math.log(2))
    assert W.dtype == np.float64
    # the paper's order: one step per pair, client by client. Step 1 on (1, 0)/0:
    # W = [[1/4, 0], [-1/4, 0]], b = (1/4, -1/4). Step 2 on (0, 2)/1: z = (1/4, -1/4), s0 = sigmoid(1/2)
    W, b, _ = fedgh_train_head(classes, protos, W0, b0, epochs=1, lr=0.5, batch_size=1)
    s0 = 1 / (1 + math.exp(-0.5))
    g = np.array([s0, (1 - s0) - 1])  # softmax - onehot(1)
    np.testing.assert_allclose(W, np.array([[0.25, 0.0], [-0.25, 0.0]]) - 0.5 * np.outer(g, [0.0, 2.0]), atol=1e-15)
    np.testing.assert_allclose(b, np.array([0.25, -0.25]) - 0.5 * g, atol=1e-15)


def test_fedgh_training_separates_the_classes_and_is_deterministic():
    rng = np.random.default_rng(1)
    classes = [np.array([0, 1, 2]), np.array([0, 2])]
    centers = np.array([[3.0, 0.0], [0.0, 3.0], [-3.0, -3.0]])
    protos = [centers[c] + 0.1 * rng.normal(size=(len(c), 2)) for c in classes]
    W0, b0 = np.zeros((3, 2)), np.zeros(3)
    W, b, _ = fedgh_train_head(classes, protos, W0, b0, epochs=50, lr=0.5, batch_size=2, shuffle=True, seed=3)
    assert ((centers @ W.T + b).argmax(1)).tolist() == [0, 1, 2]
    W2, b2, _ = fedgh_train_head(classes, protos, W0, b0, epochs=50, lr=0.5, batch_size=2, shuffle=True, seed=3)
    np.testing.assert_array_equal(W, W2)
    np.testing.assert_array_equal(b, b2)
    W3, _, _ = fedgh_train_head(classes, protos, W0, b0, epochs=50, lr=0.5, batch_size=2, shuffle=True, seed=4)
    assert not np.array_equal(W, W3)
    with pytest.raises(ValueError, match="input size 2"):
        fedgh_train_head([np.array([0])], [np.ones((1, 3))], W0, b0)
    with pytest.raises(ValueError, match="weight \\(C, d\\) and bias \\(C,\\)"):
        fedgh_train_head(classes, protos, W0, np.zeros(2))


# ------------------------------------------------------------------------------------ LG-FedAvg


def test_lg_aggregate_is_the_sample_weighted_mean_of_the_heads():
    a = {"weight": np.array([[1.0, 2.0]]), "bias": np.array([0.0])}
    b = {"weight": np.array([[5.0, -2.0]]), "bias": np.array([4.0])}
    out = lg_aggregate([a, b], [10, 30])  # weights 1/4 and 3/4
    np.testing.assert_allclose(out["weight"], [[4.0, -1.0]])
    np.testing.assert_allclose(out["bias"], [3.0])
    assert set(out) == {"weight", "bias"}
    f32 = lg_aggregate([{"w": np.ones(2, np.float32)}, {"w": np.zeros(2, np.float32)}], [1, 1])
    assert f32["w"].dtype == np.float32 and f32["w"].tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="client 1's head"):
        lg_aggregate([a, {"weight": np.ones((2, 2)), "bias": np.zeros(2)}], [1, 1])
    with pytest.raises(ValueError, match="sum to 0"):
        lg_aggregate([a, b], [0, 0])
    with pytest.raises(ValueError, match="2 heads but 1 weights"):
        lg_aggregate([a, b], [1])
