"""The model seam: every client model is a :class:`ProtoModel` (embedding + head).

``embed(x) -> (B, d)``, ``head(h) -> (B, C)`` logits, ``forward(x) -> (logits, h)``.
The embedding size ``d`` must be equal across clients (FedProto, app. B); the engine
checks this once at start (:func:`check_embedding_dims`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from fedproto.errors import ModelError

Noise = Mapping[str, torch.Tensor]
"""Explicit dropout masks keyed by layer name, each (B, width), already scaled by 1/(1-p).

Models of the CNN family take their dropout randomness from these masks when given, so the
sequential and the client-batched execution paths draw identical noise from per-client
generators (see :mod:`fedproto.training`). ``None`` means ordinary dropout from torch's RNG.
"""


class ProtoModel(nn.Module):
    """Base class: a backbone producing a d-dim embedding and a head producing logits.

    Subclasses implement :meth:`embed` and :meth:`head`. ``embedding_dim`` and
    ``num_classes`` are ints set by the subclass.
    """

    embedding_dim: int
    num_classes: int

    def embed(self, x: torch.Tensor, noise: Noise | None = None) -> torch.Tensor:
        """Map inputs (B, C, H, W) to embeddings (B, d), float32."""
        raise NotImplementedError

    def head(self, h: torch.Tensor, noise: Noise | None = None) -> torch.Tensor:
        """Map embeddings (B, d) to logits (B, num_classes)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, noise: Noise | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(logits (B, C), embedding (B, d))`` from one pass."""
        h = self.embed(x, noise)
        return self.head(h, noise), h

    head_prefixes: tuple[str, ...] = ()
    """Parameter-name prefixes of the decision layers g (the rest is the representation f)."""

    fc_prefixes: tuple[str, ...] | None = None
    """Parameter-name prefixes of every fully connected layer after the convolutional base
    (None: the head only). For the paper CNN ``fc1`` and ``fc2``; for ResNet18 ``fc``."""

    def is_head_param(self, name: str) -> bool:
        """True if parameter ``name`` belongs to the head g (the last, decision layer)."""
        return name.startswith(self.head_prefixes)

    def is_personal_param(self, name: str, layers: str = "fc") -> bool:
        """True if tensor ``name`` stays on the client under FedPer/FedRep's split.

        Args:
            name: a parameter or buffer name of this model.
            layers: ``"fc"``: every fully connected layer after the convolutional base
                (:attr:`fc_prefixes`; tab. 1's Params column for FedPer/FedRep, 106k on MNIST =
                20 clients x 5,280 conv parameters of the paper CNN); ``"head"``: the head g only.
        Raises:
            ValueError: ``layers`` is neither.
        """
        if layers == "head":
            return self.is_head_param(name)
        if layers == "fc":
            return name.startswith(self.fc_prefixes if self.fc_prefixes is not None else self.head_prefixes)
        raise ValueError(f"personal layers {layers!r}: use 'fc' or 'head'")

    def noise_widths(self) -> dict[str, int]:
        """Widths of the explicit dropout masks this model consumes (empty: none)."""
        return {}

    @property
    def dropout(self) -> float:
        """Dropout probability used with explicit masks (0 when the model has none)."""
        return 0.0

    def arch_key(self) -> tuple | None:
        """Hashable architecture description for client batching; None: not batchable."""
        return None

    batch_params: tuple[str, ...] = ()
    """The batched-path protocol (:func:`fedproto.training.train_group`): names of the parameters
    stacked along a client axis, in the order :meth:`grouped_forward` reads them; empty: this
    model trains on the sequential path only. A model joins the batched path by giving these, an
    :meth:`arch_key` and :meth:`grouped_forward`, without changes to the training loop."""

    def grouped_forward(self, P: Mapping[str, torch.Tensor], xb: torch.Tensor, G: int, noise=None):
        """Forward pass of G stacked copies of this architecture with parameters ``P`` (name ->
        (G, *shape)) on ``xb`` (B, G*C_in, H, W) channels-last, dropout masks ``noise`` (name ->
        (G, B, width)) or None; returns logits (G, B, C) and embeddings (G, B, d)."""
        raise NotImplementedError(f"{type(self).__name__} has no batched forward; it trains sequentially")


class WrappedModel(ProtoModel):
    """Wrap any ``backbone: nn.Module`` (x -> (B, ...)) and ``head: nn.Module`` ((B, d) -> (B, C)).

    The backbone output is flattened to (B, d). ``embedding_dim`` must be given (it is checked
    on the first forward pass: a mismatch raises :class:`ModelError`).
    """

    head_prefixes = ("classifier.",)

    def __init__(self, backbone: nn.Module, head: nn.Module, embedding_dim: int, num_classes: int):
        super().__init__()
        self.backbone = backbone
        self.classifier = head
        self.embedding_dim = int(embedding_dim)
        self.num_classes = int(num_classes)

    def embed(self, x, noise=None):
        h = self.backbone(x).flatten(1)
        if h.shape[1] != self.embedding_dim:
            raise ModelError(
                f"backbone produced embeddings of size {h.shape[1]}, declared embedding_dim="
                f"{self.embedding_dim}; fix the declaration or add a projection layer"
            )
        return h

    def head(self, h, noise=None):
        return self.classifier(h)


def check_embedding_dims(models: Sequence[ProtoModel]) -> int:
    """Return the shared embedding size d, or raise :class:`ModelError` naming the clients that differ.

    FedProto averages prototypes across clients, so d must be equal (app. B).
    """
    dims = [int(m.embedding_dim) for m in models]
    if not dims:
        raise ModelError("no client models were built")
    values = sorted(set(dims))
    if len(values) > 1:
        groups = "; ".join(
            f"d={v}: clients {[i for i, x in enumerate(dims) if x == v]}" for v in values
        )
        raise ModelError(
            f"clients have different embedding sizes ({groups}); FedProto needs one embedding "
            "size for all clients: give every model the same embedding_dim (add a projection layer)"
        )
    return values[0]


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters (elements)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
