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
