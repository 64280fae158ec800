"""Client partitions: the paper's n-way k-shot non-IID protocol (§Experiments).

Each of m clients gets n_i classes and k_i training samples ("shots") per class; n_i and k_i
scatter around ``ways`` and ``shots`` with spread ``stdev``. Training samples of different clients
are disjoint, unless ``overlap`` is on (see :func:`fewshot_partition`): then, where a class runs
short, clients share its samples (each client's own samples stay distinct). Each client's test
set holds ``test_shots`` samples of each of its own classes from the test split (official code,
MNIST: 40), drawn per client without replacement; test sets of different clients may overlap when
the test split is small (accuracy is per client, so this does not couple clients).

Noise models (:func:`noise_ranges` gives each range; s = 0 always means exactly n and k):
    ``uniform`` (official code, exps/federated_main.py, default): n_i uniform integer in
        [max(2, n - s), min(C - 1, n + s)]; k_i uniform integer in [k - s + 1, k + s - 2] for
        MNIST and [k - s + 1, k + s] otherwise. Each range is then widened to hold n (k) itself:
        n_i in [min(n, max(2, n - s)), max(n, min(C - 1, n + s))], k_i in [min(k, k - s + 1),
        max(k, k + s - 2 or k + s)]. So s = 0 gives exactly n and k (the official formulas give an
        empty shots range there and the official code raises; this code once fell back to
        k + 1 there), MNIST with s = 1 gives k, and every s >= 2 gives the official ranges unchanged.
    ``gaussian`` (the paper's wording): n_i = round(N(n, s)) clipped to [min(2, n), C], k_i =
        round(N(k, s)) clipped to [1, inf).

FEMNIST (62 classes) is pooled over writers for the few-shot protocol; the official shots range
for it is [k - s + 1, k + s] (as for CIFAR-10). :func:`natural_partition` is the alternative that
keeps LEAF's writer structure: one client per writer.

The natural and Dirichlet partitions live in :mod:`fedproto.data.natural_dirichlet` (re-exported
here).
"""

from __future__ import annotations

import logging
from typing import Literal

import numpy as np

from fedproto.data.assignment import Partition, indices_by_class
from fedproto.errors import PartitionError, opt

log = logging.getLogger(__name__)

NoiseModel = Literal["uniform", "gaussian"]


def noise_ranges(
    ways: int, shots: int, stdev: int, num_classes: int, noise: NoiseModel, dataset: str = ""
) -> tuple[tuple[int, int], tuple[int, float]]:
    """The closed ranges that n_i and k_i are drawn from (see the module docstring).

    Returns:
        ``((n_lo, n_hi), (k_lo, k_hi))``; ``k_hi`` is ``inf`` for gaussian noise. Both ranges hold
        ``ways`` and ``shots`` (for ways <= C), and with ``stdev == 0`` they are exactly those.
    Raises:
        ValueError: negative stdev or an unknown noise model.
    """
    if stdev < 0:
        raise ValueError(f"stdev={stdev} is negative; use stdev >= 0 (0: every client gets exactly ways and shots)")
    if noise == "uniform":
        n_lo = min(ways, max(2, ways - stdev))
        n_hi = max(ways, min(num_classes - 1, ways + stdev))
        k_lo = min(shots, shots - stdev + 1)
        k_hi = max(shots, shots + stdev - 2 if dataset == "mnist" else shots + stdev)
        return (n_lo, n_hi), (k_lo, k_hi)
    if noise == "gaussian":
        return (min(2, ways), num_classes), (1, float("inf"))
    raise ValueError(f"unknown noise model {noise!r}; choose 'uniform' or 'gaussian'")


def draw_ways_shots(
    num_clients: int,
    ways: int,
    shots: int,
    stdev: int,
    num_classes: int,
    noise: NoiseModel,
    rng: np.random.Generator,
    dataset: str = "",
) -> tuple[np.ndarray, np.ndarray]:
    """Draw n_i and k_i per client. Returns two (m,) int64 arrays within :func:`noise_ranges`.

    Raises:
        PartitionError: uniform noise whose shot range reaches below 1 (k - s + 1 < 1).
        ValueError: negative stdev or an unknown noise model.
    """
    (n_lo, n_hi), (k_lo, k_hi) = noise_ranges(ways, shots, stdev, num_classes, noise, dataset)
    if noise == "uniform":
        if k_lo < 1:
            raise PartitionError(
                f"{opt('shots', shots)} with {opt('stdev', stdev)}: the official code's uniform noise draws each "
                f"client's shots from [k - s + 1, ...] = [{k_lo}, ...], below 1 sample per class; "
                f"use {opt('shots', stdev)} or more, {opt('stdev', shots)} or less, or {opt('noise', 'gaussian')} "
                "(clipped at 1)")
        n = rng.integers(n_lo, n_hi + 1, size=num_clients)
        k = rng.integers(k_lo, int(k_hi) + 1, size=num_clients)
    else:
        n = np.clip(np.rint(rng.normal(ways, stdev, size=num_clients)), n_lo, n_hi)
        k = np.clip(np.rint(rng.normal(shots, stdev, size=num_clients)), k_lo, None)
    return n.astype(np.int64), k.astype(np.int64)


def _femnist_note(dataset: str) -> str:
    if dataset != "femnist":
        return ""
    return (
        ". Note: the FEMNIST copy read here may be a LEAF writer sample (e.g. LEAF's --sf 0.05: 14,640 "
        "train / 1,677 test samples; the 52 letter classes hold only ~53-142 train and 3-17 test "
        f"samples each), far from the paper's k=100 shots; with 20 clients about {opt('shots', 10)} and "
        f"{opt('test_shots', 3)} fit. Or use {opt('partition', 'natural')} (one client per writer)"
    )


def fewshot_partition(
    train_y: np.ndarray,
    test_y: np.ndarray,
    num_classes: int,
    num_clients: int,
    ways: int,
    shots: int,
    stdev: int = 0,
    test_shots: int = 40,
    noise: NoiseModel = "uniform",
    seed: int = 0,
    dataset: str = "",
    overlap: bool = False,
) -> Partition:
    """The paper's n-way k-shot non-IID partition (§Experiments; official sampling code).

    Args:
        train_y: (N_train,) labels of the train split. test_y: (N_test,) labels of the test split.
        num_classes: C. num_clients: m. ways: n. shots: k. stdev: spread s of n_i and k_i.
        test_shots: test samples per own class per client.
        noise: ``uniform`` (official code) or ``gaussian`` (paper). seed: partition seed.
        dataset: dataset name; selects the official shots range (MNIST differs).
        overlap: False (default): training samples of different clients are disjoint, and a class
            that cannot supply all its clients is an error. True: clients may share training
            samples. Each class's shuffled pool is still dealt out in turn; when it runs out it
            is reshuffled (seeded) and dealt again, so different clients may hold the same
            sample, while each client's own samples of a class stay distinct (a client wanting
            more samples of a class than the train split has is still an error). A partition
            that fits without sharing is the same with either value.
    Returns:
        A :class:`Partition`; the same arguments give the same partition.
    Raises:
        PartitionError: ways > C, or a class cannot supply the training samples the clients
            holding it ask for (names the class and the shortfall; with ``overlap``: one client
            asks for more samples of a class than the train split has), or too few test samples.
    """
    train_y = np.asarray(train_y)
    test_y = np.asarray(test_y)
    if ways > num_classes:
        raise PartitionError(
            f"ways={ways} is more than the {num_classes} classes of the dataset; use ways <= {num_classes}"
        )
    if ways < 1 or shots < 1 or num_clients < 1:
        raise PartitionError(f"ways, shots and clients must be >= 1 (got {ways}, {shots}, {num_clients})")
    for split, y in (("train", train_y), ("test", test_y)):
        if len(y) and (y.min() < 0 or y.max() >= num_classes):
            raise PartitionError(f"{split} labels hold {int(y.max() if y.max() >= num_classes else y.min())}, "
                                 f"outside 0..{num_classes - 1}; pass num_classes >= {int(y.max()) + 1}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x9A27]))
    n, k = draw_ways_shots(num_clients, ways, shots, stdev, num_classes, noise, rng, dataset)
    classes = [np.sort(rng.choice(num_classes, size=int(ni), replace=False)) for ni in n]

    train_avail = np.bincount(train_y, minlength=num_classes)
    test_avail = np.bincount(test_y, minlength=num_classes)
    need = np.zeros(num_classes, np.int64)
    holders = np.zeros(num_classes, np.int64)
    for c, ki in zip(classes, k):
        need[c] += ki
        holders[c] += 1
    short = np.nonzero(need > train_avail)[0]
    if overlap:  # classes may run short; only one client's own draw must fit
        k_max = np.zeros(num_classes, np.int64)
        for c, ki in zip(classes, k):
            k_max[c] = np.maximum(k_max[c], ki)
        over = np.nonzero(k_max > train_avail)[0]
        if len(over):
            j = int(over[0])
            held = np.nonzero(k_max)[0]
            fit = int(np.min(train_avail[held] - (k_max[held] - shots)))  # k_i - shots does not depend on shots
            raise PartitionError(
                f"class {j} has {train_avail[j]} training samples but a client asks for {k_max[j]} of it; with "
                f"{opt('overlap', True)} clients may share samples, but each client's own samples of a class are "
                f"distinct: " + (f"{opt('shots', fit)} is the largest that fits with this seed" if fit >= 1 else
                                 f"no {opt('shots')} value fits: lower {opt('stdev')}") + _femnist_note(dataset),
                short_class=j, needed=int(k_max[j]), available=int(train_avail[j]), short_classes=len(over),
                fitting_shots=max(fit, 0),
            )
        short = short[:0]
    if len(short):
        j = int(short[np.argmax((need - train_avail)[short])])
        # k_i - shots does not depend on ``shots`` (same random draws), so the largest shots that
        # fits these clients' classes is min_j floor((avail_j - sum offsets_j) / holders_j).
        held = np.nonzero(holders)[0]
        offsets = np.zeros(num_classes, np.int64)
        for c, ki in zip(classes, k):
            offsets[c] += ki - shots
        fit = int(np.min((train_avail[held] - offsets[held]) // holders[held]))
        hint = (f"with this seed and these clients, {opt('shots', fit)} is the largest that fits; or lower "
                f"{opt('clients')} or {opt('ways')}" if fit >= 1
                else f"no {opt('shots')} value fits: lower {opt('clients')} or {opt('ways')}")
        hint += f", or give {opt('overlap', True)} to let clients share training samples"
        raise PartitionError(
            f"class {j} runs short: {holders[j]} client{'s' if holders[j] != 1 else ''} x ~{shots} shots need "
            f"{need[j]} training samples but the train split has {train_avail[j]} (short by "
            f"{need[j] - train_avail[j]}); {len(short)} class(es) run short in all. The train split holds "
            f"{int(train_avail.min())}-{int(train_avail.max())} samples per class; {hint}{_femnist_note(dataset)}",
            short_class=j, needed=int(need[j]), available=int(train_avail[j]), short_classes=len(short),
            fitting_shots=max(fit, 0),
        )
    test_short = [int(j) for j in range(num_classes) if holders[j] and test_avail[j] < test_shots]
    if test_short:
        j = test_short[0]
        raise PartitionError(
            f"class {j} has {test_avail[j]} test samples but {opt('test_shots', test_shots)}; "
            f"lower {opt('test_shots')} to at most {int(test_avail[test_short].min())} (the test split holds "
            f"{int(test_avail.min())}-{int(test_avail.max())} samples per class){_femnist_note(dataset)}"
        )

    by_class = [rng.permutation(ix) for ix in indices_by_class(train_y, num_classes)]
    test_by_class = indices_by_class(test_y, num_classes)
    cursor = np.zeros(num_classes, np.int64)
    train_idx, test_idx, shots_out = [], [], []
    for c, ki in zip(classes, k):
        parts, tparts = [], []
        for j in c:
            if cursor[j] + ki <= len(by_class[j]):
                parts.append(by_class[j][cursor[j] : cursor[j] + ki])
                cursor[j] += ki
            else:  # overlap only (else checked above): the pool ran out; deal a reshuffled pool again
                tail = by_class[j][cursor[j] :]
                fresh = rng.permutation(by_class[j])
                # the tail's samples go last in the new pass, so this client's samples stay distinct
                fresh = np.concatenate([fresh[~np.isin(fresh, tail)], fresh[np.isin(fresh, tail)]])
                by_class[j] = fresh
                cursor[j] = ki - len(tail)
                parts.append(np.concatenate([tail, fresh[: cursor[j]]]))
            tparts.append(rng.choice(test_by_class[j], size=test_shots, replace=False))
        train_idx.append(np.sort(np.concatenate(parts)).astype(np.int64))
        test_idx.append(np.sort(np.concatenate(tparts)).astype(np.int64))
        shots_out.append(np.full(len(c), ki, np.int64))
    return Partition(train_idx, test_idx, [c.astype(np.int64) for c in classes], shots_out, overlap=overlap)


# the other two partitions (their own module; imported here so that fedproto.data.partition offers all three)
from fedproto.data.natural_dirichlet import dirichlet_partition, natural_partition  # noqa: E402

__all__ = ["Partition", "dirichlet_partition", "draw_ways_shots", "fewshot_partition", "natural_partition",
           "noise_ranges"]
