"""The Flower executor: each client's step on its own SuperNode, over Flower messages.

:class:`FlowerExecutor` is the :class:`~fedproto.engine.executors.executor.Executor` the ServerApp
(:mod:`fedproto.flower.server_app`) hands to the round loop (:class:`fedproto.engine.loop.RoundLoop`),
the loop the simulator runs: rounds, aggregation, reply checks, monitoring, communication counting
(from the algorithm messages), metrics and the run directory are the same code, so the same
clients and seed give the numbers of an in-process run.

What the server knows of a client comes from the client's node, once, when the node joins (a
``query`` reply: client id, classes, sample counts (none under DP:
:func:`fedproto.prototypes.dp.deployment_fields`), embedding size, parameter count, and the algorithm's
join message, e.g. initial weights for the weight-sharing baselines).

Membership is dynamic: each round the executor looks for newly connected nodes (a node that comes
back after a failure is queried again and takes part again), waits up to ``round-timeout``
seconds for the sampled clients, and asks again (``round-retries``) while fewer than
``min-replies`` usable replies arrived; then it stops with an error, the rounds already logged
kept. ``metrics.jsonl`` records per round which clients were ``sampled``, ``replied``, ``failed``
(with the node's error), ``unavailable`` (the SuperLink's answer for a node it knows is gone,
within about its heartbeat interval), ``timed_out`` (no reply within ``round-timeout``) and
``dropped`` (with the reason, by the loop's reply check).

The executor's parts: the message exchange (:class:`fedproto.flower.exchange.MessageExchange`) and
the membership of nodes (:class:`fedproto.flower.membership.NodeMembership`); the call path of a
round on Flower: docs/architecture.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
from flwr.app import MessageType
from flwr.serverapp import Grid

from fedproto.algorithms.algorithm import HEALTH_KEYS, Algorithm
from fedproto.algorithms.algorithm import Message as FedMessage
from fedproto.config.run_config import RunConfig
from fedproto.engine.checks import unusable
from fedproto.engine.executors.executor import Executor, RoundReplies
from fedproto.errors import ConfigError, TrainingError
from fedproto.flower.deadline import RoundDeadline
from fedproto.flower.exchange import NODE_UNAVAILABLE, REPLY_UNAVAILABLE, MessageExchange
from fedproto.flower.membership import NodeMembership
from fedproto.flower.records import (
    MESSAGE,
    METRICS,
    FlowerOptions,
    from_record,
)
from fedproto.training import TrainResult

log = logging.getLogger(__name__)

INSTANCE_KEYS = ("instance", "restored", "state-round")
"""A node's reply keys about its client's state (:data:`fedproto.flower.node_state.INSTANCE_KEYS`):
read by :meth:`FlowerExecutor._saw`, never averaged as scores."""

REPORT_KEYS = ("dp_epsilon",)
"""Keys of a node's evaluate reply that are its :meth:`~fedproto.algorithms.algorithm.Algorithm.client_report`
(per client in ``clients.csv`` and ``summary.json``), not a score averaged over clients."""

RETRY_PAUSE_S = 2.0
"""Seconds between a round below ``min-replies`` and its retry (nodes may reconnect meanwhile)."""


class FlowerExecutor(NodeMembership, MessageExchange, Executor):
    """The client side of a run on Flower SuperNodes, one client per node.

    Args:
        cfg: the run configuration. ``clients``: the number of clients (nodes) of the federation;
            with own-data nodes their ``client-id`` lies in ``0..clients-1``.
        grid: the Flower :class:`~flwr.serverapp.Grid` of the run.
        options: the Flower engine's options (timeouts, minimum replies, retries).
    Raises:
        ConfigError: two nodes with one client id at the start; ``min-replies`` above ``clients``;
            simulated attackers (under Flower a node misbehaves on its own).
        TrainingError: too few nodes joined within ``wait_nodes`` seconds (benchmark clients:
            all of them; own-data nodes: ``min_replies``); the message lists refused nodes and why.
    Attributes:
        nodes: client id -> node id of its (current) SuperNode. info: client id -> what its node
            said when it joined. refused: node id -> why it was refused (not asked again).
        embedding_dim: d (the run's ``embedding-dim`` for own-data nodes, else the nodes' own).
    """

    execution = "flower"
    membership_changes = True

    def __init__(self, cfg: RunConfig, grid: Grid, options: FlowerOptions, run_key: str = ""):
        self.opts = options
        self.run_key = run_key  # sent in every message: the nodes' state files belong to it
        if options.min_replies > cfg.clients:
            raise ConfigError(f"Flower run config: min-replies={options.min_replies} is larger than clients="
                              f"{cfg.clients}, so no round could have enough replies; give min-replies <= clients")
        if cfg.attackers:
            raise ConfigError(f"attackers={cfg.attackers}: under Flower a client misbehaves on its own node; start "
                              "that SuperNode with the node config misbehave=\"nan\" (or scale, random, flip) instead")
        self.grid = grid
        self.deadline = RoundDeadline(options.round_timeout)  # how long an exchange waits for its replies
        self.round = 0
        self.num_clients = cfg.clients
        self.nodes: dict[int, int] = {}  # client id -> node id of its (current) SuperNode
        self.info: dict[int, dict] = {}  # client id -> what its node said when it joined
        self.joins: dict[int, FedMessage] = {}  # client id -> its join message
        self.refused: dict[int, str] = {}  # node id -> why it was refused (not asked again)
        self._duplicates: dict[int, int] = {}  # refused node id -> the client id it claimed (held by a live node)
        self.refusals: list[dict] = []  # every refusal: node_id, client_id (None if unknown), reason, round
        self._logged_refusals = 0  # refusals already in a metrics.jsonl row
        self._reports: dict[int, dict] = {}  # client id -> its client_report from its last evaluate reply
        self.instance: dict[int, int] = {}  # client id -> the instance id its node last replied with
        self.state_lost: dict[int, int] = {}  # client id -> the round in which it came back without its state
        self._restored: set[int] = set()  # clients whose node has reloaded their state file (logged once)
        self._rejoined: dict[str, str] = {}  # this round's rejoins, for the metrics row
        self.own_data = cfg.dataset == "custom"
        self.cfg = cfg
        self.algorithm: Algorithm | None = None  # set by bind(), once the embedding size is known
        self._discover(self.opts.wait_nodes)
        dims = {i: int(self.info[i]["embedding-dim"]) for i in self.info}
        self.embedding_dim = cfg.embedding_dim if self.own_data else dims[min(dims)]

    def bind(self, algorithm: Algorithm) -> None:
        """The server side of the run's algorithm (its reply check decides a round's retries)."""
        self.algorithm = algorithm

    # -- the executor ---------------------------------------------------------------------------
    def join_messages(self) -> dict[int, FedMessage]:
        return dict(sorted(self.joins.items()))

    def available(self, round: int) -> list[int]:
        """The connected clients (new nodes are asked who they are first, as part of round
        ``round``: a restart or refusal found now is logged and recorded under it, also in the
        first round of a resumed run)."""
        self.round = round
        self._query_new()
        return sorted(self.nodes)

    def _round_status(self, st: dict) -> dict:
        """The round's ``sampled``/``replied``/``failed``/``unavailable``/``timed_out``, plus ``refused``: the nodes
        refused since the previous row (at the start: during discovery), with client id and reason."""
        new = self.refusals[self._logged_refusals:]
        self._logged_refusals = len(self.refusals)
        rejoined, self._rejoined = self._rejoined, {}
        return {**st, **({"refused": [dict(r) for r in new]} if new else {}),
                **({"rejoined": rejoined} if rejoined else {})}

    def train(self, round: int, sent: dict[int, FedMessage],
              downlink: Callable[[int], FedMessage] | None = None) -> RoundReplies:
        """Train the sampled clients on their nodes; retry below ``min_replies``, asking the other
        connected clients too (their messages from ``downlink``, added to the returned ``sent``).
        Raises TrainingError when the retries are spent."""
        self.round = round
        ids, msgs = sorted(sent), dict(sent)
        st = {"sampled": list(ids), "replied": [], "failed": {}, "unavailable": {}, "timed_out": []}
        out: dict[int, tuple] = {}
        ask = list(ids)
        for attempt in range(self.opts.round_retries + 1):
            replies, failed, unavailable, missing = self._send(MessageType.TRAIN, ask, msgs)
            st["failed"].update({str(i): why for i, why in failed.items()})
            st["unavailable"].update({str(i): why for i, why in unavailable.items()})
            st["timed_out"] += [i for i in missing if i not in st["timed_out"]]
            for i, rep in replies.items():
                m = rep.content[METRICS] if METRICS in rep.content else {}
                self._saw(i, m)
                if "loss_ce" in m:
                    # each entry by its name (fedproto.flower.records.SCHEMA)
                    res = TrainResult(sums=None, counts=None, loss_ce=float(m["loss_ce"]),
                                      loss_proto=float(m["loss_proto"]), steps=int(m.get("steps", 0)),
                                      emb_norm_max=float(m.get("emb-norm-max", 0.0)),
                                      loss_terms=float(m.get("loss-terms", 0.0)))
                else:  # a node under DP sends its noised release alone (fedproto.prototypes.dp.deployment_fields)
                    res = TrainResult(sums=None, counts=None, loss_ce=None, loss_proto=None, steps=0)
                out[i] = (from_record(rep.content[MESSAGE]), res)
                st["failed"].pop(str(i), None)
                st["unavailable"].pop(str(i), None)
                if i in st["timed_out"]:
                    st["timed_out"].remove(i)
            if any(r.loss_ce is not None and not np.isfinite([r.loss_ce, r.loss_proto, r.loss_terms]).all()
                   for _, r in out.values()):
                break  # a diverged client: the round loop's health check stops the run (the simulator's policy)
            dropped = {i: self._unusable(i, out[i][0], msgs[i]) for i in sorted(out)}
            dropped = {i: why for i, why in dropped.items() if why}
            valid = [i for i in out if i not in dropped]
            if len(valid) >= self.opts.min_replies:
                break  # the dropped replies are logged and recorded by the round's reply check
            for i, why in dropped.items():
                log.warning("round %d: dropped the reply of %s: %s", round, self.who(i), why)
            if attempt == self.opts.round_retries:
                where = f" (rounds 1..{round - 1} are in the run folder's metrics.jsonl)" if round > 1 else ""
                hints = []
                if st["timed_out"] or st["unavailable"]:
                    hints.append("restart the SuperNodes that did not reply or are unavailable")
                if st["failed"]:
                    hints.append("fix what the failed nodes report (a node error, or a training that diverged: "
                                 "check that node's data, model and lr)")
                if dropped:
                    hints.append("check the data and models of the nodes whose replies were dropped (their replies "
                                 "arrived but were unusable; a node config misbehave= corrupts them on purpose)")
                if not hints:
                    hints.append("start more SuperNodes")
                raise TrainingError(
                    f"round {round}: {len(valid)} valid replies, fewer than min-replies={self.opts.min_replies}, "
                    f"after {self.opts.round_retries} retries (failed: {st['failed'] or 'none'}; unavailable: "
                    f"{sorted(int(i) for i in st['unavailable']) or 'none'}; timed out: "
                    f"{st['timed_out'] or 'none'}; dropped: "
                    f"{ {str(i): w for i, w in dropped.items()} or 'none'}){where}; {'; '.join(hints)}, and run again")
            log.warning("round %d: %d valid replies, fewer than min-replies=%d; retrying (%d of %d)", round, len(valid),
                        self.opts.min_replies, attempt + 1, self.opts.round_retries)
            time.sleep(RETRY_PAUSE_S)
            self._query_new()
            ask = [i for i in sorted(self.nodes) if i not in valid]
            for i in ask:
                msgs.setdefault(i, downlink(i) if downlink else {})
        st["replied"] = sorted(out)
        return RoundReplies(out, msgs, self._round_status(st))

    def _unusable(self, cid: int, reply: FedMessage, sent: FedMessage) -> str:
        """Why the reply of ``cid`` would be dropped whole by the round's reply check ('' if usable)."""
        return unusable(self.algorithm, cid, reply, sent, self.embedding_dim)

    def client_report(self, cid: int) -> dict:
        """The node's own report from its evaluate reply (:meth:`Algorithm.client_report` runs there),
        plus ``state_lost_round`` (the round its node came back without the client's state; empty if never)."""
        return {**self._reports.get(cid, {}), "state_lost_round": self.state_lost.get(cid)}

    def who(self, cid: int) -> str:
        return f"client {cid} (node {self.nodes.get(cid)})"

    def evaluate(self, messages: dict[int, FedMessage]) -> list[dict]:
        """Per-client metrics, computed on the nodes (list indexed by client id; NaN for clients
        whose node is not connected or did not reply)."""
        self._query_new()
        ids = sorted(self.nodes)
        replies, *_ = self._send(MessageType.EVALUATE, ids, messages)
        got = {i: {k: float(v) for k, v in rep.content[METRICS].items() if k != "num-examples"}
               for i, rep in replies.items()}
        for i, m in got.items():  # the client's own report (Algorithm.client_report) goes to clients.csv, not accuracy
            self._saw(i, m)
            for k in INSTANCE_KEYS:  # the node's state, not a score
                m.pop(k, None)
            self._reports[i] = {k: m.pop(k) for k in REPORT_KEYS if k in m}
        if not got:
            raise TrainingError("no node replied to the final evaluation; restart the SuperNodes and run again")
        keys = [k for k in next(iter(got.values())) if k not in HEALTH_KEYS]
        return [got.get(i, {k: float("nan") for k in keys}) for i in range(self.num_clients)]

    def config_record(self) -> dict:
        return {"engine": "flower", "embedding_dim_in_force": self.embedding_dim,
                "flower": {"round_timeout": self.opts.round_timeout, "min_replies": self.opts.min_replies,
                           "round_retries": self.opts.round_retries, "wait_nodes": self.opts.wait_nodes,
                           "run_key": self.run_key},
                "nodes": {str(i): {**{k: v for k, v in self.info[i].items() if k != "cid"}, "node_id": self.nodes[i]}
                          for i in sorted(self.info)},
                "refused": [dict(r) for r in self.refusals]}

    def client_rows(self) -> list[dict]:
        rows = []
        for i in range(self.num_clients):
            info = self.info.get(i, {})
            classes = [int(c) for c in info.get("classes", [])]
            hidden = bool(info) and "classes" not in info  # secagg_hide_labels: the node did not send them
            rows.append({"client": i, "ways": None if hidden else len(classes),
                         "classes": "hidden" if hidden else " ".join(map(str, classes)),
                         "train_samples": info.get("train-samples"), "test_samples": info.get("test-samples"),
                         "params": int(info["params"]) if "params" in info else None})
        return rows


__all__ = ["INSTANCE_KEYS", "NODE_UNAVAILABLE", "REPLY_UNAVAILABLE", "REPORT_KEYS", "RETRY_PAUSE_S", "FlowerExecutor"]
