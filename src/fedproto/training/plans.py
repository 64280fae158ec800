"""A client's randomness for one round (:class:`Plan`: batch order, dropout masks, augmentation),
drawn from its own generator so every execution path sees the same batches, and what a client's
training returns (:class:`TrainResult`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from fedproto.training.objective import AUGMENT_PAD, OptimConfig, Phase


@dataclass
class Plan:
    """One client's randomness for one round, per phase.

    order[p]: (S, W) int64 local sample indices; weight[p]: (S, W) float32, 0 on padding;
    last_epoch[p]: (S,) bool, steps of the phase's last epoch; noise[p]: name -> (S, W, width)
    float32 dropout masks scaled by 1/(1-p); aug[p]: (S, W, 3) int64 per-sample augmentation
    ``(dy, dx, flip)`` for :func:`augment_batch` (empty list: no augmentation). W is the batch
    size B, or B + r when a trailing batch of r samples was folded into the one before it.
    """

    order: list[torch.Tensor]
    weight: list[torch.Tensor]
    last_epoch: list[torch.Tensor]
    noise: list[dict[str, torch.Tensor]] = field(default_factory=list)
    aug: list[torch.Tensor] = field(default_factory=list)
    seed: int = 0  # further randomness of the step drawn by torch (the DP-SGD noise)


@dataclass
class TrainResult:
    """Per client: class sums (C, d) and counts (C,) of last-epoch embeddings (None if not
    collected), mean losses over steps (cross-entropy, the prototype term before λ, and the
    algorithm's own terms as weighted: ``loss_terms``), the number of optimizer steps taken, and the largest L2
    norm of a training embedding in the round (``inf`` if one was not finite; see
    :data:`EMBED_NORM_LIMIT`). The losses are None where a Flower node under DP sends none
    (:func:`fedproto.prototypes.dp.deployment_fields`)."""

    sums: torch.Tensor | None
    counts: torch.Tensor | None
    loss_ce: float | None
    loss_proto: float | None
    steps: int
    emb_norm_max: float = 0.0
    loss_terms: float = 0.0
    """The mean over steps of the algorithm's own loss terms (:attr:`Objective.terms`), weighted as
    they enter the loss; 0 without any (``loss_terms`` in the metrics row)."""


def make_plan(
    n: int, phases: Sequence[Phase], opt: OptimConfig, noise_widths: dict[str, int], p_drop: float,
    rng: np.random.Generator, min_batch: int = 1,
) -> Plan:
    """Draw a client's batch order, dropout masks and augmentation for one round.

    Args:
        n: number of local training samples. phases: epochs per phase. opt: batch size, drop_last,
            augment.
        noise_widths: mask widths the model consumes (:meth:`ProtoModel.noise_widths`).
        p_drop: dropout probability. rng: the client's generator for this round.
        min_batch: smallest trailing batch kept as a step of its own (:func:`min_batch`; 1 for
            models without BatchNorm).
    Returns:
        A :class:`Plan`. Each epoch is one permutation of the n samples cut into batches of
        ``opt.batch_size`` (B). The trailing batch of r = n % B samples: with ``drop_last`` it is
        skipped (official code); else, if r >= ``min_batch`` or it is the only batch, it is a step
        of its own (padded with weight 0); else it is folded into the batch before it, which then
        holds B + r samples (the same rule on the sequential and the batched path, since both read
        this plan). With ``opt.augment`` the crop offsets (uniform in [0, 2 * AUGMENT_PAD]) and
        flips (probability 1/2) are drawn after the masks of each phase, so plans without
        augmentation are unchanged.
    """
    B = opt.batch_size
    full, r = divmod(n, B)
    fold = not opt.drop_last and 0 < r < min_batch and full >= 1
    W = B + r if fold else B
    if opt.drop_last or r == 0:
        steps = full
    else:
        steps = full if fold else full + 1
    orders, weights, lasts, noises, augs = [], [], [], [], []
    for ph in phases:
        rows, wrows, last = [], [], []
        for e in range(ph.epochs):
            perm = rng.permutation(n)
            padded = np.zeros((steps, W), np.int64)
            w = np.zeros((steps, W), np.float32)
            if fold:  # all rows but the last hold B samples; the last holds B + r
                m = (steps - 1) * B
                padded[:-1, :B] = perm[:m].reshape(steps - 1, B)
                w[:-1, :B] = 1.0
                padded[-1] = perm[m:]
                w[-1] = 1.0
            else:  # W == B: fill row by row, the padding (weight 0) at the end
                m = min(n, steps * B)
                padded.reshape(-1)[:m] = perm[:m]
                w.reshape(-1)[:m] = 1.0
            rows.append(padded)
            wrows.append(w)
            last.append(np.full(steps, e == ph.epochs - 1))
        order = np.concatenate(rows) if rows else np.zeros((0, W), np.int64)
        S = order.shape[0]
        noise = {}
        if p_drop > 0:
            keep = 1.0 - p_drop
            for name, width in noise_widths.items():
                noise[name] = torch.from_numpy(
                    ((rng.random((S, W, width)) < keep) / keep).astype(np.float32)
                )
        orders.append(torch.from_numpy(order))
        weights.append(torch.from_numpy(np.concatenate(wrows) if wrows else np.zeros((0, W), np.float32)))
        lasts.append(torch.from_numpy(np.concatenate(last) if last else np.zeros(0, bool)))
        noises.append(noise)
        if opt.augment:
            shift = rng.integers(0, 2 * AUGMENT_PAD + 1, size=(S, W, 2))
            flip = rng.random((S, W, 1)) < 0.5
            augs.append(torch.from_numpy(np.concatenate([shift, flip], axis=-1).astype(np.int64)))
    return Plan(orders, weights, lasts, noises, augs)


def poisson_plan(
    n: int, phases: Sequence[Phase], batch_size: int, noise_widths: dict[str, int], p_drop: float,
    rng: np.random.Generator,
) -> Plan:
    """A batch plan of Poisson subsampling for DP-SGD: each epoch has ``ceil(n / B)`` steps, and
    each step holds every local sample independently with probability q = min(1, B / n), so
    batch sizes vary (empty batches included); the privacy accountant assumes exactly this
    sampling (:mod:`fedproto.prototypes.dp`). Rows are padded to the largest batch with weight 0;
    dropout masks as :func:`make_plan`. No augmentation, no trailing-batch rule.

    Returns:
        A :class:`Plan`; its sample rate is ``min(1, batch_size / n)``.
    """
    q = min(1.0, batch_size / max(n, 1))
    steps_per_epoch = -(-n // batch_size)
    orders, weights, lasts, noises = [], [], [], []
    for ph in phases:
        picks, last = [], []
        for e in range(ph.epochs):
            for _ in range(steps_per_epoch):
                picks.append(np.nonzero(rng.random(n) < q)[0])
                last.append(e == ph.epochs - 1)
        S = len(picks)
        W = max([len(p) for p in picks] + [1])
        order = np.zeros((S, W), np.int64)
        w = np.zeros((S, W), np.float32)
        for i, p in enumerate(picks):
            order[i, : len(p)] = p
            w[i, : len(p)] = 1.0
        noise = {}
        if p_drop > 0:
            keep = 1.0 - p_drop
            for name, width in noise_widths.items():
                noise[name] = torch.from_numpy(((rng.random((S, W, width)) < keep) / keep).astype(np.float32))
        orders.append(torch.from_numpy(order))
        weights.append(torch.from_numpy(w))
        lasts.append(torch.from_numpy(np.array(last, bool)))
        noises.append(noise)
    return Plan(orders, weights, lasts, noises, [])


def augment_batch(x: torch.Tensor, params: torch.Tensor, pad: int = AUGMENT_PAD) -> torch.Tensor:
    """Random crop + horizontal flip of a batch, vectorised (one gather, no per-sample loop).

    Sample b is zero-padded by ``pad`` pixels per side, cropped to its original H x W at row
    offset ``dy`` and column offset ``dx`` of the padded image, then mirrored left-right if
    ``flip`` (torchvision order: ``RandomCrop(padding=pad)`` then ``RandomHorizontalFlip``).
    Padding is zero in the normalised space (the dataset's mean colour), whereas the official
    code pads the raw image with black before normalising.

    Args:
        x: (B, C, H, W) float inputs. params: (B, 3) int64 rows ``(dy, dx, flip)`` with
            dy, dx in [0, 2 * pad] and flip in {0, 1} (from :func:`make_plan`).
    Returns:
        (B, C, H, W) augmented copy.
    """
    B, C, H, W = x.shape
    Wp = W + 2 * pad
    params = params.to(x.device)
    xp = F.pad(x, (pad, pad, pad, pad))
    dy, dx, flip = params[:, 0], params[:, 1], params[:, 2].bool()
    j = torch.arange(W, device=x.device)
    rows = dy[:, None] + torch.arange(H, device=x.device)  # (B, H) rows of the padded image
    cols = dx[:, None] + torch.where(flip[:, None], W - 1 - j, j)  # (B, W) columns, mirrored if flip
    flat = (rows[:, :, None] * Wp + cols[:, None, :]).reshape(B, 1, H * W).expand(B, C, H * W)
    return xp.reshape(B, C, -1).gather(2, flat).reshape(B, C, H, W)
