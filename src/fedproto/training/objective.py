"""What a client minimises in a round and how: the optimizer settings (:class:`OptimConfig`), the
objective (:class:`Objective`: phases, the method's :class:`LossTerm` s, a pull toward reference
weights (:class:`WeightAnchor`), DP-SGD (:class:`DPSGD`)), the per-step loss every path computes
(:func:`step_terms`; the terms, the anchor and the step's loss live in :mod:`fedproto.training.terms`
and are importable from here too) and the rule that parameters a user froze never train (:func:`respect_frozen`).
The objective names no method: each method builds its own from these pieces (docs/architecture.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.optim.adam import adam as torch_adam

# re-exported: these are importable from here too
from fedproto.training.terms import CROSS_ENTROPY as CROSS_ENTROPY
from fedproto.training.terms import CrossEntropy as CrossEntropy
from fedproto.training.terms import LossTerm as LossTerm
from fedproto.training.terms import WeightAnchor as WeightAnchor
from fedproto.training.terms import anchor_loss as anchor_loss
from fedproto.training.terms import same_term as same_term
from fedproto.training.terms import step_terms as step_terms

AUGMENT_PAD = 4
"""Zero padding (pixels per side) before the random crop (official code, lib/utils.py:
``RandomCrop(32, padding=4)`` + ``RandomHorizontalFlip()`` for CIFAR-10 training images)."""


EMBED_NORM_LIMIT = 1e4
"""An L2 embedding norm above this (or a non-finite one) is reported as a blow-up: a warning naming
the client and round, and ``nonfinite``/``emb_norm`` in ``clients.csv``. Healthy embeddings of
the zoo's models lie around 1-100 (ReLU features of width 50-512); a ResNet18 whose BatchNorm
statistics were estimated from 2 values per channel reached 1e6-1e17."""


EVAL_TRAIN_NORM_RATIO = 10.0
"""A client whose median test embedding norm (eval mode) exceeds this many times the largest
training embedding norm of its last round (train mode) is reported: eval mode changed the model,
the mark of BatchNorm running statistics estimated from too few values (a ResNet18 client measured norms of ~700
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
    a client blew up to norms of 1e6-1e17 and its accuracy fell to chance (at B = 4 a
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

    ``precision``: the resolved ``precision`` option (:func:`fedproto.training.devices.resolve_precision`):
    ``fp32``, or ``bf16``/``fp16``, in which every training path runs its forward passes under
    :func:`fedproto.training.devices.autocast_for` (weights, optimizer state, losses, prototype sums stay float32;
    ``fp16`` adds loss scaling).

    Raises:
        ValueError: an unknown optimizer or schedule, ``lr_gamma`` outside (0, 1], ``lr_step_rounds`` < 1,
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
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision={self.precision!r} is not a resolved precision; use fp32, bf16 or fp16 "
                             "(fedproto.training.devices.resolve_precision turns the option's value, auto included, "
                             "into one)")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} is unknown; use one of {', '.join(OPTIMIZERS)}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} is unknown; use one of {', '.join(LR_SCHEDULES)}")
        if not 0 < self.lr_gamma <= 1:
            raise ValueError(f"lr_gamma={self.lr_gamma!r}: the step schedule multiplies the lr by it; use a factor "
                             "in (0, 1] (e.g. 0.1)")
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


@dataclass
class Objective:
    """What a client minimizes in one round (configured by the algorithm; no field names a method).

    Attributes:
        phases: local epochs, in order (FedRep: head epochs, then body epochs).
        collect: collect the embeddings of the last epoch's training passes per class
            (official code's local prototypes).
        terms: the algorithm's loss terms (:class:`LossTerm`; FedProto's prototype term among
            them), added to cross-entropy as they are.
        anchor: a pull toward reference weights (:class:`WeightAnchor`), None: none.
        dp_sgd: train with DP-SGD (:class:`DPSGD`, a training mode any method may choose;
            sequential path only), None: plain SGD.
        classification: the classification loss, the hook for a method whose classifier is not
            the model's head (prototype-as-classifier methods such as FedNH): :data:`CROSS_ENTROPY`
            (the default, cross-entropy of the head's logits), a :class:`LossTerm` of the method's
            in its place (called as a term is, its value unweighted; it may ignore the logits), or
            None (no classification loss: the head gets no gradient from it). ``loss_ce`` in
            ``metrics.jsonl`` reports what is in force (0 with None). Every training path honours it.
    """

    phases: list[Phase]
    collect: bool = False
    terms: tuple[LossTerm, ...] = ()
    anchor: WeightAnchor | None = None
    dp_sgd: DPSGD | None = None
    classification: LossTerm | None = CROSS_ENTROPY

    @property
    def anchor_mu(self) -> float:
        """The anchor's μ (0 without an anchor)."""
        return 0.0 if self.anchor is None else float(self.anchor.mu)

    def problem(self) -> str:
        """What is wrong with this objective as a method built it, or "": a ``classification`` that
        is neither a :class:`LossTerm` nor None, or a term that is no :class:`LossTerm`. (No loss
        at all is :meth:`trains_nothing`.)"""
        c: object = self.classification  # a method may set anything here: checked at run time
        if c is not None and not isinstance(c, LossTerm):
            return (f"Objective.classification must be a LossTerm or None, got {c!r} ({type(c).__name__}); "
                    "subclass fedproto.training.LossTerm (see docs/architecture.md)")
        bad = [t for t in self.terms if not isinstance(t, LossTerm)]
        if bad:
            return (f"Objective.terms must hold LossTerms, got {bad[0]!r} ({type(bad[0]).__name__}); subclass "
                    "fedproto.training.LossTerm")
        return ""

    def trains_nothing(self) -> bool:
        """True when there is no loss at all: no classification loss, no term, no anchor (e.g. a
        prototype-as-classifier method before the first global prototypes)."""
        return self.classification is None and not self.terms and not self.anchor_mu


@dataclass
class DPSGD:
    """DP-SGD settings of one client's round (Opacus's ``DPOptimizer``): per-sample gradients
    clipped to L2 norm ``max_grad_norm``, their sum plus Gaussian noise of std ``noise_multiplier``
    x ``max_grad_norm`` divided by ``expected_batch_size`` (q x n of the Poisson plan,
    :func:`poisson_plan`). The noise generator is seeded with the plan's ``seed``."""

    noise_multiplier: float
    max_grad_norm: float
    expected_batch_size: int


def on_device(obj: Objective, device: torch.device) -> Objective:
    """``obj`` with its tensors (the terms', the anchor's references) on ``device``; the same
    object when they are there already (always on CPU)."""
    if device.type == "cpu":
        return obj
    anchor = obj.anchor
    if anchor is not None and anchor.ref is not None:
        anchor = WeightAnchor(anchor.mu, {k: v.to(device) for k, v in anchor.ref.items()})
    base = obj.classification.to(device) if obj.classification is not None else None
    return replace(obj, anchor=anchor, terms=tuple(t.to(device) for t in obj.terms), classification=base)


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
    out: list[nn.Module] = []
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
