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

Size: about 470 lines: the three partitions (few-shot with both noise forms and overlap, natural,
Dirichlet) and their shared checks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from fedproto.errors import PartitionError, opt

log = logging.getLogger(__name__)

NoiseModel = Literal["uniform", "gaussian"]


@dataclass
class Partition:
    """Per-client index sets into a dataset's train and test splits.

    Attributes:
        train_idx: per client (n_train_i,) int64 indices into the train split.
        test_idx: per client (n_test_i,) int64 indices into the test split.
        classes: per client sorted (n_i,) int64 class ids.
        shots: per client (n_i,) int64 training samples per class, aligned with ``classes``.
        writers: per client the writer (group) index it holds (:func:`natural_partition`);
            empty for partitions that pool writers.
        overlap: drawn with ``overlap=True`` (:func:`fewshot_partition`): different clients may
            hold the same training sample.
    """

    train_idx: list[np.ndarray]
    test_idx: list[np.ndarray]
    classes: list[np.ndarray]
    shots: list[np.ndarray] = field(default_factory=list)
    writers: list[int] = field(default_factory=list)
    overlap: bool = False

    @property
    def num_clients(self) -> int:
        return len(self.train_idx)

    def summary(self) -> dict:
        """Counts for logs and the run directory (ways and samples per client)."""
        ways = [len(c) for c in self.classes]
        n = [len(t) for t in self.train_idx]
        out = {
            "clients": self.num_clients,
            "ways_mean": float(np.mean(ways)),
            "ways_min": int(min(ways)),
            "ways_max": int(max(ways)),
            "train_samples_mean": float(np.mean(n)),
            "train_samples_total": int(sum(n)),
            "test_samples_total": int(sum(len(t) for t in self.test_idx)),
        }
        if self.writers:
            out["writers"] = [int(w) for w in self.writers]
        if self.overlap:
            # drawn with overlap: say whether clients do share samples, and how many distinct ones they hold
            distinct = len(np.unique(np.concatenate(self.train_idx))) if self.train_idx else 0
            out["overlap"] = True
            out["train_samples_distinct"] = int(distinct)
            out["train_samples_shared"] = bool(distinct < out["train_samples_total"])
        return out


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

    by_class = [np.flatnonzero(train_y == j) for j in range(num_classes)]
    by_class = [rng.permutation(ix) for ix in by_class]
    test_by_class = [np.flatnonzero(test_y == j) for j in range(num_classes)]
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
    by_class = [np.flatnonzero(train_y == c) for c in range(num_classes)]
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
    test_by_class = [np.flatnonzero(test_y == c) for c in range(num_classes)]
    train_idx, test_idx, classes, shots = [], [], [], []
    for i in range(num_clients):
        tr = np.flatnonzero(owner == i)
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
