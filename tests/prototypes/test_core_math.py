"""The core math (prototypes, aggregation rules, privacy, the heterogeneous methods, the partition)
against values derived here by hand or by an independent computation: the options and edge cases
a run with the defaults does not reach."""

from __future__ import annotations

import numpy as np
import pytest

from fedproto.data.partition import Partition, natural_partition
from fedproto.errors import PartitionError


def test_partition_summary_counts_by_hand():
    """Partition.summary (config.json's partition entry): every count derived here from the index
    sets; writers and the overlap entries appear only where the partition has them."""
    p = Partition([np.array([0, 1, 2]), np.array([2, 3, 4, 5, 6])], [np.array([0]), np.array([1, 2])],
                  [np.array([1, 4]), np.array([0, 1, 2])])
    assert p.summary() == {"clients": 2, "ways_mean": 2.5, "ways_min": 2, "ways_max": 3,
                           "train_samples_mean": 4.0, "train_samples_total": 8, "test_samples_total": 3}
    p.overlap, p.writers = True, [7, 3]
    s = p.summary()
    assert s["writers"] == [7, 3] and s["overlap"] is True
    assert s["train_samples_distinct"] == 7 and s["train_samples_shared"] is True  # sample 2 twice
    p.train_idx = [np.array([0, 1]), np.array([2])]
    s = p.summary()
    assert (s["train_samples_distinct"], s["train_samples_total"], s["train_samples_shared"]) == (3, 3, False)


def test_natural_partition_of_a_small_made_up_writer_split():
    """Writers 0..3: writer 1 has no test sample (not eligible with min_test=1), writer 3 trains on
    classes {0, 2} and is tested on class 1 too. All eligible writers asked for: all, in order,
    with their own samples, classes and per-class counts."""
    train_g = np.array([0, 0, 1, 3, 3, 3, 2, 0])
    train_y = np.array([1, 1, 0, 2, 0, 2, 5, 3])
    test_g = np.array([3, 0, 2, 3, 2])
    test_y = np.array([1, 3, 5, 0, 4])
    p = natural_partition(train_g, test_g, train_y, test_y, 3)
    assert p.writers == [0, 2, 3]
    assert [t.tolist() for t in p.train_idx] == [[0, 1, 7], [6], [3, 4, 5]]
    assert [t.tolist() for t in p.test_idx] == [[1], [2, 4], [0, 3]]
    assert [c.tolist() for c in p.classes] == [[1, 3], [5], [0, 2]]
    assert [s.tolist() for s in p.shots] == [[2, 1], [1], [1, 2]]
    assert all(t.dtype == np.int64 for t in p.train_idx + p.test_idx + p.classes + p.shots)
    two = natural_partition(train_g, test_g, train_y, test_y, 2, seed=5)
    assert len(two.writers) == 2 and set(two.writers) < {0, 2, 3} and two.writers == sorted(two.writers)
    assert natural_partition(train_g, test_g, train_y, test_y, 2, seed=5).writers == two.writers
    with_min2 = natural_partition(train_g, test_g, train_y, test_y, 2, min_test=2)
    assert with_min2.writers == [2, 3]  # writer 0 has one test sample
    with pytest.raises(PartitionError, match="clients=4 but only 3 writers"):
        natural_partition(train_g, test_g, train_y, test_y, 4)
    with pytest.raises(PartitionError, match="must be >= 1"):
        natural_partition(train_g, test_g, train_y, test_y, 0)
    with pytest.raises(PartitionError, match="differ in length"):
        natural_partition(train_g[:-1], test_g, train_y, test_y, 1)
    with pytest.raises(PartitionError, match="no writer is eligible"):
        natural_partition(train_g, test_g, train_y, test_y, 1, min_test=5)


def test_prototype_momentum_by_hand():
    """C_j <- beta C_j(old) + (1 - beta) C_j(new) for classes in both; a new class takes its
    aggregate, a class without contributors keeps its old prototype; float32, sorted union."""
    from fedproto.prototypes import momentum_prototypes

    old_c, old_p = np.array([0, 2]), np.array([[1.0, 0.0], [0.0, 4.0]])
    new_c, new_p = np.array([2, 3]), np.array([[2.0, 0.0], [5.0, 5.0]])
    c, p = momentum_prototypes(old_c, old_p, new_c, new_p, 0.25)
    assert c.tolist() == [0, 2, 3] and c.dtype == np.int64 and p.dtype == np.float32
    np.testing.assert_allclose(p, [[1.0, 0.0], [0.25 * 0 + 0.75 * 2.0, 0.25 * 4.0 + 0.0], [5.0, 5.0]])
    c, p = momentum_prototypes(old_c, old_p, new_c, new_p, 0.0)  # beta 0: this round's, old kept where absent
    np.testing.assert_allclose(p, [[1.0, 0.0], [2.0, 0.0], [5.0, 5.0]])
    c, p = momentum_prototypes(np.array([], np.int64), np.zeros((0, 2)), new_c, new_p, 0.9)
    assert c.tolist() == [2, 3] and c.dtype == np.int64 and p.dtype == np.float32
    np.testing.assert_array_equal(p, new_p)
    for beta in (-0.1, 1.0):
        with pytest.raises(ValueError, match="outside"):
            momentum_prototypes(old_c, old_p, new_c, new_p, beta)
    with pytest.raises(ValueError, match="prototype size changed from 2 to 3"):
        momentum_prototypes(old_c, old_p, new_c, np.ones((2, 3)), 0.5)
    # a round without any class: the old prototypes stand, whatever size the empty array says
    c, p = momentum_prototypes(old_c, old_p, np.array([], np.int64), np.zeros((0, 3)), 0.5)
    assert c.tolist() == [0, 2]
    np.testing.assert_array_equal(p, old_p.astype(np.float32))


def test_client_distances_by_hand():
    """Per client the mean L2 distance of its prototypes to the global ones of the same classes;
    classes without a global prototype are left out, nan where none has one."""
    from fedproto.prototypes import client_distances

    gc, gp = np.array([1, 4]), np.array([[0.0, 0.0], [3.0, 0.0]])
    classes = [np.array([1, 4]), np.array([4, 7]), np.array([7])]
    protos = [np.array([[3.0, 4.0], [3.0, 1.0]]), np.array([[0.0, 4.0], [9.0, 9.0]]), np.array([[1.0, 1.0]])]
    d = client_distances(classes, protos, gc, gp)
    assert d.dtype == np.float64 and d[:2].tolist() == [(5.0 + 1.0) / 2, 5.0] and np.isnan(d[2])


def test_class_check_flags_by_hand():
    """The nearer test (another reference nearer than its own) acts when more than half of the
    rows pass it; the farther test flags robust z above z; rows of a class without a reference
    are not judged; in the first round only the norms count."""
    from fedproto.prototypes import class_check

    R = np.array([[0.0, 0.0], [10.0, 0.0]])
    rc = np.array([0, 1])
    classes = [np.array([0, 1]), np.array([0, 1]), np.array([0, 1, 5])]
    protos = [np.array([[0.5, 0.0], [9.5, 0.0]]), np.array([[0.0, 0.4], [10.0, 0.6]]),
              np.array([[9.0, 0.0], [10.3, 0.0], [50.0, 50.0]])]  # client 2 sends class 0 near class 1
    flags, acted = class_check(classes, protos, rc, R, z=3.0)
    assert acted
    assert [f.tolist() for f in flags] == [[False, False], [False, False], [True, False, False]]
    # with fewer than half passing the nearer test it does not act (embeddings not aligned yet)
    swapped = [p[[1, 0]] if len(p) == 2 else p for p in protos]
    flags, acted = class_check(classes, swapped, rc, R, z=3.0)
    assert not acted and not any(f[:2].any() for f in flags[:2])
    # first round (no reference): distances are the norms; one far row among equal ones
    classes = [np.array([0]), np.array([0]), np.array([0]), np.array([0])]
    protos = [np.array([[1.0, 0.0]]), np.array([[0.0, 1.1]]), np.array([[0.9, 0.0]]), np.array([[30.0, 0.0]])]
    flags, acted = class_check(classes, protos, np.array([], np.int64), np.zeros((0, 2)), z=3.0)
    assert not acted and [f.tolist() for f in flags] == [[False], [False], [False], [True]]
    # two rows only: no z-score is taken
    flags, _ = class_check(classes[:2], [protos[0], protos[3]], np.array([], np.int64), np.zeros((0, 2)))
    assert not any(f.any() for f in flags)
    with pytest.raises(ValueError, match="z=0"):
        class_check(classes, protos, rc, R, z=0)
    with pytest.raises(ValueError, match="size 3 against references of size 2"):
        class_check([np.array([0])], [np.ones((1, 3))], rc, R)


def test_lambda_warmup_schedules_by_hand():
    from fedproto.prototypes import lambda_at

    assert [lambda_at(r, 2.0, 4) for r in (1, 2, 3, 5, 9)] == [0.0, 0.5, 1.0, 2.0, 2.0]
    assert lambda_at(3, 2.0, 4, "cosine") == pytest.approx(2.0 * (1 - np.cos(np.pi * 0.5)) / 2)
    assert lambda_at(2, 2.0, 4, "cosine") == pytest.approx(2.0 * (1 - np.cos(np.pi * 0.25)) / 2)
    assert lambda_at(1, 3.0, 0) == 3.0 and lambda_at(0, 2.0, 4) == 0.0
    with pytest.raises(ValueError, match="'step'"):
        lambda_at(2, 1.0, 2, "step")


def test_robust_z_by_hand():
    """(x - median) / (1.4826 MAD); NaN kept NaN; MAD 0: +inf above the median, 0 elsewhere."""
    from fedproto.prototypes import robust_z

    v = np.array([1.0, 2.0, 3.0, 4.0, 100.0, np.nan])
    mad = 1.4826022185056018 * 1.0  # median |x - 3| over the finite values is 1
    np.testing.assert_allclose(robust_z(v)[:5], (v[:5] - 3.0) / mad)
    assert np.isnan(robust_z(v)[5])
    assert robust_z(np.array([2.0, 2.0, 2.0, 5.0, 1.0])).tolist() == [0.0, 0.0, 0.0, np.inf, 0.0]
    assert np.isnan(robust_z(np.array([np.nan, np.inf]))).all()


def test_proto_loss_normalized_on_a_batched_group_by_hand():
    """normalize=True on (G, B, d) embeddings: each embedding and each global prototype scaled to
    unit length over d (not over the batch), then the mse / squared_l2 forms by hand; a padded
    sample (weight 0) and a class without a global prototype do not count."""
    import torch

    from fedproto.prototypes import proto_loss

    h = torch.tensor([[[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]],
                      [[0.0, -5.0], [2.0, 2.0], [1.0, 1.0]]], dtype=torch.float64)
    y = torch.tensor([[0, 1, 2], [1, 1, 0]])
    table = torch.tensor([[2.0, 0.0], [0.0, 3.0], [9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([True, True, False])
    weight = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    unit = {0: np.array([1.0, 0.0]), 1: np.array([0.0, 1.0])}
    r = np.sqrt(0.5)
    # client 0: (0.6, 0.8) vs (1, 0); (1, 0) vs (0, 1); class 2 has no prototype
    sq0 = [np.sum((np.array([0.6, 0.8]) - unit[0]) ** 2), np.sum((np.array([1.0, 0.0]) - unit[1]) ** 2)]
    # client 1: (0, -1) vs (0, 1); (r, r) vs (0, 1); the third sample is padding
    sq1 = [np.sum((np.array([0.0, -1.0]) - unit[1]) ** 2), np.sum((np.array([r, r]) - unit[1]) ** 2)]
    got = proto_loss(h, y, table, mask, "mse", weight, normalize=True)
    np.testing.assert_allclose(got.numpy(), [sum(sq0) / (3 * 2), sum(sq1) / (2 * 2)], rtol=1e-12)
    got = proto_loss(h, y, table, mask, "squared_l2", weight, normalize=True)
    np.testing.assert_allclose(got.numpy(), [sum(sq0) / 3, sum(sq1) / 2], rtol=1e-12)


def test_aggregation_edge_cases_by_hand():
    """No client: empty arrays of the documented dtypes and shapes; a class id equal to C is named
    in the error (not the smallest id); min_contributors drops a class held by fewer clients."""
    from fedproto.prototypes import aggregate_prototypes

    c, p, n = aggregate_prototypes([], [], [], 5)
    assert (c.dtype, p.dtype, n.dtype) == (np.int64, np.float32, np.int64)
    assert c.shape == (0,) and p.shape == (0, 0) and n.shape == (0,)
    with pytest.raises(ValueError, match=r"class id 5 is outside 0\.\.4"):
        aggregate_prototypes([np.array([1, 5])], [np.ones((2, 2))], [np.array([1, 1])], 5)
    with pytest.raises(ValueError, match=r"class id -1 is outside"):
        aggregate_prototypes([np.array([-1, 2])], [np.ones((2, 2))], [np.array([1, 1])], 5)
    classes = [np.array([0, 1]), np.array([1])]
    protos = [np.array([[1.0, 1.0], [2.0, 0.0]]), np.array([[4.0, 2.0]])]
    counts = [np.array([3, 1]), np.array([3])]
    c, p, n = aggregate_prototypes(classes, protos, counts, 4, "weighted", min_contributors=2)
    assert c.tolist() == [1] and n.tolist() == [2]
    np.testing.assert_allclose(p, [[(2.0 * 1 + 4.0 * 3) / 4, (0.0 * 1 + 2.0 * 3) / 4]])
    c, p, n = aggregate_prototypes(classes, protos, counts, 4, "median")
    np.testing.assert_allclose(p, [[1.0, 1.0], [3.0, 1.0]])  # the median of two values is their mean


def test_l2_proto_loss_on_a_batch_without_the_last_class():
    """The ``l2`` form sums over classes present in the batch with a global prototype the distance
    between the batch mean of the class and its prototype; the batch need not hold class C - 1."""
    import torch

    from fedproto.prototypes import proto_loss

    h = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1])
    table = torch.tensor([[2.0, 1.0], [0.0, 0.0], [5.0, 5.0], [7.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([True, True, True, False])
    got = float(proto_loss(h, y, table, mask, "l2"))
    assert got == pytest.approx(np.hypot(0.0, 1.0) + 2.0, abs=1e-5)  # class 0: mean (2, 0); class 1: (0, 2)


def test_class_check_flags_are_booleans_and_robust_z_below_unit_spread():
    from fedproto.prototypes import class_check, robust_z

    flags, _ = class_check([np.array([0, 1])], [np.ones((2, 2))], np.array([0, 1]), np.zeros((2, 2)))
    assert flags[0].dtype == bool
    v = np.array([0.1, 0.2, 0.3, 0.4, 10.0])  # median 0.3, MAD 0.1: scaled 0.148, below 1
    np.testing.assert_allclose(robust_z(v), (v - 0.3) / (1.4826022185056018 * 0.1), rtol=1e-9)


def test_noised_release_of_edge_label_sets_without_noise():
    """Without noise the release is the clipped class means: a label-set class the client has no
    sample of gets a zero row and count 1 (max(1, 0)); an empty label set gives (0, d) rows; the
    classes come back int64 whatever integer type they were given in."""
    import torch

    from fedproto.prototypes.dp import noisy_prototypes

    h = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 0.5]])
    y = torch.tensor([2, 2])
    c, p, n = noisy_prototypes(h, y, np.array([2, 7], np.int32), 1.0, 0.0, None)
    assert c.dtype == np.int64 and c.tolist() == [2, 7] and n.tolist() == [2, 1] and p.dtype == np.float32
    np.testing.assert_allclose(p, [[0.3, 0.4, 0.25], [0.0, 0.0, 0.0]], rtol=1e-6)
    c, p, n = noisy_prototypes(h, y, np.array([], np.int64), 1.0, 0.0, None)
    assert c.shape == (0,) and p.shape == (0, 3) and n.shape == (0,)


def test_epsilon_edges_by_hand():
    """ε of one release is above 0 (a single step counts); δ must lie strictly inside (0, 1); the
    accountant's "optimal order is the smallest alpha" warning (a large δ or many releases) is
    silenced: ε stays a valid upper bound there."""
    import warnings

    from fedproto.prototypes.dp import epsilon

    assert epsilon([(2.0, 1.0, 1)], 1e-5) > 0.5
    assert epsilon([(2.0, 1.0, 1), (2.0, 1.0, 0)], 1e-5) == epsilon([(2.0, 1.0, 1)], 1e-5)
    for delta in (0.0, 1.0):
        with pytest.raises(ValueError, match=f"dp_delta={delta}"):
            epsilon([(1.0, 1.0, 1)], delta)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert epsilon([(1.0, 1.0, 1000)], 0.9) > 0


def test_a_partition_no_shots_value_fits_says_so():
    """Ten 2-way clients over two classes of two training samples each: even one shot per class
    needs ten samples of each class, so the error says that no shots value fits."""
    from fedproto.data.partition import fewshot_partition

    with pytest.raises(PartitionError, match=r"no \W*shots\W* value fits: lower \W*clients\W* or \W*ways"):
        fewshot_partition(np.array([0, 0, 1, 1]), np.array([0, 1] * 40), 2, 10, 2, 1)
