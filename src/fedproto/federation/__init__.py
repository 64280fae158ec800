"""Your own federation: your client models and your data, through the simulator's engine.

    from fedproto.federation import Client, federate

    clients = [Client(model=MyNet(), train=(x0, y0), test=(tx0, ty0)),            # returns (logits, h)
               Client(model=resnet, head="fc", train=my_dataset, test=my_test_set)]  # split at its head
    sim = federate(clients, num_classes=10, algorithm="fedproto", rounds=20, out="runs/mine")
    summary = sim.run()

A client's model is either a module whose ``forward(x)`` returns ``(logits (B, C), embedding
(B, d))``, or any classifier plus the name of its final layer (``head``): the embedding is that
layer's input, flattened (torchvision- and timm-style heads ``fc``, ``classifier``, ``head``).
Data are tensors or arrays held in memory (the fast path), or a map-style
``torch.utils.data.Dataset`` whose items are ``(x, y)`` pairs, read batch by batch with its own
transforms (for data that does not fit in memory). Everything is checked before round 1, and
each error names the client. The engine, evaluation, metrics, run directory and checkpoints are
those of :class:`fedproto.simulation.Simulation`.

The adapters of a user's model live in :mod:`fedproto.federation.own_models`, those of the data in
:mod:`fedproto.federation.own_data`; every name is importable from here. The call path of a round:
docs/architecture.md.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedproto.algorithms.algorithm import ClientData, ClientState
from fedproto.config.run_config import build_config
from fedproto.data.partition import Partition
from fedproto.errors import ConfigError, DataError, ModelError
from fedproto.federation.own_data import (
    LABEL_CHECKS,
    PROBE_ITEMS,
    LazyInputs,
    _split,
    dataset_labels,
    model_dtype,
    to_model_dtype,
)
from fedproto.federation.own_models import (
    HeadSplitModel,
    Projected,
    TupleModel,
    adapt,
    share_initial_weights,
    with_projection,
)
from fedproto.simulation import Simulation

ArrayLike = Any


@dataclass
class Client:
    """One client of your federation.

    Attributes:
        model: an ``nn.Module`` returning ``(logits, embedding)``, or any classifier with ``head``.
        train, test: ``(x, y)`` tensors or arrays (x: (n, ...) float, y: (n,) int labels in
            0..C-1), or a map-style ``Dataset`` of ``(x, y)`` items.
        head: name of the final layer of a classifier (its input is the embedding); None when
            ``model`` returns ``(logits, embedding)`` itself.
        embedding_dim: when given and the model's embedding has another size, a linear projection
            to this size and a new linear head are appended (:func:`with_projection`), so clients
            whose architectures end in different widths share one prototype size.
        collate: for a ``Dataset``: a function from a list of items' inputs to the model's batch
            input (e.g. :func:`fedproto.data.inputs.pad_collate` for variable-length token
            sequences); None: inputs are stacked (leaf by leaf for dicts and tuples).

    Inputs reach the model as it takes them: integer token ids stay integers, a dict (``{"input_ids":
    ..., "attention_mask": ...}``) stays a dict, a tuple ``(ids, mask)`` a tuple; in-memory ``x`` may
    be such a dict, tuple or list of (n, ...) tensors or arrays (:class:`fedproto.data.inputs.Inputs`).
    """

    model: nn.Module
    train: Any
    test: Any
    head: str | None = None
    embedding_dim: int | None = None
    collate: Any = None


def federate(clients: Sequence[Client], num_classes: int | None = None, out: Any = None, *,
             dataset: str | None = None, observers: Sequence[Any] = (), **options: Any):
    """Build a :class:`~fedproto.simulation.Simulation` of your own clients.

    Defaults: where ``dataset`` names the registry's dataset your data come from (``"mnist"``,
    ``"cifar10"``...), the options the paper sets per dataset take its values, as ``fedproto run
    --dataset`` does (``rounds``: mnist 100, femnist 120, cifar10 110; ``lambda_proto``: mnist 1,
    cifar10 0.1) and ``num_classes`` defaults to its classes; without ``dataset``: 20 rounds and
    λ = 1. Every other option has :class:`~fedproto.config.run_config.RunConfig`'s default (batch size 8, lr
    0.01, momentum 0.5, ...); any keyword overrides.

    Args:
        clients: one :class:`Client` per client (their order gives the client ids 0..m-1).
        num_classes: C; labels lie in 0..C-1 (default: the classes of ``dataset``; required
            without it).
        out: the run directory (None: ``out_dir/<algorithm>-custom-m<clients>-s<seed>``; False:
            write nothing).
        dataset: the name of a dataset of :data:`fedproto.data.registry.DATASETS` whose per-dataset
            defaults to use (None: the defaults above). It only sets defaults: the data are your
            clients'.
        observers: your own :class:`fedproto.engine.loop.Observer` s (:class:`~fedproto.simulation.Simulation`'s
            ``observers``).
        options: any run option of :class:`fedproto.config.run_config.RunConfig` (``algorithm``,
            ``rounds``, ``lambda_proto``, ``lr``, ``batch_size``, ``participation``...).
    Returns:
        A Simulation; ``.run()`` trains and returns the summary.
    Raises:
        ConfigError: a bad option, an unknown ``dataset``, or ``num_classes`` missing, not a whole
            number, or not the dataset's. DataError: bad data (names the client). ModelError: a model
            that does not fit (names the client), two clients sharing a model or layer object, or
            embedding sizes that differ (names the clients and the fix,
            ``Client(..., embedding_dim=d)``).
    """
    from fedproto.data.registry import DATASETS, LOADABLE
    from fedproto.engine.setup import build_setup

    if isinstance(clients, Client) or not isinstance(clients, Iterable):
        raise DataError(f"clients is a {type(clients).__name__}; pass a list of fedproto.federation.Client")
    clients = list(clients)
    if not clients:
        raise DataError("no clients given; pass a list of fedproto.federation.Client")
    if num_classes is not None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral):
            raise ConfigError(f"federate(num_classes={num_classes!r}): give the number of classes as a whole number "
                              "(your labels lie in 0..num_classes-1)")
        num_classes = int(num_classes)
    for k in ("classes", "clients", "model", "partition"):
        if k in options:
            raise ModelError(f"{k} is set by federate() from your clients; leave it out")
    if dataset is not None:
        if dataset not in LOADABLE:
            raise ConfigError(f"federate(dataset={dataset!r}): no such dataset; name one of {', '.join(LOADABLE)} "
                              "for its defaults, or leave dataset out")
        info = DATASETS[dataset]
        if num_classes is not None and num_classes != info.classes:
            raise ConfigError(f"federate(num_classes={num_classes}, dataset={dataset!r}): {dataset} has "
                              f"{info.classes} classes; give num_classes={info.classes} or leave it out")
        num_classes = info.classes
        from fedproto.algorithms.method_options import owners

        defaults = {"rounds": info.rounds}
        if options.get("algorithm", "fedproto") in owners("lambda_proto"):  # λ only where the algorithm has one
            defaults["lambda_proto"] = info.lambda_proto
        options = {**defaults, **options}
    if num_classes is None:
        raise ConfigError("federate() needs num_classes (your labels lie in 0..num_classes-1), or dataset='<name>' "
                          "of the dataset your data come from")
    cfg = build_config(overrides={**options, "dataset": "custom", "classes": int(num_classes),
                                  "clients": len(clients), "model": "custom"})
    states, data, part = [], [], Partition([], [], [])
    owner: dict[int, int] = {}  # id of a parameter -> its client: no two clients may share one
    for i, c in enumerate(clients):
        if not isinstance(c, Client):
            raise DataError(f"client {i} is a {type(c).__name__}; wrap it as fedproto.federation.Client(model, train, "
                            "test)")
        x, y = _split(c.train, i, "train", num_classes, c.collate)
        tx, ty = _split(c.test, i, "test", num_classes, c.collate)
        dtype = model_dtype(c.model)  # inputs in the model's floating dtype, on every route (logged when cast)
        x, tx = to_model_dtype(x, dtype, i, "train"), to_model_dtype(tx, dtype, i, "test")
        if c.embedding_dim is not None and (isinstance(c.embedding_dim, bool) or not (
                isinstance(c.embedding_dim, numbers.Integral) and c.embedding_dim >= 1)):
            raise ModelError(f"client {i}: embedding_dim={c.embedding_dim!r}; give a whole number >= 1 or None")
        try:
            sample = x[0:1]
        except DataError as e:
            raise e.prefixed(f"client {i}: train: ") from None
        except (TypeError, ValueError, IndexError, KeyError, AttributeError, RuntimeError) as e:
            raise DataError(f"client {i}: cannot read its first training input ({type(e).__name__}: {str(e)[:160]}); "
                            "its inputs must be tensors or arrays of one shape") from None
        mine = list(c.model.named_parameters()) if isinstance(c.model, nn.Module) else []
        shared = next(((owner[id(p)], n) for n, p in mine if id(p) in owner), None)
        if shared is not None:
            raise ModelError(f"clients {shared[0]} and {i} share parameters (e.g. {shared[1]!r}: the same model or "
                             "layer object), so they would train one set of weights; give each client its own model "
                             "(e.g. copy.deepcopy(model))")
        owner.update((id(p), i) for _, p in mine)
        model = adapt(c.model, c.head, num_classes, sample, i)
        if c.embedding_dim is not None:
            model = with_projection(model, int(c.embedding_dim))
        states.append(ClientState(i, model, np.unique(y.numpy())))
        data.append(ClientData(x, y, tx, ty))
        part.train_idx.append(np.arange(len(y)))
        part.test_idx.append(np.arange(len(ty)))
        part.classes.append(states[-1].classes)
        part.shots.append(np.bincount(y.numpy(), minlength=num_classes)[states[-1].classes])
    if cfg.augment:  # random crops and flips act on image batches (n, C, H, W) only
        other = [i for i, d in enumerate(data) if not (isinstance(b := d.x[0:1], torch.Tensor) and b.dim() == 4)]
        if other:
            raise ConfigError(f"augment=True crops and flips images (n, C, H, W), but the inputs of clients "
                              f"{other[:10]} are not image tensors (token ids, dicts, tables or signals); leave "
                              "augment off for them, or augment in your Dataset's transform")
    dims = [int(s.model.embedding_dim) for s in states]
    fix = (f"give every client Client(..., embedding_dim=d) with one d (e.g. embedding_dim={min(dims)}), which appends "
           "a projection to size d where a model's embedding differs")  # the check: build_setup's, worded for Python
    if cfg.shared_init:  # clients of one architecture start from the first one's weights
        share_initial_weights([st.model for st in states])
    setup = build_setup(cfg, states, data, part, fix=fix)  # the checks and the resolved options of `fedproto run`
    return Simulation(cfg, setup=setup, out=out, observers=observers)


FederationSimulation = Simulation
"""The run :func:`federate` builds: a :class:`~fedproto.simulation.Simulation` (which writes
``embeddings.npz`` for ``fedproto plot`` into its run directory, as every front end does)."""


__all__ = ["LABEL_CHECKS", "PROBE_ITEMS", "Client", "FederationSimulation", "HeadSplitModel", "LazyInputs", "Projected",
           "TupleModel", "adapt", "dataset_labels", "federate", "share_initial_weights", "with_projection"]
