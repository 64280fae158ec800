"""The prototypes themselves: per-class sums, local prototypes (eq. 3), the server's aggregation
(eq. 6) and momentum, and the dense (C, d) table with its mask. Conventions: :mod:`fedproto.prototypes`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

AggregationRule = Literal["mean", "weighted", "median", "trimmed"]

AGGREGATION_RULES: tuple[str, ...] = ("mean", "weighted", "median", "trimmed")


def class_sums(h: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class sums and counts of embeddings.

    Args:
        h: (N, d) embeddings. y: (N,) int64 labels in [0, num_classes).
    Returns:
        sums (num_classes, d) in h's dtype, counts (num_classes,) int64.
    """
    sums = torch.zeros(num_classes, h.shape[-1], dtype=h.dtype, device=h.device)
    sums.index_add_(0, y, h)
    counts = torch.bincount(y, minlength=num_classes)
    return sums, counts


def local_prototypes(
    sums: torch.Tensor, counts: torch.Tensor
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Local prototypes (eq. 3) from per-class sums, for the classes present only.

    Args:
        sums: (C, d), counts: (C,).
    Returns:
        classes (K,) int64, protos (K, d) float32, counts (K,) int64 for the K classes with count > 0.
    """
    present = torch.nonzero(counts > 0).flatten()
    protos = sums[present] / counts[present].unsqueeze(1).to(sums.dtype)
    return (
        present.cpu().numpy().astype(np.int64),
        protos.detach().cpu().numpy().astype(np.float32),
        counts[present].cpu().numpy().astype(np.int64),
    )


def aggregate_prototypes(
    classes: Sequence[np.ndarray],
    protos: Sequence[np.ndarray],
    counts: Sequence[np.ndarray],
    num_classes: int,
    rule: AggregationRule = "mean",
    trim: float = 0.2,
    min_contributors: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Server aggregation of local prototypes into global prototypes, per class.

    Only clients that hold class j contribute to it (the set N_j of eq. 6); a class that no
    client holds gets no global prototype.

    Rules:
        ``mean``: unweighted mean over N_j (official code: lib/utils.py, ``proto_aggregation``).
        ``weighted``: sum_i |D_ij| / N_j * C_i^(j), the convex form of eq. 6. The literal eq. 6
            also divides by |N_j|; the weights already sum to one, so that extra factor shrinks
            every global prototype toward zero by the number of contributors (Pitfalls), and it
            is not offered.
        ``median``: coordinate-wise median over N_j (robust aggregation, practitioner's guide).
        ``trimmed``: coordinate-wise trimmed mean over N_j (:func:`scipy.stats.trim_mean`): per
            coordinate, the ``int(trim * |N_j|)`` largest and as many smallest values are cut and
            the rest averaged; with ``trim * |N_j| < 1`` nothing is cut (a plain mean). Robust
            against fewer than ``int(trim * |N_j|)`` bad clients per class (practitioner's guide §4.2).

    Args:
        classes: per client (K_i,) int class ids. protos: per client (K_i, d). counts: per client (K_i,).
        num_classes: C.
        trim: the fraction cut from each end for ``trimmed``, in [0, 0.5).
        min_contributors: a class held by fewer clients gets no global prototype from this call
            (the caller may keep an earlier one); 1 keeps every class.
    Returns:
        global classes (K,) int64 sorted, global protos (K, d) float32, contributors (K,) int64
        (number of clients that held each class).
    Raises:
        ValueError: unknown rule, ``trim`` outside [0, 0.5), ``min_contributors`` < 1,
            inconsistent shapes, or a class id outside 0..C-1.
    """
    if rule not in AGGREGATION_RULES:
        raise ValueError(f"unknown aggregation rule {rule!r}; choose one of {AGGREGATION_RULES}")
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim={trim} is outside [0, 0.5): it is the fraction cut from each end")
    if min_contributors < 1:
        raise ValueError(f"min_contributors={min_contributors}: use 1 or more")
    if not protos:
        return np.zeros(0, np.int64), np.zeros((0, 0), np.float32), np.zeros(0, np.int64)
    cls = np.concatenate([np.asarray(c, np.int64) for c in classes])
    P = np.concatenate([np.asarray(p, np.float64) for p in protos], axis=0)
    n = np.concatenate([np.asarray(c, np.float64) for c in counts])
    if not (len(cls) == len(P) == len(n)):
        raise ValueError("classes, protos and counts must have matching lengths per client")
    if len(cls) and (cls.min() < 0 or cls.max() >= num_classes):
        bad = int(cls.max() if cls.max() >= num_classes else cls.min())
        raise ValueError(f"class id {bad} is outside 0..{num_classes - 1} (num_classes={num_classes})")
    d = P.shape[1]
    contributors = np.bincount(cls, minlength=num_classes)
    present = np.nonzero(contributors >= min_contributors)[0]
    if rule in ("median", "trimmed"):
        from scipy.stats import trim_mean

        one = (lambda v: np.median(v, axis=0)) if rule == "median" else (lambda v: trim_mean(v, trim, axis=0))
        out = np.stack([one(P[cls == j]) for j in present]) if len(present) else np.zeros((0, d))
    else:
        w = n if rule == "weighted" else np.ones_like(n)
        acc = np.zeros((num_classes, d))
        np.add.at(acc, cls, P * w[:, None])
        wsum = np.bincount(cls, weights=w, minlength=num_classes)
        out = acc[present] / wsum[present, None]
    return present.astype(np.int64), out.astype(np.float32), contributors[present].astype(np.int64)


def prototype_table(
    classes: np.ndarray, protos: np.ndarray, num_classes: int, dim: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense (C, d) tensor and (C,) bool mask from a sparse (classes, protos) pair."""
    table = torch.zeros(num_classes, dim, dtype=dtype)
    mask = torch.zeros(num_classes, dtype=torch.bool)
    if len(classes):
        idx = torch.as_tensor(np.asarray(classes), dtype=torch.long)
        table[idx] = torch.as_tensor(np.asarray(protos), dtype=dtype)
        mask[idx] = True
    return table, mask


def momentum_prototypes(
    old_classes: np.ndarray, old_protos: np.ndarray, classes: np.ndarray, protos: np.ndarray, beta: float
) -> tuple[np.ndarray, np.ndarray]:
    """Prototype momentum on the server: C_j <- beta * C_j(previous) + (1 - beta) * C_j(this round)
    (practitioner's guide §4.3.2; not in the paper). A class new this round takes its aggregate;
    a class without contributors this round keeps its previous prototype.

    Args:
        old_classes: (K0,) int64 sorted; old_protos: (K0, d). classes: (K,) sorted; protos: (K, d).
        beta: in [0, 1); 0 takes this round's aggregate for every class it has (and still keeps
            the previous prototype of a class without contributors: FedProto's rule under client
            sampling, where a round's sampled clients may hold only some classes).
    Returns:
        classes (K',) int64 sorted (the union), protos (K', d) float32.
    Raises:
        ValueError: beta outside [0, 1) or prototype sizes that differ.
    """
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"prototype momentum {beta} is outside [0, 1)")
    if len(old_classes) == 0:
        return np.asarray(classes, np.int64), np.asarray(protos, np.float32)
    if old_protos.shape[1] != protos.shape[1] and len(classes):
        raise ValueError(f"prototype size changed from {old_protos.shape[1]} to {protos.shape[1]}")
    old = dict(zip(np.asarray(old_classes).tolist(), np.asarray(old_protos, np.float64)))
    new = dict(zip(np.asarray(classes).tolist(), np.asarray(protos, np.float64)))
    keys = sorted(set(old) | set(new))
    out = [beta * old[k] + (1 - beta) * new[k] if k in old and k in new else (new[k] if k in new else old[k])
           for k in keys]
    return np.asarray(keys, np.int64), np.stack(out).astype(np.float32)
