"""Who takes part in a run on Flower: the nodes that join (asked who they are once, refused with a
reason), the discovery at the start, and clients whose node restarted (with or without their
state).

:class:`NodeMembership` is a part of :class:`~fedproto.flower.flower_executor.FlowerExecutor`, not an
executor of its own: it reads and keeps the attributes the executor sets (``nodes``, ``info``,
``joins``, ``refused``, ``refusals``, ``instance``, ``state_lost``, ``cfg``, ``opts``, ``round``)
and sends through :class:`~fedproto.flower.exchange.MessageExchange`.
"""

from __future__ import annotations

import logging
import re
import time

from fedproto.algorithms.requirements import needs_one_size
from fedproto.errors import ConfigError, TrainingError
from fedproto.flower.records import CONFIG, MESSAGE, METRICS, QUERY, from_record, schema_problem

log = logging.getLogger("fedproto.flower.flower_executor")  # the executor's logger: its parts log as it does

_APP_ERROR = re.compile(r"<class '[\w.]+'>|^\w+(Error|Exception|Exit|Interrupt)\b")
"""An error reply that names an exception the ClientApp raised (Flower's ``<class '...'>:<'...'>``, or
``DataError: ...``): the node's own refusal, final. Other failures at the start are Flower's (a ClientApp
that could not authenticate its task under load) and the node is asked again while the join wait lasts."""


class NodeMembership:
    """Nodes joining, refused, discovered and restarted (a part of
    :class:`~fedproto.flower.flower_executor.FlowerExecutor`)."""

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
            log.warning("%s: client %d (node %s) restarted and lost its state (a fresh model from here on); "
                        "clients.csv marks it (state_lost_round) and the headline accuracy leaves it out unless it "
                        "trains in half the rounds from here", self._when(), cid, node)
        elif int(metrics.get("restored", 0)) and cid not in self._restored:
            self._restored.add(cid)
            self._rejoined[str(cid)] = "restarted with its state restored from its state file"
            log.warning("%s: client %d (node %s) restarted and reloaded its state from its state file",
                        self._when(), cid, node)

    def _when(self) -> str:
        """``round r``, or, while the nodes join (before the first round of this process, also the
        first of a resumed run), ``at the start``: the metrics row of the next round records it."""
        return f"round {self.round}" if self.round else "at the start"

    def left_out(self, history: list[dict], rounds: int) -> dict[int, str]:
        """The clients the headline accuracy leaves out (summary.json ``left_out``, clients.csv), with
        why: those whose node was refused at join and that no other node served (the refusal's
        reason), and those whose node lost their state (:attr:`state_lost`) and that trained in
        fewer than ``ceil(rounds / 2)`` rounds from then on (their model is mostly untrained)."""
        need = -(-rounds // 2)
        out = {}
        for ref in self.refusals:
            cid = ref.get("client_id")
            if cid is not None and 0 <= cid < self.cfg.clients and cid not in self.nodes and cid not in out:
                out[cid] = f"its node was refused at join: {ref['reason']}"
        for cid, r0 in sorted(self.state_lost.items()):
            since = sum(1 for row in history if row["round"] >= r0 and cid in row.get("replied", ()))
            if since < need:
                out[cid] = (f"its node lost its state in round {r0}; it trained in {since} round(s) from then on, "
                            f"fewer than {need}")
        return out

    def _query_new(self, strict: bool = False, limit: float | None = None) -> list[int]:
        """Ask nodes not seen before who they are; returns the client ids that joined. A node
        that fails the query (its own data or model refused, e.g. labels outside the classes) is
        logged with its reason and not asked again; at the start (round 0) a failure that names no
        exception of the ClientApp (Flower's own, e.g. under load) is asked again while the wait
        lasts. ``strict`` (the start): two nodes with one client id raise ConfigError; later, a new
        node with a known client id is refused while the client's node is still connected, and
        replaces it once that node is gone (the client came back). ``limit``: the most seconds to wait for
        the answers (what is left of the join wait), else the exchange's deadline."""
        connected = set(self._grid("get_node_ids"))
        for nid, cid in list(self._duplicates.items()):  # the client's first node is gone: ask again
            if self.nodes.get(cid) not in connected:
                del self._duplicates[nid]
                self.refused.pop(nid, None)
        known = set(self.nodes.values()) | set(self.refused)
        new = [nid for nid in connected if nid not in known]
        if not new:
            return []
        ok, failed, unavailable, late = self._exchange([self._message({}, nid, QUERY) for nid in new], limit)
        for nid, why in unavailable.items():  # gone again before it answered: asked again when it is back
            log.warning("node %d is unavailable: %s", nid, why)
            self.unanswered[nid] = f"unavailable: {why}"
        for nid in late:  # asked again at the next look
            self.unanswered[nid] = (f"no answer within round-timeout={self.opts.round_timeout:g} s" if limit is None
                                    else f"no answer within the join wait (wait-nodes={self.opts.wait_nodes:g} s)")
        for nid, why in failed.items():
            if self.round == 0 and not _APP_ERROR.search(why):  # Flower's own failure at the start (a task token
                self.unanswered[nid] = f"failed its query: {why}"  # refused under load): asked again while waiting
                log.warning("node %d failed its query (%s); asking it again", nid, why)
                continue
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
            self.unanswered.pop(nid, None)
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
        """Wait for the run's nodes to join: at most ``wait_s`` seconds (``wait-nodes``), or longer where the
        nodes' answers were measured slower (``3 x`` their median, :meth:`RoundDeadline.adapted`): a query waits
        what is left of it, or ``3 x`` the median answer when that is longer (no more round-timeout on top); the
        wait ends at once when every client has joined or been refused."""
        m = self.cfg.clients
        need = m if not self.own_data else self.opts.min_replies
        start = time.monotonic()
        first = True
        self.online_seen: set[int] = set()  # every node the SuperLink listed as online during the wait
        self.unanswered: dict[int, str] = {}  # node id -> why its query got no answer (asked again)
        while True:
            nids = list(self._grid("get_node_ids"))
            self.online_seen.update(int(n) for n in nids)
            wait_s = self.deadline.adapted(wait_s)  # slow answers (a loaded machine): a longer join wait
            deadline = start + wait_s
            # a query waits what is left of the join wait, or as long as the answers measured so far may take
            slow = self.deadline.adapted(0.0) if self.deadline.measured else 0.0
            self._query_new(strict=first, limit=max(self.opts.poll_interval, deadline - time.monotonic(), slow))
            first = False
            if self.refused and not self.own_data:  # benchmark clients: a refused node is a set-up mistake
                nid, why = next(iter(self.refused.items()))
                e = TrainingError(f"node {nid} refused to join: {why}")
                e.nodes_seen = self.nodes_seen()
                raise e
            settled = set(self.nodes) | {r["client_id"] for r in self.refusals if r.get("client_id") is not None}
            wait_s = self.deadline.adapted(wait_s)  # with this query's answers (or its wait) measured
            if len(self.nodes) >= m or len(settled & set(range(m))) >= m or time.monotonic() >= start + wait_s:
                break
            if len(nids) < m:
                log.warning("waiting up to %g s for %d SuperNodes (%d joined)", wait_s, m, len(self.nodes))
            time.sleep(1.0)
        self.join_wait_s = time.monotonic() - start
        if len(self.nodes) < need:
            raise self._not_started(wait_s, need)
        if len(self.nodes) < m:
            log.warning("starting with %d of %d clients (%s); the others take part once they connect",
                        len(self.nodes), m, sorted(self.nodes))

    def _not_started(self, wait_s: float, need: int) -> TrainingError:
        """The error of a run too few nodes joined: what was seen (the nodes online, those that failed their
        query and why, those that did not answer) and what to change; ``nodes_seen`` holds the same."""
        m, online = self.cfg.clients, sorted(self.online_seen)
        which = "" if self.own_data else " (one per partition-id 0..clients-1)"
        said = "".join(f"; node {n} refused: {why}" for n, why in list(self.refused.items())[:5])
        said += "".join(f"; node {n} did not join ({why})" for n, why in list(self.unanswered.items())[:5])
        there = sorted(set(online) - set(self.nodes.values()) - set(self.refused))  # online, not joined
        clients = sorted(set(range(m)) - set(self.nodes))
        absent = max(0, m - len(online))
        key = "client-id" if self.own_data else "partition-id"
        if there:  # they are there but did not join: slow (a loaded machine) or failing
            fix = (f"{len(online)} node(s) were online {online[:10]} but not enough joined: on a loaded machine raise "
                   f"wait-nodes (e.g. wait-nodes={max(300, 5 * wait_s):g}) and round-timeout, and read the nodes' "
                   "logs for the reasons")
        else:  # nobody was waiting to join: a longer wait changes nothing
            fix = (f"{len(online)} node(s) were online {online[:10]}; {absent} of {m} SuperNodes never connected "
                   f"({key} {', '.join(map(str, clients[:10]))} did not join): start them, then run the restart "
                   "command of failure.json")
        e = TrainingError(f"{len(self.nodes)} SuperNodes joined within {wait_s:g} s, but the run has clients={m} and "
                          f"needs {need}{which}: {fix}{said}")
        e.nodes_seen = self.nodes_seen()
        e.missing = {"clients": clients, "never_connected": absent, "online_not_joined": there}
        e.fix = fix
        return e

    def nodes_seen(self) -> dict:
        """What the start saw (``failure.json``'s ``nodes_seen``): the node ids listed online, the clients
        that joined (client id -> node id), the nodes refused and those that did not answer, with why."""
        return {"online": sorted(self.online_seen), "joined": {str(c): n for c, n in sorted(self.nodes.items())},
                "refused": {str(n): why for n, why in self.refused.items()},
                "unanswered": {str(n): why for n, why in self.unanswered.items()}}


__all__ = ["NodeMembership"]
