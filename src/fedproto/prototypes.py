"""The FedProto math: class means (eq. 3), aggregation (eq. 6), distances (eq. 7/8), and
nearest-prototype inference (eq. 4). Pure tensor/array functions, no state.

Conventions: ``d`` is the embedding size, ``C`` the number of classes of the dataset, a
prototype table is ``(C, d)`` float with a boolean ``(C,)`` mask of which rows exist. Absent
classes are never filled with zeros and averaged in: they are masked out everywhere.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np
import torch

AggregationRule = Literal["mean", "weighted", "median"]
DistanceForm = Literal["mse", "squared_l2", "l2"]

AGGREGATION_RULES: tuple[str, ...] = ("mean", "weighted", "median")
DISTANCE_FORMS: tuple[str, ...] = ("mse", "squared_l2", "l2")


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

    Args:
        classes: per client (K_i,) int class ids. protos: per client (K_i, d). counts: per client (K_i,).
        num_classes: C.
    Returns:
        global classes (K,) int64 sorted, global protos (K, d) float32, contributors (K,) int64
        (number of clients that held each class).
    Raises:
        ValueError: unknown rule, inconsistent shapes, or a class id outside 0..C-1.
    """
    if rule not in AGGREGATION_RULES:
        raise ValueError(f"unknown aggregation rule {rule!r}; choose one of {AGGREGATION_RULES}")
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
    present = np.nonzero(contributors)[0]
    if rule == "median":
        out = np.stack([np.median(P[cls == j], axis=0) for j in present]) if len(present) else np.zeros((0, d))
    else:
        w = n if rule == "weighted" else np.ones_like(n)
        acc = np.zeros((num_classes, d))
        np.add.at(acc, cls, P * w[:, None])
        wsum = np.bincount(cls, weights=w, minlength=num_classes)
        out = acc[present] / wsum[present, None]
    return present.astype(np.int64), out.astype(np.float32), contributors[present].astype(np.int64)


def prototype_table(
    classes: np.ndarray, protos: np.ndarray, num_classes: int, dim: int, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense (C, d) tensor and (C,) bool mask from a sparse (classes, protos) pair."""
    table = torch.zeros(num_classes, dim, dtype=dtype)
    mask = torch.zeros(num_classes, dtype=torch.bool)
    if len(classes):
        idx = torch.as_tensor(np.asarray(classes), dtype=torch.long)
        table[idx] = torch.as_tensor(np.asarray(protos), dtype=dtype)
        mask[idx] = True
    return table, mask


def proto_loss(
    h: torch.Tensor,
    y: torch.Tensor,
    table: torch.Tensor,
    mask: torch.Tensor,
    form: DistanceForm = "mse",
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The regularizer L_R between embeddings and global prototypes, per client.

    Leading dimensions ``...`` (e.g. clients G in the batched engine) are kept.

    Forms:
        ``mse``: sum over covered samples of ||h_b - C̄_{y_b}||² / (B * d): the official code's
            ``MSELoss`` against a target that equals the embedding itself where the class has no
            global prototype (lib/update.py), so uncovered samples count in the denominator.
        ``squared_l2``: the same per-sample squared L2 distance, averaged over the batch only
            (appendix B, λ||f(x) - C̄||²).
        ``l2``: sum over classes j in the batch with a global prototype of ||mean_j(h) - C̄_j||₂,
            the main text's L2 distance between local and global prototypes (eq. 7/8), with the
            local prototype estimated on the batch.

    Args:
        h: (..., B, d) embeddings. y: (..., B) labels. table: (C, d) global prototypes.
        mask: (C,) bool, which rows of ``table`` exist. weight: (..., B) 0/1 sample validity
            (padding in the batched engine); None means all valid.
    Returns:
        (...) loss; zero where no sample is covered.
    """
    if weight is None:
        weight = torch.ones(y.shape, dtype=h.dtype, device=h.device)
    if form in ("mse", "squared_l2"):
        covered = mask[y].to(h.dtype) * weight
        sq = ((h - table[y]) ** 2).sum(-1)
        total = (sq * covered).sum(-1)
        denom = weight.sum(-1).clamp_min(1.0)
        if form == "mse":
            denom = denom * h.shape[-1]
        return total / denom
    if form == "l2":
        C = table.shape[0]
        onehot = torch.nn.functional.one_hot(y, C).to(h.dtype) * weight.unsqueeze(-1)  # (..., B, C)
        counts = onehot.sum(-2)  # (..., C)
        sums = onehot.transpose(-1, -2) @ h  # (..., C, d)
        means = sums / counts.clamp_min(1.0).unsqueeze(-1)
        dist = torch.sqrt(((means - table) ** 2).sum(-1) + 1e-12)
        use = (counts > 0) & mask
        return (dist * use.to(h.dtype)).sum(-1)
    raise ValueError(f"unknown distance form {form!r}; choose one of {DISTANCE_FORMS}")


def nearest_prototype(
    h: torch.Tensor, table: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """Prototype inference (eq. 4): argmin_j ||h - C_j||₂ over allowed classes.

    Args:
        h: (B, d). table: (C, d). allowed: (C,) bool (classes with a global prototype, restricted
            to the client's own classes by default; official code: others get a fixed distance).
    Returns:
        (B,) int64 predicted labels. If no class is allowed, returns -1 for every sample.
    """
    if not bool(allowed.any()):
        return torch.full((h.shape[0],), -1, dtype=torch.long)
    dist = torch.cdist(h, table.to(h.dtype))
    dist = dist.masked_fill(~allowed.unsqueeze(0), float("inf"))
    return dist.argmin(1)
