"""The pieces of a client's loss every training path composes alike: a method's loss terms
(:class:`LossTerm`), a pull toward reference weights (:class:`WeightAnchor`), the step's loss
from them (:func:`step_terms`, :func:`anchor_loss`). See docs/architecture.md ("LossTerm")."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F


class LossTerm:
    """A term an algorithm adds to its clients' local loss beside cross-entropy (FedProto's
    prototype term is one, :class:`fedproto.algorithms.proto_term.ProtoTerm`): the seam through
    which a method with its own loss needs no engine change. Every training path calls it, so one
    term trains alike on the sequential, batched and worker paths.

    Subclasses implement :meth:`__call__` for a batch with any leading dimensions (one client:
    none; a batched group: (G,)), from the batch's outputs:

        term(logits (..., B, C), h (..., B, d), y (..., B) int64, w (..., B)) -> (...)

    where ``w`` weighs the samples (1, or 0 on padding); return the weighted mean over the batch,
    ``(value * w).sum(-1) / w.sum(-1).clamp_min(1)``, already multiplied by the term's weight.
    Tensors the term holds (e.g. global per-class targets) must be moved by :meth:`to`; terms of two
    clients must compare equal with :meth:`same_as` to train in one batched computation (the
    default compares the attributes, tensors by value). Terms are pickled to worker processes, so
    define them at module level. DP-SGD (``dp="full"``) refuses a term unless it sets
    :attr:`per_sample` (its loss must be a mean of per-sample values).
    A term that returns another shape (one value per sample, or one scalar for a batched group)
    raises ``ValueError`` naming it (:func:`step_terms`); a plain number is added as it is.

    A term that sets :attr:`reported` is reported apart: :meth:`parts` gives its weighted value and
    its value before the weight, the mean of which over a round's steps is ``TrainResult.loss_proto``
    (``loss_proto`` in ``metrics.jsonl``; the prototype term's); the other terms' weighted sum is
    ``loss_terms``.
    """

    reported: bool = False
    """Report this term's unweighted value apart (:meth:`parts`; ``loss_proto``) instead of in ``loss_terms``."""

    per_sample: bool = False
    """The term is a weighted mean of per-sample values, so DP-SGD (per-sample gradients) may train it."""

    def parts(self, logits: torch.Tensor, h: torch.Tensor, y: torch.Tensor,
              w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weighted value, value before the weight), each of shape (...), for a :attr:`reported`
        term. Default: the call's value twice."""
        value = self(logits, h, y, w)
        return value, value

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


class CrossEntropy(LossTerm):
    """The built-in classification loss: cross-entropy of the logits against the labels, the weighted
    batch mean (:attr:`fedproto.training.Objective.classification` by default; its value is
    ``loss_ce`` in ``metrics.jsonl``)."""

    per_sample = True

    def __call__(self, logits: torch.Tensor, h: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
        return (ce.reshape(y.shape) * w).sum(-1) / w.sum(-1).clamp_min(1.0)


CROSS_ENTROPY = CrossEntropy()
"""The default classification loss of an :class:`~fedproto.training.Objective` (stateless: one object serves all)."""


def same_term(a: LossTerm | None, b: LossTerm | None) -> bool:
    """True when ``a`` and ``b`` are both None or the same term (:meth:`LossTerm.same_as`)."""
    return (a is None and b is None) or (a is not None and b is not None and a.same_as(b))


@dataclass
class WeightAnchor:
    """A pull of the trained parameters toward reference weights: ``mu / 2 x sum ||w - ref||²``
    over the parameters a phase trains that have a reference (FedProx's proximal term, arXiv
    1812.06127, eq. 2, with the round's global weights; FeSEM's, with the client's cluster centre).
    It acts on the parameters, not on the batch's outputs, so it is a piece of the objective of its
    own rather than a :class:`LossTerm`.

    Attributes:
        mu: the weight μ >= 0 (0: no pull).
        ref: parameter name -> tensor of that parameter's shape; None where the batched paths carry
            the references stacked (:func:`fedproto.training.stacked.stacked_refs`).
    """

    mu: float
    ref: dict[str, torch.Tensor] | None = None


def _checked(t: LossTerm, value: torch.Tensor | float, ce: torch.Tensor, y: torch.Tensor) -> torch.Tensor | float:
    """``value`` of term ``t`` if it is a number or a tensor of ``ce``'s shape, else ValueError."""
    if not isinstance(value, (int, float)) and not (isinstance(value, torch.Tensor) and value.shape == ce.shape):
        got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"loss term {type(t).__name__} returned {got} for a batch of labels of shape "
                         f"{tuple(y.shape)}: it must return shape {tuple(ce.shape)}, the weighted batch mean per "
                         "leading index ((value * w).sum(-1) / w.sum(-1).clamp_min(1); see LossTerm)")
    return value


def step_terms(logits: torch.Tensor, h: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
               obj: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss of one step for (..., B) batches, and its parts, each of shape (...), under ``obj``
    (a :class:`fedproto.training.objective.Objective`: its ``terms``).

    Returns:
        ``(ce, reported, extra, loss)``: the classification loss (``obj.classification``: by default
        :class:`CrossEntropy`, the weighted mean; a method's own term in its place; 0 when it is None)
        as ``loss_ce`` reports it; the :attr:`LossTerm.reported`
        terms' values before their weights (the prototype term's: ``loss_proto``; 0 without one);
        the other terms' weighted sum (``loss_terms``); and the loss without the
        :class:`WeightAnchor`, ``ce + weighted reported terms + extra``.

    Raises:
        ValueError: a term returned something else than a number or a tensor of shape (...) (e.g.
            one value per sample, or one mean over a batched group's clients), naming the term.
    """
    base: LossTerm | None = getattr(obj, "classification", CROSS_ENTROPY)
    ce: torch.Tensor
    if base is CROSS_ENTROPY or isinstance(base, CrossEntropy):
        ce = base(logits, h, y, w)
    else:  # a method's own classification loss, or none: 0 (loss_ce reads 0), a zero gradient for the head
        ref = logits.sum((-1, -2)) * 0.0  # in the graph, so a step whose loss is only this still backpropagates
        ce = ref if base is None else _checked(base, base(logits, h, y, w), ref, y) + ref
    reported: torch.Tensor | float | None = None
    weighted: torch.Tensor | float | None = None
    extra = torch.zeros_like(ce)
    for t in obj.terms:
        if t.reported:
            value, raw = t.parts(logits, h, y, w)
            value, raw = _checked(t, value, ce, y), _checked(t, raw, ce, y)
            weighted = value if weighted is None else weighted + value
            reported = raw if reported is None else reported + raw
        else:
            extra = extra + _checked(t, t(logits, h, y, w), ce, y)
    if reported is None:
        reported = weighted = torch.zeros_like(ce)
    # weighted is set wherever reported is (both None or both set), so it is not None here
    # reported: a tensor unless a reported term returned a plain number, which the callers do not take
    # (they reshape it); read as the tensor they need
    return ce, cast(torch.Tensor, reported), extra, ce + cast("torch.Tensor | float", weighted) + extra


def anchor_loss(obj: Any, named: Mapping[str, torch.Tensor]) -> torch.Tensor | float:
    """``mu / 2 x sum ||w - ref||²`` of :attr:`Objective.anchor` over the parameters in ``named``
    (one client's, name -> tensor) that train (``requires_grad``) and have a reference; 0.0
    without an anchor (or with μ = 0, or no reference)."""
    a: WeightAnchor | None = obj.anchor
    if a is None or a.mu <= 0 or a.ref is None:
        return 0.0
    return 0.5 * a.mu * sum(((named[k] - a.ref[k]) ** 2).sum() for k in named if named[k].requires_grad)
