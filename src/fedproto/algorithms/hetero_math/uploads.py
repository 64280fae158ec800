"""What the heterogeneous methods share: stacking the clients' sparse per-class uploads and the
per-class average over clients (:func:`class_centers`), used by FedTGP's cluster centers and FD's
global logits. Conventions and sources: :mod:`fedproto.algorithms.hetero_math`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FD_RULES: tuple[str, ...] = ("mean", "weighted")


def _stack_uploads(
    classes: Sequence[np.ndarray], values: Sequence[np.ndarray], num_classes: int, what: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Concatenate per-client sparse uploads: (n,) class ids, (n, k) rows, (n,) client index.

    Raises:
        ValueError: a different number of clients in ``classes`` and ``values``, rows that do not
            match their class ids, rows of different sizes, or a class id outside 0..C-1.
    """
    if len(classes) != len(values):
        raise ValueError(f"{what}: {len(classes)} clients' class ids but {len(values)} clients' rows")
    cls, rows, owner = [], [], []
    for i, (c, v) in enumerate(zip(classes, values)):
        c = np.asarray(c, np.int64).reshape(-1)
        v = np.asarray(v)
        if v.ndim != 2 or v.shape[0] != len(c):
            raise ValueError(f"{what}: client {i} sends {len(c)} class ids with rows of shape {v.shape}; "
                             f"give one row per class id, shape ({len(c)}, k)")
        cls.append(c)
        rows.append(v)
        owner.append(np.full(len(c), i, np.int64))
    if not cls:
        return np.zeros(0, np.int64), np.zeros((0, 0)), np.zeros(0, np.int64)
    widths = sorted({r.shape[1] for r in rows if len(r)})
    if len(widths) > 1:
        raise ValueError(f"{what}: clients send rows of sizes {widths}; every client must use one size")
    c = np.concatenate(cls)
    if len(c) and (c.min() < 0 or c.max() >= num_classes):
        bad = int(c.max() if c.max() >= num_classes else c.min())
        raise ValueError(f"{what}: class id {bad} is outside 0..{num_classes - 1} (num_classes={num_classes})")
    dtype = np.result_type(*[r.dtype for r in rows])
    width = widths[0] if widths else 0
    out = np.concatenate([r.reshape(len(r), width) for r in rows]).astype(dtype, copy=False)
    return c, out, np.concatenate(owner)


def check_server_training(epochs: int, lr: float, batch_size: int) -> None:
    """The checks of a server-side training loop's settings (FedTGP's generator, FedGH's head).

    Raises:
        ValueError: ``epochs`` < 0, ``lr`` not above 0, ``batch_size`` < 1 (naming the value).
    """
    if epochs < 0:
        raise ValueError(f"server epochs {epochs}: give 0 or more")
    if not lr > 0:
        raise ValueError(f"server lr {lr}: give a positive step size")
    if batch_size < 1:
        raise ValueError(f"server batch size {batch_size}: give 1 or more")


def class_centers(
    classes: Sequence[np.ndarray],
    values: Sequence[np.ndarray],
    counts: Sequence[np.ndarray] | None,
    num_classes: int,
    rule: str = "mean",
    leave_out: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-class average over clients of sparse per-class rows (prototypes or mean logits).

    ``mean``: (1/|N_j|) sum_{i in N_j} v_i^j over the clients N_j that sent class j (FedTGP's
    cluster centers Q^j; FD's global-average logits; PFLlib's ``proto_cluster`` /
    ``logit_aggregation``: unweighted). ``weighted``: sum_i n_ij v_i^j / sum_i n_ij with the
    sample counts n_ij. With ``leave_out = i`` client i's rows are left out (FD's paper: each
    device distils toward the average of the *other* devices, alg. 1 of arXiv 1811.11479).

    Args:
        classes: per client (K_i,) int class ids. values: per client (K_i, k) rows.
        counts: per client (K_i,) sample counts; needed for ``weighted`` only (None otherwise).
        num_classes: C. rule: ``mean`` or ``weighted``. leave_out: a client index to leave out, or None.
    Returns:
        classes (K,) int64 sorted (the classes at least one counted client sent), centers (K, k)
        in the rows' dtype, contributors (K,) int64.
    Raises:
        ValueError: an unknown rule, ``weighted`` without counts, counts that do not match the
            class ids or are negative, and the shape errors of the uploads.
    """
    if rule not in FD_RULES:
        raise ValueError(f"unknown averaging rule {rule!r}; choose one of {FD_RULES}")
    cls, rows, owner = _stack_uploads(classes, values, num_classes, "class_centers")
    if rule == "weighted":
        if counts is None:
            raise ValueError("rule='weighted' needs the per-class sample counts; pass counts or use rule='mean'")
        n = np.concatenate([np.asarray(c, np.float64).reshape(-1) for c in counts]) if len(counts) else np.zeros(0)
        if n.shape != cls.shape:
            raise ValueError(f"counts give {n.shape[0]} numbers for {cls.shape[0]} class rows; give one per row")
        if (n < 0).any():
            raise ValueError(f"negative sample count {n.min()}: counts are numbers of samples")
    else:
        n = np.ones(len(cls))
    keep = owner != leave_out if leave_out is not None else np.ones(len(cls), bool)
    cls, rows, n = cls[keep], rows[keep], n[keep]
    dtype = rows.dtype if rows.dtype.kind == "f" else np.float64
    width = rows.shape[1] if rows.ndim == 2 else 0
    acc = np.zeros((num_classes, width), np.float64)
    np.add.at(acc, cls, rows.astype(np.float64) * n[:, None])
    wsum = np.bincount(cls, weights=n, minlength=num_classes)
    contributors = np.bincount(cls, minlength=num_classes)
    present = np.nonzero((contributors > 0) & (wsum > 0))[0]
    out = acc[present] / wsum[present, None]
    return present.astype(np.int64), out.astype(dtype), contributors[present].astype(np.int64)
