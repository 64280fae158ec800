"""The Flower ``ServerApp``: the in-process round engine with its client step sent over Flower.

:class:`FlowerEngine` is :class:`fedproto.simulation.Simulation` with the client side replaced
by messages to SuperNodes: rounds, aggregation, reply checks, monitoring, communication counting
(from the algorithm messages), metrics and the run directory are the simulation's own code, so
the same clients and seed give the numbers of an in-process run.

The server holds no data and no client model. What it knows of a client comes from the client's
node, once, when the node joins (a ``query`` reply: client id, classes, sample counts (none under
DP: :func:`fedproto.privacy.deployment_fields`), embedding size, parameter count, and the
algorithm's join message, e.g. initial weights for the weight-sharing baselines, whose first
broadcast is then the weights of the client with the lowest id). It needs only the run config:
for nodes with their own data (:mod:`fedproto.flower.node`)
``dataset = "custom"``, ``classes``, ``embedding-dim`` and the algorithm's options.

Membership is dynamic: each round the server looks for newly connected nodes (a node that comes
back after a failure is queried again and takes part again), samples ``participation`` of the
connected clients (seeded by ``seed`` and the round, :func:`fedproto.simulation.sample_clients`),
waits up to ``round-timeout`` seconds, and aggregates the valid replies if at least
``min-replies`` arrived; otherwise it retries the round (``round-retries``) and then stops with an
error, the rounds already logged kept. Every reply is checked before aggregation
(:func:`fedproto.simulation.reply_problem`); a bad one is dropped and logged with the client and
node id and the reason. ``metrics.jsonl`` records per round which clients were ``sampled``,
``replied``, ``failed`` (with the node's error), ``unavailable`` (the SuperLink's answer for a node it
knows is gone, within about its heartbeat interval), ``timed_out`` (no reply within ``round-timeout``)
and ``dropped`` (with the reason).

Run options come from the Flower run config (``[tool.flwr.app.config]`` of the Flower app, or
``flwr run --run-config``): every :class:`fedproto.config.RunConfig` option (``-`` or ``_``) plus
the keys of :class:`fedproto.flower.common.FlowerOptions`. The run directory is written where the
ServerApp runs: ``out_dir/<run name>-run<Flower run id>``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedproto.algorithms.base import HEALTH_KEYS, ClientState
from fedproto.algorithms.base import Message as FedMessage
from fedproto.config import RunConfig
from fedproto.data.partition import Partition
from fedproto.errors import ConfigError, FedprotoError, TrainingError
from fedproto.flower.common import CONFIG, MESSAGE, METRICS, QUERY, FlowerOptions, from_record, run_config, to_record
from fedproto.simulation import Setup, Simulation, build_algorithm, reply_problem, sample_clients
from fedproto.training import TrainResult

NODE_UNAVAILABLE = 5
"""Flower's ``ErrorCode.NODE_UNAVAILABLE`` (``flwr.common.constant``): the SuperLink's error reply
for a message to a node it has marked offline."""
REPLY_UNAVAILABLE = 4
"""Flower's ``ErrorCode.REPLY_MESSAGE_UNAVAILABLE``: the reply expired or was lost at the SuperLink."""

log = logging.getLogger(__name__)

app = ServerApp()

REPORT_KEYS = ("dp_epsilon",)
"""Keys of a node's evaluate reply that are its :meth:`~fedproto.algorithms.base.Algorithm.client_report`
(per client in ``clients.csv`` and ``summary.json``), not a score averaged over clients."""

RETRY_PAUSE_S = 2.0
"""Seconds between a round below ``min-replies`` and its retry (nodes may reconnect meanwhile)."""


class FlowerEngine(Simulation):
    """Run a configured experiment with one Flower SuperNode per client.

    Args:
        cfg: the run configuration (``checkpoint_every`` must be 0: client models stay on the
            nodes, so the server cannot checkpoint them). ``clients``: the number of clients
            (nodes) of the federation; with own-data nodes their ``client-id`` lies in
            ``0..clients-1``.
        grid: the Flower :class:`~flwr.serverapp.Grid` of the run.
        out: run directory (as :class:`~fedproto.simulation.Simulation`).
        options: the Flower engine's options (timeouts, minimum replies, retries).
        wait_s, timeout_s: override ``options.wait_nodes`` and ``options.round_timeout``.
    Raises:
        ConfigError: checkpoints requested; two nodes with one client id at the start; the nodes
            disagree on the embedding size (benchmark nodes).
        TrainingError: too few nodes joined within ``wait_nodes`` seconds (benchmark clients:
            all of them; own-data nodes: ``min_replies``); the message lists refused nodes and why.
    """

    def __init__(self, cfg: RunConfig, grid: Grid, out=None, options: FlowerOptions | None = None,
                 wait_s: float | None = None, timeout_s: float | None = None,
                 on_round: Callable[[dict], None] | None = None):
        if cfg.checkpoint_every:
            raise ConfigError(f"checkpoint_every={cfg.checkpoint_every}: under Flower the client models stay on "
                              "the SuperNodes, so the server cannot checkpoint them; set checkpoint_every=0")
        opts = options or FlowerOptions()
        self.opts = FlowerOptions(
            round_timeout=opts.round_timeout if timeout_s is None else timeout_s,
            min_replies=opts.min_replies, round_retries=opts.round_retries,
            wait_nodes=opts.wait_nodes if wait_s is None else wait_s, class_names=opts.class_names)
        if self.opts.min_replies > cfg.clients:
            raise ConfigError(f"Flower run config: min-replies={self.opts.min_replies} is larger than clients="
                              f"{cfg.clients}, so no round could have enough replies; give min-replies <= clients")
        self.grid = grid
        self.round = 0
        self.nodes: dict[int, int] = {}  # client id -> node id of its (current) SuperNode
        self.info: dict[int, dict] = {}  # client id -> what its node said when it joined
        self.joins: dict[int, FedMessage] = {}  # client id -> its join message
        self.refused: dict[int, str] = {}  # node id -> why it was refused (not asked again)
        self._duplicates: dict[int, int] = {}  # refused node id -> the client id it claimed (held by a live node)
        self.refusals: list[dict] = []  # every refusal: node_id, client_id (None if unknown), reason, round
        self._logged_refusals = 0  # refusals already in a metrics.jsonl row
        self._status: dict = {}
        self._reports: dict[int, dict] = {}  # client id -> its client_report from its last evaluate reply
        self.own_data = cfg.dataset == "custom"
        self.cfg = cfg
        self._discover(self.opts.wait_nodes)
        dims = {i: int(self.info[i]["embedding-dim"]) for i in self.info}
        d = cfg.embedding_dim if self.own_data else dims[min(dims)]
        S = [ClientState(i, None, np.asarray(self.info[i]["classes"] if i in self.info else [], np.int64))
             for i in range(cfg.clients)]
        part = Partition([np.arange(int(self.info.get(i, {}).get("train-samples", 0))) for i in range(cfg.clients)],
                         [np.arange(int(self.info.get(i, {}).get("test-samples", 0))) for i in range(cfg.clients)],
                         [s.classes for s in S])
        setup = Setup(None, part, S, [], build_algorithm(cfg, d), d)
        if cfg.attackers:
            raise ConfigError(f"attackers={cfg.attackers}: under Flower a client misbehaves on its own node; start "
                              "that SuperNode with the node config misbehave=\"nan\" (or scale, random, flip) instead")
        super().__init__(cfg, setup=setup, out=out, on_round=on_round)

    # -- nodes ----------------------------------------------------------------------------------
    def _exchange(self, messages: list[Message]) -> tuple[dict[int, Message], dict[int, str], dict[int, str],
                                                            list[int]]:
        """Send, wait up to ``round_timeout``: (replies by node id, failures by node id (the node's
        error), unavailable nodes by node id (the SuperLink's answer for a node it knows is gone:
        no wait), node ids that did not reply in time).

        A reply is matched to the message it answers (``reply_to_message_id``): an error reply the
        SuperLink sends for an unavailable node carries the SuperLink's node id as its source, so
        matching by source node recorded it as a timeout (issue #23). A grid that sets no message
        ids (a test double) is matched by source node."""
        if not messages:
            return {}, {}, {}, []
        replies = list(self.grid.send_and_receive(messages, timeout=self.opts.round_timeout))
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

    def _query_new(self, strict: bool = False) -> list[int]:
        """Ask nodes not seen before who they are; returns the client ids that joined. A node
        that fails the query (its own data or model refused, e.g. labels outside the classes) is
        logged with its reason and not asked again. ``strict`` (the start): two nodes with one
        client id raise ConfigError; later, a new node with a known client id is refused while
        the client's node is still connected, and replaces it once that node is gone (the client
        came back)."""
        connected = set(self.grid.get_node_ids())
        for nid, cid in list(self._duplicates.items()):  # the client's first node is gone: ask again
            if self.nodes.get(cid) not in connected:
                del self._duplicates[nid]
                self.refused.pop(nid, None)
        known = set(self.nodes.values()) | set(self.refused)
        new = [nid for nid in connected if nid not in known]
        if not new:
            return []
        ok, failed, unavailable, _ = self._exchange([Message(RecordDict({}), dst_node_id=nid, message_type=QUERY)
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
            if hasattr(self, "setup"):  # joined after the start: what the server knows of it comes from this reply
                self.setup.states[cid].classes = np.asarray(info["classes"], np.int64)
                self.setup.partition.classes[cid] = self.setup.states[cid].classes
            self.joins.setdefault(cid, from_record(rep.content[MESSAGE]) if MESSAGE in rep.content else {})
            joined.append(cid)
        return joined

    def _refuse(self, nid: int, cid: int | None, why: str) -> None:
        self.refused[nid] = why
        self.refusals.append({"node_id": nid, "client_id": cid, "reason": why, "round": self.round})

    def _refusal(self, cid: int, info: dict) -> str:
        m, d = self.cfg.clients, int(info.get("embedding-dim", -1))
        if not 0 <= cid < m:
            return f"client-id={cid} is outside 0..{m - 1} (the run config has clients={m}); raise clients or renumber"
        if self.own_data and d != self.cfg.embedding_dim:
            return f"client {cid}'s embedding size is {d}, the run's embedding-dim is {self.cfg.embedding_dim}"
        if not self.own_data and self.info:
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
            nids = list(self.grid.get_node_ids())
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

    # -- the round engine's hooks -----------------------------------------------------------------
    def _initial_message(self) -> FedMessage:
        return self.setup.algorithm.initial_message_from(dict(sorted(self.joins.items())))

    def _sample(self, round: int) -> list[int]:
        """``participation`` of the connected clients (all by default), drawn with (seed, round)."""
        self._query_new()
        live = sorted(self.nodes)
        if not live:
            return []
        p = self.cfg.participation
        if p > 1:
            p = min(p, len(live))
        return [live[j] for j in sample_clients(self.cfg.seed, round, len(live), p)]

    def _round_status(self) -> dict:
        """The round's ``sampled``/``replied``/``failed``/``unavailable``/``timed_out``, plus ``refused``: the nodes
        refused since the previous row (at the start: during discovery), with client id and reason."""
        new = self.refusals[self._logged_refusals:]
        self._logged_refusals = len(self.refusals)
        return {**self._status, **({"refused": [dict(r) for r in new]} if new else {})}

    def _client_step(self, round: int, ids: list[int], msgs: dict[int, FedMessage]) -> dict:
        """Train the sampled clients on their nodes; retry below ``min_replies`` (adding the
        messages of clients asked on a retry to ``msgs``). Raises TrainingError when the retries
        are spent."""
        self.round = round
        alg = self.setup.algorithm
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
                if "loss_ce" in m:
                    res = TrainResult(None, None, float(m["loss_ce"]), float(m["loss_proto"]), int(m["steps"]),
                                      float(m.get("emb-norm-max", 0.0)))
                else:  # a node under DP sends its noised release alone (fedproto.privacy.deployment_fields)
                    res = TrainResult(None, None, None, None, 0)
                if res.loss_ce is not None and not np.isfinite([res.loss_ce, res.loss_proto]).all():
                    st["failed"][str(i)] = "its training loss is not finite (diverged)"
                    log.warning("round %d: client %d's training diverged (loss not finite); its reply is left out",
                                round, i)
                    continue
                out[i] = (from_record(rep.content[MESSAGE]), res)
                st["failed"].pop(str(i), None)
                st["unavailable"].pop(str(i), None)
                if i in st["timed_out"]:
                    st["timed_out"].remove(i)
            dropped = {i: self._unusable(i, out[i][0], msgs[i]) for i in sorted(out)}
            dropped = {i: why for i, why in dropped.items() if why}
            valid = [i for i in out if i not in dropped]
            if len(valid) >= self.opts.min_replies:
                break  # the dropped replies are logged and recorded by the round's reply check
            for i, why in dropped.items():
                log.warning("round %d: dropped the reply of %s: %s", round, self._who(i), why)
            if attempt == self.opts.round_retries:
                self._status = {**st, "replied": sorted(out)}
                where = (f" (rounds 1..{round - 1} are in {self.run_dir.path / 'metrics.jsonl'})"
                         if self.run_dir and round > 1 else "")
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
                msgs.setdefault(i, alg.downlink(self.message, i))
        st["replied"] = sorted(out)
        self._status = st
        return out

    def _unusable(self, cid: int, reply: FedMessage, sent: FedMessage) -> str:
        """Why the reply of ``cid`` would be dropped whole by the round's reply check ('' if usable)."""
        alg, d = self.setup.algorithm, self.setup.embedding_dim
        why = reply_problem(alg, reply, sent, d)
        if why or not reply:
            return why
        clean, parts = alg.reply_problems(cid, reply)
        if clean:
            return ""
        return "; ".join(parts[:3]) + (f" (and {len(parts) - 3} more)" if len(parts) > 3 else "") or "nothing usable"

    def _send(self, kind: str, ids: Iterable[int], msgs: dict[int, FedMessage]):
        """Send ``kind`` to the clients ``ids``: (replies by client id, failures by client id,
        client ids that timed out). Failures and timeouts are logged."""
        ids = [i for i in ids if i in self.nodes]
        out = [Message(RecordDict({MESSAGE: to_record(msgs[i]),
                                   CONFIG: ConfigRecord({"round": self.round, "cid": i})}),
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
            log.warning("round %d (%s): client %d (node %d) sent no reply within %g s", self.round, kind,
                        cid_of[nid], nid, self.opts.round_timeout)
        return ({cid_of[n]: r for n, r in ok.items()}, {cid_of[n]: w for n, w in failed.items()},
                {cid_of[n]: w for n, w in unavailable.items()}, [cid_of[n] for n in missing])

    def _client_report(self, cid: int) -> dict:
        return self._reports.get(cid, {})  # from the node's evaluate reply (Algorithm.client_report runs there)

    def _who(self, cid: int) -> str:
        return f"client {cid} (node {self.nodes.get(cid)})"

    def evaluate(self) -> list[dict]:
        """Per-client metrics, computed on the nodes (list indexed by client id; NaN for clients
        whose node is not connected or did not reply)."""
        alg = self.setup.algorithm
        self._query_new()
        if self.run_dir:  # nodes that joined or were refused after the start
            self.run_dir.write_config(self._config_record())
        ids = sorted(self.nodes)
        replies, *_ = self._send(MessageType.EVALUATE, ids, {i: alg.downlink(self.message, i) for i in ids})
        got = {i: {k: float(v) for k, v in rep.content[METRICS].items() if k != "num-examples"}
               for i, rep in replies.items()}
        for i, m in got.items():  # the client's own report (Algorithm.client_report) goes to clients.csv, not accuracy
            self._reports[i] = {k: m.pop(k) for k in REPORT_KEYS if k in m}
        if not got:
            raise TrainingError("no node replied to the final evaluation; restart the SuperNodes and run again")
        keys = [k for k in next(iter(got.values())) if k not in HEALTH_KEYS]
        return [got.get(i, {k: float("nan") for k in keys}) for i in range(len(self.setup.states))]

    def _config_record(self) -> dict:
        return {**self.cfg.model_dump(), "lambda_proto_in_force": self.cfg.lam, "engine": "flower",
                "embedding_dim_in_force": self.setup.embedding_dim,
                "flower": {"round_timeout": self.opts.round_timeout, "min_replies": self.opts.min_replies,
                           "round_retries": self.opts.round_retries, "wait_nodes": self.opts.wait_nodes},
                "nodes": {str(i): {**{k: v for k, v in self.info[i].items() if k != "cid"}, "node_id": self.nodes[i]}
                          for i in sorted(self.info)},
                "refused": [dict(r) for r in self.refusals]}

    def _model_params(self) -> list[int | None]:
        return [int(self.info[i]["params"]) if i in self.info else None for i in range(len(self.setup.states))]

    def _client_rows(self, per_client: list[dict]) -> list[dict]:
        rows = []
        for i, s in enumerate(self.setup.states):
            info = self.info.get(i, {})
            row = {"client": i, "ways": len(s.classes), "classes": " ".join(map(str, s.classes)),
                   "train_samples": info.get("train-samples"), "test_samples": info.get("test-samples"),
                   "params": info.get("params")}
            row.update(per_client[i])
            rows.append(row)
        return rows

    def run(self, resume: bool = False) -> dict:
        """Run all rounds (see :meth:`Simulation.run`); ``resume`` is not supported."""
        if resume:
            raise ConfigError("resume is not supported under Flower (client models stay on the nodes)")
        return super().run()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """ServerApp entry point: run the configured experiment and log its summary."""
    try:
        cfg = run_config(context.run_config)
        opts = FlowerOptions.from_user_config(context.run_config)
        out = Path(cfg.out_dir) / f"{cfg.run_name()}-run{context.run_id}"
        summary = FlowerEngine(cfg, grid, out=out, options=opts).run()
    except FedprotoError as e:  # a user mistake: one line, no traceback (flwr run still exits 0)
        from fedproto.options import flower_wording

        log.error("fedproto: %s", e.render(flower_wording))  # options named as run-config keys
        return
    acc = summary["accuracy"].get("acc", {})
    n = summary["clients"]
    if not acc and cfg.dp != "off":
        log.warning("fedproto: %s on %s with dp=%s: each node kept its accuracy (and logged it); results in %s",
                    cfg.algorithm, cfg.dataset, cfg.dp, out)
        return
    over = f"{summary['clients_evaluated']} of {n}" if "clients_evaluated" in summary else f"{n}"
    log.warning("fedproto: %s on %s: accuracy %.2f ± %.2f %% over %s clients, %.1fk parameters up per round; "
                "results in %s", cfg.algorithm, cfg.dataset, 100 * acc.get("mean", float("nan")),
                100 * acc.get("std", float("nan")), over, summary["params_per_round"]["up"] / 1e3, out)
