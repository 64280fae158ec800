"""A partition's result, :class:`Partition`: which train and test samples each client holds
(made by :mod:`fedproto.data.partition` and :mod:`fedproto.data.natural_dirichlet`; import it from
:mod:`fedproto.data.partition`, which re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Partition:
    """Per-client index sets into a dataset's train and test splits.

    Attributes:
        train_idx: per client (n_train_i,) int64 indices into the train split.
        test_idx: per client (n_test_i,) int64 indices into the test split.
        classes: per client sorted (n_i,) int64 class ids.
        shots: per client (n_i,) int64 training samples per class, aligned with ``classes``.
        writers: per client the writer (group) index it holds (:func:`fedproto.data.partition.natural_partition`);
            empty for partitions that pool writers.
        overlap: drawn with ``overlap=True`` (:func:`fedproto.data.partition.fewshot_partition`): different clients may
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


def indices_by_class(labels: np.ndarray, num_classes: int) -> list[np.ndarray]:
    """The sample indices of each label, in ascending order: ``[np.flatnonzero(labels == c) for c in
    range(num_classes)]``, from one stable sort instead of a pass over the samples per label.

    Args:
        labels: (N,) integer labels in ``0..num_classes-1`` (class ids, or the client of each sample).
        num_classes: the number of labels C.
    Returns:
        C int64 arrays; array ``c`` holds the indices ``i`` with ``labels[i] == c``, ascending.
    """
    labels = np.asarray(labels)
    order = np.argsort(labels, kind="stable").astype(np.int64, copy=False)
    return np.split(order, np.cumsum(np.bincount(labels, minlength=num_classes))[:-1])
