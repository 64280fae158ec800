"""TODO"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import REFS, honest_replies

from fedproto.prototypes import (
    aggregate_prototypes,
    class_check,
    class_sums,
    lambda_at,
    local_prototypes,
    momentum_prototypes,
    nearest_prototype,
    proto_loss,
    prototype_table,
    robust_z,
)


def test_weighted_vs_mean_aggregation():
    # client A: 10 samples of class 2 at prototype (0, 0); client B: 90 samples at (10, 20)
    cls = [np.array([2]), np.array([2])]
    protos = [np.array([[0.0, 0.0]]), np.array([[10.0, 20.0]])]
    counts = [np.array([10]), np.array([90])]
    c, p, n = aggregate_prototypes(cls, protos, counts, 5, "weighted")
    assert c.tolist() == [2] and n.tolist() == [2]
    np.testing.assert_allclose(p[0], [9.0, 18.0])  # 0.1 * A + 0.9 * B
    c, p, _ = aggregate_prototypes(cls, protos, counts, 5, "mean")
    np.testing.assert_allclose(p[0], [5.0, 10.0])  # 0.5 / 0.5


def test_absent_classes_are_not_averaged_as_zeros():
    # class 0 held by both, class 1 only by A, class 3 by nobody
    cls = [np.array([0, 1]), np.array([0])]
    protos = [np.array([[2.0, 2.0], [4.0, 4.0]]), np.array([[6.0, 6.0]])]
    counts = [np.array([5, 5]), np.array([5])]
    c, p, n = aggregate_prototypes(cls, protos, counts, 4, "mean")
    assert c.tolist() == [0, 1]
    np.testing.assert_allclose(p, [[4.0, 4.0], [4.0, 4.0]])  # class 1 not halved by a zero from B
    assert n.tolist() == [2, 1]
    c, p, _ = aggregate_prototypes(cls, protos, counts, 4, "median")
    np.testing.assert_allclose(p, [[4.0, 4.0], [4.0, 4.0]])


def test_local_prototypes_are_class_means():
    h = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 5.0]])
    y = torch.tensor([1, 1, 3])
    s, n = class_sums(h, y, 4)
    c, p, cnt = local_prototypes(s, n)
    assert c.tolist() == [1, 3] and cnt.tolist() == [2, 1]
    np.testing.assert_allclose(p, [[2.0, 0.0], [0.0, 5.0]])


def test_proto_loss_forms_values():
    table, mask = prototype_table(np.array([0]), np.array([[1.0, 1.0]]), 3, 2)
    h = torch.tensor([[3.0, 1.0], [0.0, 0.0]])
    y = torch.tensor([0, 2])  # second sample's class has no global prototype
    # squared distances: sample 0 -> 4, sample 1 -> not covered
    assert proto_loss(h, y, table, mask, "mse").item() == pytest.approx(4.0 / (2 * 2))
    assert proto_loss(h, y, table, mask, "squared_l2").item() == pytest.approx(4.0 / 2)
    assert proto_loss(h, y, table, mask, "l2").item() == pytest.approx(2.0, rel=1e-5)
    # no covered sample -> zero
    assert proto_loss(h, torch.tensor([2, 2]), table, mask, "mse").item() == 0.0
    with pytest.raises(ValueError):
        proto_loss(h, y, table, mask, "cosine")


def test_proto_loss_positive_when_embeddings_differ_and_has_gradient():
    table, mask = prototype_table(np.array([0, 1]), np.zeros((2, 4), np.float32), 2, 4)
    h = torch.ones(3, 4, requires_grad=True)
    loss = proto_loss(h, torch.tensor([0, 1, 1]), table, mask, "mse")
    assert loss.item() == pytest.approx(1.0)
    loss.backward()
    assert torch.allclose(h.grad, torch.full((3, 4), 2.0 / 12))


def test_nearest_prototype_respects_allowed_classes():
    table = torch.tensor([[0.0, 0.0], [1.0, 0.0], [5.0, 5.0]])
    h = torch.tensor([[0.9, 0.0], [4.0, 4.0]])
    allowed = torch.tensor([True, True, True])
    assert nearest_prototype(h, table, allowed).tolist() == [1, 2]
    allowed = torch.tensor([True, False, True])
    assert nearest_prototype(h, table, allowed).tolist() == [0, 2]


def test_aggregation_refuses_class_ids_outside_the_range():
    with pytest.raises(ValueError, match=r"class id 5 is outside 0..4"):
        aggregate_prototypes([np.array([5])], [np.ones((1, 2))], [np.array([3])], 5)


def test_nearest_prototype_never_leaves_the_allowed_classes():
    """Float32 distances of embeddings near 3e19 overflow to inf for every class, and
    an argmin over all classes would return class 0 although only class 2 was allowed."""
    from fedproto.prototypes import embedding_health

    allowed = torch.zeros(10, dtype=torch.bool)
    allowed[2] = True
    table = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
    assert nearest_prototype(torch.full((3, 4), 3e19), table, allowed).tolist() == [2, 2, 2]
    gen = torch.Generator().manual_seed(1)
    for scale in (1.0, 1e19, 3e38):
        for bad in (None, float("nan"), float("inf"), -float("inf")):
            h = torch.randn(16, 4, generator=gen) * scale
            if bad is not None:
                h[::3, 1] = bad
            for _ in range(5):
                allowed = torch.rand(10, generator=gen) < 0.4
                allowed[int(torch.randint(10, (1,), generator=gen))] = True
                for normalize in (False, True):
                    pred = nearest_prototype(h, table, allowed, normalize)
                    assert bool(allowed[pred].all()), (scale, bad, allowed, pred)
    # finite and moderate values: the nearest allowed class, as before
    allowed = torch.tensor([True, False, True] + [False] * 7)
    assert nearest_prototype(table[[1, 2, 0]] + 1e-3, table, allowed).tolist() == [
        int(torch.cdist(table[1:2], table[[0, 2]]).argmin()) * 2, 2, 0]
    # a NaN prototype of an allowed class never wins (else it would take every sample)
    t = table.clone()
    t[3] = float("nan")
    allowed = torch.zeros(10, dtype=torch.bool)
    allowed[[3, 7]] = True
    assert nearest_prototype(torch.randn(5, 4), t, allowed).tolist() == [7] * 5
    for bad_mask in (torch.tensor(True), torch.ones(2, dtype=torch.bool)):
        with pytest.raises(ValueError, match="allowed \\(C,\\)"):
            nearest_prototype(torch.randn(5, 4), table, bad_mask)
    assert nearest_prototype(torch.randn(2, 4), table, np.arange(10) == 4).tolist() == [4, 4]  # numpy mask
    with pytest.raises(ValueError, match="shape \\(N, d\\)"):
        embedding_health(torch.ones(3))
    # the health flags that go to clients.csv
    h = torch.ones(4, 3)
    assert embedding_health(h, torch.zeros(4, 10)) == {"emb_norm": pytest.approx(3 ** 0.5), "nonfinite": 0.0}
    h[1, 0] = float("nan")
    assert embedding_health(h)["nonfinite"] == 1.0
    assert embedding_health(torch.ones(2, 3), torch.tensor([[float("inf")]]))["nonfinite"] == 1.0


def test_lambda_warmup_values():
    assert [lambda_at(r, 2.0, 4) for r in (1, 2, 3, 5, 9)] == [0.0, 0.5, 1.0, 2.0, 2.0]
    assert [lambda_at(r, 2.0, 0) for r in (1, 2, 50)] == [2.0, 2.0, 2.0]


def test_momentum_prototypes_values():
    cls, protos = momentum_prototypes(np.array([0, 1]), np.array([[0.0, 0.0], [2.0, 2.0]]),
                                      np.array([1, 2]), np.array([[4.0, 4.0], [6.0, 6.0]]), 0.5)
    assert cls.tolist() == [0, 1, 2]
    assert protos.tolist() == [[0.0, 0.0], [3.0, 3.0], [6.0, 6.0]]  # kept, 0.5*2+0.5*4, new
    cls0, p0 = momentum_prototypes(np.array([0]), np.array([[1.0]]), np.array([0]), np.array([[3.0]]), 0.0)
    assert p0.tolist() == [[3.0]]
    with pytest.raises(ValueError, match="outside"):
        momentum_prototypes(np.array([0]), np.array([[1.0]]), np.array([0]), np.array([[3.0]]), 1.0)


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


def test_class_check_flags_flipped_and_scaled_prototypes_not_honest_ones():
    rng = np.random.default_rng(0)
    honest = honest_replies(rng, REFS, [[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    flipped = [(c, p, n) for c, p, n in honest_replies(rng, REFS, [[0, 1], [2, 3]])]
    flipped = [((c + 1) % 4, p, n) for c, p, n in flipped]  # class c's prototype sent as c + 1
    scaled = [(c, p * 100, n) for c, p, n in honest_replies(rng, REFS, [[1, 2]])]
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
