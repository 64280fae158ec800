"""Model names -> per-client builders (DESIGN.md ``zoo``), including FedProto-mh assignments.

Names:
    ``cnn``: the paper CNN for every client.
    ``cnn-mh``: FedProto-mh for MNIST/FEMNIST: conv2 channels 18 / 20 / 22 for clients whose index
        falls in the first / second / third of three equal blocks (official code for 20 clients:
        0-6, 7-13, 14-19; exps/federated_main.py).
    ``cnn-small+cnn-large`` style lists: ``"projcnn:16-32,projcnn:32-64"`` assigns the listed
        architectures round-robin; every entry ends in a projection to ``embedding_dim``.
"""

from __future__ import annotations

from typing import Callable

import torch

from fedproto.errors import ModelError
from fedproto.models.base import ProtoModel
from fedproto.models.cnn import PaperCNN, ProjectedCNN

MODEL_NAMES = ("cnn", "cnn-mh", "projcnn:<c1>-<c2>[,...]")


def mh_conv2_channels(cid: int, num_clients: int) -> int:
    """FedProto-mh conv2 width of client ``cid``: 18, 20, 22 by thirds (official: 0-6/7-13/14-19 of 20)."""
    block = -(-num_clients // 3)  # ceil: 20 -> 7
    return (18, 20, 22)[min(cid // block, 2)]


def _one(spec: str, cid: int, num_clients: int, in_channels: int, num_classes: int, input_size: int,
         embedding_dim: int, dropout: float) -> ProtoModel:
    if spec == "cnn":
        return PaperCNN(in_channels, num_classes, 20, embedding_dim, input_size, dropout)
    if spec == "cnn-mh":
        return PaperCNN(in_channels, num_classes, mh_conv2_channels(cid, num_clients), embedding_dim,
                        input_size, dropout)
    if spec.startswith("projcnn:"):
        try:
            chans = tuple(int(c) for c in spec.split(":", 1)[1].split("-"))
        except ValueError:
            raise ModelError(f"bad model spec {spec!r}: write projcnn:<channels>-<channels>, e.g. projcnn:32-64")
        return ProjectedCNN(in_channels, num_classes, chans, embedding_dim, dropout=0.0)
    raise ModelError(f"unknown model {spec!r}; known: {', '.join(MODEL_NAMES)}")


def build_client_models(
    name: str, num_clients: int, in_channels: int, num_classes: int, input_size: int,
    embedding_dim: int = 50, dropout: float = 0.5, seed: int = 0,
) -> list[ProtoModel]:
    """Build one model per client, each initialised from its own seed (seed, client id).

    Args:
        name: see module docstring; a comma-separated list assigns specs round-robin.
    Raises:
        ModelError: an unknown model name.
    """
    specs = [s.strip() for s in name.split(",") if s.strip()]
    if not specs:
        raise ModelError("empty model name")
    models = []
    for cid in range(num_clients):
        torch.manual_seed(seed * 1_000_003 + cid)
        models.append(_one(specs[cid % len(specs)], cid, num_clients, in_channels, num_classes,
                           input_size, embedding_dim, dropout))
    return models


def check_model_name(name: str) -> None:
    """Validate a model name without building (raises :class:`ModelError`)."""
    build_client_models(name, 1, 1, 2, 28, 4, 0.0)


