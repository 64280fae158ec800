import numpy as np
import pytest

from fedproto.data.partition import draw_ways_shots, fewshot_partition
from fedproto.errors import PartitionError

rng = np.random.default_rng(0)
TRAIN_Y = np.repeat(np.arange(10), 600)
TEST_Y = np.repeat(np.arange(10), 100)


def make(**kw):
    args = dict(train_y=TRAIN_Y, test_y=TEST_Y, num_classes=10, num_clients=20, ways=3, shots=20,
                stdev=2, test_shots=10, seed=7, dataset="mnist")
    args.update(kw)
    return fewshot_partition(**args)


def test_partition_invariants():
    p = make()
    all_train = np.concatenate(p.train_idx)
    assert len(all_train) == len(set(all_train.tolist()))  # disjoint across clients
    for tr, te, cls, k in zip(p.train_idx, p.test_idx, p.classes, p.shots):
        assert 2 <= len(cls) <= 5  # official uniform range [max(2, 3-2), min(9, 3+2)]
        assert set(TRAIN_Y[tr].tolist()) == set(cls.tolist())
        assert set(TEST_Y[te].tolist()) == set(cls.tolist())
        assert np.all(np.bincount(TRAIN_Y[tr], minlength=10)[cls] == k)
        assert np.all(np.bincount(TEST_Y[te], minlength=10)[cls] == 10)
        assert len(np.unique(te)) == len(te)
        assert 19 <= k[0] <= 20  # MNIST official shots range [k-s+1, k+s-2]


def test_same_seed_same_partition_and_different_seed_differs():
    a, b, c = make(), make(), make(seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a.train_idx, b.train_idx))
    assert all(np.array_equal(x, y) for x, y in zip(a.test_idx, b.test_idx))
    assert not all(np.array_equal(x, y) for x, y in zip(a.train_idx, c.train_idx))


def test_gaussian_noise_model():
    n, k = draw_ways_shots(2000, 5, 100, 1, 10, "gaussian", np.random.default_rng(1))
    assert abs(n.mean() - 5) < 0.1 and 0.9 < n.std() < 1.2 and n.min() >= 2 and n.max() <= 10
    assert abs(k.mean() - 100) < 0.2
    n, k = draw_ways_shots(2000, 3, 100, 1, 10, "uniform", np.random.default_rng(1), "femnist")
    assert set(n.tolist()) == {2, 3, 4} and set(k.tolist()) == {100, 101}


def test_uniform_shots_never_reach_below_one():
    # reported fault: shots=1, stdev=3 drew k in [-1, 4]; a negative k sliced a class backwards
    # (one client got 17,720 MNIST samples, another none) and the run went on
    with pytest.raises(PartitionError, match=r"shots=1 with stdev=3: .*\[-1, \.\.\.\].*--shots 3 or more"):
        draw_ways_shots(6, 3, 1, 3, 10, "uniform", np.random.default_rng(0), "mnist")
    n, k = draw_ways_shots(500, 3, 3, 3, 10, "uniform", np.random.default_rng(0), "mnist")
    assert k.min() == 1 and k.max() <= 4
    with pytest.raises(PartitionError, match="shots=1 with stdev=2"):
        make(shots=1, stdev=2)


def test_capacity_error_names_class_and_shortfall():
    with pytest.raises(PartitionError, match=r"class \d+ runs short: .*\(short by \d+\)"):
        make(shots=400)
    with pytest.raises(PartitionError, match="ways=11"):
        make(ways=11)
    with pytest.raises(PartitionError, match="test_shots=200"):
        make(test_shots=200)


def test_labels_outside_the_class_range_are_refused():
    with pytest.raises(PartitionError, match=r"train labels hold 10, outside 0..9; pass num_classes >= 11"):
        make(train_y=np.append(TRAIN_Y, 10))
