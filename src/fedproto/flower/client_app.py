"""The Flower ``ClientApp``: one fedproto client per SuperNode.

A node is one of two kinds, by its node config:

* **its own client** (``client-id``, ``data``, ``model``; :mod:`fedproto.flower.node`): the
  node reads its own data folder and builds its own model; nothing else about the federation
  is on it, and the run config only declares ``dataset = "custom"``, the ``classes`` and the
  ``embedding-dim``. Nodes may have different architectures.
* **a benchmark client** (``partition-id``, ``num-partitions``, optional ``data-dir``; what
  Flower's simulation runtime sets): every node makes the same seeded partition of the run's
  dataset from the run config and builds only client ``partition-id``'s model, reading its rows
  from the dataset memory-mapped once per machine (:mod:`fedproto.flower.virtual`).

The client's model and extras live in ``context.state`` between rounds (they never leave the
node); the data set-up is cached per process. An own-data node also keeps them in its state file
and reloads them after a restart, and every reply carries the node's ``instance``, ``restored`` and
``state-round`` in its metrics record (:mod:`fedproto.flower.node_state`).

Handlers (message types): ``query`` (reply: the client id, its classes, sample counts, embedding
size and parameter count, plus the algorithm's :meth:`~fedproto.algorithms.algorithm.Algorithm.join_message`,
e.g. initial weights for weight-sharing methods), ``train`` (one client step:
:func:`fedproto.engine.executors.in_process.client_step`, reply: the algorithm message plus losses) and
``evaluate`` (reply: the algorithm's per-client metrics).

Under DP (``dp`` ``prototypes`` or ``full``) a node sends only what is public or covered by the
accountant (:func:`fedproto.prototypes.dp.deployment_fields`): at ``query`` no sample counts, at
``train`` the noised release alone, at ``evaluate`` ``dp_epsilon`` under ``prototypes`` and
nothing under ``full``; the node logs what it keeps (its accuracy, and its ε under ``full``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedproto.algorithms.algorithm import Algorithm, ClientData, ClientState
from fedproto.config.run_config import RunConfig
from fedproto.engine.executors.in_process import client_step
from fedproto.errors import ConfigError
from fedproto.flower import node_state
from fedproto.flower.node import corrupt, load_local_client, whole
from fedproto.flower.records import (
    CONFIG,
    MESSAGE,
    METRICS,
    SCHEMA,
    FlowerOptions,
    from_record,
    run_config,
    schema_problem,
    to_record,
)
from fedproto.flower.virtual import forget as forget_virtual
from fedproto.flower.virtual import virtual_client
from fedproto.models.proto_model import count_parameters
from fedproto.prototypes.dp import deployment_fields

STATE_MODEL = "fedproto.model"
STATE_EXTRA = "fedproto.extra"

log = logging.getLogger(__name__)
EXPIRY: dict[str, float] = {}
"""``{"at": t}``: when the message this process is running expires (``created_at + ttl``, Unix
seconds), set by :func:`drop_expired`; the executor's child reads it to end a ClientApp that
outlives its message (:mod:`fedproto.deploy.warm_executor`)."""
SEEN_HOOKS: list = []
"""Called (no arguments) when a message reaches the ClientApp, before it is run or refused: the warm
executor's child tells its executor it got its message (:func:`fedproto.deploy.warm_tasks.child_reporter`)."""


class MessageExpired(RuntimeError):
    """A message reached the ClientApp after its ``ttl``: its round is over and no reply is awaited."""


def drop_expired(msg: Message, context: Context, call_next) -> Message:
    """Flower mod around every handler: refuse a message past its ``created_at + ttl`` (Unix
    seconds; the server sets ``ttl`` to the exchange's deadline plus
    :data:`fedproto.flower.exchange.TTL_MARGIN`) without running it, and note its expiry in
    :data:`EXPIRY` (infinite for a message whose ``created_at`` or ``ttl`` is missing or not a
    finite number: it runs, and the executor's child does not end itself for it).

    Raises:
        MessageExpired: naming the message type, its round and how long ago it expired (Flower
            sends the node's error as the reply, which the SuperLink drops as expired).
    """
    meta = msg.metadata
    try:
        at = float(meta.created_at) + float(meta.ttl)
    except (TypeError, ValueError):
        at = math.nan
    if not math.isfinite(at) and at != math.inf:  # no expiry known: run it, never ended for it
        at = math.inf
    EXPIRY["at"] = at
    for hook in SEEN_HOOKS:
        hook()
    late = time.time() - at
    if late > 0:
        rnd = msg.content[CONFIG].get("round", "?") if CONFIG in msg.content else "?"
        log.warning("a %s message of round %s expired %.1f s ago: not run", meta.message_type, rnd, late)
        raise MessageExpired(f"the {meta.message_type} message of round {rnd} expired {late:.1f} s before it "
                             "reached the ClientApp (its round's deadline passed; the server no longer waits): "
                             "not run")
    return call_next(msg, context)


app = ClientApp(mods=[drop_expired])


@dataclass
class Node:
    """What a node holds: the run config, its client (state, data) and the algorithm's client side."""

    cfg: RunConfig
    cid: int
    state: ClientState
    data: ClientData
    algorithm: Algorithm
    misbehave: str | None = None


_CACHE: dict[str, Any] = {}


def forget_clients() -> None:
    """Forget the clients this process has built (their data, models and initial weights): what a
    new SuperNode process starts without."""
    _CACHE.clear()
    _INITIAL.clear()
    forget_virtual()


_INITIAL: dict[int, tuple[dict, dict]] = {}
"""id(model) -> its weights and extras when its node first built it (:func:`node`)."""


def _run_key(msg: Message) -> str | None:
    """The server's run key in a message's config record (:data:`fedproto.flower.node_state.RUN_KEY`), if any."""
    if CONFIG in msg.content and node_state.RUN_KEY in msg.content[CONFIG]:
        return str(msg.content[CONFIG][node_state.RUN_KEY])
    return None


def node(context: Context, run_key: str | None = None) -> Node:
    """This node's client, its model restored from ``context.state`` (built on first use).

    Raises:
        ConfigError: an invalid run config; own client: see
            :func:`fedproto.flower.node.load_local_client`; benchmark client: ``partition-id``
            missing or outside ``0..clients-1``, ``num-partitions`` different from ``clients``.
    """
    nc = context.node_config
    overrides = {"data_dir": str(nc["data-dir"])} if "data-dir" in nc else {}
    cfg = run_config(context.run_config, overrides)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    own = any(k in nc for k in ("client-id", "data", "model")) or (cfg.dataset == "custom" and "partition-id" not in nc)
    if own:
        if cfg.dataset != "custom":
            raise ConfigError(f"this SuperNode brings its own data (node config data={nc.get('data')!r}) but the run "
                              f"config has dataset={cfg.dataset!r}; set dataset = \"custom\", classes and "
                              "embedding-dim in the run config (or start the node with partition-id instead)")
        key = cfg.model_dump_json() + repr(sorted(nc.items()))
        if key not in _CACHE:
            _CACHE.clear()  # one run at a time per process
            _INITIAL.clear()
            names = list(FlowerOptions.from_user_config(context.run_config).class_names)
            _CACHE[key] = load_local_client(nc, cfg, names)
        lc = _CACHE[key]
        n = Node(cfg, lc.cid, lc.state, lc.data, lc.algorithm, nc.get("misbehave"))
    else:  # a fresh model has the initial weights: nothing to restore when the context holds no state
        n = _benchmark_node(cfg, nc, fresh=STATE_MODEL not in context.state)
    if own:
        # the cached client's model is trained in place: a context without the client's state (a new run, a
        # restarted node, a new SuperLink) starts from the initial weights, not from another run's
        model = n.state.model
        init = _INITIAL.setdefault(id(model), ({k: v.detach().clone() for k, v in model.state_dict().items()},
                                               dict(n.state.extra)))
        if STATE_MODEL not in context.state:
            n.state.model.load_state_dict(init[0])
            n.state.extra = dict(init[1])
    # the instance id; after a restart, the client's state file (fedproto.flower.node_state)
    saved = node_state.begin(context, n.cid, cfg, n.state.model, n.state.extra, run_key)
    if saved is not None:
        context.state[STATE_MODEL] = ArrayRecord(torch_state_dict=saved["model"])
        context.state[STATE_EXTRA] = ConfigRecord(saved["extra"])
    if STATE_MODEL in context.state:
        n.state.model.load_state_dict(context.state[STATE_MODEL].to_torch_state_dict())
        n.state.extra = dict(context.state[STATE_EXTRA])
    # with DP, this node's share of the noise (fedproto.secagg.epsilon), for its releases and its epsilon
    if n.cfg.secagg:
        from fedproto.secagg.epsilon import adjust

        adjust(n.cfg, n.algorithm)
    return n


def _benchmark_node(cfg: RunConfig, nc, fresh: bool) -> Node:
    """Client ``partition-id`` of the run (:func:`fedproto.flower.virtual.virtual_client`: this process
    holds its own model and an index view of the mapped dataset, not the whole run)."""
    if cfg.dataset == "custom":
        raise ConfigError("the run config has dataset=\"custom\" (nodes bring their own data) but this SuperNode has "
                          "no client-id, data and model in its node config; start it with --node-config "
                          "'client-id=0 data=\"/path/to/folder\" model=\"cnn\"'")
    if "partition-id" not in nc:
        raise ConfigError("this SuperNode has no partition-id in its node config; start it with "
                          "--node-config \"partition-id=I num-partitions=N\" (I: its client id, 0-based), or with "
                          "its own data: --node-config 'client-id=I data=\"/folder\" model=\"cnn\"'")
    raw = {k: nc.get(k, cfg.clients) for k in ("partition-id", "num-partitions")}
    bad = {k: v for k, v in raw.items() if not whole(v)}
    if bad:
        k, v = next(iter(bad.items()))
        raise ConfigError(f"node config {k}={v!r} is not a whole number; start the SuperNode with integers, e.g. "
                          "--node-config \"partition-id=0 num-partitions=3\"")
    cid, parts = int(raw["partition-id"]), int(raw["num-partitions"])
    if parts != cfg.clients:
        raise ConfigError(f"node config num-partitions={parts} but the run has clients={cfg.clients}; "
                          "start the SuperNodes with num-partitions equal to clients")
    state, data, algorithm = virtual_client(cfg, cid, fresh)
    return Node(cfg, cid, state, data, algorithm, nc.get("misbehave"))


def _save(n: Node, context: Context) -> None:
    context.state[STATE_MODEL] = ArrayRecord(torch_state_dict=n.state.model.state_dict())
    context.state[STATE_EXTRA] = ConfigRecord(dict(n.state.extra))


def _checked_round(n: Node, msg: Message) -> int:
    """The round of a server message to this node's client. Raises ConfigError when it is for
    another client or in another message schema (:data:`fedproto.flower.records.SCHEMA`)."""
    cfg = msg.content[CONFIG]
    bad = schema_problem(cfg.get("schema"), "server")
    if bad:
        raise ConfigError(bad)
    if int(cfg["cid"]) != n.cid:
        raise ConfigError(f"a message for client {cfg['cid']} reached the node of client {n.cid}: two SuperNodes "
                          "share a client-id (or partition-id)?")
    return int(cfg["round"])


HIDDEN_UNDER_SECAGG = ("classes", "train-samples", "test-samples", "num-examples", "steps")
"""What a node does not send at join, after training and after evaluating under ``secagg`` with
``secagg_hide_labels`` (the default): its label set, its sample counts and its step count (the
training samples over the batch size)."""


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Reply with what the server needs of this node: ``cid``, ``classes`` (its training classes),
    ``train-samples``, ``test-samples``, ``params``, ``embedding-dim`` (in a ConfigRecord) and the
    algorithm's join message (e.g. the model's initial weights for weight-sharing methods). Under
    DP without the sample counts (:func:`fedproto.prototypes.dp.deployment_fields`); under ``secagg`` with
    ``secagg_hide_labels`` without the label set and the counts (:data:`HIDDEN_UNDER_SECAGG`)."""
    bad = schema_problem(msg.content[CONFIG].get("schema") if CONFIG in msg.content else None, "server")
    if bad:
        raise ConfigError(bad)
    n = node(context, _run_key(msg))
    info = {"cid": n.cid, "classes": [int(c) for c in n.state.classes], "train-samples": len(n.data.y),
            "test-samples": len(n.data.test_y), "params": count_parameters(n.state.model),
            "embedding-dim": int(n.state.model.embedding_dim)}
    info = {**deployment_fields(n.cfg.dp, "query", info), "schema": SCHEMA}  # the schema is public
    if n.cfg.secagg and n.cfg.secagg_hide_labels:  # the server learns per-class totals only (secure-aggregation.md)
        info = {k: v for k, v in info.items() if k not in HIDDEN_UNDER_SECAGG}
    join = n.algorithm.join_message(n.state)
    content = {CONFIG: ConfigRecord(info), MESSAGE: to_record(join),
               METRICS: MetricRecord(node_state.reply_metrics(context))}
    return Message(RecordDict(content), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local training; same seeding as the simulation's sequential path (the DP noise
    excepted: it comes from :func:`fedproto.prototypes.dp.secure_rng`). Reply: the algorithm message
    and, without DP, the losses, step count, largest embedding norm and ``num-examples``; under DP
    the message alone. A node with ``misbehave`` in its node config corrupts its message (tests of
    the server's checks)."""
    n = node(context, _run_key(msg))
    r = _checked_round(n, msg)
    if n.misbehave == "vanish":  # a node that drops out in each round's train step (tests)
        raise ConnectionAbortedError(f"client {n.cid} vanishes (node config misbehave='vanish')")
    down, masked = from_record(msg.content[MESSAGE]), None
    if n.cfg.secagg:  # secure aggregation (fedproto.flower.secagg_messages): the reply leaves the node masked
        from fedproto.flower.secagg_messages import masked_reply

        down, masked = masked_reply(n, down, context, r)
    out, res = client_step(n.algorithm, n.state, down, n.data, n.cfg.seed, r)
    _save(n, context)
    node_state.after_train(context, n.cid, n.cfg, r, n.state.model, n.state.extra)
    if n.misbehave:
        rng = np.random.default_rng(np.random.SeedSequence([n.cfg.seed, r, n.cid, 0xBAD]))
        out = corrupt(out, n.misbehave, rng, n.cfg.num_classes)
    if masked is not None:
        out = masked(out)
    metrics = {"loss_ce": float(res.loss_ce), "loss_proto": float(res.loss_proto), "steps": int(res.steps),
               "emb-norm-max": float(res.emb_norm_max), "loss-terms": float(res.loss_terms),
               "num-examples": len(n.data.y)}
    metrics = {**deployment_fields(n.cfg.dp, "train", metrics), **node_state.reply_metrics(context)}
    if n.cfg.secagg and n.cfg.secagg_hide_labels:
        metrics = {k: v for k, v in metrics.items() if k not in HIDDEN_UNDER_SECAGG}
    content = {MESSAGE: to_record(out), METRICS: MetricRecord(metrics)}
    return Message(RecordDict(content), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The algorithm's metrics of this client on its own test set (``acc`` in [0, 1]; FedProto
    adds ``acc_proto``, eq. 4), plus ``num-examples``. Under DP only ``dp_epsilon`` under
    ``prototypes``, nothing under ``full`` (:func:`fedproto.prototypes.dp.deployment_fields`); the node
    logs the metrics it keeps."""
    n = node(context, _run_key(msg))
    _checked_round(n, msg)
    metrics: dict[str, Any] = n.algorithm.evaluate(n.state, from_record(msg.content[MESSAGE]), n.data)
    metrics.update(n.algorithm.client_report(n.state))  # e.g. the privacy this client spent (dp)
    metrics = {k: float(v) for k, v in metrics.items()}
    metrics["num-examples"] = len(n.data.test_y)
    sent = deployment_fields(n.cfg.dp, "evaluate", metrics)
    if n.cfg.secagg and n.cfg.secagg_hide_labels:
        sent = {k: v for k, v in sent.items() if k not in HIDDEN_UNDER_SECAGG}
    if len(sent) < len(metrics):
        log.warning("fedproto client %d (dp=%s) keeps on this node: %s", n.cid, n.cfg.dp,
                    ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k not in sent))
    sent.update(node_state.reply_metrics(context))
    return Message(RecordDict({METRICS: MetricRecord(sent)}), reply_to=msg)


@app.query("secagg")
def secagg(msg: Message, context: Context) -> Message:
    """A step of secure aggregation (option ``secagg``: :func:`fedproto.flower.secagg_messages.step`)."""
    from fedproto.flower.secagg_messages import step

    out = step(node(context, _run_key(msg)), from_record(msg.content[MESSAGE]), context)
    return Message(RecordDict({MESSAGE: to_record(out)}), reply_to=msg)
