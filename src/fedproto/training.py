"""Local training: one client step as a function of (model, data, plan, objective).

Two execution paths share every definition in this module:

* :func:`train_client` — the reference: a plain ``nn.Module`` loop with a ``torch.optim`` optimizer
  (:func:`make_optimizer`: SGD, Adam or AdamW).
* :func:`train_group` — clients of one CNN architecture trained as one batched computation:
  their weights are stacked along a client axis, convolutions become grouped convolutions over
  clients stacked on the channel axis (channels-last), linear layers become batched matmuls,
  and the optimizer is applied per client (SGD with momentum as ``torch.optim.SGD``, Adam/AdamW with
  ``torch.optim.adam.adam`` on the stacked rows); clients whose data has run out leave the stacked
  computation (compaction), so their weights and optimizer state stay untouched.

* :func:`train_group_generic` — clients of any one architecture (equal :func:`generic_key`) trained
  as one batched computation with ``torch.func``: ``functional_call`` of one model under ``vmap``
  over the clients' stacked parameters and buffers (BatchNorm statistics per client, dropout
  masks replayed from each client's torch seed); for models without a hand-written batched forward.

All draw their randomness (batch order, dropout masks and, with ``OptimConfig.augment``, the
crop offsets and flips of :func:`augment_batch`) from the same per-client plan
(:func:`make_plan`), so they give the same weights up to float rounding.

Loss per step and client (eq. 7): mean cross-entropy over the batch + ``lambda_proto`` x
:func:`fedproto.prototypes.proto_loss` + ``prox_mu``/2 x ||w - w_ref||² (FedProx).
The optimizer is created anew at each call (official code: a fresh ``torch.optim.SGD`` per round,
so momentum, or Adam's moments, do not carry across rounds); its lr is the round's
(:meth:`OptimConfig.lr_of_round`, the ``lr_schedule`` option).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.adam import adam as torch_adam

from fedproto.grouped import grouped_call, grouped_forward, grouped_graph
from fedproto.models.base import ProtoModel
from fedproto.prototypes import proto_loss

AUGMENT_PAD = 4
"""Zero padding (pixels per side) before the random crop (official code, lib/utils.py:
``RandomCrop(32, padding=4)`` + ``RandomHorizontalFlip()`` for CIFAR-10 training images)."""


EMBED_NORM_LIMIT = 1e4
"""An L2 embedding norm above this (or a non-finite one) is reported as a blow-up: a warning naming
the client and round, and ``nonfinite``/``emb_norm`` in ``clients.csv``. Healthy embeddings of
the zoo's models lie around 1-100 (ReLU features of width 50-512); a ResNet18 whose BatchNorm
statistics were estimated from 2 values per channel reached 1e6-1e17 (issue #10)."""


EVAL_TRAIN_NORM_RATIO = 10.0
"""A client whose median test embedding norm (eval mode) exceeds this many times the largest
training embedding norm of its last round (train mode) is reported: eval mode changed the model,
the mark of BatchNorm running statistics estimated from too few values (issue #10: norms of ~700
against ~20 in training, chance accuracy, yet below :data:`EMBED_NORM_LIMIT`). Healthy models stay
below 1x: the median lies below the maximum, and dropout is off at test time."""


def has_batchnorm(model: nn.Module) -> bool:
    """True if ``model`` holds a BatchNorm layer (any ``torch.nn.modules.batchnorm._BatchNorm``)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def min_batch(model: nn.Module, batch_size: int) -> int:
    """Smallest training batch a model is given (the trailing-batch rule of :func:`make_plan`).

    Models with BatchNorm: ``max(ceil(B / 2), min(B, 4))`` for batch size B (4 for B = 4..8, 5
    for 10, 2 for B = 2). BatchNorm in train mode normalises each channel with the batch's own mean
    and variance; where a layer's maps are 1x1 (ResNet18's layer4 on 32x32 inputs) those come from
    as many values as the batch has samples, so a 2-sample trailing batch is normalised to exactly
    +-1 and its running variance estimate is dominated by noise: the eval-mode embeddings of such
    a client blew up to norms of 1e6-1e17 and its accuracy fell to chance (issue #10; at B = 4 a
    kept 2-sample batch did the same). With this rule no trailing batch holds fewer than
    min(B, 4) samples nor fewer than half the batch size, and none more than 1.5 B + 3. Batch
    sizes below 4 leave every step short of values: :func:`fedproto.engine.setup.prepare` warns.
    Models without BatchNorm: 1 (every trailing batch is kept as it is).
    """
    B = int(batch_size)
    return max(-(-B // 2), min(B, 4)) if has_batchnorm(model) else 1


OPTIMIZERS = ("sgd", "adam", "adamw")
"""Local optimizers (:attr:`OptimConfig.optimizer`): ``torch.optim.SGD``, ``Adam``, ``AdamW``."""

LR_SCHEDULES = ("constant", "step", "cosine")
"""Learning-rate schedules over rounds (:meth:`OptimConfig.lr_of_round`)."""

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
"""Adam/AdamW β1, β2 and ε: torch's defaults, passed explicitly to ``torch.optim.Adam``/``AdamW`` on the
sequential path and to ``torch.optim.adam.adam`` on the batched paths, so both run the same update."""


@dataclass
class OptimConfig:
    """Local optimizer settings (paper, app. A: SGD, lr 0.01, momentum 0.5; batch size 8; one local epoch).

    ``optimizer``: ``sgd`` (``torch.optim.SGD`` with ``momentum``), ``adam`` (``torch.optim.Adam``) or
    ``adamw`` (``torch.optim.AdamW``, decoupled weight decay); Adam's betas and eps are torch's defaults
    (:data:`ADAM_BETAS`, :data:`ADAM_EPS`), ``momentum`` applies to SGD only, ``weight_decay`` passes
    through to each (AdamW's is then 0 unless set, not torch's 0.01). A fresh optimizer per round and
    phase, as the official code's SGD (no moments carry across rounds).

    ``lr_schedule`` over rounds (:meth:`lr_of_round`): ``constant``; ``step`` (``lr`` x ``lr_gamma`` **
    ((r - 1) // ``lr_step_rounds``)); ``cosine`` (from ``lr`` at round 1 to ``lr_min`` at round
    ``rounds``). ``round`` is the round being trained (set by the engine with :meth:`at_round`; None: round
    1's lr); :attr:`round_lr` is the lr the training paths use.

    ``augment``: random crop of the input size from the :data:`AUGMENT_PAD`-padded image plus a
    random horizontal flip on every training batch (official code for CIFAR-10; the paper does
    not state augmentation). See :func:`augment_batch`.

    Raises:
        ValueError: an unknown optimizer or schedule, ``lr_gamma`` <= 0, ``lr_step_rounds`` < 1,
            ``lr_min`` < 0 or above ``lr``, ``rounds`` < 1 (the message names the value and the fix).
    """

    lr: float = 0.01
    momentum: float = 0.5
    weight_decay: float = 0.0
    batch_size: int = 8
    drop_last: bool = False
    augment: bool = False
    optimizer: str = "sgd"
    lr_schedule: str = "constant"
    lr_step_rounds: int = 30
    lr_gamma: float = 0.1
    lr_min: float = 0.0
    rounds: int = 1
    round: int | None = None

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} is unknown; use one of {', '.join(OPTIMIZERS)}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} is unknown; use one of {', '.join(LR_SCHEDULES)}")
        if not self.lr_gamma > 0:
            raise ValueError(f"lr_gamma={self.lr_gamma!r}: the step schedule multiplies the lr by it; use a factor "
                             "> 0 (e.g. 0.1)")
        if int(self.lr_step_rounds) < 1:
            raise ValueError(f"lr_step_rounds={self.lr_step_rounds!r}: use a whole number of rounds >= 1")
        if not 0 <= self.lr_min <= self.lr:
            raise ValueError(f"lr_min={self.lr_min!r}: the cosine floor lies in [0, lr={self.lr}]; use a value in "
                             "that range (0: decay to zero)")
        if int(self.rounds) < 1:
            raise ValueError(f"rounds={self.rounds!r}: use the run's number of rounds (>= 1)")

    def lr_of_round(self, r: int) -> float:
        """The learning rate of round ``r`` (1-based), a pure function of these settings and ``r``:

        * ``constant``: ``lr``;
        * ``step``: ``lr * lr_gamma ** ((r - 1) // lr_step_rounds)`` (``lr_step_rounds`` rounds per step);
        * ``cosine``: ``lr_min + (lr - lr_min) * (1 + cos(pi * (r - 1) / (rounds - 1))) / 2``: ``lr`` at
          round 1, ``lr_min`` at round ``rounds`` (``lr`` throughout when ``rounds`` is 1); rounds past
          ``rounds`` keep ``lr_min``.

        Raises:
            ValueError: ``r`` < 1.
        """
        if int(r) < 1:
            raise ValueError(f"round {r!r}: rounds count from 1")
        if self.lr_schedule == "step":
            return self.lr * self.lr_gamma ** ((int(r) - 1) // int(self.lr_step_rounds))
        if self.lr_schedule == "cosine":
            if self.rounds <= 1:
                return self.lr
            t = min(int(r) - 1, self.rounds - 1) / (self.rounds - 1)
            return self.lr_min + (self.lr - self.lr_min) * (1.0 + math.cos(math.pi * t)) / 2.0
        return self.lr

    @property
    def round_lr(self) -> float:
        """The lr the training paths use: :meth:`lr_of_round` of ``round`` (``lr`` when ``round`` is None)."""
        return self.lr if self.round is None else self.lr_of_round(self.round)

    def at_round(self, r: int) -> OptimConfig:
        """These settings for round ``r`` (``round`` set; the same object when it already is ``r``)."""
        return self if self.round == r else replace(self, round=int(r))


def make_optimizer(params: list[torch.Tensor], opt: OptimConfig) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer of ``opt`` over ``params`` at the round's lr (:attr:`OptimConfig.round_lr`):
    ``SGD(lr, momentum, weight_decay)``, ``Adam(lr, betas, eps, weight_decay)`` or ``AdamW(...)``."""
    lr = opt.round_lr
    if opt.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=opt.weight_decay)
    if opt.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=opt.weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=opt.momentum, weight_decay=opt.weight_decay)


def stacked_state(opt: OptimConfig, P: dict[str, torch.Tensor],
                  names: Sequence[str]) -> dict[tuple[str, str], torch.Tensor]:
    """Zero optimizer state for stacked parameters ``P`` (name -> (G, *shape)) of the batched paths, keyed
    ``(slot, name)``: SGD ``("m", k)`` (momentum buffer); Adam/AdamW ``("m", k)`` and ``("v", k)``
    (first and second moments). Rows are clients, so the engines compact and write them back as the weights."""
    slots = ("m",) if opt.optimizer == "sgd" else ("m", "v")
    return {(s, k): torch.zeros_like(P[k]) for s in slots for k in names}


def adam_step_stacked(opt: OptimConfig, params: list[torch.Tensor], grads: list[torch.Tensor],
                      exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                      steps: list[torch.Tensor]) -> None:
    """One Adam/AdamW step of stacked parameters (G, *shape) in place, with ``torch.optim.adam.adam`` (the
    function ``torch.optim.Adam.step`` calls): the update is elementwise, so each client's rows get the update
    their own ``torch.optim.Adam`` would give. ``steps``: one scalar tensor per parameter (its step count,
    shared by the stepping clients: they all took every step of the phase so far)."""
    torch_adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None,
               decoupled_weight_decay=opt.optimizer == "adamw", amsgrad=False, beta1=ADAM_BETAS[0],
               beta2=ADAM_BETAS[1], lr=opt.round_lr, weight_decay=opt.weight_decay, eps=ADAM_EPS, maximize=False)


@dataclass
class Phase:
    """A run of local epochs that trains the parameters whose names pass ``trains`` (None: all).
    ``frozen_eval``: BatchNorm layers none of whose parameters train run in eval mode, so their
    running statistics stay as they are too (the frozen feature extractor of two-stage training)."""

    epochs: int
    trains: Callable[[str], bool] | None = None
    frozen_eval: bool = False


class LossTerm:
    """A term an algorithm adds to its clients' local loss, beside cross-entropy, FedProto's
    prototype term and FedProx's proximal term (which are built in): the seam through which a
    method with its own loss needs no engine change. Every training path calls it, so one term
    trains alike on the sequential, batched and worker paths.

    Subclasses implement :meth:`__call__` for a batch with any leading dimensions (one client:
    none; a batched group: (G,)), from the batch's outputs:

        term(logits (..., B, C), h (..., B, d), y (..., B) int64, w (..., B)) -> (...)

    where ``w`` weighs the samples (1, or 0 on padding); return the weighted mean over the batch,
    ``(value * w).sum(-1) / w.sum(-1).clamp_min(1)``, already multiplied by the term's weight.
    Tensors the term holds (e.g. global per-class targets) must be moved by :meth:`to`; terms of two
    clients must compare equal with :meth:`same_as` to train in one batched computation (the
    default compares the attributes, tensors by value). Terms are pickled to worker processes, so
    define them at module level. DP-SGD (``dp="full"``) refuses them (its loss must be per sample).
    """

    def __call__(self, logits: torch.Tensor, h: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def to(self, device: torch.device) -> LossTerm:
        """This term with its tensors on ``device`` (a new object where any moved)."""
        moved = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor) and v.device != device}
        if not moved:
            return self
        out = copy.copy(self)
        vars(out).update(moved)
        return out

    def same_as(self, other: LossTerm) -> bool:
        """True when ``other`` is the same term (type and attributes; tensors compared by value)."""
        if type(other) is not type(self) or vars(self).keys() != vars(other).keys():
            return False
        for k, a in vars(self).items():
            b = vars(other)[k]
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                        and bool(torch.equal(a.cpu(), b.cpu()))):
                    return False
            elif a != b:
                return False
        return True


@dataclass
class Objective:
    """What a client minimizes in one round (configured by the algorithm).

    Attributes:
        phases: local epochs, in order (FedRep: head epochs, then body epochs).
        lambda_proto: λ, weight of the prototype regularizer (0: none).
        table: (C, d) global prototypes; mask: (C,) bool rows that exist.
        form: distance form, see :func:`fedproto.prototypes.proto_loss`.
        prox_mu: FedProx μ (0: none); prox_ref: name -> tensor of the global weights.
        collect: collect the embeddings of the last epoch's training passes per class
            (official code's local prototypes).
        normalize: L2-normalize embeddings and global prototypes inside the prototype loss.
        dp_sgd: train with DP-SGD (:class:`DPSGD`; sequential path only), None: plain SGD.
        terms: the algorithm's own loss terms (:class:`LossTerm`), added to the loss as they are.
    """

    phases: list[Phase]
    lambda_proto: float = 0.0
    table: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    form: str = "mse"
    prox_mu: float = 0.0
    prox_ref: dict[str, torch.Tensor] | None = None
    collect: bool = False
    normalize: bool = False
    dp_sgd: DPSGD | None = None
    terms: tuple[LossTerm, ...] = ()


@dataclass
class DPSGD:
    """DP-SGD settings of one client's round (Opacus's ``DPOptimizer``): per-sample gradients
    clipped to L2 norm ``max_grad_norm``, their sum plus Gaussian noise of std ``noise_multiplier``
    x ``max_grad_norm`` divided by ``expected_batch_size`` (q x n of the Poisson plan,
    :func:`poisson_plan`). The noise generator is seeded with the plan's ``seed``."""

    noise_multiplier: float
    max_grad_norm: float
    expected_batch_size: int


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
    collected), mean losses over steps, the number of optimizer steps taken, and the largest L2
    norm of a training embedding in the round (``inf`` if one was not finite; see
    :data:`EMBED_NORM_LIMIT`). The losses are None where a Flower node under DP sends none
    (:func:`fedproto.privacy.deployment_fields`)."""

    sums: torch.Tensor | None
    counts: torch.Tensor | None
    loss_ce: float | None
    loss_proto: float | None
    steps: int
    emb_norm_max: float = 0.0


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
    sampling (:mod:`fedproto.privacy`). Rows are padded to the largest batch with weight 0;
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


def on_device(obj: Objective, device: torch.device) -> Objective:
    """``obj`` with its tensors (global prototypes, mask, FedProx reference) on ``device``; the
    same object when they are there already (always on CPU)."""
    if device.type == "cpu":
        return obj
    ref = {k: v.to(device) for k, v in obj.prox_ref.items()} if obj.prox_ref is not None else None
    return replace(obj, table=None if obj.table is None else obj.table.to(device),
                   mask=None if obj.mask is None else obj.mask.to(device), prox_ref=ref,
                   terms=tuple(t.to(device) for t in obj.terms))


def _step_terms(logits, h, y, w, obj: Objective):
    """Cross-entropy (weighted mean), prototype loss and the sum of the algorithm's own terms
    (:attr:`Objective.terms`) for (..., B) batches, each of shape (...)."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    ce = (ce.reshape(y.shape) * w).sum(-1) / w.sum(-1).clamp_min(1.0)
    if obj.lambda_proto > 0 and obj.table is not None and bool(obj.mask.any()):
        lp = proto_loss(h, y, obj.table, obj.mask, obj.form, w, obj.normalize)
    else:
        lp = torch.zeros_like(ce)
    extra = sum((t(logits, h, y, w) for t in obj.terms), torch.zeros_like(ce))
    return ce, lp, extra


def frozen_params(model: nn.Module) -> frozenset[str]:
    """Names of the parameters of ``model`` that its owner froze (``requires_grad=False``).

    Training never changes them on any path (sequential, batched, worker processes, DP-SGD, the
    two-stage option) and leaves their flags as they were; see :func:`respect_frozen`.
    """
    return frozenset(n for n, p in model.named_parameters() if not p.requires_grad)


def frozen_batchnorms(model: nn.Module) -> list[nn.Module]:
    """The BatchNorm layers of ``model`` whose affine parameters are all frozen (``requires_grad=False``):
    they run in eval mode while training, so their running statistics stay as they are too (the
    way one fine-tunes a pretrained network). A BatchNorm without parameters (``affine=False``)
    has nothing to freeze and keeps updating its statistics in training mode."""
    out = []
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            ps = list(m.parameters(recurse=False))
            if ps and not any(p.requires_grad for p in ps):
                out.append(m)
    return out


def respect_frozen(obj: Objective, frozen: frozenset[str]) -> Objective:
    """``obj`` whose phases leave the parameters named in ``frozen`` (:func:`frozen_params`) untrained:
    each phase's ``trains`` predicate becomes ``name not in frozen and trains(name)``. The same
    object when ``frozen`` is empty."""
    if not frozen:
        return obj
    phases = [Phase(p.epochs, _NotFrozen(frozen, p.trains), p.frozen_eval) for p in obj.phases]
    return replace(obj, phases=phases)


class _NotFrozen:
    """Picklable predicate of :func:`respect_frozen`."""

    def __init__(self, frozen: frozenset[str], trains: Callable[[str], bool] | None):
        self.frozen, self.trains = frozenset(frozen), trains

    def __call__(self, name: str) -> bool:
        return name not in self.frozen and (self.trains is None or self.trains(name))


def train_client(
    model: ProtoModel, x: torch.Tensor, y: torch.Tensor, plan: Plan, obj: Objective, opt: OptimConfig
) -> TrainResult:
    """Reference local training of one client (sequential path).

    Parameters with ``requires_grad=False`` (:func:`frozen_params`) are not trained and keep their
    flag; BatchNorm layers whose parameters are all frozen run in eval mode (:func:`frozen_batchnorms`).

    Args:
        model: the client's model (trained in place). x: (n, C, H, W) local inputs; y: (n,) labels.
        plan: from :func:`make_plan`. obj: the round's objective. opt: optimizer settings.
    Returns:
        :class:`TrainResult`.
    """
    named = dict(model.named_parameters())
    flags = {n_: p.requires_grad for n_, p in named.items()}
    try:
        return _train_client(model, x, y, plan, respect_frozen(obj, frozen_params(model)), opt)
    finally:
        for n_, p in named.items():
            p.requires_grad_(flags[n_])


def _train_client(
    model: ProtoModel, x: torch.Tensor, y: torch.Tensor, plan: Plan, obj: Objective, opt: OptimConfig
) -> TrainResult:
    """The body of :func:`train_client` (``obj`` already leaves the frozen parameters alone)."""
    model.train()
    user_frozen_bn = {id(m) for m in frozen_batchnorms(model)}
    C = model.num_classes
    p0 = next(model.parameters())
    dev = p0.device
    obj = on_device(obj, dev)
    sums = counts = None
    if obj.collect:
        sums = torch.zeros(C, model.embedding_dim, dtype=p0.dtype, device=dev)
        counts = torch.zeros(C, dtype=torch.long, device=dev)
    ce_total = lp_total = 0.0
    steps = 0
    norm_max = torch.zeros((), dtype=torch.float64, device=dev)
    named = dict(model.named_parameters())
    net, gsm = model, None
    if obj.dp_sgd is not None:
        from opacus import GradSampleModule

        if obj.prox_mu > 0 or (obj.lambda_proto > 0 and obj.form == "l2") or obj.terms:
            raise ValueError("DP-SGD needs a loss that is a mean of per-sample terms: not FedProx's proximal term, "
                             "the 'l2' distance (a batch prototype) or an algorithm's own loss terms")
        net = gsm = GradSampleModule(model, loss_reduction="mean")
        # Opacus's backward hooks on the first layer fire with respect to its outputs (inputs need no gradient)
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
    for pi, ph in enumerate(obj.phases):
        params = [p for n_, p in named.items() if ph.trains is None or ph.trains(n_)]
        for n_, p in named.items():
            p.requires_grad_(ph.trains is None or ph.trains(n_))
        for mod_name, mod in model.named_modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                frozen = id(mod) in user_frozen_bn or (
                    ph.frozen_eval and not any(ph.trains is None or ph.trains(f"{mod_name}.{n_}")
                                               for n_, _ in mod.named_parameters()))
                mod.train(not frozen)
        # a phase may have nothing to train (all its parameters frozen): it still runs its passes (the
        # embeddings it collects), without steps
        optim = make_optimizer(params, opt) if params else None
        if obj.dp_sgd is not None and optim is not None:
            from opacus.optimizers import DPOptimizer

            dp = obj.dp_sgd
            gen = torch.Generator(device=dev).manual_seed(plan.seed + pi)
            optim = DPOptimizer(optim, noise_multiplier=dp.noise_multiplier, max_grad_norm=dp.max_grad_norm,
                                expected_batch_size=dp.expected_batch_size, loss_reduction="mean", generator=gen)
        order, weight, last = plan.order[pi], plan.weight[pi], plan.last_epoch[pi]
        noise = plan.noise[pi] if plan.noise else {}
        aug = plan.aug[pi] if plan.aug else None
        is_last_phase = pi == len(obj.phases) - 1
        for s in range(order.shape[0]):
            valid = weight[s] > 0
            idx = order[s][valid]
            xb, yb = x[idx].to(dev, non_blocking=True), y[idx].to(dev, non_blocking=True)
            if aug is not None:
                xb = augment_batch(xb, aug[s][valid])
            nb = {k: v[s][valid].to(dev) for k, v in noise.items()} if noise else None
            with torch.set_grad_enabled(optim is not None):
                logits, h = (net if optim is not None else model)(xb, nb)
                ce, lp, extra = _step_terms(logits, h, yb, torch.ones(len(yb), device=dev), obj)
                loss = ce + obj.lambda_proto * lp + extra
                if obj.prox_mu > 0 and obj.prox_ref is not None:
                    loss = loss + 0.5 * obj.prox_mu * sum(
                        ((named[k] - obj.prox_ref[k]) ** 2).sum() for k in named if named[k].requires_grad
                    )
            if optim is not None:
                optim.zero_grad(set_to_none=True)
                loss.backward()
                optim.step()
            ce_total += float(ce.detach())
            lp_total += float(lp.detach())
            steps += 1
            norm_max = torch.maximum(norm_max, _norm_max(h.detach(), -1))
            if obj.collect and is_last_phase and bool(last[s]):
                hd = h.detach()
                sums.index_add_(0, yb, hd)
                counts += torch.bincount(yb, minlength=C)
    if gsm is not None:
        gsm.to_standard_module()  # hooks off, per-sample gradients gone: the plain model again
    if sums is not None:
        sums, counts = sums.cpu(), counts.cpu()
    return TrainResult(sums, counts, ce_total / max(steps, 1), lp_total / max(steps, 1), steps, float(norm_max))


def _norm_max(h: torch.Tensor, dim: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Largest L2 norm along the sample axis of embeddings ``h`` (..., B, d) -> (...); a non-finite
    embedding counts as ``inf``. ``valid`` (..., B) masks out padding."""
    norms = h.detach().double().norm(dim=-1).nan_to_num(nan=float("inf"), posinf=float("inf"))
    if valid is not None:
        norms = torch.where(valid, norms, 0.0)
    return norms.amax(dim) if norms.numel() else norms.new_zeros(norms.shape[:-1])


# ----------------------------------------------------------------------------------------------
# Client-batched path for the paper CNN family.


def batch_key(model: ProtoModel) -> tuple | None:
    """What clients trained as one batched computation share: the architecture
    (:meth:`ProtoModel.arch_key`) and the frozen parameters (:func:`frozen_params`); None: the
    model trains on the sequential path only."""
    key = model.arch_key()
    return None if key is None else (key, tuple(sorted(frozen_params(model))))


def can_batch(models: Sequence[ProtoModel]) -> bool:
    """True when all models share one architecture and the same frozen parameters
    (:func:`batch_key`) that can be trained as one batched computation
    (:attr:`ProtoModel.batch_params` and :meth:`ProtoModel.grouped_forward`)."""
    keys = {batch_key(m) for m in models}
    return len(keys) == 1 and None not in keys and bool(models[0].batch_params)


def _same_objective(a: Objective, b: Objective, names: Sequence[str]) -> bool:
    """True if two objectives agree in all but ``prox_ref`` (see :func:`train_group`); phases are
    compared by what they train among ``names``."""
    def same_tensor(x, y):
        return (x is None and y is None) or (x is not None and y is not None and x.shape == y.shape
                                             and bool(torch.equal(x.cpu(), y.cpu())))

    def phases(o):  # what each phase trains, by parameter name (the predicates are new functions each round)
        return [(p.epochs, None if p.trains is None else tuple(p.trains(k) for k in names)) for p in o.phases]

    return (phases(a) == phases(b)
            and a.lambda_proto == b.lambda_proto and a.form == b.form and a.prox_mu == b.prox_mu
            and a.collect == b.collect and a.normalize == b.normalize
            and same_tensor(a.table, b.table) and same_tensor(a.mask, b.mask)
            and len(a.terms) == len(b.terms) and all(t.same_as(u) for t, u in zip(a.terms, b.terms)))


@torch.no_grad()
def _write_back(P, bufs, Pc, bufc, ids) -> None:
    """Copy the compacted parameters and optimizer state of clients ``ids`` back into the full stacks."""
    for k in P:
        P[k][ids] = Pc[k].detach()
    for k in bufs:
        bufs[k][ids] = bufc[k]


class TrainsOnly:
    """A picklable :attr:`Phase.trains` predicate: true for the parameter names in ``names``
    (the worker processes of :mod:`fedproto.parallel` get phases in this form)."""

    def __init__(self, names):
        self.names = frozenset(names)

    def __call__(self, name: str) -> bool:
        return name in self.names

    def __eq__(self, other) -> bool:
        return isinstance(other, TrainsOnly) and self.names == other.names

    def __hash__(self) -> int:
        return hash(self.names)


def portable_objective(obj: Objective, names: Sequence[str]) -> Objective:
    """``obj`` with each phase's ``trains`` predicate replaced by a :class:`TrainsOnly` over
    ``names`` (what the batched engine asks it), so that it pickles (FedRep's predicates are
    closures); ``prox_ref`` dropped (the batched engine takes references stacked)."""
    phases = [Phase(p.epochs, None if p.trains is None else TrainsOnly(k for k in names if p.trains(k)),
                    p.frozen_eval) for p in obj.phases]
    return replace(obj, phases=phases, prox_ref=None)


@dataclass
class StackedPhase:
    """The plans of G clients for one phase, stacked for :func:`train_stacked`.

    steps: (G,) int64 steps of each client; order: (Smax, B, G) int64 rows of the group's input
    tensor X (padding points at the client's first sample); weight: (Smax, G, B) float32, 0 on
    padding; last: (Smax, G) bool, steps of the last epoch; noise: name -> (Smax, G, B, width)
    dropout masks (ones on padding); aug: (Smax, B, G, 3) int64 augmentation or None.
    B is the widest batch of the group (batch size, or more where a trailing batch was folded).
    """

    steps: torch.Tensor
    order: torch.Tensor
    weight: torch.Tensor
    last: torch.Tensor
    noise: dict[str, torch.Tensor]
    aug: torch.Tensor | None


def stack_plans(plans: Sequence[Plan], pi: int, offsets: Sequence[int], batch_size: int) -> StackedPhase:
    """Stack phase ``pi`` of G clients' plans (:class:`Plan`) into a :class:`StackedPhase`;
    client g's sample j is row ``offsets[g] + j`` of the group's input tensor."""
    G = len(plans)
    off = torch.as_tensor(np.asarray(offsets, np.int64))
    S = [pl.order[pi].shape[0] for pl in plans]
    Smax = max(S) if S else 0
    Wd = [pl.order[pi].shape[1] for pl in plans]
    B = max(Wd, default=batch_size)
    order = off.view(1, 1, G).repeat(Smax, B, 1)  # padding points at the client's own first sample
    weight = torch.zeros(Smax, G, B)
    last = torch.zeros(Smax, G, dtype=torch.bool)
    aug = torch.zeros(Smax, B, G, 3, dtype=torch.long) if plans[0].aug else None
    for g, pl in enumerate(plans):
        order[: S[g], : Wd[g], g] = pl.order[pi] + off[g]
        weight[: S[g], g, : Wd[g]] = pl.weight[pi]
        last[: S[g], g] = pl.last_epoch[pi]
        if aug is not None:
            aug[: S[g], : Wd[g], g] = pl.aug[pi]
    noise = {}
    if plans[0].noise and plans[0].noise[pi]:
        for name in plans[0].noise[pi]:
            width = plans[0].noise[pi][name].shape[-1]
            t = torch.ones(Smax, G, B, width)
            for g, pl in enumerate(plans):
                t[: S[g], g, : Wd[g]] = pl.noise[pi][name]
            noise[name] = t
    return StackedPhase(torch.as_tensor(S, dtype=torch.long), order, weight, last, noise, aug)


def train_group(
    models: Sequence[ProtoModel],
    xs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    plans: Sequence[Plan],
    obj: Objective,
    opt: OptimConfig,
    objs: Sequence[Objective] | None = None,
) -> list[TrainResult]:
    """Train G clients with one architecture as one batched computation (see module docstring).

    Args:
        models: G models with equal :meth:`arch_key` (checked by :func:`can_batch`); updated in place.
        xs: per client local inputs (n_g, Cin, H, W).
        ys: per client local labels (n_g,).
        plans: per client plans with the same phase structure.
        obj: the shared objective (global prototypes are the same for all clients of a round).
        opt: optimizer settings (:class:`OptimConfig`).
        objs: optional per-client objectives, used only for their ``prox_ref`` (FeSEM/FedProx
            reference weights may differ per client); everything else must equal ``obj``'s.
    Returns:
        One :class:`TrainResult` per client, as :func:`train_client` would give.
    Raises:
        ValueError: per-client objectives that differ from ``obj`` in anything but ``prox_ref``, or
            models whose frozen parameters (:func:`frozen_params`) differ (they cannot share one
            batched computation).
    """
    names = models[0].batch_params
    G = len(models)
    frozen = frozen_params(models[0])
    for g, m in enumerate(models):
        if frozen_params(m) != frozen:
            raise ValueError(f"client {g} of the group has other frozen parameters (requires_grad=False) than the "
                             "group's first; train it in another group")
    obj = respect_frozen(obj, frozen)
    objs = [respect_frozen(o, frozen) for o in objs] if objs is not None else None
    P = {k: torch.stack([dict(m.named_parameters())[k].detach() for m in models]).clone() for k in names}
    ref = stacked_refs(obj, objs, names, G)
    offsets = np.cumsum([0] + [len(x) for x in xs])[:-1]
    X = torch.cat(list(xs)).contiguous()
    Y = torch.cat(list(ys))
    phases = [stack_plans(plans, pi, offsets, opt.batch_size) for pi in range(len(obj.phases))]
    out = train_stacked(models[0], P, X, Y, phases, obj, opt, ref)
    with torch.no_grad():
        for g, m in enumerate(models):
            named = dict(m.named_parameters())
            for k in names:
                named[k].copy_(P[k][g])
    return out


def stacked_refs(obj: Objective, objs: Sequence[Objective] | None, names: Sequence[str], G: int):
    """FedProx/FeSEM reference weights of G clients stacked per name ((G, *shape); None without a
    proximal term), after checking that the per-client objectives ``objs`` agree with ``obj`` in
    all else (:func:`train_group`'s ValueError)."""
    for g, o in enumerate(objs or ()):
        if not _same_objective(o, obj, names):
            raise ValueError(f"client {g} of the group has another objective than the group's (phases, lambda, "
                             "global prototypes, distance or FedProx mu differ); train it in another group")
    if obj.prox_mu <= 0:
        return None
    src = objs if objs is not None else [obj] * G
    # frozen parameters (never trained, never sent) have no reference
    return {k: torch.stack([o.prox_ref[k] for o in src]) for k in names if k in src[0].prox_ref}


def train_stacked(
    m0: ProtoModel,
    P: dict[str, torch.Tensor],
    X: torch.Tensor,
    Y: torch.Tensor,
    phases: Sequence[StackedPhase],
    obj: Objective,
    opt: OptimConfig,
    ref: dict[str, torch.Tensor] | None = None,
) -> list[TrainResult]:
    """The core of :func:`train_group` on stacked weights: trains G clients, updating ``P`` in place.

    Args:
        m0: a model of the group's architecture (its :meth:`grouped_forward` is used, not its weights).
        P: name -> (G, *shape) stacked parameters (:attr:`ProtoModel.batch_params`).
        X: (N, Cin, H, W) inputs holding every client's samples; Y: (N,) labels.
        phases: one :class:`StackedPhase` per phase of ``obj`` (:func:`stack_plans`).
        obj: the objective (its ``prox_ref`` is not used: ``ref`` holds the stacked references).
        ref: name -> (G, *shape) FedProx/FeSEM reference weights, or None.
    Returns:
        One :class:`TrainResult` per client.
    """
    names = m0.batch_params
    G = next(iter(P.values())).shape[0]
    C, d = m0.num_classes, m0.embedding_dim
    dev = P[names[0]].device
    obj = on_device(obj, dev)
    ref = {k: v.to(dev) for k, v in ref.items()} if ref is not None else None
    X, Y = X.to(dev), Y.to(dev)
    Cin = X.shape[1]
    sums = torch.zeros(G * C, d, dtype=X.dtype, device=dev) if obj.collect else None
    counts = torch.zeros(G * C, dtype=torch.long, device=dev) if obj.collect else None
    ce_tot = torch.zeros(G, dtype=torch.float64, device=dev)  # float64 sums: exact for float32 and float64 runs
    lp_tot = torch.zeros(G, dtype=torch.float64, device=dev)
    nsteps = torch.zeros(G, device=dev)
    norm_max = torch.zeros(G, dtype=torch.float64, device=dev)
    for pi, ph in enumerate(obj.phases):
        sp = phases[pi]
        train_names = [k for k in names if ph.trains is None or ph.trains(k)]
        for k in names:
            P[k].requires_grad_(k in train_names)
        bufs = stacked_state(opt, P, train_names)  # (slot, name) -> (G, *shape): momentum, or Adam's moments
        adam_steps = {k: torch.tensor(0.0) for k in train_names}  # Adam's step count (shared by stepping clients)
        Smax, B = sp.order.shape[0], sp.order.shape[1]
        order, weight, last = sp.order.to(dev), sp.weight.to(dev), sp.last.to(dev)
        noise = {k: v.to(dev) for k, v in sp.noise.items()}
        aug = sp.aug.to(dev) if sp.aug is not None else None
        is_last_phase = pi == len(obj.phases) - 1
        S_t = sp.steps
        cur: torch.Tensor | None = None  # ids of the clients still stepping (the set only shrinks)
        Pc: dict[str, torch.Tensor] = {}  # their parameters and momentum, compacted
        bufc: dict[str, torch.Tensor] = {}
        for s in range(Smax):
            act = torch.nonzero(S_t > s).flatten().to(dev)
            if cur is None or len(act) != len(cur):
                # compaction: clients whose data ran out leave the batched computation, so their
                # weights and momentum stay untouched and no compute is spent on padding
                if cur is not None:
                    _write_back(P, bufs, Pc, bufc, cur)
                cur, Gc = act, len(act)
                Pc = {k: P[k][cur].clone().requires_grad_(k in train_names) for k in names}
                bufc = {k: v[cur].clone() for k, v in bufs.items()}
                refc = {k: ref[k][cur] for k in train_names if k in ref} if ref is not None else None
                ids_C = (cur * C).unsqueeze(1)
            idx = order[s][:, cur].reshape(-1)
            xb = X[idx] if aug is None else augment_batch(X[idx], aug[s][:, cur].reshape(-1, 3))
            xb = xb.reshape(B, Gc * Cin, *X.shape[2:]).contiguous(memory_format=torch.channels_last)
            yb = Y[idx].reshape(B, Gc).t()
            w = weight[s][cur]
            nz = {k: v[s][cur] for k, v in noise.items()} if noise else None
            logits, h = m0.grouped_forward(Pc, xb, Gc, nz)
            ce, lp, extra = _step_terms(logits, h, yb, w, obj)
            loss_g = ce + obj.lambda_proto * lp + extra
            if refc is not None:
                for k in refc:
                    loss_g = loss_g + 0.5 * obj.prox_mu * ((Pc[k] - refc[k]) ** 2).flatten(1).sum(1)
            gs = torch.autograd.grad(loss_g.sum(), [Pc[k] for k in train_names], allow_unused=True) if train_names \
                else ()  # () : all frozen
            stepped = [k for k, g in zip(train_names, gs) if g is not None]  # torch.optim skips a None gradient
            plist = [Pc[k] for k in stepped]
            grads = [g for g in gs if g is not None]
            with torch.no_grad():
                blist = [bufc["m", k] for k in stepped]
                if opt.optimizer != "sgd" and plist:  # Adam/AdamW: torch's own update on the stacked rows
                    adam_step_stacked(opt, plist, grads, blist, [bufc["v", k] for k in stepped],
                                      [adam_steps[k] for k in stepped])
                elif plist:  # SGD as torch.optim.SGD (weight decay, momentum, step)
                    if opt.weight_decay:
                        torch._foreach_add_(grads, plist, alpha=opt.weight_decay)
                    if opt.momentum:
                        torch._foreach_mul_(blist, opt.momentum)
                        torch._foreach_add_(blist, grads)
                    else:
                        torch._foreach_copy_(blist, grads)
                    torch._foreach_add_(plist, blist, alpha=-opt.round_lr)
                ce_tot.index_add_(0, cur, ce.detach().double())
                lp_tot.index_add_(0, cur, lp.detach().double())
                nsteps[cur] += 1
                norm_max[cur] = torch.maximum(norm_max[cur], _norm_max(h.detach(), -1, w > 0))
                if obj.collect and is_last_phase:
                    sel = last[s][cur].to(h.dtype).unsqueeze(1) * w  # (Gc, B)
                    flat = (yb + ids_C).reshape(-1)
                    sums.index_add_(0, flat, (h.detach() * sel.unsqueeze(-1)).reshape(-1, d))
                    counts.index_add_(0, flat, sel.reshape(-1).long())
        if cur is not None:
            _write_back(P, bufs, Pc, bufc, cur)
    for k in names:
        P[k].requires_grad_(False)
    out = []
    for g in range(G):
        n = max(float(nsteps[g]), 1.0)
        out.append(
            TrainResult(
                sums[g * C : (g + 1) * C].cpu().clone() if obj.collect else None,
                counts[g * C : (g + 1) * C].cpu().clone() if obj.collect else None,
                float(ce_tot[g]) / n,
                float(lp_tot[g]) / n,
                int(nsteps[g]),
                float(norm_max[g]),
            )
        )
    return out


@torch.no_grad()
def embed_all(model: ProtoModel, x: torch.Tensor, batch: int = 512) -> torch.Tensor:
    """Embeddings (n, d) of ``x`` in eval mode (used for eq. 3 after training and for inference)."""
    model.eval()
    dev = next(model.parameters()).device
    out = [model.embed(x[i : i + batch].to(dev)) for i in range(0, len(x), batch)]
    return torch.cat(out) if out else torch.zeros(0, model.embedding_dim, device=next(model.parameters()).device)


@torch.no_grad()
def predict(model: ProtoModel, x: torch.Tensor, batch: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (n, C) and embeddings (n, d) in eval mode."""
    model.eval()
    dev = next(model.parameters()).device
    logits, hs = [], []
    for i in range(0, len(x), batch):
        lo, h = model(x[i : i + batch].to(dev))
        logits.append(lo)
        hs.append(h)
    if not logits:
        return torch.zeros(0, model.num_classes, device=dev), torch.zeros(0, model.embedding_dim, device=dev)
    return torch.cat(logits), torch.cat(hs)


# ----------------------------------------------------------------------------------------------
# Client-batched path for any model (torch.func): the same computation as train_client, G clients at once.

_FEATURE_DROPOUT = {nn.Dropout1d: 3, nn.Dropout2d: 4, nn.Dropout3d: 5}
"""Dropout modules that zero whole channels, with the input rank they are replayed for (torch's
``make_feature_noise``: a mask of shape (N, C, 1, ...))."""


def _plain(v) -> bool:
    """True for values that describe a module's configuration in :func:`generic_key` (numbers,
    strings, None, and tuples of them)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    return isinstance(v, tuple) and all(_plain(x) for x in v)


def generic_key(model: nn.Module) -> tuple | None:
    """What clients trained together on the generic batched path (:func:`train_group_generic`) share.

    The key holds, for every submodule in order: its name, type, configuration (its attributes that
    are numbers, strings or tuples of them: a convolution's stride and padding, a dropout's p, a
    BatchNorm's momentum, the train/eval flag) and the number of hooks it carries; and every
    parameter's name, shape, dtype, device and ``requires_grad`` flag (so the frozen set), and every
    buffer's name, shape and dtype. Models with equal keys compute the same function of their
    weights, so one of them can serve as the template of the group's ``functional_call``.

    Returns:
        The key, or None where the model cannot join the generic path: a model with a hand-written
        batched forward (:attr:`ProtoModel.batch_params`: :func:`train_group` is faster), a module
        whose ``forward`` was replaced on the instance, or a dropout kind whose masks the batched
        path cannot draw as the sequential path does (``AlphaDropout``, ``FeatureAlphaDropout``, p > 0).
    """
    if getattr(model, "batch_params", ()):
        return None
    mods = []
    for name, m in model.named_modules():
        if "forward" in vars(m):
            return None
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and type(m) not in (nn.Dropout, *_FEATURE_DROPOUT):
            return None
        attrs = tuple(sorted((k, v) for k, v in vars(m).items() if _plain(v)))
        hooks = tuple(len(getattr(m, h, ())) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                                       "_backward_pre_hooks"))
        mods.append((name, type(m), attrs, hooks))
    params = tuple((n, tuple(p.shape), p.dtype, str(p.device), p.requires_grad) for n, p in model.named_parameters())
    bufs = tuple((n, tuple(b.shape), b.dtype) for n, b in model.named_buffers())
    return ("generic", tuple(mods), params, bufs)


def _dropout_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The torch dropout modules of ``model`` that are active in training (p > 0), by name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]


@dataclass
class _DropCall:
    """One dropout module's call in a forward pass: its name, p, the shape of one sample's mask
    ((*sample_shape) or (C, 1, ...) for channel dropout) and the dtype it draws in."""

    name: str
    p: float
    shape: tuple[int, ...]
    dtype: torch.dtype


def _dropout_calls(model: nn.Module, x1: torch.Tensor) -> list[_DropCall]:
    """The dropout calls of one forward pass of ``model`` on one sample ``x1`` (1, ...), in call order
    (eval mode, no gradient; the model's flags and state are left as they were).

    Raises:
        ValueError: a dropout module called more than once per pass, or a channel dropout given an
            input of another rank than it is meant for (its masks could not be replayed).
    """
    calls: list[_DropCall] = []
    handles = []
    for name, m in _dropout_modules(model):
        def hook(mod, args, _name=name):
            x = args[0]
            if any(c.name == _name for c in calls):
                raise ValueError(f"dropout {_name!r} is called more than once per forward pass")
            rank = _FEATURE_DROPOUT.get(type(mod))
            if rank is not None and x.dim() != rank:
                raise ValueError(f"{type(mod).__name__} {_name!r} got a {x.dim()}-d input")
            shape = tuple(x.shape[1:]) if rank is None else (x.shape[1],) + (1,) * (x.dim() - 2)
            calls.append(_DropCall(_name, float(mod.p), shape, x.dtype))
        handles.append(m.register_forward_pre_hook(hook))
    flags = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            model(x1)
    finally:
        for h in handles:
            h.remove()
        for m, f in flags.items():
            m.training = f
    return calls


def _replay_masks(calls: Sequence[_DropCall], counts: Sequence[torch.Tensor], seed: int) -> list[list[dict]]:
    """Per phase and step, the dropout masks (name -> (c, *shape), scaled by 1/(1-p)) that torch's
    CPU generator seeded with ``seed`` gives the sequential path (:func:`train_client` after
    :func:`fedproto.engine.executors.local.client_step`): torch's CPU dropout draws
    ``empty(shape).bernoulli_(1 - p)`` per call, in call order, for the c samples of the step.
    ``counts[p]``: (S,) samples per step of phase p. p = 1 zeroes without a draw."""
    gen = torch.Generator().manual_seed(int(seed))
    out = []
    for cnt in counts:
        steps = []
        for c in cnt.tolist():
            masks = {}
            for call in calls:
                if call.p >= 1.0:
                    masks[call.name] = torch.zeros((c, *call.shape), dtype=call.dtype)
                    continue
                m = torch.empty((c, *call.shape), dtype=call.dtype).bernoulli_(1.0 - call.p, generator=gen)
                masks[call.name] = m.div_(1.0 - call.p)
            steps.append(masks)
        out.append(steps)
    return out


class _Functional:
    """``model`` run as a function of stacked weights under ``torch.func.vmap``: ``functional_call``
    with a client's parameters and buffers, its dropout modules reading the client's masks from
    :attr:`masks` (set inside the vmapped function) instead of drawing from torch's generator.
    Use as a context manager: the dropout modules' ``forward`` is replaced on the instance meanwhile."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.masks: dict[str, torch.Tensor] = {}
        self._drops = _dropout_modules(model)

    def __enter__(self):
        for name, m in self._drops:
            m.forward = (lambda x, _n=name: x * self.masks[_n])
        return self

    def __exit__(self, *exc):
        for _, m in self._drops:
            del m.forward

    def forward(self, params, buffers, x, masks, noise):
        self.masks = masks
        try:
            return torch.func.functional_call(self.model, {**params, **buffers}, (x, noise or None))
        finally:
            self.masks = {}

    def __call__(self, params, buffers, x, masks, noise):
        return torch.func.vmap(self.forward, in_dims=(0, 0, 0, 0, 0))(params, buffers, x, masks, noise)


def generic_batch_problem(model: ProtoModel, x: torch.Tensor) -> str | None:
    """Why ``model`` cannot train on the generic batched path, or None if it can.

    Runs the vmapped training computation once on two stacked copies of the model's weights and
    two samples of ``x`` (n, ...) each (train mode, a backward pass; the model's weights, buffers
    and flags are left as they were). It fails for forward passes that ``torch.func.vmap`` cannot
    batch: random ops other than dropout modules (``torch.rand``, ``F.dropout`` called directly),
    ``.item()`` or data-dependent Python control flow, in-place changes of inputs.
    """
    if generic_key(model) is None:
        return "no generic batched key (see fedproto.training.generic_key)"
    if len(x) == 0:
        return "no training samples"
    flags = {m: m.training for m in model.modules()}
    try:
        calls = _dropout_calls(model, x[:1])
        params = {k: torch.stack([p.detach()] * 2).requires_grad_(True) for k, p in model.named_parameters()}
        buffers = {k: torch.stack([b.detach()] * 2) for k, b in model.named_buffers()}
        xb = torch.stack([x[:2]] * 2).to(next(model.parameters()).device)
        c = xb.shape[1]
        masks = {d.name: torch.ones((2, c, *d.shape), dtype=d.dtype, device=xb.device) for d in calls}
        noise = {k: torch.ones(2, c, w, dtype=xb.dtype, device=xb.device) for k, w in model.noise_widths().items()}
        model.train()
        with _Functional(model) as f:
            logits, h = f(params, buffers, xb, masks, noise)
        loss = logits.sum() + h.sum()
        torch.autograd.grad(loss, [p for p in params.values()], allow_unused=True)
        return None
    except Exception as e:  # noqa: BLE001 - any failure means: train this model sequentially
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        for m, f_ in flags.items():
            m.training = f_


def _set_train_modes(model: nn.Module, ph: Phase, user_frozen_bn: set[int]) -> None:
    """Train mode, with the BatchNorm layers :func:`_train_client` runs in eval mode in phase ``ph``."""
    model.train()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            frozen = id(mod) in user_frozen_bn or (
                ph.frozen_eval and not any(ph.trains is None or ph.trains(f"{mod_name}.{n_}")
                                           for n_, _ in mod.named_parameters()))
            mod.train(not frozen)


def train_group_generic(
    models: Sequence[ProtoModel],
    xs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    plans: Sequence[Plan],
    obj: Objective,
    opt: OptimConfig,
    objs: Sequence[Objective] | None = None,
    seeds: Sequence[int] | None = None,
) -> list[TrainResult]:
    """Train G clients of one architecture (equal :func:`generic_key`) as one batched computation,
    for any model: ``torch.func.functional_call`` of the first model under ``torch.func.vmap`` over
    the clients' stacked parameters and buffers (torch.func's model ensembling).

    The same computation as :func:`train_client` per client, so the same weights up to float rounding:

    * each step feeds every client exactly its valid samples of the plan (no padding): clients whose
      step holds another sample count (a trailing batch) run in a vmapped call of their own in the
      same step, so BatchNorm normalises each client's batch with that batch's own statistics;
    * BatchNorm running statistics are stacked buffers updated per client in place; BatchNorm
      layers whose parameters are all frozen (:func:`frozen_batchnorms`) or that a phase with
      ``frozen_eval`` does not train run in eval mode; frozen parameters (:func:`frozen_params`)
      are not updated and keep their flags;
    * dropout modules (``nn.Dropout``, ``nn.Dropout1d/2d/3d``) take per-client masks replayed from
      torch's CPU generator seeded with the client's ``seeds[g]`` (:func:`_replay_masks`), the masks
      the sequential path draws after ``torch.manual_seed(seeds[g])``; explicit masks
      (:meth:`ProtoModel.noise_widths`) come from the plans as on every path;
    * SGD with momentum and weight decay as ``torch.optim.SGD``, Adam/AdamW with ``torch.optim.adam.adam``
      (a fresh optimizer per phase; parameters that get no gradient are skipped, as torch.optim skips a
      ``None`` gradient).

    Clients whose plan has run out of steps leave the stacked computation (compaction), as in
    :func:`train_stacked`. Models made only of the standard layers :func:`fedproto.grouped.grouped_graph`
    accepts (no BatchNorm, no active dropout) run their forward as G-grouped operations on one
    channels-last layout (:func:`fedproto.grouped.grouped_forward`) instead of under ``vmap``; on image
    inputs they train in :func:`train_stacked`'s loop, the paper CNN's: one grouped call per step, a
    trailing batch padded with samples of weight 0 (their samples do not interact without BatchNorm),
    one ``torch._foreach`` optimizer step for all parameters. The same computation, faster on CPU.

    Args:
        models: G models with equal :func:`generic_key` that passed :func:`generic_batch_problem`;
            updated in place (parameters and buffers).
        xs: per client local inputs (n_g, ...); ys: per client labels (n_g,).
        plans: per client plans with the same phase structure (:func:`make_plan`).
        obj: the shared objective; objs: optional per-client objectives (for ``prox_ref`` only).
        opt: optimizer settings (:class:`OptimConfig`).
        seeds: per client seed of torch's generator on the sequential path
            (:func:`fedproto.engine.seeding.client_seed`); needed when the models hold active dropout
            modules. On CUDA the sequential path's dropout draws from the fused CUDA kernel's
            generator instead, so there the two paths draw other (equally distributed) masks.
    Returns:
        One :class:`TrainResult` per client, as :func:`train_client` would give.
    Raises:
        ValueError: models with different :func:`generic_key`, per-client objectives that differ in
            anything but ``prox_ref``, or models with active dropout modules and no ``seeds``.
    """
    G = len(models)
    m0 = models[0]
    key = generic_key(m0)
    for g, m in enumerate(models):
        if key is None or generic_key(m) != key:
            raise ValueError(f"client {g} of the group has another architecture, frozen set or module configuration "
                             "than the group's first (fedproto.training.generic_key); train it in another group")
    frozen = frozen_params(m0)
    names = [k for k, _ in m0.named_parameters()]
    bnames = [k for k, _ in m0.named_buffers()]
    obj = respect_frozen(obj, frozen)
    objs = [respect_frozen(o, frozen) for o in objs] if objs is not None else None
    ref = stacked_refs(obj, objs, names, G)
    dev = next(m0.parameters()).device
    obj = on_device(obj, dev)
    ref = {k: v.to(dev) for k, v in ref.items()} if ref is not None else None
    calls = _dropout_calls(m0, xs[0][:1].to(dev)) if _dropout_modules(m0) else []
    if calls and seeds is None:
        raise ValueError("models with dropout modules need the clients' torch seeds (seeds=) to draw the "
                         "sequential path's masks")
    masks = [_replay_masks(calls, [(w > 0).sum(1) for w in pl.weight], seeds[g]) if calls else None
             for g, pl in enumerate(plans)]
    P = {k: torch.stack([dict(m.named_parameters())[k].detach() for m in models]).clone() for k in names}
    Bf = {k: torch.stack([dict(m.named_buffers())[k] for m in models]).clone() for k in bnames}
    offsets = np.cumsum([0] + [len(x) for x in xs])[:-1]
    X = torch.cat([x.to(dev) for x in xs])
    Y = torch.cat([y.to(dev) for y in ys])
    C, d = m0.num_classes, m0.embedding_dim
    sums = torch.zeros(G * C, d, dtype=P[names[0]].dtype, device=dev) if obj.collect else None
    counts = torch.zeros(G * C, dtype=torch.long, device=dev) if obj.collect else None
    ce_tot = torch.zeros(G, dtype=torch.float64, device=dev)
    lp_tot = torch.zeros(G, dtype=torch.float64, device=dev)
    nsteps = torch.zeros(G, device=dev)
    norm_max = torch.zeros(G, dtype=torch.float64, device=dev)
    user_frozen_bn = {id(m) for m in frozen_batchnorms(m0)}
    gm = None if calls or bnames else grouped_graph(m0)[0]  # standard layers only: grouped ops, faster than vmap
    if gm is not None and X.dim() == 4:  # images: the hand-written batched path's loop (train_stacked)
        for m in models:
            m.train()
        phases = [stack_plans(plans, pi, offsets, opt.batch_size) for pi in range(len(obj.phases))]
        out = train_stacked(_Traced(gm, m0, names), P, X.contiguous(), Y, phases, obj, opt, ref)
        with torch.no_grad():
            for g, m in enumerate(models):
                for k, p in m.named_parameters():
                    p.copy_(P[k][g])
        return out
    with _Functional(m0) as fn:
        for pi, ph in enumerate(obj.phases):
            for m in models:  # the modes the sequential path leaves each model in
                _set_train_modes(m, ph, {id(b) for b in frozen_batchnorms(m)})
            _set_train_modes(m0, ph, user_frozen_bn)
            train_names = [k for k in names if ph.trains is None or ph.trains(k)]
            mom = stacked_state(opt, P, train_names)  # (slot, name): momentum, or Adam's moments
            adam_steps = {k: torch.tensor(0.0) for k in train_names}  # Adam's step count per parameter
            sp = stack_plans(plans, pi, offsets, opt.batch_size)
            order, valid_n = sp.order.to(dev), (sp.weight > 0).sum(-1)  # (Smax, B, G), (Smax, G)
            noise = {k: v.to(dev) for k, v in sp.noise.items()}
            aug = sp.aug.to(dev) if sp.aug is not None else None
            is_last_phase = pi == len(obj.phases) - 1
            cur: torch.Tensor | None = None
            Pc: dict[str, torch.Tensor] = {}  # the stepping clients' parameters, buffers and momentum, compacted
            Bc: dict[str, torch.Tensor] = {}
            momc: dict[tuple[str, str], torch.Tensor] = {}
            for s in range(order.shape[0]):
                act = torch.nonzero(sp.steps > s).flatten()
                if cur is None or len(act) != len(cur):
                    if cur is not None:
                        _write_back_generic(P, Bf, mom, Pc, Bc, momc, cur)
                    cur = act
                    Pc = {k: P[k][cur.to(dev)].clone().requires_grad_(k in train_names) for k in names}
                    Bc = {k: Bf[k][cur.to(dev)].clone() for k in bnames}
                    momc = {k: v[cur.to(dev)].clone() for k, v in mom.items()}
                cnt = valid_n[s][cur]
                grads: dict[str, torch.Tensor | None] = {}
                for c in torch.unique(cnt).tolist():
                    pos = torch.nonzero(cnt == c).flatten()
                    whole = len(pos) == len(cur)
                    pos_d = pos.to(dev)
                    ids = cur[pos]
                    idd = ids.to(dev)
                    # another sample count than the rest of the step: the clients' own leaves, their gradients
                    # copied into the step's (every stepping client is in exactly one sub-group)
                    pin = Pc if whole else {k: v[pos_d].detach().requires_grad_(k in train_names)
                                            for k, v in Pc.items()}
                    bin_ = Bc if whole else {k: v[pos_d].clone() for k, v in Bc.items()}
                    idx = order[s][:c, idd].t()  # (Gs, c) rows of X
                    xb = X[idx.reshape(-1)]
                    if aug is not None:
                        xb = augment_batch(xb, aug[s][:c, idd].transpose(0, 1).reshape(-1, 3))
                    xb = xb.reshape(len(ids), c, *X.shape[1:])
                    yb = Y[idx]
                    mk = {d_.name: torch.stack([masks[g][pi][s][d_.name] for g in ids.tolist()]).to(dev)
                          for d_ in calls}
                    nz = {k: v[s][idd, :c] for k, v in noise.items()}
                    logits, h = grouped_call(gm, pin, xb) if gm is not None else fn(pin, bin_, xb, mk, nz)
                    if not whole:
                        with torch.no_grad():
                            for k in bnames:
                                Bc[k][pos_d] = bin_[k]
                    w = torch.ones(yb.shape, dtype=logits.dtype, device=dev)
                    ce, lp, extra = _step_terms(logits, h, yb, w, obj)
                    loss_g = ce + obj.lambda_proto * lp + extra
                    if ref is not None:
                        for k in train_names:
                            if k in ref:
                                loss_g = loss_g + 0.5 * obj.prox_mu * ((pin[k] - ref[k][idd]) ** 2).flatten(1).sum(1)
                    if train_names:
                        gs = torch.autograd.grad(loss_g.sum(), [pin[k] for k in train_names], allow_unused=True)
                        for k, gr in zip(train_names, gs):
                            if whole or gr is None:
                                grads[k] = gr
                            else:
                                if k not in grads:
                                    grads[k] = torch.empty_like(Pc[k])
                                grads[k].index_copy_(0, pos_d, gr)
                    with torch.no_grad():
                        ce_tot.index_add_(0, idd, ce.detach().double())
                        lp_tot.index_add_(0, idd, lp.detach().double())
                        nsteps[idd] += 1
                        norm_max[idd] = torch.maximum(norm_max[idd], _norm_max(h.detach(), -1))
                        if obj.collect and is_last_phase:
                            sel = sp.last[s][ids].to(dev).to(h.dtype).unsqueeze(1) * w
                            flat = (yb + (idd * C).unsqueeze(1)).reshape(-1)
                            sums.index_add_(0, flat, (h.detach() * sel.unsqueeze(-1)).reshape(-1, d))
                            counts.index_add_(0, flat, sel.reshape(-1).long())
                with torch.no_grad():
                    stepped = [k for k in train_names if grads.get(k) is not None]  # torch.optim skips None grads
                    if opt.optimizer != "sgd" and stepped:
                        adam_step_stacked(opt, [Pc[k] for k in stepped], [grads[k] for k in stepped],
                                          [momc["m", k] for k in stepped], [momc["v", k] for k in stepped],
                                          [adam_steps[k] for k in stepped])
                    for k in stepped if opt.optimizer == "sgd" else ():
                        gr, p = grads[k], Pc[k]
                        if opt.weight_decay:
                            gr = gr.add(p, alpha=opt.weight_decay)
                        if opt.momentum:
                            momc["m", k].mul_(opt.momentum).add_(gr)
                            p.add_(momc["m", k], alpha=-opt.round_lr)
                        else:
                            p.add_(gr, alpha=-opt.round_lr)
            if cur is not None:
                _write_back_generic(P, Bf, mom, Pc, Bc, momc, cur)
    with torch.no_grad():
        for g, m in enumerate(models):
            for k, p in m.named_parameters():
                p.copy_(P[k][g])
            for k, b in m.named_buffers():
                b.copy_(Bf[k][g])
    out = []
    for g in range(G):
        n = max(float(nsteps[g]), 1.0)
        out.append(TrainResult(
            sums[g * C : (g + 1) * C].cpu().clone() if obj.collect else None,
            counts[g * C : (g + 1) * C].cpu().clone() if obj.collect else None,
            float(ce_tot[g]) / n, float(lp_tot[g]) / n, int(nsteps[g]), float(norm_max[g])))
    return out


class _Traced:
    """A model traced for the grouped forward (:func:`fedproto.grouped.grouped_graph`) in the role
    :func:`train_stacked` gives a model with a hand-written batched forward."""

    def __init__(self, gm, m0: ProtoModel, names: Sequence[str]):
        self.gm, self.batch_params = gm, tuple(names)
        self.num_classes, self.embedding_dim = m0.num_classes, m0.embedding_dim

    def grouped_forward(self, P, xb, G, noise=None):
        return grouped_forward(self.gm, P, xb, G)


@torch.no_grad()
def _write_back_generic(P, Bf, mom, Pc, Bc, momc, cur) -> None:
    """Copy the compacted parameters, buffers and optimizer state of clients ``cur`` back into the full stacks."""
    ids = cur.to(next(iter(P.values())).device)
    for k in P:
        P[k][ids] = Pc[k].detach()
    for k in Bf:
        Bf[k][ids] = Bc[k]
    for k in mom:
        mom[k][ids] = momc[k]
