"""FedProto's prototype regularizer as a loss term (docs/architecture.md, "LossTerm"): the
training paths call it as they call any method's term, so the objective names no method."""

from __future__ import annotations

from typing import cast

import torch

from fedproto.prototypes import proto_loss
from fedproto.prototypes.distances import DistanceForm
from fedproto.training import LossTerm


class ProtoTerm(LossTerm):
    """λ x the distance of each embedding to its class's global prototype (paper eq. 7's second
    term; :func:`fedproto.prototypes.proto_loss`), reported apart before λ as ``loss_proto``.

    Args:
        weight: λ > 0.
        table: (C, d) global prototypes; mask: (C,) bool, the rows that exist (at least one).
        form: the distance (:func:`~fedproto.prototypes.proto_loss`: ``mse``, ``squared_l2``, ``l2``, ...).
        normalize: L2-normalize embeddings and global prototypes inside the distance.

    A call on logits (..., B, C), embeddings h (..., B, d), labels y (..., B) and sample weights
    w (..., B) returns the weighted batch mean (...) times λ. Every form but ``l2`` (the distance to
    a batch prototype) is a mean of per-sample values, so DP-SGD may train it (:attr:`per_sample`).
    """

    reported = True

    def __init__(self, weight: float, table: torch.Tensor, mask: torch.Tensor, form: str = "mse",
                 normalize: bool = False):
        self.weight, self.table, self.mask = float(weight), table, mask
        self.form, self.normalize = form, bool(normalize)
        self.per_sample = form != "l2"

    def parts(self, logits: torch.Tensor, h: torch.Tensor, y: torch.Tensor,
              w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(λ x distance, distance), each (...)."""
        form = cast(DistanceForm, self.form)  # a str of DISTANCE_FORMS: proto_loss refuses others (ValueError)
        lp = proto_loss(h, y, self.table, self.mask, form, w, self.normalize)
        return self.weight * lp, lp

    def __call__(self, logits: torch.Tensor, h: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.parts(logits, h, y, w)[0]
