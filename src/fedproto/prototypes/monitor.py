"""Monitoring and robustness on the server (practitioner's guide §4.2, §4.3.5; not in the paper):
each client's distance to the global prototypes, the per-class plausibility check and robust
z-scores. Conventions: :mod:`fedproto.prototypes`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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
    * (farther) its distance to its own reference ``||p - R_c||`` has a robust z-score
      (:func:`robust_z`, median and MAD over all the rows judged, every class pooled) above ``z``:
      scaled or random vectors.

    The nearer test needs embeddings aligned with the references, which FedProto's clients reach
    only after some rounds (each client has its own feature extractor); it acts only when more
    than half of the rows judged pass it, so that while most honest prototypes still lie nearer
    another class it flags nothing. Both tests pool the rows of all classes, so they hold while
    fewer than half of the round's rows are bad, however the bad rows fall on the classes (a
    per-class median breaks at half of one class's holders). With no reference at all (the first
    round) the reference of every class is the origin: only the farther test acts, on the norms.
    A row of a class without a reference, in a round where other classes have one, is not judged.
    Not in the paper.

    Args:
        classes: per client, (K_i,) int class ids. protos: per client, (K_i, d).
        ref_classes: (K,) int classes of the reference prototypes (may be empty).
        ref_protos: (K, d) reference prototypes.
        z: the robust z-score above which the farther test flags a row (> 0).
    Returns:
        (flags, nearer_acted): per client a (K_i,) bool array, True where the row is flagged; and
        whether the nearer test acted.
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
    acted = len(rc) > 1 and bool(len(judged)) and nearer.mean() < 0.5
    bad = nearer if acted else np.zeros(len(judged), bool)
    if len(judged) >= 3:
        bad = bad | (robust_z(own) > z)
    for n, b in zip(judged.tolist(), bad.tolist()):
        if b:
            i, k, _ = rows[n]
            flags[i][k] = True
    return flags, acted


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
