"""The Flower ``ClientApp``: one fedproto client per SuperNode.

A node learns which client it is from its node config: ``partition-id`` (0-based client id) and
``num-partitions`` (must equal the run's ``clients``), Flower's usual keys; ``data-dir``
optionally points at the node's copy of the dataset. Every node builds the same seeded
partition and models from the run config and keeps only its own client. The client's model and
extras live in ``context.state`` between rounds (they never leave the node); the data set-up
is cached per process.

Handlers (message types): ``query`` (reply: the node's client id), ``train`` (one client step:
:meth:`fedproto.algorithms.base.Algorithm.client_update` with the engine's seeding, reply: the
algorithm message plus losses) and ``evaluate`` (reply: the algorithm's per-client metrics).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedproto.config import RunConfig
from fedproto.errors import ConfigError
from fedproto.flower.common import CONFIG, MESSAGE, METRICS, from_record, run_config, to_record
from fedproto.simulation import Setup, client_step, prepare

STATE_MODEL = "fedproto.model"
STATE_EXTRA = "fedproto.extra"

app = ClientApp()


@dataclass
class Node:
    """What a node holds: the run config, the (cached) set-up and its client id."""

    cfg: RunConfig
    setup: Setup
    cid: int


_SETUPS: dict[str, Setup] = {}


def node(context: Context) -> Node:
    """This node's client, its model restored from ``context.state`` (built on first use).

    Raises:
        ConfigError: ``partition-id`` missing or outside ``0..clients-1``, ``num-partitions``
            different from the run's ``clients``, or an invalid run config.
    """
    nc = context.node_config
    overrides = {"data_dir": str(nc["data-dir"])} if "data-dir" in nc else {}
    cfg = run_config(context.run_config, overrides)
    if "partition-id" not in nc:
        raise ConfigError("this SuperNode has no partition-id in its node config; start it with "
                          "--node-config \"partition-id=I num-partitions=N\" (I: its client id, 0-based)")
    raw = {k: nc.get(k, cfg.clients) for k in ("partition-id", "num-partitions")}
    bad = {k: v for k, v in raw.items() if not _whole(v)}
    if bad:
        k, v = next(iter(bad.items()))
        raise ConfigError(f"node config {k}={v!r} is not a whole number; start the SuperNode with integers, e.g. "
                          "--node-config \"partition-id=0 num-partitions=3\"")
    cid, parts = int(raw["partition-id"]), int(raw["num-partitions"])
    if parts != cfg.clients:
        raise ConfigError(f"node config num-partitions={parts} but the run has clients={cfg.clients}; "
                          "start the SuperNodes with num-partitions equal to clients")
    key = cfg.model_dump_json()
    if key not in _SETUPS:
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        _SETUPS.clear()  # one run at a time per process
        _SETUPS[key] = prepare(cfg, progress=False)
    setup = _SETUPS[key]
    if not 0 <= cid < len(setup.states):
        raise ConfigError(f"node config partition-id={cid} is outside 0..{len(setup.states) - 1} "
                          f"(the run has {len(setup.states)} clients)")
    state = setup.states[cid]
    if STATE_MODEL in context.state:
        state.model.load_state_dict(context.state[STATE_MODEL].to_torch_state_dict())
        state.extra = dict(context.state[STATE_EXTRA])
    return Node(cfg, setup, cid)


def _whole(v) -> bool:
    if isinstance(v, bool):
        return False
    try:
        return float(v).is_integer()
    except (TypeError, ValueError):
        return False


def _save(n: Node, context: Context) -> None:
    state = n.setup.states[n.cid]
    context.state[STATE_MODEL] = ArrayRecord(torch_state_dict=state.model.state_dict())
    context.state[STATE_EXTRA] = ConfigRecord(dict(state.extra))


def _checked_round(n: Node, msg: Message) -> int:
    cfg = msg.content[CONFIG]
    if int(cfg["cid"]) != n.cid:
        raise ConfigError(f"a message for client {cfg['cid']} reached the node of client {n.cid} "
                          "(partition-id): two SuperNodes share a partition-id?")
    return int(cfg["round"])


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Reply with this node's client id (``partition-id``)."""
    n = node(context)
    return Message(RecordDict({CONFIG: ConfigRecord({"cid": n.cid})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local training; same seeding as the simulation's sequential path."""
    n = node(context)
    r = _checked_round(n, msg)
    alg, state, data = n.setup.algorithm, n.setup.states[n.cid], n.setup.data[n.cid]
    out, res = client_step(alg, state, from_record(msg.content[MESSAGE]), data, n.cfg.seed, r)
    _save(n, context)
    metrics = {"loss_ce": float(res.loss_ce), "loss_proto": float(res.loss_proto), "steps": int(res.steps),
               "emb-norm-max": float(res.emb_norm_max), "num-examples": len(data.x)}
    return Message(RecordDict({MESSAGE: to_record(out), METRICS: MetricRecord(metrics)}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The algorithm's metrics of this client on its own test set (``acc`` in [0, 1]; FedProto
    adds ``proto_acc``, eq. 4), plus ``num-examples``."""
    n = node(context)
    _checked_round(n, msg)
    state, data = n.setup.states[n.cid], n.setup.data[n.cid]
    metrics: dict[str, Any] = n.setup.algorithm.evaluate(state, from_record(msg.content[MESSAGE]), data)
    metrics = {k: float(v) for k, v in metrics.items()}
    metrics["num-examples"] = len(data.test_y)
    return Message(RecordDict({METRICS: MetricRecord(metrics)}), reply_to=msg)
