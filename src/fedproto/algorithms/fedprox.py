"""FedProx (Li et al., arXiv 1812.06127), a baseline of tab. 1.

FedAvg (see :mod:`fedproto.algorithms.fedavg`: same messages, same sample-weighted aggregation,
same personalized evaluation) plus a proximal term in every local step:

    loss = CE + mu/2 * ||w - w_global||²

where ``w_global`` are the weights the client received this round (the objective's
:class:`~fedproto.training.WeightAnchor`, applied by every training path to the parameters being trained, so the
term reaches the gradient: mu * (w - w_global)). ``mu`` is the run option ``prox_mu`` (default
0.01, one of the values of the FedProx paper's grid {0.001, 0.01, 0.1, 1}; mu = 0 is FedAvg).
Note: the FedProto official code's FedProx function computes this term between state-dict copies,
so there it never reaches the gradient (see the paper summary, "Paper vs code"); here it does.

What is sent: up ``w/<name>`` for all weights + ``n`` (count); down ``w/<name>``. Parameters the
user froze (``requires_grad=False``) are neither sent nor trained, so the term leaves them out.
"""

from __future__ import annotations

from typing import Any

import torch

from fedproto.algorithms.algorithm import ClientState, Message
from fedproto.algorithms.fedavg import WEIGHT_PREFIX, FedAvg
from fedproto.algorithms.method_options import FedProxOptions, checked_options
from fedproto.training import Objective, OptimConfig, Phase, WeightAnchor


class FedProx(FedAvg):
    """FedAvg with the proximal term mu/2 ||w - w_global||² (module docstring).

    Args:
        num_classes, opt, local_epochs: as :class:`FedAvg`. prox_mu: mu >= 0.
    """

    name = "fedprox"
    Options = FedProxOptions

    def __init__(self, num_classes: int, opt: OptimConfig, local_epochs: int = 1, prox_mu: float = 0.01, *,
                 freeze_after: int = 0) -> None:
        super().__init__(num_classes, opt, local_epochs, freeze_after=freeze_after)
        self.options = checked_options(FedProxOptions, prox_mu=prox_mu)

    @property
    def prox_mu(self) -> float:
        """mu, ``self.options.prox_mu`` (the run's, set by :meth:`Algorithm.from_config`)."""
        return float(self.options.prox_mu)

    def divergence_hint(self, cfg: Any) -> str:
        from fedproto.errors import opt

        return f" or {opt('prox_mu')} (now {self.prox_mu})" if self.prox_mu > 0 else ""

    def objective(self, state: ClientState, message: Message) -> Objective:
        """Cross-entropy + mu/2 ||w - w_global||², the reference being this round's global weights."""
        phases = [Phase(self.local_epochs)]
        ref = {
            name: torch.tensor(message[WEIGHT_PREFIX + name], dtype=p.dtype)
            for name, p in state.model.named_parameters()
            if WEIGHT_PREFIX + name in message
        }
        trained = [name for name, p in state.model.named_parameters() if p.requires_grad]  # frozen: not sent
        if self.prox_mu == 0 or any(name not in ref for name in trained):
            # mu = 0, or no global weights to stay close to (cannot happen after initial_message)
            return Objective(phases=phases)
        return Objective(phases=phases, anchor=WeightAnchor(self.prox_mu, ref))
