"""A SuperNode's own client: its data folder and its model, named in its node config.

Node config keys (``flower-supernode --node-config '...'``):

``client-id``
    This client's id, a whole number >= 0, unique in the federation. It names the client in the
    server's logs and metrics and seeds its training exactly as client ``client-id`` of an
    in-process run (:func:`fedproto.engine.executors.in_process.client_step`).
``data``
    The client's folder: ``train.npz`` and ``test.npz`` (arrays ``x``, ``y``; or several named
    input arrays ``x.<name>``, e.g. token ids and masks, that a factory's model takes as a dict), or ``train/`` and
    ``test/`` folders of class sub-folders of images (:func:`fedproto.data.folder.load_client_folder`).
``model``
    A zoo spec (``cnn``, ``projcnn:16-32``, ``resnet18``; built for the data's channels and size,
    ending in the run's ``embedding-dim``), or an import path ``package.module:factory`` of a
    function returning an ``nn.Module`` (called with those of ``num_classes``, ``in_channels``
    and ``embedding_dim`` it accepts). The model is built after ``torch.manual_seed(
    fedproto.models.zoo.model_seed(seed, client-id))`` (with ``shared-init``: client-id 0's seed on every
    node, :func:`fedproto.models.zoo.init_seed`).
``head`` (optional)
    The final layer of a plain classifier from a factory (its input is the embedding); leave it
    out when the module returns ``(logits, embedding)`` itself.
``state-dir`` (optional)
    The folder of the node's state file, which keeps the client's model across a restart of the
    SuperNode (:mod:`fedproto.flower.node_state`); default ``~/.cache/fedproto/node-state``
    (``$XDG_CACHE_HOME/fedproto/node-state``); ``state-dir=""``: no state file.
``misbehave`` (optional, for tests of the server's checks only)
    ``nan``, ``scale``, ``random`` or ``flip``: the node corrupts every message it sends up
    (:func:`fedproto.engine.attacks.corrupt_message`).

The run config declares the class set (``classes``) and the embedding size (``embedding-dim``);
a node whose labels fall outside the classes or whose model has another embedding size is
refused with a :class:`~fedproto.errors.ConfigError` naming the node.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedproto.algorithms.algorithm import Algorithm, ClientData, ClientState, Message
from fedproto.algorithms.requirements import needs_one_size
from fedproto.config.run_config import RunConfig
from fedproto.data.inputs import describe
from fedproto.errors import ConfigError, FedprotoError
from fedproto.models.names import MODEL_NAMES, ZOO

MISBEHAVIOURS = ("nan", "scale", "random", "flip", "vanish")
"""``vanish``: the node fails every train step (after the key and share steps of ``secagg``): a dropout."""
NODE_KEYS = ("client-id", "data", "model", "head", "state-dir", "misbehave", "data-dir")
"""The node config keys of an own-data node (``data-dir`` is accepted and unused)."""
FLOWER_NODE_KEYS = ("partition-id", "num-partitions")
"""Node config keys Flower's simulation runtime sets itself (ignored on an own-data node)."""


@dataclass
class LocalClient:
    """A node's client: its state (model, classes), data and the algorithm's client side."""

    cid: int
    state: ClientState
    data: ClientData
    algorithm: Algorithm
    who: str


def whole(v: Any) -> bool:
    """True for a whole number (an int, or a float without fraction; not a bool)."""
    if isinstance(v, bool):
        return False
    try:
        return float(v).is_integer()
    except (TypeError, ValueError):
        return False


def node_client_id(node_config: Mapping[str, Any]) -> int:
    """The ``client-id`` of a node config. Raises ConfigError when it is missing or not a whole number >= 0."""
    v = node_config.get("client-id")
    if v is None or not whole(v) or int(float(v)) < 0:
        raise ConfigError(f"node config client-id={v!r}: give this SuperNode a whole number >= 0, unique in the "
                          "federation, e.g. --node-config 'client-id=0 data=\"/data/site0\" model=\"cnn\"'")
    return int(float(v))


def load_local_client(node_config: Mapping[str, Any], cfg: RunConfig,
                      class_names: list[str] | None = None) -> LocalClient:
    """Build the node's client from its node config (see the module docstring) and the run config.

    Raises:
        ConfigError: a missing or bad key, unreadable data, labels outside the run's classes, a
            model that cannot be built or whose embedding size differs from ``embedding_dim``;
            every message starts with ``node client-id=<id>``.
    """
    from fedproto.data.folder import load_client_folder
    from fedproto.data.partition import Partition
    from fedproto.engine.setup import build_setup
    from fedproto.federation import adapt
    from fedproto.models.zoo import build_model, init_seed

    unknown = sorted(str(k) for k in node_config if k not in NODE_KEYS + FLOWER_NODE_KEYS)
    if unknown:
        cid = node_config.get("client-id")
        where = f"node client-id={cid}" if cid is not None else "this SuperNode"
        raise ConfigError(f"{where}: unknown node config key(s) {', '.join(repr(k) for k in unknown)}; the known keys "
                          f"are {', '.join(NODE_KEYS[:6])}; check the spelling (e.g. client-id, not clientid)")
    cid = node_client_id(node_config)
    who = f"node client-id={cid}"
    for key in ("data", "model"):
        if not isinstance(node_config.get(key), str) or not node_config[key].strip():
            raise ConfigError(f"{who}: node config {key}={node_config.get(key)!r}; give a string, e.g. data=\"/data/"
                              "site0\" model=\"cnn\"")
    bad = node_config.get("misbehave")
    if bad is not None and bad not in MISBEHAVIOURS:
        raise ConfigError(f"{who}: node config misbehave={bad!r}; choose one of {', '.join(MISBEHAVIOURS)} "
                          "(tests only)")
    C, d = cfg.num_classes, cfg.embedding_dim
    spec, head = node_config["model"].strip(), node_config.get("head")
    try:
        (x, y), (tx, ty) = load_client_folder(node_config["data"], C, class_names)
        if _is_import_path(spec):
            torch.manual_seed(init_seed(cfg.seed, cid, cfg.shared_init))  # shared_init: one seed for all nodes
            factory_model = _factory(spec, C, int(x.shape[1]) if isinstance(x, torch.Tensor) else 0, d)
            try:
                model = adapt(factory_model, head, C, x[0:1], cid)
            except FedprotoError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure of a user's model on one input
                hint = (f"if its forward returns (logits, embedding) itself, leave out head={head!r}"
                        if head is not None
                        else "its forward must return (logits, embedding), or give head='<final layer name>'")
                raise ConfigError(f"model {spec!r} failed on a training input of shape {describe(x[0:1])} "
                                  f"({type(e).__name__}: {str(e)[:200]}); {hint}") from None
        else:
            if not isinstance(x, torch.Tensor) or x.ndim != 4:
                raise ConfigError(f"model {spec!r} takes images (n, C, H, W) but the data are "
                                  f"{describe(x) if not isinstance(x, torch.Tensor) else tuple(x.shape)}; give a model "
                                  "factory (package.module:factory) for flat features or named arrays")
            try:
                model = build_model(spec, cid, int(x.shape[1]), C, int(x.shape[-1]), d, cfg.dropout, cfg.seed,
                                    shared_init=cfg.shared_init)
            except FedprotoError:
                raise
            except Exception as e:  # noqa: BLE001 - e.g. images too small for the architecture
                raise ConfigError(f"model {spec!r} cannot be built for inputs of shape {tuple(x.shape[1:])} "
                                  f"({type(e).__name__}: {str(e)[:200]}); give larger images "
                                  "or a model factory (package.module:factory) that takes this size") from None
    except FedprotoError as e:
        raise ConfigError(f"{who}: {e}") from None
    if model.embedding_dim != d and needs_one_size(cfg.algorithm):  # fd, local: any size (their model_needs)
        raise ConfigError(f"{who}: its model {spec!r} has embedding size {model.embedding_dim}, but the run's "
                          f"embedding-dim is {d}; end the model in a {d}-wide layer (or change embedding-dim)")
    state = ClientState(cid, model, np.unique(y.numpy()))
    data = ClientData(x, y, tx, ty)
    try:  # the set-up of every front end (fedproto.engine.setup.build_setup), for this node's one client
        setup = build_setup(cfg, [state], [data], Partition([np.arange(len(y))], [np.arange(len(ty))],
                                                            [state.classes]), place=False,
                            whole=False)
    except FedprotoError as e:
        raise ConfigError(f"{who}: {e}") from None
    return LocalClient(cid, state, data, setup.algorithm, who)


def _is_import_path(spec: str) -> bool:
    """``package.module:factory`` rather than a zoo spec (``projcnn:16-32`` has a colon too)."""
    from fedproto.errors import ModelError
    from fedproto.models.zoo import check_model_name

    mod, sep, _ = spec.partition(":")
    if not sep or mod.strip() in ZOO:
        return False  # a zoo spec (a bad one gets the zoo's message)
    try:
        check_model_name(spec)
        return False
    except ModelError:
        return True


def _factory(path: str, num_classes: int, in_channels: int, embedding_dim: int) -> torch.nn.Module:
    """Call the ``package.module:factory`` at ``path``; raises ModelError-like ConfigError."""
    mod_name, _, attr = path.partition(":")
    if not all(p.isidentifier() for p in mod_name.split(".")) or not attr.isidentifier():

        raise ConfigError(f"model {path!r} is neither a zoo model ({', '.join(MODEL_NAMES)}) nor an import path "
                          "package.module:factory (absolute, e.g. mymodels.nets:small_cnn); fix the node config model=")
    try:
        fn = getattr(importlib.import_module(mod_name), attr)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - missing package, or the module failed while importing
        where = "cannot be imported" if isinstance(e, (ImportError, AttributeError)) else "failed while importing"
        raise ConfigError(f"model {path!r} {where} ({type(e).__name__}: {str(e)[:200]}); install the package on "
                          "this node, fix the module, or fix the import path (package.module:factory)") from None
    offered = {"num_classes": num_classes, "in_channels": in_channels, "embedding_dim": embedding_dim}
    try:
        params = inspect.signature(fn).parameters
        kwargs = {k: v for k, v in offered.items() if k in params}
        model = fn(**kwargs)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever the user's factory raises
        raise ConfigError(f"model factory {path!r} failed ({type(e).__name__}: {str(e)[:200]}); fix the factory (it "
                          f"is called with those of {sorted(offered)} it accepts)") from None
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model factory {path!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def corrupt(message: Message, kind: str, rng: np.random.Generator, num_classes: int) -> Message:
    """A misbehaving node's message (node config ``misbehave``, tests of the server's checks):
    :func:`fedproto.engine.attacks.corrupt_message` (``nan``, ``scale``, ``random``, ``flip``), as the
    simulator's ``attackers`` use it."""
    from fedproto.engine.attacks import corrupt_message

    return corrupt_message(message, kind, rng, num_classes)


__all__ = ["LocalClient", "MISBEHAVIOURS", "NODE_KEYS", "corrupt", "load_local_client", "node_client_id", "whole"]
