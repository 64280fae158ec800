"""The partitions beside the paper's few-shot protocol (:mod:`fedproto.data.partition`): one
client per writer (:func:`natural_partition`, LEAF's FEMNIST split) and Dirichlet label skew
(:func:`dirichlet_partition`). Both return a :class:`fedproto.data.partition.Partition`; import
them from :mod:`fedproto.data.partition`, which re-exports them.
"""

from __future__ import annotations

import logging

import numpy as np

from fedproto.data.assignment import Partition, indices_by_class
from fedproto.errors import PartitionError, opt

log = logging.getLogger("fedproto.data.partition")


def natural_partition(
    train_groups: np.ndarray,
    test_groups: np.ndarray,
    train_y: np.ndarray,
    test_y: np.ndarray,
    num_clients: int,
    seed: int = 0,
    min_test: int = 1,
) -> Partition:
    """One client per writer (LEAF's natural FEMNIST split; not the paper's protocol, which pools
    FEMNIST and draws n-way k-shot tasks, §Experiments).

    Client i holds all train samples of its writer and all test samples of the same writer.
    Its ``classes`` are the classes of its train samples and ``shots`` their per-class counts
    (unequal, as written). A writer's test split may hold classes it never trained on (in the
    LEAF 5% sample, 412 of 1,677 test samples, 25%); those samples are **kept**: classifier accuracy
    counts them (the head still has all C outputs), while nearest-prototype accuracy restricted
    to own classes (``proto_classes="own"``) always misses them. Accuracy numbers on this
    partition are therefore per writer on that writer's whole test split.

    Args:
        train_groups: (N_train,) int writer index per train sample. test_groups: (N_test,) int
            writer index per test sample, same numbering (``Dataset.train_groups/test_groups``).
        train_y: (N_train,) labels. test_y: (N_test,) labels.
        num_clients: how many writers to use. Writers are eligible if they have >= 1 train and
            >= ``min_test`` test samples; if num_clients equals the eligible count all are used,
            else a seeded random subset. Clients are ordered by writer index.
        seed: selection seed. min_test: minimum test samples of an eligible writer.
    Returns:
        A :class:`Partition` with ``writers`` set (client i -> writer index).
    Raises:
        PartitionError: mismatched lengths, num_clients < 1, or more clients asked for than
            eligible writers exist (names the available count; no silent clipping, so a run
            never has fewer clients than configured).
    """
    train_groups = np.asarray(train_groups, dtype=np.int64)
    test_groups = np.asarray(test_groups, dtype=np.int64)
    train_y = np.asarray(train_y, dtype=np.int64)
    test_y = np.asarray(test_y, dtype=np.int64)
    if train_groups.shape != train_y.shape or test_groups.shape != test_y.shape:
        raise PartitionError(
            f"writer ids and labels differ in length (train {train_groups.shape} vs {train_y.shape}, "
            f"test {test_groups.shape} vs {test_y.shape})"
        )
    if num_clients < 1:
        raise PartitionError(f"clients must be >= 1 (got {num_clients})")
    W = int(max(train_groups.max(initial=-1), test_groups.max(initial=-1))) + 1
    n_train = np.bincount(train_groups, minlength=W)
    n_test = np.bincount(test_groups, minlength=W)
    eligible = np.flatnonzero((n_train >= 1) & (n_test >= min_test))
    if len(eligible) == 0:
        raise PartitionError(
            f"no writer is eligible for the natural partition ({W} writers in all; eligible: >= 1 train "
            f"and >= {min_test} test samples); check the dataset's files or use {opt('partition', 'fewshot')}")
    if num_clients > len(eligible):
        raise PartitionError(
            f"{opt('clients', num_clients)} but only {len(eligible)} writers are available for the natural "
            f"partition ({W} writers in all; eligible: >= 1 train and >= {min_test} test samples); "
            f"use {opt('clients', len(eligible))} or fewer"
        )
    if num_clients == len(eligible):
        chosen = eligible
    else:
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0x4E41]))
        chosen = np.sort(rng.choice(eligible, size=num_clients, replace=False))
    train_order = np.argsort(train_groups, kind="stable")
    test_order = np.argsort(test_groups, kind="stable")
    train_start = np.concatenate([[0], np.cumsum(n_train)])
    test_start = np.concatenate([[0], np.cumsum(n_test)])
    train_idx, test_idx, classes, shots = [], [], [], []
    unseen = 0
    for w in chosen:
        tr = np.sort(train_order[train_start[w] : train_start[w + 1]])
        te = np.sort(test_order[test_start[w] : test_start[w + 1]])
        cls, cnt = np.unique(train_y[tr], return_counts=True)
        unseen += int((~np.isin(test_y[te], cls)).sum())
        train_idx.append(tr.astype(np.int64))
        test_idx.append(te.astype(np.int64))
        classes.append(cls.astype(np.int64))
        shots.append(cnt.astype(np.int64))
    total_test = sum(len(t) for t in test_idx)
    if unseen:
        log.info("natural partition: %d of %d test samples are of classes their writer never "
                 "trained on (kept; see natural_partition)", unseen, total_test)
    return Partition(train_idx, test_idx, classes, shots, [int(w) for w in chosen])


def dirichlet_partition(
    train_y: np.ndarray,
    test_y: np.ndarray,
    num_classes: int,
    num_clients: int,
    alpha: float,
    min_samples: int = 10,
    test_shots: int = 40,
    seed: int = 0,
    max_tries: int = 100,
) -> Partition:
    """Dirichlet label skew (Hsu et al. 2019, arXiv 1909.06335; Yurochkin et al. 2019), the
    field's most used non-IID split; not the paper's protocol.

    For each class c, in order, proportions q_c ~ Dir(alpha, ..., alpha) over the m clients are
    drawn and c's shuffled training samples are cut at the cumulative proportions (client i gets
    floor(Q_i n_c) - floor(Q_{i-1} n_c) of them, Q the cumulative sums). Every training sample
    goes to exactly one client. If some client ends with fewer than ``min_samples`` training
    samples, all classes are drawn again (at most ``max_tries`` times). Small alpha (0.1): most
    clients hold one or two classes; large alpha (100): nearly IID.

    This matches Flower Datasets' ``DirichletPartitioner(num_partitions=m, alpha=alpha,
    min_partition_size=min_samples, self_balancing=False)`` in its semantics (per-class Dirichlet
    cuts, redraw until every partition is large enough); the draws differ (other generator),
    and we add per-client test sets. A client's classes are those it holds at least one training
    sample of; its test set holds ``test_shots`` x (its number of classes) samples of the test
    split, spread over its classes in proportion to its training counts (largest remainders,
    at least one per class, at most the test samples the class has), drawn per client without
    replacement (test sets of different clients may overlap).

    Args:
        train_y: (N_train,) labels. test_y: (N_test,) labels. num_classes: C.
        num_clients: m. alpha: concentration > 0. min_samples: least training samples per client.
        test_shots: test samples per own class on average. seed: partition seed.
        max_tries: redraws allowed to meet ``min_samples``.
    Returns:
        A :class:`Partition` (``shots`` holds the per-class training counts, aligned with
        ``classes``).
    Raises:
        PartitionError: alpha <= 0, fewer samples than clients x min_samples, or no draw that
            gives every client ``min_samples`` within ``max_tries`` (names the smallest client).
    """
    train_y = np.asarray(train_y, dtype=np.int64)
    test_y = np.asarray(test_y, dtype=np.int64)
    if not alpha > 0:
        raise PartitionError(f"alpha={alpha}: the Dirichlet concentration must be > 0 (0.1: strong skew, 100: ~IID)")
    if num_clients < 1 or min_samples < 0 or test_shots < 1:
        raise PartitionError(f"clients ({num_clients}) and test_shots ({test_shots}) must be >= 1, "
                             f"min_samples ({min_samples}) >= 0")
    if num_clients * min_samples > len(train_y):
        raise PartitionError(f"{num_clients} clients x min {min_samples} samples need {num_clients * min_samples} "
                             f"training samples, the train split has {len(train_y)}; lower the clients or the "
                             "minimum")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xD1A1]))
    by_class = indices_by_class(train_y, num_classes)
    smallest = (0, 0)
    for _ in range(max_tries):
        owner = np.empty(len(train_y), np.int64)
        for c in range(num_classes):
            idx = rng.permutation(by_class[c])
            q = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = np.floor(np.cumsum(q) * len(idx)).astype(np.int64)
            cuts[-1] = len(idx)
            owner[idx] = np.repeat(np.arange(num_clients), np.diff(np.concatenate([[0], cuts])))
        sizes = np.bincount(owner, minlength=num_clients)
        if sizes.min() >= min_samples:
            break
        smallest = (int(sizes.argmin()), int(sizes.min()))
    else:
        raise PartitionError(
            f"alpha={alpha} with {num_clients} clients: in {max_tries} draws some client always held fewer than "
            f"{min_samples} training samples (last: client {smallest[0]} with {smallest[1]}); raise alpha, lower "
            "the minimum, or use fewer clients")
    test_by_class = indices_by_class(test_y, num_classes)
    by_owner = indices_by_class(owner, num_clients)
    train_idx, test_idx, classes, shots = [], [], [], []
    for i in range(num_clients):
        tr = by_owner[i]
        cnt = np.bincount(train_y[tr], minlength=num_classes)
        cls = np.flatnonzero(cnt)
        total = test_shots * len(cls)
        share = cnt[cls] / cnt[cls].sum() * total
        want = np.maximum(np.floor(share).astype(np.int64), 1)  # at least one per own class
        for j in np.argsort(-(share - want), kind="stable")[: max(0, total - int(want.sum()))]:
            want[j] += 1  # largest remainders first; a class raised to its minimum has none
        parts = []
        for c, w in zip(cls, want):  # at most the class's test samples (a small test split, e.g. digits)
            parts.append(rng.choice(test_by_class[c], size=int(min(w, len(test_by_class[c]))), replace=False))
        train_idx.append(tr)
        test_idx.append(np.sort(np.concatenate(parts)).astype(np.int64) if parts else np.zeros(0, np.int64))
        classes.append(cls.astype(np.int64))
        shots.append(cnt[cls].astype(np.int64))
    return Partition(train_idx, test_idx, classes, shots)
