"""FD, federated distillation (Jeong et al., "Communication-Efficient On-Device Machine Learning:
Federated Distillation and Augmentation under Non-IID Private Data", arXiv 1811.11479; PFLlib's
FedDistill).

Client: cross-entropy + ``fd_lambda`` x the distillation term between its logits and the global
per-class logits of each sample's class (:func:`fedproto.algorithms.hetero_math.fd_distill_loss`: soft-target
cross-entropy, temperature ``fd_temperature``; the paper and PFLlib use T = 1 and λ = 1), then it
sends its per-class mean logits (:func:`fedproto.algorithms.hetero_math.class_mean_logits`). Server: the per-class
mean over the clients that sent the class (:func:`fedproto.algorithms.hetero_math.fd_global_logits`), the same
table for every client (PFLlib). Round 1 has no global logits (cross-entropy only).

Where we follow the paper: per-class mean logits up, the per-class mean over the clients down
(unweighted by sample counts), and the distillation term added to the cross-entropy. Where we
differ: the paper and PFLlib average the logits produced during local training (train mode, every
local step); we compute them in an eval-mode pass over the training data after training (the same
numbers on every engine and executor, and the logits of the model the client keeps). The paper
gives device i the average of the *other* devices' logits (``leave_out`` of
:func:`fedproto.algorithms.hetero_math.fd_global_logits`); PFLlib, and we, send everyone the mean of all (one
broadcast). Needs no equal embedding size: only the label space is shared. Evaluation: ``acc``, the
client's own model (FD has no global model).

Messages: up ``classes`` (K,) int64, ``logits`` (K, C) float32, ``counts`` (K,) int64; down
``classes`` (K,) int64, ``logits`` (K, C) float32.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedproto.algorithms.algorithm import Algorithm, ClientData, ClientState, Message
from fedproto.algorithms.hetero_math import class_mean_logits, fd_distill_loss, fd_global_logits
from fedproto.algorithms.method_options import FDOptions, checked_options
from fedproto.algorithms.requirements import LABEL_SPACE
from fedproto.algorithms.server_state import ServerState
from fedproto.training import LossTerm, Objective, OptimConfig, Phase, TrainResult, predict


class LogitDistill(LossTerm):
    """FD's distillation term (:class:`fedproto.training.LossTerm`): ``weight`` x
    :func:`fedproto.algorithms.hetero_math.fd_distill_loss` against the (C, C) ``table`` of global logits (``mask``:
    (C,) rows that exist) at ``temperature``. Two clients' terms are equal (:meth:`LossTerm.same_as`)
    when all four are, so FD's clients train in one batched computation."""

    def __init__(self, weight: float, table: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0):
        self.weight, self.table, self.mask, self.temperature = float(weight), table, mask, float(temperature)

    def __call__(self, logits: torch.Tensor, h: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """(...) the weighted term for (..., B, C) logits, (..., B) labels and sample weights ``w``."""
        return self.weight * fd_distill_loss(logits, y, self.table.to(logits.dtype), self.mask, self.temperature,
                                             "ce", w.to(logits.dtype))


class FD(Algorithm):
    """FD: share per-class mean logits, distil toward their global mean (module docstring).

    Args:
        num_classes, opt, local_epochs: as :class:`Algorithm`.
        fd_lambda: weight of the distillation term (>= 0). fd_temperature: T > 0.
    """

    model_needs = LABEL_SPACE
    """What the clients' models must share (:mod:`fedproto.algorithms.requirements`)."""

    name = "fd"
    Options = FDOptions

    def __init__(self, num_classes: int, opt: OptimConfig, local_epochs: int = 1, fd_lambda: float = 1.0,
                 fd_temperature: float = 1.0, *, freeze_after: int = 0) -> None:
        super().__init__(num_classes, opt, local_epochs, freeze_after=freeze_after)
        self.options = checked_options(FDOptions, fd_lambda=fd_lambda, fd_temperature=fd_temperature)

    @property
    def fd_lambda(self) -> float:
        """``self.options.fd_lambda`` (the run's, set by :meth:`Algorithm.from_config`)."""
        return float(self.options.fd_lambda)

    @property
    def fd_temperature(self) -> float:
        """``self.options.fd_temperature`` (the run's, set by :meth:`Algorithm.from_config`)."""
        return float(self.options.fd_temperature)

    def divergence_hint(self, cfg: Any) -> str:
        from fedproto.errors import opt

        return f" or {opt('fd_lambda')} (now {self.fd_lambda:g})" if self.fd_lambda > 0 else ""

    # -- server ---------------------------------------------------------------------------------
    def reply_problem(self, reply: Message, sent: Message, embedding_dim: int) -> str:
        """A reply is (K,) int ``classes`` within 0..C-1, (K, C) finite ``logits``, (K,) ``counts`` >= 1."""
        from fedproto.algorithms.fedgh import protos_problem

        if set(reply) != {"classes", "logits", "counts"}:
            return f"entries {sorted(reply)[:6]}, expected ['classes', 'counts', 'logits']"
        return protos_problem({"classes": reply["classes"], "protos": reply["logits"], "counts": reply["counts"]},
                              self.num_classes, self.num_classes).replace("protos", "logits")

    def aggregate(self, round: int, messages: dict[int, Message], state: ServerState | None = None) -> ServerState:
        """Per-class mean of the clients' mean logits (unweighted, PFLlib) as the next message."""
        msgs = [m for m in messages.values() if m]
        c, z, _ = fd_global_logits([m["classes"] for m in msgs], [m["logits"] for m in msgs],
                                   [m["counts"] for m in msgs], self.num_classes)
        return ServerState({"classes": c, "logits": z.astype(np.float32)})

    # -- client ---------------------------------------------------------------------------------
    def objective(self, state: ClientState, message: Message) -> Objective:
        """Cross-entropy, plus the distillation term once global logits exist."""
        obj = Objective(phases=[Phase(self.local_epochs)])
        if self.fd_lambda > 0 and len(message.get("classes", ())):
            C = self.num_classes
            table = torch.zeros(C, C, dtype=torch.float32)
            mask = torch.zeros(C, dtype=torch.bool)
            idx = torch.as_tensor(message["classes"], dtype=torch.long)
            table[idx] = torch.as_tensor(message["logits"], dtype=torch.float32)
            mask[idx] = True
            obj.terms = (LogitDistill(self.fd_lambda, table, mask, self.fd_temperature),)
        return obj

    def finish(self, state: ClientState, message: Message, data: ClientData, result: TrainResult) -> Message:
        """The client's per-class mean logits (eval-mode pass over its training data)."""
        logits, _ = predict(state.model, data.x)
        c, z, n = class_mean_logits(logits.cpu(), data.y.cpu(), self.num_classes)
        return {"classes": c, "logits": z.astype(np.float32), "counts": n}
