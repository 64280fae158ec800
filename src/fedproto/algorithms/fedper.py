"""FedPer (Arivazhagan et al., arXiv 1912.00818), a baseline of tab. 1.

Federated learning with personalization layers: the base layers are shared and averaged as in
FedAvg (sample-weighted); the personalization layers never leave the client. Which layers are
personal is ``personal_layers`` (:meth:`ProtoModel.is_personal_param`):

* ``"fc"`` (default): every fully connected layer after the convolutional base, so only the
  convolutions are shared. This is what tab. 1's Params column implies: FedPer sends 106k
  parameters per round on MNIST, which is 20 clients x 5,280 conv parameters of the paper CNN
  (the whole CNN is 21,840, and FedAvg's 430k is 20 x 21.8k); on CIFAR-10 225M against FedAvg's
  235M is everything but ResNet18's ``fc``.
* ``"head"``: the last layer g only (the paper CNN's ``fc2``), FedRep's narrower split.

Local training: cross-entropy on all parameters for ``local_epochs`` epochs.

What is sent: up ``w/<name>`` for every shared tensor + ``n`` (count); down ``w/<name>`` for
every shared tensor. The first broadcast is client 0's initial base; each client keeps its own
initialisation of the personal layers. Evaluation: ``acc`` (personal), the client's model (global
base as trained locally + own personal layers) after the last round's local training, on its own
test set; ``acc_global``, the server's aggregated base of the last round with the client's own
personal layers (as they are after its last local training), on its own test set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from fedproto.algorithms.algorithm import ClientState, Message
from fedproto.algorithms.fedavg import FedAvg
from fedproto.algorithms.method_options import FedPerOptions, checked_options
from fedproto.models.proto_model import ProtoModel
from fedproto.plugins import AlgorithmOptions
from fedproto.training import OptimConfig

PERSONAL_LAYERS = ("fc", "head")
"""Values of ``personal_layers`` (see the module docstring)."""


class FedPer(FedAvg):
    """Share the base, keep the personal layers local (module docstring).

    Args:
        num_classes, opt, local_epochs: as :class:`FedAvg`.
        personal_layers: ``"fc"`` (default) or ``"head"``.
    Raises:
        ValueError: unknown ``personal_layers``.
    """

    name = "fedper"
    Options: ClassVar[type[AlgorithmOptions] | None] = FedPerOptions
    global_protocol = ("global: the server's aggregated body (shared layers) after the last round's aggregation, "
                       "with the client's own personal layers as its last local training left them, on the client's "
                       "own test set")

    def __init__(self, num_classes: int, opt: OptimConfig, local_epochs: int = 1, personal_layers: str = "fc", *,
                 freeze_after: int = 0) -> None:
        super().__init__(num_classes, opt, local_epochs, freeze_after=freeze_after)
        self.options = checked_options(FedPerOptions, personal_layers=personal_layers)

    @property
    def personal_layers(self) -> str:
        """``self.options.personal_layers`` (the run's, set by :meth:`Algorithm.from_config`)."""
        return str(self.options.personal_layers)

    def is_personal(self, model: ProtoModel) -> Callable[[str], bool]:
        """Predicate on tensor names: True for the tensors that stay on the client."""
        layers = self.personal_layers

        def personal(name: str) -> bool:
            return model.is_personal_param(name, layers)

        return personal

    def initial_message(self, states: list[ClientState]) -> Message:
        """As FedAvg's, after checking that every client model has personal layers (a model whose
        head is unknown, e.g. one returning (logits, embedding) given without ``head=``, would share
        everything and run as FedAvg)."""
        for s in states:
            self._check_personal(s)
        return super().initial_message(states)

    def join_message(self, state: ClientState) -> Message:
        """As FedAvg's (the shared tensors), after the personal-layer check of :meth:`initial_message`."""
        self._check_personal(state)
        return super().join_message(state)

    def _check_personal(self, s: ClientState) -> None:
        from fedproto.errors import ConfigError

        personal = self.is_personal(s.model)
        if not any(personal(n) for n, _ in s.model.named_parameters()):
            raise ConfigError(f"{self.name} keeps the head on the client, but client {s.cid}'s model has no known "
                              "head; give Client(..., head='<name of its final layer>')")

    def include(self, model: ProtoModel) -> Callable[[str], bool]:
        """The tensors shared: all but the personal layers (:meth:`is_personal`)."""
        personal = self.is_personal(model)

        def shared(name: str) -> bool:
            return not personal(name)

        return shared
