"""Client partitions: the paper's n-way k-shot non-IID protocol (§Experiments).

Each of m clients gets n_i classes and k_i training samples ("shots") per class; n_i and k_i
scatter around ``ways`` and ``shots`` with spread ``stdev``. Training samples of different clients
are disjoint. Each client's test set holds ``test_shots`` samples of each of its own classes from
the test split (official code, MNIST: 40), drawn per client without replacement; test sets of
different clients may overlap when the test split is small (accuracy is per client, so this does
not couple clients).

Noise models:
    ``uniform`` (official code, exps/federated_main.py, default): n_i uniform integer in
        [max(2, n - s), min(C - 1, n + s)]; k_i uniform integer in [k - s + 1, k + s - 2] for
        MNIST and [k - s + 1, k + s] otherwise (a range that comes out empty collapses to its
        lower end, k - s + 1, where the official code raises).
    ``gaussian`` (the paper's wording): n_i = round(N(n, s)) clipped to [2, C], k_i =
        round(N(k, s)) clipped to [1, inf).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from fedproto.errors import PartitionError

NoiseModel = Literal["uniform", "gaussian"]


@dataclass
class Partition:
    """Per-client index sets into a dataset's train and test splits.

    Attributes:
        train_idx: per client (n_train_i,) int64 indices into the train split.
        test_idx: per client (n_test_i,) int64 indices into the test split.
        classes: per client sorted (n_i,) int64 class ids.
        shots: per client (n_i,) int64 training samples per class, aligned with ``classes``.
    """

    train_idx: list[np.ndarray]
    test_idx: list[np.ndarray]
    classes: list[np.ndarray]
    shots: list[np.ndarray] = field(default_factory=list)

    @property
    def num_clients(self) -> int:
        return len(self.train_idx)

    def summary(self) -> dict:
        """Counts for logs and the run directory (ways and samples per client)."""
        ways = [len(c) for c in self.classes]
        n = [len(t) for t in self.train_idx]
        return {
            "clients": self.num_clients,
            "ways_mean": float(np.mean(ways)),
            "ways_min": int(min(ways)),
            "ways_max": int(max(ways)),
            "train_samples_mean": float(np.mean(n)),
            "train_samples_total": int(sum(n)),
            "test_samples_total": int(sum(len(t) for t in self.test_idx)),
        }


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
    """Draw n_i and k_i per client. Returns two (m,) int64 arrays. See the module docstring."""
    if noise == "uniform":
        lo, hi = max(2, ways - stdev), min(num_classes - 1, ways + stdev)
        lo, hi = min(lo, ways), max(min(hi, num_classes), ways)
        n = rng.integers(lo, hi + 1, size=num_clients)
        klo = shots - stdev + 1
        khi = shots + stdev - 2 if dataset == "mnist" else shots + stdev
        khi = max(khi, klo)
        k = rng.integers(klo, khi + 1, size=num_clients)
    elif noise == "gaussian":
        n = np.clip(np.rint(rng.normal(ways, stdev, size=num_clients)), min(2, ways), num_classes)
        k = np.clip(np.rint(rng.normal(shots, stdev, size=num_clients)), 1, None)
    else:
        raise ValueError(f"unknown noise model {noise!r}; choose 'uniform' or 'gaussian'")
    return n.astype(np.int64), k.astype(np.int64)


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
) -> Partition:
    """The paper's n-way k-shot non-IID partition (§Experiments; official sampling code).

    Args:
        train_y: (N_train,) labels of the train split. test_y: (N_test,) labels of the test split.
        num_classes: C. num_clients: m. ways: n. shots: k. stdev: spread s of n_i and k_i.
        test_shots: test samples per own class per client.
        noise: ``uniform`` (official code) or ``gaussian`` (paper). seed: partition seed.
        dataset: dataset name; selects the official shots range (MNIST differs).
    Returns:
        A :class:`Partition`; the same arguments give the same partition.
    Raises:
        PartitionError: ways > C, or a class cannot supply the training samples the clients
            holding it ask for (names the class and the shortfall), or too few test samples.
    """
    train_y = np.asarray(train_y)
    test_y = np.asarray(test_y)
    if ways > num_classes:
        raise PartitionError(
            f"ways={ways} is more than the {num_classes} classes of the dataset; use ways <= {num_classes}"
        )
    if ways < 1 or shots < 1 or num_clients < 1:
        raise PartitionError(f"ways, shots and clients must be >= 1 (got {ways}, {shots}, {num_clients})")
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
    if len(short):
        j = int(short[np.argmax((need - train_avail)[short])])
        raise PartitionError(
            f"class {j} runs short: {holders[j]} clients x ~{shots} shots need {need[j]} training "
            f"samples but the train split has {train_avail[j]} (short by {need[j] - train_avail[j]}); "
            f"{len(short)} class(es) run short in all. Lower --shots, --clients or --ways "
            f"(capacity is about {int(train_avail.min())} samples per class)"
        )
    test_short = [int(j) for j in range(num_classes) if holders[j] and test_avail[j] < test_shots]
    if test_short:
        j = test_short[0]
        raise PartitionError(
            f"class {j} has {test_avail[j]} test samples but test_shots={test_shots}; "
            f"lower --test-shots to at most {int(test_avail[test_short].min())}"
        )

    by_class = [np.flatnonzero(train_y == j) for j in range(num_classes)]
    by_class = [rng.permutation(ix) for ix in by_class]
    test_by_class = [np.flatnonzero(test_y == j) for j in range(num_classes)]
    cursor = np.zeros(num_classes, np.int64)
    train_idx, test_idx, shots_out = [], [], []
    for c, ki in zip(classes, k):
        parts, tparts = [], []
        for j in c:
            parts.append(by_class[j][cursor[j] : cursor[j] + ki])
            cursor[j] += ki
            tparts.append(rng.choice(test_by_class[j], size=test_shots, replace=False))
        train_idx.append(np.sort(np.concatenate(parts)).astype(np.int64))
        test_idx.append(np.sort(np.concatenate(tparts)).astype(np.int64))
        shots_out.append(np.full(len(c), ki, np.int64))
    return Partition(train_idx, test_idx, [c.astype(np.int64) for c in classes], shots_out)
