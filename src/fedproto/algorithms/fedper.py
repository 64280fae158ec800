"""FedPer (Arivazhagan et al., arXiv 1912.00818), a baseline of tab. 1.

Federated learning with personalization layers: the base layers (the representation f, every
parameter for which :meth:`ProtoModel.is_head_param` is false) are shared and averaged as in
FedAvg (sample-weighted); the head g (the personalization layer, for the paper CNN ``fc2``) never
leaves the client. Local training: cross-entropy on all parameters for ``local_epochs`` epochs.

What is sent: up ``w/<name>`` for every body tensor + ``n`` (count); down ``w/<name>`` for every
body tensor. The first broadcast is client 0's initial body; each client keeps its own head
initialisation. Evaluation: the client's model (global body as trained locally + own head) after
the last round's local training, on its own test set.
"""

from __future__ import annotations

from fedproto.algorithms.fedavg import FedAvg
from fedproto.models.base import ProtoModel


class FedPer(FedAvg):
    """Share the body, keep the head local (module docstring)."""

    name = "fedper"

    def include(self, model: ProtoModel):
        return lambda name: not model.is_head_param(name)
