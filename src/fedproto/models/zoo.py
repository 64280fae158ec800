"""Model names -> per-client builders (docs/architecture.md, "A model"), including FedProto-mh assignments.

Names:
    ``cnn``: the paper CNN for every client.
    ``cnn-mh``: FedProto-mh for MNIST/FEMNIST: conv2 channels 18 / 20 / 22 for clients whose index
        falls in the first / second / third of three equal blocks (official code for 20 clients:
        0-6, 7-13, 14-19; exps/federated_main.py).
    ``cnn-small+cnn-large`` style lists: ``"projcnn:16-32,projcnn:32-64"`` assigns the listed
        architectures round-robin; every entry ends in a projection to ``embedding_dim``.
    ``resnet18``: ResNet18 (CIFAR-10 model, §Experiments), conv1/maxpool strides (2, 2); d = 512
        whatever ``embedding_dim`` says (the architecture fixes it).
    ``resnet18-mh``: FedProto-mh for CIFAR-10: strides (1, 4) for the first half of the clients
        (ceil(m/2); official code for 20 clients: 0-9), (2, 2) for the others.

``pretrained``: a torchvision-layout resnet18 state dict file, loaded into every ResNet18 client
except conv1/bn1/fc (official code, exps/federated_main.py; :func:`fedproto.models.resnet.load_pretrained`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

import torch

from fedproto.errors import ModelError, opt, suggestion
from fedproto.models.cnn import PaperCNN, ProjectedCNN
from fedproto.models.names import MODEL_NAMES, zoo_name  # the one list of names (MODEL_NAMES re-exported)
from fedproto.models.proto_model import ProtoModel
from fedproto.models.resnet import MH_STRIDES, ResNet18, load_pretrained, read_state_dict

log = logging.getLogger(__name__)



def mh_conv2_channels(cid: int, num_clients: int) -> int:
    """FedProto-mh conv2 width of client ``cid``: 18, 20, 22 by thirds (official: 0-6/7-13/14-19 of 20)."""
    block = -(-num_clients // 3)  # ceil: 20 -> 7
    return (18, 20, 22)[min(cid // block, 2)]


def mh_resnet_strides(cid: int, num_clients: int) -> tuple[int, int]:
    """FedProto-mh (conv1, maxpool) strides of client ``cid``: (1, 4) for the first ceil(m/2)
    clients, else (2, 2) (official code for 20 clients: clients 0-9 (1, 4))."""
    return MH_STRIDES[0] if cid < -(-num_clients // 2) else MH_STRIDES[1]


def _unknown_model(spec: str) -> ModelError:
    """The error for an unknown model name: the nearest known name ("did you mean 'resnet18'?")
    where one is close, and the known names."""
    near = suggestion(spec, [n for n in MODEL_NAMES if ":" not in n])
    guess = f"; did you mean {near!r}?" if near is not None else ""
    return ModelError(f"unknown model {spec!r}{guess} (known: {', '.join(MODEL_NAMES)})")


def _one(spec: str, cid: int, num_clients: int, in_channels: int, num_classes: int, input_size: int,
         embedding_dim: int, dropout: float) -> ProtoModel:
    if spec == "cnn":
        return PaperCNN(in_channels, num_classes, 20, embedding_dim, input_size, dropout)
    if spec == "cnn-mh":
        return PaperCNN(in_channels, num_classes, mh_conv2_channels(cid, num_clients), embedding_dim,
                        input_size, dropout)
    if spec == "resnet18":
        return ResNet18(num_classes, in_channels)
    if spec == "resnet18-mh":
        return ResNet18(num_classes, in_channels, *mh_resnet_strides(cid, num_clients))
    if spec.startswith("projcnn:"):
        return ProjectedCNN(in_channels, num_classes, projcnn_channels(spec), embedding_dim, dropout=0.0)
    raise _unknown_model(spec)


def model_seed(seed: int, cid: int) -> int:
    """The torch seed set before client ``cid``'s model is built (its initial weights)."""
    return seed * 1_000_003 + cid


def init_seed(seed: int, cid: int, shared_init: bool = False) -> int:
    """The torch seed of client ``cid``'s initial weights: :func:`model_seed` of the client, or with
    ``shared_init`` that of client 0 for every client (one architecture built after one seed gives the same
    weights, so clients of one architecture start identical wherever they are built)."""
    return model_seed(seed, 0 if shared_init else cid)


def build_model(spec: str, cid: int, in_channels: int, num_classes: int, input_size: int,
                embedding_dim: int = 50, dropout: float = 0.5, seed: int = 0, shared_init: bool = False) -> ProtoModel:
    """One client's model from a single zoo spec (``cnn``, ``projcnn:16-32``, ``resnet18``), seeded
    with :func:`init_seed` as :func:`build_client_models` seeds client ``cid`` (the ``-mh`` specs
    depend on the number of clients: use :func:`build_client_models` for them).

    Raises:
        ModelError: an unknown spec, or an ``-mh`` spec.
    """
    if spec.endswith("-mh"):
        raise ModelError(f"model {spec!r} assigns architectures by client position among all clients; give one "
                         "architecture per node (cnn, projcnn:<c1>-<c2>, resnet18)")
    check_model_name(spec)
    torch.manual_seed(init_seed(seed, cid, shared_init))
    return _one(spec, cid, cid + 1, in_channels, num_classes, input_size, embedding_dim, dropout)


def build_client_models(
    name: str, num_clients: int, in_channels: int, num_classes: int, input_size: int,
    embedding_dim: int = 50, dropout: float = 0.5, seed: int = 0,
    pretrained: str | os.PathLike | Mapping[str, torch.Tensor] | None = None, shared_init: bool = False,
) -> list[ProtoModel]:
    """Build one model per client, each initialised from its own seed (seed, client id).

    Args:
        name: see module docstring; a comma-separated list assigns specs round-robin.
        pretrained: resnet18 state dict (file path or mapping) for the ResNet18 clients; read once.
        shared_init: seed every client's model with client 0's seed (:func:`init_seed`), so clients of one
            architecture start from identical weights (the ``shared_init`` option; PFLlib, HtFLlib and
            FL-bench start clients this way), clients of different architectures from their own.
    Raises:
        ModelError: an unknown model name; ``pretrained`` given but no client is a ResNet18; a
            state dict that does not fit resnet18 (names the key).
        DataError: the ``pretrained`` file is missing or unreadable.
    """
    specs = [s.strip() for s in name.split(",") if s.strip()]
    if not specs:
        raise ModelError("empty model name")
    models = []
    for cid in range(num_clients):
        torch.manual_seed(init_seed(seed, cid, shared_init))
        models.append(_one(specs[cid % len(specs)], cid, num_clients, in_channels, num_classes,
                           input_size, embedding_dim, dropout))
    if pretrained is not None:
        targets = [m for m in models if isinstance(m, ResNet18)]
        if not targets:
            raise ModelError(f"pretrained weights are for resnet18 models, but model {name!r} has none",
                             option="pretrained", hint=f"use {opt('model', 'resnet18')} (or resnet18-mh) or "
                             f"drop {opt('pretrained')}")
        state = dict(pretrained) if isinstance(pretrained, Mapping) else read_state_dict(pretrained)
        origin = None if isinstance(pretrained, Mapping) else str(pretrained)
        for m in targets:
            load_pretrained(m, state, origin)
        log.info("loaded pretrained weights into %d ResNet18 client(s) (all but conv1, bn1, fc)", len(targets))
    return models


def build_client_model(
    name: str, cid: int, num_clients: int, in_channels: int, num_classes: int, input_size: int,
    embedding_dim: int = 50, dropout: float = 0.5, seed: int = 0,
    pretrained: str | os.PathLike | Mapping[str, torch.Tensor] | None = None, shared_init: bool = False,
) -> ProtoModel:
    """Client ``cid``'s model alone, exactly as :func:`build_client_models` builds it among
    ``num_clients`` clients (its architecture from its position in ``name``'s list and, for ``-mh``
    specs, among the clients; its initial weights from :func:`init_seed`). For a process that holds
    one client of a federation (a Flower simulation actor).

    Raises:
        ModelError: an unknown model name; ``cid`` outside ``0..num_clients-1``; ``pretrained`` for a
            client that is not a ResNet18 (given to a run where no client is one).
        DataError: the ``pretrained`` file is missing or unreadable.
    """
    specs = [s.strip() for s in name.split(",") if s.strip()]
    if not specs:
        raise ModelError("empty model name")
    if not 0 <= cid < num_clients:
        raise ModelError(f"client {cid} is outside 0..{num_clients - 1}")
    torch.manual_seed(init_seed(seed, cid, shared_init))
    model = _one(specs[cid % len(specs)], cid, num_clients, in_channels, num_classes, input_size, embedding_dim,
                 dropout)
    if pretrained is not None and isinstance(model, ResNet18):
        state = dict(pretrained) if isinstance(pretrained, Mapping) else read_state_dict(pretrained)
        load_pretrained(model, state, None if isinstance(pretrained, Mapping) else str(pretrained))
    elif pretrained is not None and not any(s.startswith("resnet18") for s in specs):
        raise ModelError(f"pretrained weights are for resnet18 models, but model {name!r} has none",
                         option="pretrained", hint=f"use {opt('model', 'resnet18')} (or resnet18-mh) or "
                         f"drop {opt('pretrained')}")
    return model


_PROJCNN = re.compile(r"projcnn:([0-9]+(?:-[0-9]+)*)", re.ASCII)
MAX_PROJCNN_CHANNELS = 4096
MAX_PROJCNN_LAYERS = 8


def projcnn_channels(spec: str) -> tuple[int, ...]:
    """Conv channels of a ``projcnn:<c1>-<c2>[-...]`` spec, e.g. ``projcnn:32-64`` -> (32, 64).

    Raises:
        ModelError: not that form, a channel count outside 1..4096, or more than 8 layers.
    """
    m = _PROJCNN.fullmatch(spec)
    chans = tuple(int(c) for c in m.group(1).split("-")) if m else ()
    if not chans or len(chans) > MAX_PROJCNN_LAYERS or not all(1 <= c <= MAX_PROJCNN_CHANNELS for c in chans):
        raise ModelError(f"bad model spec {spec!r}: write projcnn:<channels>-<channels> with 1 to "
                         f"{MAX_PROJCNN_LAYERS} conv layers of 1 to {MAX_PROJCNN_CHANNELS} channels, "
                         "e.g. projcnn:32-64")
    return chans


def check_model_name(name: str) -> None:
    """Validate a model name without building any model (raises :class:`ModelError`)."""
    specs = [s.strip() for s in name.split(",")]
    if not any(specs):
        raise ModelError("empty model name; known: " + ", ".join(MODEL_NAMES))
    if not all(specs):
        raise ModelError(f"model list {name!r} has an empty entry; write the specs separated by single commas, "
                         "e.g. 'cnn,projcnn:16-32'")
    for spec in specs:
        entry = zoo_name(spec)
        if entry is not None and entry.family != "projcnn":
            continue
        if spec.startswith("projcnn:"):
            projcnn_channels(spec)
            continue
        raise _unknown_model(spec)


