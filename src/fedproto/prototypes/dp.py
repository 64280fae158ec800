"""Differential privacy for what leaves a FedProto client, and its accounting.

Two modes (option ``dp``):

``prototypes`` (output perturbation). Each round the client clips every training sample's
embedding to L2 norm ``C`` (``dp_clip``), sums them per class of its label set, and releases the
sums and the counts with Gaussian noise (:func:`noisy_prototypes`); the prototype it sends is the
noisy sum over the noisy count. Neighbouring datasets: the client's data with one training sample
added or removed (the client's label set is public: a prototype is sent for each of its classes).
The guarantee holds *for a fixed feature extractor*: the extractor was trained on the same data,
and what it learnt is not covered, so this mode alone protects no sample in the sense of a
federated run.

``full`` (DP-SGD + output perturbation). Local training is DP-SGD (Abadi et al. 2016) through
Opacus: Poisson-sampled batches (rate q = B / n), per-sample gradients clipped to ``dp_grad_clip``,
Gaussian noise of ``dp_noise`` times that bound; the prototypes are released as in
``prototypes``. The extractor is then itself differentially private, so everything the client
uploads over the run (prototypes of every round) has a sample-level guarantee with respect to
adding or removing one of its training samples. Not covered: client-level privacy (a client's
whole dataset, or its label set), the test data, and the simulator's own logs (losses and
accuracies computed from private data in ``metrics.jsonl``), which a deployment does not send.

Where the noise comes from: every noise draw of a release, and DP-SGD's Poisson sampling and
gradient noise, come from :func:`secure_rng`, seeded from the operating system's secure
randomness on the client, never from the run's seed: the server knows that seed (it sets it in a
Flower run config), the round, the client id and the architecture, and with noise drawn from them
it could subtract the noise and recover the exact prototypes and counts. ``dp_reproducible_noise``
draws the noise from the run's seed instead (bit-for-bit reproducible DP runs in the simulator,
refused under Flower); it voids the guarantee against anyone who knows the seed.

What is public under both modes: the client's label set (a prototype is sent for each of its
classes, so a class held by a single sample appears or vanishes with that sample: the
neighbouring relation keeps the label set fixed) and its architecture. A deployment sends nothing
else about its data (:func:`deployment_fields`).

Privacy spent: the Rényi-DP accountant of Opacus (:class:`opacus.accountants.RDPAccountant`),
composing the subsampled Gaussian mechanism of every DP-SGD step with the Gaussian mechanism of
every prototype release (:func:`epsilon`).
"""

from __future__ import annotations

import math
import secrets
from typing import Any

import numpy as np
import torch

DP_MODES: tuple[str, ...] = ("off", "prototypes", "full")

RELEASE_SENSITIVITY = math.sqrt(2.0)
"""L2 sensitivity of one release, in units of ``C``: the vector (per-class sums of clipped
embeddings, ``C`` x per-class counts) changes by at most ``sqrt(C**2 + C**2)`` when one sample is
added or removed (its clipped embedding enters one class sum, and that class count moves by 1)."""


def secure_rng() -> np.random.Generator:
    """A numpy generator seeded with 128 bits of the operating system's secure randomness
    (:func:`secrets.randbits`): a fresh one per release and per DP-SGD training, so no one who
    knows the run's seed, round and client id can regenerate its draws. (PCG64 itself is not a
    cryptographic generator; its secret is the seed, and its raw draws never leave the client.)"""
    return np.random.default_rng(secrets.randbits(128))


def clip_rows(h: torch.Tensor, bound: float) -> torch.Tensor:
    """Each row of ``h`` (N, d) scaled to L2 norm at most ``bound`` (rows within it unchanged)."""
    norms = h.norm(dim=1, keepdim=True)
    return h * torch.clamp(bound / norms.clamp_min(1e-12), max=1.0)


def noisy_prototypes(
    h: torch.Tensor, y: torch.Tensor, classes: np.ndarray, clip: float, noise_multiplier: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Local prototypes released with the Gaussian mechanism (mode ``prototypes``).

    Per class c of ``classes``: S_c = sum of the clipped embeddings (:func:`clip_rows`) of the
    samples of class c, n_c their number; released S~_c = S_c + N(0, s^2 I) and
    n~_c = n_c + N(0, (s / C)^2) with s = ``noise_multiplier`` x :data:`RELEASE_SENSITIVITY` x C. The
    prototype is S~_c / max(n~_c, 1) and the count sent max(1, round(n~_c)) (post-processing).

    Args:
        h: (N, d) embeddings of all local training samples (each sample once). y: (N,) labels.
        classes: (K,) the client's public label set (sorted). clip: C > 0.
        noise_multiplier: sigma >= 0 (0: clipping only, no privacy). rng: the noise's generator,
            one the server cannot regenerate (:func:`secure_rng`) for the guarantee to hold.
    Returns:
        classes (K,) int64, protos (K, d) float32, counts (K,) int64 >= 1.
    Raises:
        ValueError: ``clip`` <= 0 or ``noise_multiplier`` < 0.
    """
    if not clip > 0 or not noise_multiplier >= 0:
        raise ValueError(f"dp_clip={clip} must be > 0 and dp_noise={noise_multiplier} >= 0")
    classes = np.asarray(classes, np.int64)
    hc = clip_rows(h.detach().to(torch.float64).cpu(), clip).numpy()
    yy = y.cpu().numpy()
    d = h.shape[1]
    sums = np.stack([hc[yy == c].sum(0) if (yy == c).any() else np.zeros(d) for c in classes]) if len(classes) \
        else np.zeros((0, d))
    counts = np.array([(yy == c).sum() for c in classes], np.float64)
    s = noise_multiplier * RELEASE_SENSITIVITY * clip
    if s > 0:
        sums = sums + rng.normal(0.0, s, sums.shape)
        counts = counts + rng.normal(0.0, s / clip, counts.shape)
    protos = sums / np.maximum(counts, 1.0)[:, None]
    return classes, protos.astype(np.float32), np.maximum(1, np.rint(counts)).astype(np.int64)


SENT_UNDER_DP: dict[str, tuple[str, ...]] = {
    "query": ("cid", "classes", "params", "embedding-dim"),
    "train": (),
    "evaluate": (),
}
"""What a node sends the server under DP beside the algorithm message, per Flower message type:
at ``query`` its client id, label set and architecture size (public); nothing at ``train`` but
the noised release; nothing at ``evaluate`` but, under ``prototypes``, ``dp_epsilon``."""


def deployment_fields(dp: str, kind: str, values: dict[str, Any]) -> dict[str, Any]:
    """Of the values a client's node would report to the server beside the algorithm message (the
    Flower ClientApp's ``query``, ``train`` and ``evaluate`` replies), those it may send under
    ``dp``: all of them with ``dp="off"``; under DP only what is public or covered by the
    accountant (:data:`SENT_UNDER_DP`). Left out under DP: the training and test sample counts,
    the training losses, step count and largest embedding norm, the test accuracies and
    embedding health, all computed from private data without noise. ``dp_epsilon`` is sent
    under ``prototypes`` (a function of σ, δ and the number of releases, all known to the
    server) and not under ``full`` (it depends on the sample count through DP-SGD's sampling
    rate q = B / n and step count).

    Args:
        dp: ``off``, ``prototypes`` or ``full``. kind: ``query``, ``train`` or ``evaluate``.
        values: what the node would send without DP (key -> value).
    Returns:
        A new dict, a subset of ``values``.
    Raises:
        ValueError: ``dp`` or ``kind`` unknown.
    """
    if dp not in DP_MODES or kind not in SENT_UNDER_DP:
        raise ValueError(f"dp={dp!r} (one of {', '.join(DP_MODES)}) and kind={kind!r} (one of "
                         f"{', '.join(SENT_UNDER_DP)}): one is unknown")
    if dp == "off":
        return dict(values)
    keep = SENT_UNDER_DP[kind] + (("dp_epsilon",) if kind == "evaluate" and dp == "prototypes" else ())
    return {k: v for k, v in values.items() if k in keep}


def epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """ε at ``delta`` of a sequence of Gaussian mechanisms, by the Rényi-DP accountant of Opacus.

    Args:
        history: entries ``(noise_multiplier, sample_rate, steps)``: ``steps`` applications of the
            Gaussian mechanism with that noise multiplier (noise std / L2 sensitivity) on a
            Poisson subsample of rate ``sample_rate`` (1.0: the whole dataset, as a prototype
            release). Entries with ``steps`` 0 are ignored.
        delta: in (0, 1).
    Returns:
        ε >= 0 (``inf`` when any applied mechanism has noise multiplier 0; 0.0 for an empty history).
    Raises:
        ValueError: ``delta`` outside (0, 1).
    """
    from opacus.accountants import RDPAccountant

    if not 0.0 < delta < 1.0:
        raise ValueError(f"dp_delta={delta} must lie in (0, 1) (e.g. 1e-5, below 1 / samples)")
    used = [(float(s), float(q), int(n)) for s, q, n in history if n > 0]
    if not used:
        return 0.0
    if any(s <= 0 for s, _, _ in used):
        return math.inf
    import warnings

    acc = RDPAccountant()
    acc.history = used
    with warnings.catch_warnings():  # "optimal order is the smallest alpha": ε is still a valid upper bound
        warnings.filterwarnings("ignore", message="Optimal order is the")
        eps = float(acc.get_epsilon(delta=delta))
    return max(0.0, eps)  # the RDP conversion can go below 0 for a large δ, where 0 already holds
