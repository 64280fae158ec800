"""The Flower executor: each client's step on its own SuperNode, over Flower messages.

:class:`FlowerExecutor` is the :class:`~fedproto.engine.executors.base.Executor` the ServerApp
(:mod:`fedproto.flower.server_app`) hands to the round loop (:class:`fedproto.engine.loop.RoundLoop`),
the loop the simulator runs: rounds, aggregation, reply checks, monitoring, communication counting
(from the algorithm messages), metrics and the run directory are the same code, so the same
clients and seed give the numbers of an in-process run.

What the server knows of a client comes from the client's node, once, when the node joins (a
``query`` reply: client id, classes, sample counts (none under DP:
:func:`fedproto.privacy.deployment_fields`), embedding size, parameter count, and the algorithm's
join message, e.g. initial weights for the weight-sharing baselines).

Membership is dynamic: each round the executor looks for newly connected nodes (a node that comes
back after a failure is queried again and takes part again), waits up to ``round-timeout``
seconds for the sampled clients, and asks again (``round-retries``) while fewer than
``min-replies`` usable replies arrived; then it stops with an error, the rounds already logged
kept. ``metrics.jsonl`` records per round which clients were ``sampled``, ``replied``, ``failed``
(with the node's error), ``unavailable`` (the SuperLink's answer for a node it knows is gone,
within about its heartbeat interval), ``timed_out`` (no reply within ``round-timeout``) and
``dropped`` (with the reason, by the loop's reply check).

Size: about 500 lines: node discovery, the message exchange, retries and failure records of one
transport, which change together.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedproto.algorithms.base import HEALTH_KEYS, Algorithm
from fedproto.algorithms.base import Message as FedMessage
from fedproto.algorithms.requirements import needs_one_size
from fedproto.config import RunConfig
from fedproto.engine.checks import unusable
from fedproto.engine.executors.base import Executor, RoundReplies
from fedproto.errors import ConfigError, TrainingError
from fedproto.flower.common import (
    CONFIG,
    MESSAGE,
    METRICS,
    QUERY,
    SCHEMA,
    FlowerOptions,
    from_record,
    schema_problem,
    to_record,
)
from fedproto.flower.deadline import RoundDeadline
from fedproto.training import TrainResult

NODE_UNAVAILABLE = 5
"""Flower's ``ErrorCode.NODE_UNAVAILABLE`` (``flwr.common.constant``): the SuperLink's error reply
for a message to a node it has marked offline."""
REPLY_UNAVAILABLE = 4
"""Flower's ``ErrorCode.REPLY_MESSAGE_UNAVAILABLE``: the reply expired or was lost at the SuperLink."""

log = logging.getLogger(__name__)

INSTANCE_KEYS = ("instance", "restored", "state-round")
"""A node's reply keys about its client's state (:data:`fedproto.flower.node_state.INSTANCE_KEYS`):
read by :meth:`FlowerExecutor._saw`, never averaged as scores."""

REPORT_KEYS = ("dp_epsilon",)
"""Keys of a node's evaluate reply that are its :meth:`~fedproto.algorithms.base.Algorithm.client_report`
(per client in ``clients.csv`` and ``summary.json``), not a score averaged over clients."""

RETRY_PAUSE_S = 2.0
"""Seconds between a round below ``min-replies`` and its retry (nodes may reconnect meanwhile)."""


class FlowerExecutor(Executor):
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

    def _saw(self, cid: int, metrics) -> None:
        """Note the instance keys of a reply of client ``cid`` (:data:`INSTANCE_KEYS`): a new
        ``instance`` means its node restarted and lost the client's state (a fresh model), recorded
        in :attr:`state_lost` and in the round's ``rejoined``; ``restored`` 1 means the node came back
        with its state file (:mod:`fedproto.flower.node_state`)."""
        if "instance" not in metrics:
            return
        inst, old = int(metrics["instance"]), self.instance.get(cid)
        self.instance[cid] = inst
        node = self.nodes.get(cid)
        if old is not None and inst != old:
            self.state_lost[cid] = self.round
            self._restored.discard(cid)
            self._rejoined[str(cid)] = "restarted without its state: a fresh model"
            log.warning("round %d: client %d (node %s) restarted and lost its state (a fresh model from here on); "
                        "clients.csv marks it (state_lost_round) and the headline accuracy leaves it out unless it "
                        "trains in half the rounds from here", self.round, cid, node)
        elif int(metrics.get("restored", 0)) and cid not in self._restored:
            self._restored.add(cid)
            self._rejoined[str(cid)] = "restarted with its state restored from its state file"
            log.warning("round %d: client %d (node %s) restarted and reloaded its state from its state file",
                        self.round, cid, node)

    def left_out(self, history: list[dict], rounds: int) -> dict[int, str]:
        """The clients the headline accuracy leaves out (summary.json ``left_out``), with why: those
        whose node lost their state (:attr:`state_lost`) and that trained in fewer than
        ``ceil(rounds / 2)`` rounds from then on (their model is mostly untrained)."""
        need = -(-rounds // 2)
        out = {}
        for cid, r0 in sorted(self.state_lost.items()):
            since = sum(1 for row in history if row["round"] >= r0 and cid in row.get("replied", ()))
            if since < need:
                out[cid] = (f"its node lost its state in round {r0}; it trained in {since} round(s) from then on, "
                            f"fewer than {need}")
        return out

    def _config(self, entries: dict) -> dict:
        """A message's config record: ``entries`` plus the run key (:data:`fedproto.flower.node_state.RUN_KEY`)
        and the message schema (:data:`fedproto.flower.common.SCHEMA`)."""
        entries = {**entries, "run-key": self.run_key} if self.run_key else dict(entries)
        entries["schema"] = SCHEMA  # the node refuses another version (fedproto.flower.common.schema_problem)
        return {CONFIG: ConfigRecord(entries)}

    def bind(self, algorithm: Algorithm) -> None:
        """The server side of the run's algorithm (its reply check decides a round's retries)."""
        self.algorithm = algorithm

    # -- nodes ----------------------------------------------------------------------------------
    def _exchange(self, messages: list[Message]) -> tuple[dict[int, Message], dict[int, str], dict[int, str],
                                                            list[int]]:
        """Send, wait up to ``round_timeout``: (replies by node id, failures by node id (the node's
        error), unavailable nodes by node id (the SuperLink's answer for a node it knows is gone:
        no wait), node ids that did not reply in time).

        A reply is matched to the message it answers (``reply_to_message_id``): an error reply the
        SuperLink sends for an unavailable node carries the SuperLink's node id as its source, so
        matching by source node recorded it as a timeout. A grid that sets no message
        ids (a test double) is matched by source node."""
        if not messages:
            return {}, {}, {}, []
        replies = self._send_and_receive(messages)
        by_message = {rep.metadata.reply_to_message_id: rep for rep in replies if rep.metadata.reply_to_message_id}
        by_node = {rep.metadata.src_node_id: rep for rep in replies}
        ok, failed, unavailable, missing = {}, {}, {}, []
        for m in messages:
            nid = m.metadata.dst_node_id
            rep = by_message.get(m.metadata.message_id) if m.metadata.message_id else None
            if rep is None:
                rep = by_node.get(nid)
            if rep is None:
                missing.append(nid)
            elif rep.has_error():
                err = rep.error
                if err.code == NODE_UNAVAILABLE:
                    unavailable[nid] = f"{err.reason} (code {err.code})"
                elif err.code == REPLY_UNAVAILABLE:  # the reply expired or was lost at the SuperLink
                    missing.append(nid)
                else:
                    failed[nid] = f"{err.reason} (code {err.code})"
            else:
                ok[nid] = rep
        return ok, failed, unavailable, missing

    def _send_and_receive(self, messages: list[Message]) -> list[Message]:
        """Push ``messages`` and pull their replies every ``poll_interval`` seconds until all are in
        or ``round_timeout`` has passed. Flower's own ``Grid.send_and_receive`` waits a fixed 3 s
        between pulls (flwr 1.42), which made every round last at least 3 s more than its slowest
        node; a grid without push/pull (a test double) is asked with ``send_and_receive``."""
        try:
            pending = set(self._grid("push_messages", messages))
        except NotImplementedError:
            return list(self.grid.send_and_receive(messages, timeout=self.opts.round_timeout))
        start = time.monotonic()
        end = start + self.deadline.seconds()  # round-timeout, longer once rounds ran slow (fedproto.flower.deadline)
        out: list[Message] = []
        while pending:
            got = list(self._grid("pull_messages", pending))
            out += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            if not pending or time.monotonic() >= end:
                break
            time.sleep(min(self.opts.poll_interval, max(0.0, end - time.monotonic())))
        if not pending or not out:  # all replied, or none in time (a lower bound): fedproto.flower.deadline
            self.deadline.record(time.monotonic() - start)
        return out

    def _grid(self, method: str, *args):
        """``self.grid.<method>(*args)`` (a call to the SuperLink) with a deadline of ``round_timeout``
        seconds. Flower's ServerApp retries a SuperLink it cannot reach without end (flwr 1.42: no
        ``max_time`` on its connection), so a SuperLink that died would hold the ServerApp in that
        call until a SuperLink came back, and only then would the run end, with no record of why.

        Raises:
            TrainingError: no answer within ``round_timeout`` s (the call goes on in the background);
                the run then stops and ``failure.json`` records it (:class:`FlowerEngine`).
            whatever the grid raises (e.g. NotImplementedError from a grid without push/pull).
        """
        box: dict = {}

        def call():
            try:
                box["value"] = getattr(self.grid, method)(*args)
            except BaseException as e:  # raised again in the caller's thread
                box["error"] = e

        worker = threading.Thread(target=call, name=f"fedproto-grid-{method}", daemon=True)
        worker.start()
        worker.join(self.opts.round_timeout)
        if worker.is_alive():
            raise TrainingError(f"the SuperLink did not answer {method} within {self.opts.round_timeout:g} s "
                                "(round-timeout; Flower keeps retrying it): it is down or unreachable. Start the "
                                "SuperLink again and continue the run with resume-from (the command is in "
                                "failure.json in the run folder)")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _query_new(self, strict: bool = False) -> list[int]:
        """Ask nodes not seen before who they are; returns the client ids that joined. A node
        that fails the query (its own data or model refused, e.g. labels outside the classes) is
        logged with its reason and not asked again. ``strict`` (the start): two nodes with one
        client id raise ConfigError; later, a new node with a known client id is refused while
        the client's node is still connected, and replaces it once that node is gone (the client
        came back)."""
        connected = set(self._grid("get_node_ids"))
        for nid, cid in list(self._duplicates.items()):  # the client's first node is gone: ask again
            if self.nodes.get(cid) not in connected:
                del self._duplicates[nid]
                self.refused.pop(nid, None)
        known = set(self.nodes.values()) | set(self.refused)
        new = [nid for nid in connected if nid not in known]
        if not new:
            return []
        ok, failed, unavailable, _ = self._exchange([Message(RecordDict(self._config({})), dst_node_id=nid,
                                                             message_type=QUERY)
                                                     for nid in new])
        for nid, why in unavailable.items():  # gone again before it answered: asked again when it is back
            log.warning("node %d is unavailable: %s", nid, why)
        for nid, why in failed.items():
            m = re.search(r"client-id=(\d+)", why)
            self._refuse(nid, int(m.group(1)) if m else None, why)
            log.warning("node %d refused: %s", nid, why)
        if strict:
            seen: dict[int, list[int]] = {}
            for nid, rep in ok.items():
                seen.setdefault(int(rep.content[CONFIG]["cid"]), []).append(nid)
            dups = {c: sorted(v) for c, v in seen.items() if len(v) > 1}
            if dups:
                c, v = next(iter(dups.items()))
                key = "client-id" if self.own_data else "partition-id"
                raise ConfigError(f"nodes {v} all have {key}={c}; give each SuperNode its own {key}")
        joined = []
        for nid, rep in sorted(ok.items()):
            info = dict(rep.content[CONFIG])
            cid = int(info["cid"])
            why = self._refusal(cid, info)
            if why:
                self._refuse(nid, cid, why)
                log.warning("node %d (client %d) refused: %s", nid, cid, why)
                continue
            if cid in self.nodes and self.nodes[cid] != nid and self.nodes[cid] in connected:
                key = "client-id" if self.own_data else "partition-id"
                why = (f"{key}={cid} is already taken by node {self.nodes[cid]}, which is still connected; node "
                       f"{nid} is refused while node {self.nodes[cid]} is there: give each SuperNode its own {key}")
                self._refuse(nid, cid, why)
                self._duplicates[nid] = cid
                log.warning("node %d (client %d) refused: %s", nid, cid, why)
                continue
            if cid in self.nodes and self.nodes[cid] != nid:
                log.warning("client %d is back on node %d (was node %d)", cid, nid, self.nodes[cid])
            self.nodes[cid], self.info[cid] = nid, info
            self._saw(cid, rep.content[METRICS] if METRICS in rep.content else {})
            self.joins.setdefault(cid, from_record(rep.content[MESSAGE]) if MESSAGE in rep.content else {})
            joined.append(cid)
        return joined

    def _refuse(self, nid: int, cid: int | None, why: str) -> None:
        self.refused[nid] = why
        self.refusals.append({"node_id": nid, "client_id": cid, "reason": why, "round": self.round})

    def _refusal(self, cid: int, info: dict) -> str:
        bad_schema = schema_problem(info.get("schema"), "node")
        if bad_schema:
            return bad_schema
        m, d = self.cfg.clients, int(info.get("embedding-dim", -1))
        if not 0 <= cid < m:
            return f"client-id={cid} is outside 0..{m - 1} (the run config has clients={m}); raise clients or renumber"
        if self.own_data and d != self.cfg.embedding_dim and needs_one_size(self.cfg.algorithm):
            return f"client {cid}'s embedding size is {d}, the run's embedding-dim is {self.cfg.embedding_dim}"
        if not self.own_data and self.info and needs_one_size(self.cfg.algorithm):
            d0 = int(next(iter(self.info.values()))["embedding-dim"])
            if d != d0:
                return f"client {cid}'s embedding size is {d}, the other clients' is {d0}"
        bad = [c for c in info.get("classes", []) if not 0 <= int(c) < self.cfg.num_classes]
        if bad:
            return f"client {cid} has classes {bad[:5]} outside 0..{self.cfg.num_classes - 1}"
        return ""

    def _discover(self, wait_s: float) -> None:
        m = self.cfg.clients
        need = m if not self.own_data else self.opts.min_replies
        deadline = time.monotonic() + wait_s
        first = True
        while True:
            nids = list(self._grid("get_node_ids"))
            self._query_new(strict=first)
            first = False
            if self.refused and not self.own_data:  # benchmark clients: a refused node is a set-up mistake
                nid, why = next(iter(self.refused.items()))
                raise TrainingError(f"node {nid} refused to join: {why}")
            if len(self.nodes) >= m or time.monotonic() >= deadline:
                break
            if len(nids) < m:
                log.warning("waiting up to %g s for %d SuperNodes (%d joined)", wait_s, m, len(self.nodes))
            time.sleep(1.0)
        if len(self.nodes) < need:
            refused = "".join(f"; node {n} refused: {why}" for n, why in list(self.refused.items())[:5])
            which = "" if self.own_data else " (one per partition-id 0..clients-1)"
            raise TrainingError(f"{len(self.nodes)} SuperNodes joined within {wait_s:g} s, but the run has clients={m} "
                                f"and needs {need}{which}: start the missing SuperNodes{refused}")
        if len(self.nodes) < m:
            log.warning("starting with %d of %d clients (%s); the others take part once they connect",
                        len(self.nodes), m, sorted(self.nodes))

    # -- the executor ---------------------------------------------------------------------------
    def join_messages(self) -> dict[int, FedMessage]:
        return dict(sorted(self.joins.items()))

    def available(self, round: int) -> list[int]:
        """The connected clients (new nodes are asked who they are first)."""
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
                    # each entry by its name (fedproto.flower.common.SCHEMA)
                    res = TrainResult(sums=None, counts=None, loss_ce=float(m["loss_ce"]),
                                      loss_proto=float(m["loss_proto"]), steps=int(m["steps"]),
                                      emb_norm_max=float(m.get("emb-norm-max", 0.0)),
                                      loss_terms=float(m.get("loss-terms", 0.0)))
                else:  # a node under DP sends its noised release alone (fedproto.privacy.deployment_fields)
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

    def _send(self, kind: str, ids: Iterable[int], msgs: dict[int, FedMessage]):
        """Send ``kind`` to the clients ``ids``: (replies by client id, failures by client id,
        client ids that timed out). Failures and timeouts are logged."""
        ids = [i for i in ids if i in self.nodes]
        out = [Message(RecordDict({MESSAGE: to_record(msgs[i]),
                                   **self._config({"round": self.round, "cid": i})}),
                       dst_node_id=self.nodes[i], message_type=kind, group_id=str(self.round))
               for i in ids]
        ok, failed, unavailable, missing = self._exchange(out)
        cid_of = {self.nodes[i]: i for i in ids}
        for nid, why in failed.items():
            log.warning("round %d (%s): client %d (node %d) failed: %s", self.round, kind, cid_of[nid], nid, why)
        for nid, why in unavailable.items():
            log.warning("round %d (%s): client %d (node %d) is unavailable: %s", self.round, kind, cid_of[nid], nid,
                        why)
        for nid in missing:
            log.warning("round %d (%s): client %d (node %d) sent no reply within %.0f s", self.round, kind,
                        cid_of[nid], nid, self.deadline.seconds())
        return ({cid_of[n]: r for n, r in ok.items()}, {cid_of[n]: w for n, w in failed.items()},
                {cid_of[n]: w for n, w in unavailable.items()}, [cid_of[n] for n in missing])

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
            rows.append({"client": i, "ways": len(classes), "classes": " ".join(map(str, classes)),
                         "train_samples": info.get("train-samples"), "test_samples": info.get("test-samples"),
                         "params": int(info["params"]) if "params" in info else None})
        return rows
