"""Misbehaving clients, for experiments and tests: a client's outgoing message altered
before the server sees it.

The engine applies :func:`corrupt_message` to the messages of the clients chosen by
:func:`attacker_ids` (options ``attack`` and ``attackers``); their own training and evaluation
are unchanged, so "honest clients" in the summary are the others. The practitioner's guide
(§4.2) describes the case met in practice: one client with poor data (an old scanner) poisons
the global prototypes.
"""

from __future__ import annotations

import numpy as np

ATTACKS: tuple[str, ...] = ("none", "scale", "random", "nan", "flip")
"""``scale``: every float entry multiplied by ``scale`` (prototypes 100x by default); ``random``:
each prototype (row) replaced by a Gaussian vector of the same L2 norm (other float arrays: by
Gaussian noise of their standard deviation); ``nan``: every float entry NaN; ``flip``: each class
id c sent as (c + 1) mod C (prototypes attached to the wrong class)."""


def attacker_ids(seed: int, num_clients: int, count: int) -> list[int]:
    """The ``count`` misbehaving clients of a run: drawn without replacement from a generator of
    ``seed`` alone (the same clients in every engine and on resume).

    Returns:
        Sorted client ids.
    Raises:
        ValueError: ``count`` outside 0..num_clients.
    """
    if not 0 <= count <= num_clients:
        raise ValueError(f"attackers={count}: give a number of clients in 0..{num_clients}")
    if count == 0:
        return []
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xBAD]))
    return sorted(int(i) for i in rng.choice(num_clients, size=count, replace=False))


def corrupt_message(message: dict[str, np.ndarray], kind: str, rng: np.random.Generator, num_classes: int,
                    scale: float = 100.0) -> dict[str, np.ndarray]:
    """A copy of a client's message altered as ``kind`` (:data:`ATTACKS`).

    Float arrays are the payload (prototypes ``protos`` (K, d), or model weights); ``classes``
    (K,) int is the class ids; integer entries other than ``classes`` (``counts``) are kept.

    Args:
        message: the honest message (not modified). kind: one of :data:`ATTACKS`.
        rng: the generator for ``random``. num_classes: C, for ``flip``. scale: factor of ``scale``.
    Returns:
        The altered message (the same arrays' shapes and dtypes).
    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in ATTACKS:
        raise ValueError(f"attack {kind!r}: choose one of {', '.join(ATTACKS)}")
    out = {k: np.array(v, copy=True) for k, v in message.items()}
    if kind == "none":
        return out
    if kind == "flip":
        if "classes" in out and len(out["classes"]):
            c = (out["classes"] + 1) % num_classes
            order = np.argsort(c, kind="stable")  # keep classes sorted, rows following them
            out = {k: (v[order] if k != "classes" and v.ndim >= 1 and len(v) == len(c) else v)
                   for k, v in out.items()}
            out["classes"] = c[order]
        return out
    for k, v in out.items():
        if v.dtype.kind != "f":
            continue
        if kind == "scale":
            out[k] = (v * scale).astype(v.dtype)
        elif kind == "nan":
            out[k] = np.full_like(v, np.nan)
        elif k == "protos" and v.ndim == 2:
            g = rng.standard_normal(v.shape)
            g /= np.maximum(np.linalg.norm(g, axis=1, keepdims=True), 1e-12)
            out[k] = (g * np.linalg.norm(v, axis=1, keepdims=True)).astype(v.dtype)
        else:
            out[k] = (rng.standard_normal(v.shape) * (float(v.std()) if v.size else 0.0)).astype(v.dtype)
    return out
