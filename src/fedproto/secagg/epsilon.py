"""Differential privacy under secure aggregation: distributed noise (``dp = "prototypes"`` with ``secagg``).

Without secure aggregation each client releases its per-class sums of clipped embeddings and its
counts with the Gaussian noise the accountant assumes (:func:`fedproto.prototypes.dp.noisy_prototypes`:
standard deviation s = σ · √2 · C on each sum coordinate, s / C on each count). Under secure
aggregation the server sees only the sum over a class's contributors, so each client adds a share
of that noise: standard deviation s / √h, h = ``secagg_honest``. A class sum with at least h honest
contributors (whose noise the server and the colluding clients do not know) then carries noise of
variance at least s², that of one client's release without secure aggregation: the sum is
(ε, δ)-DP with the ε of noise multiplier σ (:func:`epsilon_sum`), with respect to one training
sample of one client (the label sets public). With fewer honest contributors the guarantee falls
back to each client's own noise, multiplier σ / √h (each client's ``dp_epsilon``: what holds if
every other client colludes with the server).

The server divides the noised sums by the noised counts (``aggregation = "weighted"``, the convex
eq. 6): a post-processing.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedproto.errors import ConfigError, opt


def check(cfg: Any) -> None:
    """Refuse DP under ``secagg`` where the noise cannot be shared out: ``dp = "full"`` (DP-SGD's
    noise protects each client's training on its own) and ``aggregation`` other than ``weighted``.

    Raises:
        ConfigError: naming the conflict.
    """
    if cfg.dp == "full":
        raise ConfigError(f"{opt('secagg', True)} with {opt('dp', 'full')}: DP-SGD's noise is each client's own and "
                          f"cannot be shared out over the sum; use {opt('dp', 'prototypes')} (distributed noise) or "
                          "secagg off",
                          option="dp", value="full")
    if cfg.dp == "prototypes" and cfg.aggregation != "weighted":
        raise ConfigError(f"{opt('secagg', True)} with {opt('dp', 'prototypes')} sums the noised class sums and "
                          f"counts, which the server divides: use {opt('aggregation', 'weighted')} (now "
                          f"{cfg.aggregation!r})", option="aggregation", value=cfg.aggregation)


def local_noise(cfg: Any) -> float:
    """Each client's noise multiplier under ``secagg``: σ / √h."""
    return cfg.dp_noise / math.sqrt(cfg.secagg_honest)


def adjust(cfg: Any, algorithm: Any) -> None:
    """Under ``secagg`` with DP: the algorithm's noise multiplier becomes each client's share,
    :func:`local_noise` (what its releases and its own ε use), on the server and on every node."""
    if getattr(cfg, "secagg", False) and getattr(cfg, "dp", "off") != "off":
        algorithm.dp_noise = local_noise(cfg)


def noisy_sums(alg: Any, state: Any, data: Any, rng: np.random.Generator | None = None) -> np.ndarray:
    """A client's (C * (d + 2),) float64 vector under distributed noise: per class of its label set
    the sum of its clipped embeddings and its count, each with Gaussian noise of standard deviation
    s / √h (``alg.dp_noise`` is already σ / √h, :func:`local_noise`), and 1 in the contributor slot.

    Args:
        alg: the run's FedProto (``dp_clip``, ``dp_noise``). state: the client's
            :class:`~fedproto.algorithms.algorithm.ClientState`. data: its
            :class:`~fedproto.algorithms.algorithm.ClientData`. rng: the noise's generator (default
            :func:`fedproto.prototypes.dp.secure_rng`, which the server cannot regenerate).
    """
    from fedproto.prototypes.dp import RELEASE_SENSITIVITY, clip_rows, secure_rng
    from fedproto.training import embed_all

    C, d = alg.num_classes, alg.embedding_dim
    rng = rng or secure_rng()
    h = clip_rows(embed_all(state.model, data.x).detach().to("cpu", dtype=_f64()), alg.dp_clip).numpy()
    y = data.y.cpu().numpy()
    classes = np.asarray(state.classes, np.int64)
    out = np.zeros(C * (d + 2), np.float64)
    sums, counts = out[:C * d].reshape(C, d), out[C * d:C * (d + 1)]
    s = alg.dp_noise * RELEASE_SENSITIVITY * alg.dp_clip
    for c in classes.tolist():
        sums[c] = h[y == c].sum(0) + (rng.normal(0.0, s, d) if s > 0 else 0.0)
        counts[c] = float((y == c).sum()) + (rng.normal(0.0, s / alg.dp_clip) if s > 0 else 0.0)
    out[C * (d + 1) + classes] = 1.0
    return out


def _f64():
    import torch

    return torch.float64


def class_epsilons(cfg: Any, history: np.ndarray | None) -> dict[int, float]:
    """ε of each class's released sums, from the noise actually in them: in a round where class c
    was decoded over n contributors, each adding noise of multiplier σ / √h, the sum carries
    multiplier σ · √(n / h) (the contributors honest: their noise unknown to the server); the
    rounds compose (Opacus RDP, :func:`fedproto.prototypes.dp.epsilon`). A withheld class releases nothing.

    Args:
        cfg: the run config (``dp_noise`` σ, ``secagg_honest`` h, ``dp_delta``).
        history: (rounds, C) contributors of each decoded class per round (negative: withheld,
            0: held by nobody), :meth:`fedproto.secagg.masked_round.SecureServer.aggregate`'s.
    Returns:
        class -> ε, for the classes decoded at least once.
    """
    from collections import Counter

    from fedproto.prototypes.dp import epsilon

    if history is None or not len(history):
        return {}
    out = {}
    for c in range(history.shape[1]):
        used = Counter(int(n) for n in history[:, c] if n > 0)
        if used:
            mults = [(cfg.dp_noise * math.sqrt(n / cfg.secagg_honest), 1.0, k) for n, k in sorted(used.items())]
            out[c] = float(epsilon(mults, cfg.dp_delta))
    return out


def summary(cfg: Any, per_client: list[dict], history: np.ndarray | None = None) -> dict:
    """``summary.json``'s ``secure_aggregation.dp``: the noise multipliers, ε of each class's sums
    from the contributors actually present (:func:`class_epsilons`; ``epsilon_sum`` the largest)
    and the clients' own ε (from their reports)."""
    eps = [m["dp_epsilon"] for m in per_client if m.get("dp_epsilon", math.nan) == m.get("dp_epsilon")]
    per_class = class_epsilons(cfg, history)
    fewest = int(history[history > 0].min()) if history is not None and (history > 0).any() else None
    return {
        "noise": "distributed: each client adds noise of multiplier noise_multiplier_per_client = "
                 "noise_multiplier / sqrt(honest_clients_assumed)",
        "honest_clients_assumed": int(cfg.secagg_honest), "noise_multiplier": cfg.dp_noise,
        "noise_multiplier_per_client": local_noise(cfg), "delta": cfg.dp_delta,
        "epsilon_sum": max(per_class.values()) if per_class else 0.0,
        "epsilon_per_class": {str(c): e for c, e in per_class.items()},
        "fewest_contributors_decoded": fewest,
        "epsilon_sum_holds": "for each class's released sums, from the contributors actually in each round's sum "
                             "(multiplier noise_multiplier * sqrt(contributors / honest_clients_assumed)), all of them "
                             "honest; epsilon_sum is the largest over the classes; over all rounds, one training "
                             "sample of one client added or removed, label sets public, for a fixed feature extractor",
        "epsilon_client_max": float(max(eps)) if eps else None,
        "epsilon_client_holds": "always, from the client's own noise alone (every other client colluding)",
    }
