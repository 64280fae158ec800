"""FedRep (Collins et al., arXiv 2102.07078), a baseline of tab. 1.

Like FedPer the body (representation) is shared and averaged (sample-weighted) and the head stays
local (``personal_layers``: by default every fully connected layer, as FedPer and tab. 1's
Params column, 110k on MNIST, about the paper CNN's 20 x 5,280 conv parameters; ``"head"``: the
last layer only, FedRep's own split), but each round's local training alternates: first
``rep_head_epochs`` epochs update only the head with the body frozen, then ``local_epochs``
epochs update only the body with the head frozen (two :class:`~fedproto.training.Phase` s; each
phase starts a fresh SGD optimizer).

Default ``rep_head_epochs`` = 9: FedRep's point is "many local updates of the low-dimensional head
for every update of the representation" (abstract); the official FedRep code's defaults
(``--local_ep 10 --local_rep_ep 1``) give 10 local epochs of which the first 9 train the head and
the last 1 the representation. With the FedProto setting of one body epoch (app. A,
``local_epochs=1``) this keeps that 9:1 ratio. A round costs about ``rep_head_epochs +
local_epochs`` epochs of forward passes (head-only backward passes are cheap).

What is sent: up ``w/<name>`` for every body tensor + ``n`` (count); down ``w/<name>`` for every
body tensor. Evaluation: ``acc`` (personal), the client's model after the last round's local
training (head adapted to the received body, then the body updated), on its own test set;
``acc_global``, the server's aggregated body of the last round with the client's own head, as
FedPer.
"""

from __future__ import annotations

from fedproto.algorithms.algorithm import ClientState, Message
from fedproto.algorithms.fedper import FedPer
from fedproto.algorithms.method_options import FedRepOptions, checked_options
from fedproto.training import Objective, OptimConfig, Phase


class FedRep(FedPer):
    """Head epochs (body frozen), then body epochs (head frozen); share the body.

    Args:
        num_classes, opt: as :class:`FedAvg`. local_epochs: body epochs per round.
        rep_head_epochs: head epochs per round (>= 1).
        personal_layers: what the head is, as :class:`FedPer` (``"fc"`` or ``"head"``).
    Raises:
        ValueError: ``rep_head_epochs`` < 1 or unknown ``personal_layers``.
    """

    name = "fedrep"
    Options = FedRepOptions

    def __init__(self, num_classes: int, opt: OptimConfig, local_epochs: int = 1, rep_head_epochs: int = 9,
                 personal_layers: str = "fc", *, freeze_after: int = 0) -> None:
        super().__init__(num_classes, opt, local_epochs, personal_layers, freeze_after=freeze_after)
        self.options = checked_options(FedRepOptions, rep_head_epochs=rep_head_epochs, personal_layers=personal_layers)

    @property
    def rep_head_epochs(self) -> int:
        """``self.options.rep_head_epochs`` (the run's, set by :meth:`Algorithm.from_config`)."""
        return int(self.options.rep_head_epochs)

    def objective(self, state: ClientState, message: Message) -> Objective:
        is_head = self.is_personal(state.model)
        return Objective(phases=[
            Phase(self.rep_head_epochs, trains=is_head),
            Phase(self.local_epochs, trains=lambda name: not is_head(name)),
        ])
