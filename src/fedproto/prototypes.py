"""The FedProto math: class means (eq. 3), aggregation (eq. 6), distances (eq. 7/8), and
nearest-prototype inference (eq. 4). Pure tensor/array functions, no state.

Conventions: ``d`` is the embedding size, ``C`` the number of classes of the dataset, a
prototype table is ``(C, d)`` float with a boolean ``(C,)`` mask of which rows exist. Absent
classes are never filled with zeros and averaged in: they are masked out everywhere.

Size: about 420 lines of pure functions, the FedProto math (pure functions;
docs/architecture.md), most of it docstrings with the equations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

AggregationRule = Literal["mean", "weighted", "median", "trimmed"]
DistanceForm = Literal["mse", "squared_l2", "l2"]

AGGREGATION_RULES: tuple[str, ...] = ("mean", "weighted", "median", "trimmed")
LAMBDA_SCHEDULES: tuple[str, ...] = ("linear", "cosine")
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
    out = [beta * old[k] + (1 - beta) * new[k] if k in old and k in new else new.get(k, old.get(k)) for k in keys]
    return np.asarray(keys, np.int64), np.stack(out).astype(np.float32)


def client_distances(
    classes: Sequence[np.ndarray], protos: Sequence[np.ndarray], global_classes: np.ndarray,
    global_protos: np.ndarray,
) -> np.ndarray:
    """Monitoring (practitioner's guide §4.3.5): per client, the mean L2 distance between its
    local prototypes and the global prototypes of the same classes.

    Args:
        classes: per client, the (K_i,) classes of its local prototypes.
        protos: per client, the (K_i, d) local prototypes.
        global_classes: (K,) classes of the global prototypes.
        global_protos: (K, d) global prototypes.

    Returns:
        (m,) float64, nan for a client none of whose classes has a global prototype.
    """
    index = {int(c): i for i, c in enumerate(np.asarray(global_classes).tolist())}
    out = np.full(len(protos), np.nan)
    for i, (c, p) in enumerate(zip(classes, protos)):
        rows = [(k, index[int(j)]) for k, j in enumerate(np.asarray(c).tolist()) if int(j) in index]
        if rows:
            a = np.asarray(p, np.float64)[[k for k, _ in rows]]
            b = np.asarray(global_protos, np.float64)[[g for _, g in rows]]
            out[i] = float(np.linalg.norm(a - b, axis=1).mean())
    return out


def class_check(
    classes: Sequence[np.ndarray], protos: Sequence[np.ndarray], ref_classes: np.ndarray, ref_protos: np.ndarray,
    z: float = 3.0,
) -> tuple[list[np.ndarray], bool]:
    """Per-class plausibility of local prototypes against reference prototypes R (the global
    prototypes the clients trained toward). The prototype p that a client sends for class c is
    flagged when

    * (nearer) another class's reference is nearer to it than its own: ``min_{j != c} ||p - R_j|| <
      ||p - R_c||``: a prototype sent under the wrong class id (``attack="flip"``); or
    * (farther) its log distance to its own reference ``log ||p - R_c||`` has a robust z-score above
      ``z``: (x - median) / max(MAD, ``DISTANCE_FLOOR`` = 0.1), the MAD scaled to a normal standard
      deviation, over all the rows judged, every class pooled: scaled or random vectors. Log
      distances make the test one of ratios (a row 3x as far as the typical one is as odd in a
      class whose prototypes lie far from their reference as in a tight one), and the floor keeps a
      round whose rows lie at almost the same distance from flagging one a little farther.

    The nearer test needs embeddings aligned with the references, which FedProto's clients reach
    only after some rounds (each client has its own feature extractor), and some datasets not
    within a run (digits with 20 clients: after 20 rounds 30-45 % of the honest rows still lie
    nearer another class, spread over most clients). It acts only in rounds where more than half
    of the clients judged have every row nearer its own class than any other: a flipping client
    has all its rows misplaced, an honest client of a federation that is not aligned yet has some
    misplaced, so the test waits until a majority of clients is aligned, and then stays sound while
    fewer than half of the clients misbehave. Both tests pool the rows of all classes (a per-class
    median breaks at half of one class's holders). With no reference at all (the first round) the
    reference of every class is the origin: only the farther test acts, on the norms. A row of a
    class without a reference, in a round where other classes have one, is not judged. Not in the
    paper.

    Args:
        classes: per client, (K_i,) int class ids. protos: per client, (K_i, d).
        ref_classes: (K,) int classes of the reference prototypes (may be empty).
        ref_protos: (K, d) reference prototypes.
        z: the robust z-score above which the farther test flags a row (> 0).
    Returns:
        (flags, nearer_acted): per client a (K_i,) bool array, True where the row is flagged; and
        whether the nearer test acted (more than half of the clients judged fully aligned).
    Raises:
        ValueError: ``z`` not above 0, or prototypes whose size differs from the references'.
    """
    if not z > 0:
        raise ValueError(f"class check z={z}: give a robust z-score above 0 (e.g. 3)")
    rc = np.asarray(ref_classes, np.int64)
    flags = [np.zeros(len(np.asarray(c)), bool) for c in classes]
    rows = [(i, k, int(c)) for i, cs in enumerate(classes) for k, c in enumerate(np.asarray(cs).tolist())]
    if not rows:
        return flags, False
    P = np.concatenate([np.asarray(p, np.float64).reshape(len(np.asarray(c)), -1) for c, p in zip(classes, protos)])
    if len(rc) == 0:  # first round: the origin is every class's reference
        judged = np.arange(len(rows))
        own = np.linalg.norm(P, axis=1)
        nearer = np.zeros(len(rows), bool)
    else:
        R = np.asarray(ref_protos, np.float64)
        if P.shape[1] != R.shape[1]:
            raise ValueError(f"prototypes of size {P.shape[1]} against references of size {R.shape[1]}")
        index = {int(c): r for r, c in enumerate(rc.tolist())}
        judged = np.array([n for n, (_, _, c) in enumerate(rows) if c in index], np.int64)
        ref = np.array([index[rows[n][2]] for n in judged], np.int64)
        d = np.sqrt(((P[judged, None, :] - R[None, :, :]) ** 2).sum(-1))  # (n, K)
        own = d[np.arange(len(judged)), ref]
        d[np.arange(len(judged)), ref] = np.inf
        nearer = d.min(1) < own if len(rc) > 1 else np.zeros(len(judged), bool)
    # the nearer test acts when more than half of the clients judged have no row nearer another class
    client = np.array([rows[n][0] for n in judged], np.int64)
    misplaced = np.unique(client[nearer])
    acted = len(rc) > 1 and bool(len(judged)) and 2 * len(misplaced) < len(np.unique(client))
    bad = nearer if acted else np.zeros(len(judged), bool)
    if len(judged) >= 3:
        scale = np.log(np.maximum(own, 1e-12))  # distances compared as ratios: a row 2x as far is 2x, in any class
        bad = bad | (_floored_z(scale, DISTANCE_FLOOR) > z)
    for n, b in zip(judged.tolist(), bad.tolist()):
        if b:
            i, k, _ = rows[n]
            flags[i][k] = True
    return flags, acted


DISTANCE_FLOOR = 0.1
"""The least spread :func:`class_check` assumes for the log distances to the own reference (about
10 %), so that a round where honest rows lie at almost the same distance does not flag one a little farther."""


def _floored_z(values: np.ndarray, floor: float) -> np.ndarray:
    """Robust z-scores ((x - median) / MAD, the MAD scaled to a normal standard deviation) with the
    MAD taken as at least ``floor``; (n,) float64."""
    from scipy.stats import median_abs_deviation

    v = np.asarray(values, np.float64)
    mad = max(float(median_abs_deviation(v, scale="normal")), floor)
    return (v - float(np.median(v))) / mad


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


def robust_z(values: np.ndarray) -> np.ndarray:
    """Robust z-scores over clients: (x - median) / MAD, with the MAD scaled to the standard
    deviation of a normal distribution (:func:`scipy.stats.median_abs_deviation`,
    ``scale="normal"``), NaN entries ignored and kept NaN. Where the MAD is 0 (half the clients or
    more at the median), a value above the median scores +inf and the others 0.

    Args:
        values: (m,) per-client numbers (e.g. prototype distances, :func:`client_distances`).
    Returns:
        (m,) float64 z-scores.
    """
    from scipy.stats import median_abs_deviation

    v = np.asarray(values, np.float64)
    out = np.full(v.shape, np.nan)
    ok = np.isfinite(v)
    if not ok.any():
        return out
    med = float(np.median(v[ok]))
    mad = float(median_abs_deviation(v[ok], scale="normal"))
    if mad > 0:
        out[ok] = (v[ok] - med) / mad
    else:
        out[ok] = np.where(v[ok] > med, np.inf, 0.0)
    return out
