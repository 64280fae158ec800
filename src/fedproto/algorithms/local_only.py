"""Local training: the no-communication baseline of tab. 1 ("Local", 0 parameters per round).

Every client trains its own model with plain cross-entropy for ``local_epochs`` epochs each round
and never sends or receives anything: client and server messages are empty (``{}``), so the
engine counts 0 parameters in both directions. Evaluation: the client's own model on its own
test set (:meth:`Algorithm.evaluate`). Works with heterogeneous client models.
"""

from __future__ import annotations

from fedproto.algorithms.algorithm import Algorithm, Message
from fedproto.algorithms.method_options import NoOptions
from fedproto.algorithms.requirements import NOTHING
from fedproto.algorithms.server_state import ServerState


class Local(Algorithm):
    """Each client alone (tab. 1 "Local"): cross-entropy only, messages ``{}`` both ways."""

    model_needs = NOTHING
    """What the clients' models must share (:mod:`fedproto.algorithms.requirements`)."""

    name = "local"
    Options = NoOptions
    shares_weights = False

    def aggregate(self, round: int, messages: dict[int, Message], state: ServerState | None = None) -> ServerState:
        """Nothing to combine: the empty message."""
        return ServerState({})
