"""TODO"""


import numpy as np
import pytest
from conftest import DATA, needs_femnist

from fedproto.config.run_config import build_config
from fedproto.data.partition import draw_ways_shots, fewshot_partition, natural_partition
from fedproto.engine.setup import prepare
from fedproto.errors import ConfigError, PartitionError
from fedproto.simulation import Simulation

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
    with pytest.raises(PartitionError, match=r"shots=1 with stdev=3: .*\[-1, \.\.\.\].*use shots=3 or more"):
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


def _documented_range(ways, shots, stdev, C, noise, dataset):
    """The ranges as docs/options.md states them (written out here, not taken from the library)."""
    if noise == "uniform":
        k_hi = shots + stdev - 2 if dataset == "mnist" else shots + stdev
        return ((min(ways, max(2, ways - stdev)), max(ways, min(C - 1, ways + stdev))),
                (min(shots, shots - stdev + 1), max(shots, k_hi)))
    return (min(2, ways), C), (1, np.inf)


@pytest.mark.parametrize("noise", ["uniform", "gaussian"])
@pytest.mark.parametrize("dataset", ["mnist", "cifar10"])
def test_drawn_ways_and_shots_lie_in_the_documented_range(noise, dataset):
    """stdev 0 gives exactly the shots asked for (it once gave shots + 1). For every (ways, shots,
    stdev) of a grid, every draw lies in the documented range, the range holds ways and shots,
    stdev 0 gives exactly ways and shots, and the official ranges hold for stdev >= 2."""
    C = 10
    for ways in (1, 2, 3, 5, 9, 10):
        for shots in (1, 2, 5, 40, 100):
            for stdev in (0, 1, 2, 3, 5):
                if noise == "uniform" and shots - stdev + 1 < 1:
                    continue  # refused, see test_uniform_shots_never_reach_below_one
                n, k = draw_ways_shots(300, ways, shots, stdev, C, noise, np.random.default_rng(stdev), dataset)
                (nlo, nhi), (klo, khi) = _documented_range(ways, shots, stdev, C, noise, dataset)
                where = (ways, shots, stdev)
                assert nlo <= ways <= nhi and klo <= shots <= khi, where
                assert n.min() >= nlo and n.max() <= nhi and k.min() >= klo and k.max() <= khi, where
                if stdev == 0:
                    assert set(n.tolist()) == {ways} and set(k.tolist()) == {shots}, where
                if noise == "uniform" and stdev >= 2 and 2 <= ways - stdev and ways + stdev <= C - 1:
                    official_k = (shots - stdev + 1, shots + stdev - 2 if dataset == "mnist" else shots + stdev)
                    assert (klo, khi) == official_k and (nlo, nhi) == (ways - stdev, ways + stdev), where
                    assert set(k.tolist()) == set(range(klo, khi + 1)), where  # the whole range is drawn


def test_stdev_zero_partition_has_exactly_the_asked_shots():
    """The reported input: 3 clients, ways 2, shots 5, stdev 0 gave 6 samples per class."""
    p = make(num_clients=3, ways=2, shots=5, stdev=0)
    for tr, cls, k in zip(p.train_idx, p.classes, p.shots):
        assert len(cls) == 2 and list(k) == [5, 5] and len(tr) == 10


def test_dirichlet_partition_semantics():
    """Per class, Dir(alpha) proportions over clients; every training sample goes to exactly one
    client; each client holds >= min_samples; test sets follow each client's training class
    proportions; seeded; smaller alpha gives stronger skew."""
    from fedproto.data.partition import dirichlet_partition

    ty, sy = np.repeat(np.arange(10), 600), np.repeat(np.arange(10), 100)
    p = dirichlet_partition(ty, sy, 10, 20, 0.5, min_samples=10, test_shots=10, seed=3)
    allidx = np.concatenate(p.train_idx)
    assert sorted(allidx.tolist()) == list(range(len(ty)))  # a partition of the train split
    for tr, te, cls, k in zip(p.train_idx, p.test_idx, p.classes, p.shots):
        cnt = np.bincount(ty[tr], minlength=10)
        assert len(tr) >= 10 and cls.tolist() == np.flatnonzero(cnt).tolist() and k.tolist() == cnt[cls].tolist()
        tcnt = np.bincount(sy[te], minlength=10)
        assert set(np.flatnonzero(tcnt)) == set(cls.tolist()) and len(te) == 10 * len(cls)
        assert len(np.unique(te)) == len(te)
        # test counts follow the training proportions within one sample per class
        assert np.all(np.abs(tcnt[cls] - k / k.sum() * len(te)) < 1.0)
    q = dirichlet_partition(ty, sy, 10, 20, 0.5, min_samples=10, test_shots=10, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(p.train_idx, q.train_idx))

    def mean_ways(alpha):
        return np.mean([len(c) for c in dirichlet_partition(ty, sy, 10, 20, alpha, 5, 2, seed=1).classes])

    assert mean_ways(0.1) < mean_ways(1.0) < mean_ways(100.0) == 10.0
    # a small test split (digits holds ~54 per class) caps a client's test samples of a class
    small = dirichlet_partition(ty, np.repeat(np.arange(10), 3), 10, 4, 0.1, min_samples=10, test_shots=10, seed=1)
    assert all(np.bincount(np.repeat(np.arange(10), 3)[te], minlength=10).max() <= 3 for te in small.test_idx)
    with pytest.raises(PartitionError, match="alpha=0"):
        dirichlet_partition(ty, sy, 10, 20, 0.0)
    with pytest.raises(PartitionError, match="need 60000 training samples, the train split has 6000"):
        dirichlet_partition(ty, sy, 10, 600, 0.5, min_samples=100)
    with pytest.raises(PartitionError, match=r"client \d+ with \d+.*raise alpha"):
        dirichlet_partition(ty, sy, 10, 200, 0.01, min_samples=25, max_tries=3)


def test_dirichlet_partition_runs_end_to_end(tmp_path):
    from fedproto.config.run_config import build_config

    cfg = build_config(overrides=dict(dataset="digits", partition="dirichlet", alpha=0.3, clients=5, rounds=5,
                                      test_shots=5, min_client_samples=20, out_dir=str(tmp_path)))
    # options that change results and differ from their defaults are in the name
    assert cfg.run_name() == "fedproto-digits-dir0.3-m5-s1234-test_shots5-min_client_samples20-r5"
    sim = Simulation(cfg)
    s = sim.run()
    chance = np.mean([1 / len(st.classes) for st in sim.setup.states])
    assert s["ways"] is None and "training class proportions" in s["test_set"]
    assert s["accuracy"]["acc"]["mean"] > chance + 0.25, (s["accuracy"], chance)


MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def _mnist_like_labels():
    """Label arrays with MNIST's per-class counts (60,000 train, 10,000 test), shuffled."""
    return (np.random.default_rng(0).permutation(np.repeat(np.arange(10), MNIST_TRAIN_COUNTS)),
            np.random.default_rng(1).permutation(np.repeat(np.arange(10), MNIST_TEST_COUNTS)))


def _digest(p):
    import hashlib

    h = hashlib.sha256()
    for part in (p.train_idx, p.test_idx, p.classes, p.shots):
        for a in part:
            h.update(np.asarray(a, np.int64).tobytes())
            h.update(b"|")
    return h.hexdigest()


def test_overlap_off_leaves_the_default_partition_unchanged():
    """The default MNIST setting (20 clients, ways 3, shots 100, stdev 2, test_shots 40, seed 1234):
    the option absent, False and True (nothing runs short, so nothing is shared) give the same
    partition, and it is the one the code gave before the option existed (digest recorded from
    commit 1c6dbcf)."""
    ty, sy = _mnist_like_labels()
    args = (ty, sy, 10, 20, 3, 100, 2, 40, "uniform", 1234, "mnist")
    absent, off, on = fewshot_partition(*args), fewshot_partition(*args, overlap=False), \
        fewshot_partition(*args, overlap=True)
    assert _digest(absent) == "d52a927b45e582aa01d8a2276c1838f5d40b901a585f8f330154ddbdc68e374e"
    assert _digest(off) == _digest(absent) == _digest(on)
    assert "overlap" not in absent.summary() and "overlap" not in off.summary()
    assert on.summary()["overlap"] is True and on.summary()["train_samples_shared"] is False
    assert on.summary()["train_samples_distinct"] == on.summary()["train_samples_total"] == 6958
    # the small fake-label setting of the tests above, too
    assert _digest(make()) == _digest(make(overlap=False))


def test_overlap_lets_10000_clients_share_mnist_samples():
    """10,000 clients x 3 ways x 5 shots = 150,000 samples from MNIST's 60,000: refused without
    overlap (with a hint naming it), dealt with it: every client holds 3 classes x 5 distinct
    samples of those classes, samples are shared across clients, and every sample of a class is
    held by the same number of clients up to one (each pass over a class's pool uses it whole)."""
    ty, sy = _mnist_like_labels()
    args = dict(train_y=ty, test_y=sy, num_classes=10, num_clients=10_000, ways=3, shots=5, stdev=0,
                test_shots=40, seed=1234, dataset="mnist")
    with pytest.raises(PartitionError, match=r"runs short: .*give overlap=True to let clients share training samples"):
        fewshot_partition(**args)
    p = fewshot_partition(**args, overlap=True)
    assert p.num_clients == 10_000
    for tr, te, cls, k in zip(p.train_idx, p.test_idx, p.classes, p.shots):
        assert len(cls) == 3 and list(k) == [5, 5, 5]
        assert len(tr) == 15 and len(np.unique(tr)) == 15
        assert np.array_equal(np.bincount(ty[tr], minlength=10)[cls], [5, 5, 5])
        assert set(ty[tr].tolist()) == set(cls.tolist())
        assert np.array_equal(np.bincount(sy[te], minlength=10)[cls], [40, 40, 40]) and len(np.unique(te)) == 120
    held = np.bincount(np.concatenate(p.train_idx), minlength=len(ty))
    assert held.sum() == 150_000 and held.max() > 1  # shared
    for j in range(10):
        per_class = held[ty == j]
        assert per_class.min() >= 1 and per_class.max() - per_class.min() <= 1, j
    s = p.summary()
    assert s["overlap"] is True and s["train_samples_shared"] is True
    assert s["train_samples_total"] == 150_000 and s["train_samples_distinct"] == 60_000
    again = fewshot_partition(**args, overlap=True)
    assert _digest(again) == _digest(p)  # seeded


def test_overlap_still_refuses_a_client_larger_than_its_class():
    """With overlap a class may run short, but one client's samples of a class stay distinct:
    TRAIN_Y has 600 per class; shots 700 (stdev 2: k in [699, 700]) cannot fit and the error names
    the largest shots that does."""
    with pytest.raises(PartitionError, match=r"has 600 training samples but a client asks for 700 of it; with "
                       r"overlap=True .* shots=600 is the largest that fits") as e:
        make(shots=700, overlap=True)
    assert e.value.fitting_shots == 600 and e.value.short_class is not None
    p = make(shots=600, overlap=True)  # 20 clients x ~3 ways x 600 > 600 per class: shared, each distinct
    assert all(len(np.unique(tr)) == len(tr) for tr in p.train_idx)
    assert p.summary()["train_samples_shared"] is True


def test_overlap_option_in_config_and_cli_wording():
    from fedproto.config.run_config import ADDED_FIELDS, build_config
    from fedproto.config.run_options import cli_wording
    from fedproto.errors import ConfigError

    assert build_config().overlap is False and ADDED_FIELDS["overlap"] is False
    assert build_config(overrides={"overlap": True}).overlap is True
    assert cli_wording("overlap", True) == "--overlap" and cli_wording("overlap", False) == "--no-overlap"
    with pytest.raises(ConfigError, match="gives every sample to one client"):
        build_config(overrides={"overlap": True, "partition": "dirichlet"})


def test_overlap_runs_end_to_end_and_is_recorded(tmp_path):
    """Through RunConfig, prepare and the run directory: digits (about 140 train samples per
    class) with 60 clients x 3 ways x 10 shots runs short without overlap and runs with it;
    config.json's partition summary says that samples are shared."""
    import json

    from fedproto.config.run_config import build_config
    from fedproto.engine.setup import prepare

    base = dict(dataset="digits", clients=60, ways=3, shots=10, stdev=0, test_shots=5, rounds=1, eval_every=0,
                threads=1, out_dir=str(tmp_path), name="o")
    with pytest.raises(PartitionError, match="give overlap=True"):
        prepare(build_config(overrides=base), progress=False)
    sim = Simulation(build_config(overrides={**base, "overlap": True}))
    sim.run()
    part = json.loads((tmp_path / "o" / "config.json").read_text())["partition_summary"]
    assert part["overlap"] is True and part["train_samples_shared"] is True
    assert part["train_samples_total"] == 1800 > part["train_samples_distinct"]
    assert all(len(np.unique(tr)) == len(tr) == 30 for tr in sim.setup.partition.train_idx)


@pytest.fixture(scope="module")
def femnist():
    from fedproto.data.datasets import load_dataset

    return load_dataset("femnist", DATA, download=False)


@pytest.mark.usefixtures("one_thread")
@needs_femnist
def test_natural_partition_one_client_per_writer(femnist):
    ds = femnist
    tr_g, te_g, tr_y, te_y = ds.train_groups, ds.test_groups, ds.train_y.numpy(), ds.test_y.numpy()
    W = len(ds.group_names)
    p = natural_partition(tr_g, te_g, tr_y, te_y, W, seed=0)
    assert p.num_clients == W and sorted(p.writers) == list(range(W))
    all_train = np.concatenate(p.train_idx)
    assert np.array_equal(np.sort(all_train), np.arange(len(tr_y)))  # disjoint and complete
    assert np.array_equal(np.sort(np.concatenate(p.test_idx)), np.arange(len(te_y)))
    unseen = 0
    for tr, te, cls, k, w in zip(p.train_idx, p.test_idx, p.classes, p.shots, p.writers):
        assert np.all(tr_g[tr] == w) and np.all(te_g[te] == w)
        assert len(tr) == (tr_g == w).sum() and len(te) == (te_g == w).sum() >= 1
        assert np.array_equal(cls, np.unique(tr_y[tr]))
        assert np.array_equal(k, np.bincount(tr_y[tr], minlength=62)[cls]) and k.sum() == len(tr)
        unseen += int((~np.isin(te_y[te], cls)).sum())
    assert unseen > 0  # test samples of classes the writer never trained on are kept

    a = natural_partition(tr_g, te_g, tr_y, te_y, 20, seed=3)
    b = natural_partition(tr_g, te_g, tr_y, te_y, 20, seed=3)
    c = natural_partition(tr_g, te_g, tr_y, te_y, 20, seed=4)
    assert a.writers == b.writers and a.writers != c.writers and a.writers == sorted(a.writers)
    assert len(set(a.writers)) == 20
    with pytest.raises(PartitionError, match=rf"only {W} writers are available.*use clients={W} or fewer"):
        natural_partition(tr_g, te_g, tr_y, te_y, W + 1, seed=0)


@pytest.mark.usefixtures("one_thread")
@needs_femnist
def test_natural_partition_through_prepare(femnist):
    cfg = build_config(overrides=dict(dataset="femnist", partition="natural", clients=5, rounds=1))
    setup = prepare(cfg, dataset=femnist)
    assert len(setup.states) == 5 and setup.partition.writers
    for s, d, w in zip(setup.states, setup.data, setup.partition.writers):
        assert len(d.x) == (femnist.train_groups == w).sum()
        assert set(d.y.tolist()) == set(s.classes.tolist())


@pytest.mark.usefixtures("one_thread")
def test_natural_partition_needs_writer_ids():
    cfg = build_config(overrides=dict(dataset="digits", partition="natural", clients=2))
    with pytest.raises(ConfigError, match="natural.*writer ids"):
        prepare(cfg)


@pytest.mark.usefixtures("one_thread")
@needs_femnist
def test_femnist_fewshot_feasible_and_capacity_error(femnist):
    tr_y, te_y = femnist.train_y.numpy(), femnist.test_y.numpy()
    # 20 clients, 3 ways: ~10 shots and <= 3 test shots fit the LEAF 5% writer sample
    p = fewshot_partition(tr_y, te_y, 62, 20, 3, 10, 1, 3, "uniform", 1234, "femnist")
    assert p.num_clients == 20
    assert len(np.unique(np.concatenate(p.train_idx))) == sum(len(t) for t in p.train_idx)
    for tr, cls, k in zip(p.train_idx, p.classes, p.shots):
        assert 10 <= k[0] <= 11  # official FEMNIST range [k - s + 1, k + s]
        assert np.all(np.bincount(tr_y[tr], minlength=62)[cls] == k)
    with pytest.raises(PartitionError, match=r"runs short.*largest that fits.*LEAF writer sample"):
        fewshot_partition(tr_y, te_y, 62, 20, 3, 100, 1, 3, "uniform", 1234, "femnist")
    with pytest.raises(PartitionError, match=r"test_shots=40.*LEAF writer sample"):
        fewshot_partition(tr_y, te_y, 62, 20, 3, 10, 1, 40, "uniform", 1234, "femnist")


@pytest.mark.usefixtures("one_thread")
def test_capacity_hint_is_the_largest_shots_that_fits():
    tr_y, te_y = np.repeat(np.arange(10), 60), np.repeat(np.arange(10), 20)
    with pytest.raises(PartitionError, match=r"shots=(\d+) is the largest") as e:
        fewshot_partition(tr_y, te_y, 10, 20, 3, 40, 2, 5, "uniform", 5, "cifar10")
    fit = int(str(e.value).split("shots=")[-1].split()[0])
    fewshot_partition(tr_y, te_y, 10, 20, 3, fit, 2, 5, "uniform", 5, "cifar10")
    with pytest.raises(PartitionError):
        fewshot_partition(tr_y, te_y, 10, 20, 3, fit + 1, 2, 5, "uniform", 5, "cifar10")
