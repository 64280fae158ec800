"""Distances to prototypes: the regularizer L_R (eq. 7/8 and the official code's MSE),
nearest-prototype inference (eq. 4), the health of embeddings and λ's warm-up schedule.
Conventions: :mod:`fedproto.prototypes`."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

DistanceForm = Literal["mse", "squared_l2", "l2"]

LAMBDA_SCHEDULES: tuple[str, ...] = ("linear", "cosine")
DISTANCE_FORMS: tuple[str, ...] = ("mse", "squared_l2", "l2")


def proto_loss(
    h: torch.Tensor,
    y: torch.Tensor,
    table: torch.Tensor,
    mask: torch.Tensor,
    form: DistanceForm = "mse",
    weight: torch.Tensor | None = None,
    normalize: bool = False,
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
        normalize: L2-normalize the embeddings and the global prototypes first, so the distance
            measures direction only (practitioner's guide §4.3.3; not in the paper).
    Returns:
        (...) loss; zero where no sample is covered.
    """
    if weight is None:
        weight = torch.ones(y.shape, dtype=h.dtype, device=h.device)
    if normalize:
        h, table = F.normalize(h, dim=-1), F.normalize(table, dim=-1)
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
    h: torch.Tensor, table: torch.Tensor, allowed: torch.Tensor, normalize: bool = False
) -> torch.Tensor:
    """Prototype inference (eq. 4): argmin_j ||h - C_j||₂ over allowed classes.

    Distances are computed in float64 among the allowed classes only, so the prediction is always
    an allowed class, whatever the values: float32 distances of embeddings with norms above ~1e19
    overflow to ``inf`` for every class, and an argmin over all classes with the others masked to
    ``inf`` then returned class 0, which need not be allowed. Embeddings that are not
    finite still give an allowed class (the first allowed one with a NaN distance); callers detect
    and report them (:func:`embedding_health`).

    Args:
        h: (B, d). table: (C, d). allowed: (C,) bool (classes with a global prototype, restricted
            to the client's own classes by default; official code: others get a fixed distance).
        normalize: compare L2-normalized h and C_j (cosine), as training does with
            ``proto_normalize``.
    Returns:
        (B,) int64 predicted labels, each with ``allowed[label]`` True. If no class is allowed,
        returns -1 for every sample. A NaN distance (NaN embedding or prototype) counts as
        infinitely far.
    Raises:
        ValueError: shapes other than h (B, d), table (C, d), allowed (C,).
    """
    allowed = torch.as_tensor(allowed)
    if allowed.shape != (table.shape[0],) or h.ndim != 2 or table.ndim != 2 or h.shape[1] != table.shape[1]:
        raise ValueError(f"nearest_prototype needs h (B, d), table (C, d) and allowed (C,): got h "
                         f"{tuple(h.shape)}, table {tuple(table.shape)}, allowed {tuple(allowed.shape)}")
    cols = torch.nonzero(allowed.to(torch.bool)).flatten()
    if len(cols) == 0:
        return torch.full((h.shape[0],), -1, dtype=torch.long)
    h64, t64 = h.to(torch.float64), table[cols.to(table.device)].to(torch.float64)
    if normalize:
        h64, t64 = F.normalize(h64, dim=-1), F.normalize(t64, dim=-1)
    dist = torch.cdist(h64, t64.to(h64.device)).nan_to_num(nan=float("inf"))  # a NaN prototype never wins
    return cols.to(dist.device)[dist.argmin(1)] if dist.shape[0] else torch.zeros(0, dtype=torch.long)


def embedding_health(h: torch.Tensor, *scores: torch.Tensor) -> dict[str, float]:
    """Per-client health of evaluation outputs: the median L2 norm of the embeddings ``h`` (N, d)
    (``emb_norm``; NaN for N = 0) and ``nonfinite`` (1.0 if any value of ``h`` or of the score
    tensors, e.g. (N, C) logits, is NaN or infinite, else 0.0). The engine warns, naming the
    client, when ``nonfinite`` is set or ``emb_norm`` exceeds
    :data:`fedproto.training.EMBED_NORM_LIMIT`; both are columns of ``clients.csv``."""
    if h.ndim != 2:
        raise ValueError(f"embedding_health needs embeddings of shape (N, d), got {tuple(h.shape)}")
    bad = any(bool((~torch.isfinite(t)).any()) for t in (h, *scores) if t.numel())
    norms = h.to(torch.float64).norm(dim=-1) if h.numel() else h.new_zeros(0)
    med = float(norms.nan_to_num(nan=float("inf")).median()) if len(norms) else float("nan")
    return {"emb_norm": med, "nonfinite": float(bad)}


def lambda_at(round: int, lambda_proto: float, warmup: int, schedule: str = "linear") -> float:
    """λ of round ``round`` (1-based) under a warm-up of ``warmup`` rounds (practitioner's guide
    §4.3.1: a small λ while prototypes are poor, then the full value). With t = min(1, (round - 1)
    / warmup): ``linear`` gives λ · t, ``cosine`` gives λ · (1 - cos(π t)) / 2 (slow start and
    finish, the same end points); ``warmup`` 0 gives λ every round. Round 1 has no global
    prototypes anyway, so round 2 starts at λ / warmup (linear) and round warmup + 1 reaches λ.

    Raises:
        ValueError: an unknown ``schedule``.
    """
    if schedule not in LAMBDA_SCHEDULES:
        raise ValueError(f"lambda schedule {schedule!r}: choose one of {', '.join(LAMBDA_SCHEDULES)}")
    if warmup <= 0:
        return float(lambda_proto)
    t = min(1.0, max(0, round - 1) / warmup)
    if schedule == "cosine":
        t = (1.0 - float(np.cos(np.pi * t))) / 2.0
    return float(lambda_proto) * t
