"""The message exchange of :class:`~fedproto.flower.flower_executor.FlowerExecutor` with its nodes: one
message per node sent and its reply matched, within ``round-timeout`` seconds, every SuperLink call
under that deadline, and each failure sorted (a node's error, a node the SuperLink knows is gone,
no reply in time).

:class:`MessageExchange` is a part of the executor, not an executor of its own: it reads the
attributes :class:`~fedproto.flower.flower_executor.FlowerExecutor` sets (``grid``, ``opts``, ``nodes``,
``round``, ``run_key``, ``deadline``: a :class:`fedproto.flower.deadline.RoundDeadline`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from flwr.app import ConfigRecord, Message, RecordDict

from fedproto.algorithms.algorithm import Message as FedMessage
from fedproto.errors import TrainingError
from fedproto.flower.records import CONFIG, MESSAGE, SCHEMA, to_record

NODE_UNAVAILABLE = 5
"""Flower's ``ErrorCode.NODE_UNAVAILABLE`` (``flwr.common.constant``): the SuperLink's error reply
for a message to a node it has marked offline."""
REPLY_UNAVAILABLE = 4
"""Flower's ``ErrorCode.REPLY_MESSAGE_UNAVAILABLE``: the reply expired or was lost at the SuperLink."""
TTL_MARGIN = 30.0
"""Seconds a message lives beyond the deadline of its exchange (its Flower ``ttl`` is the deadline
plus this): room for the clocks of the ServerApp's, the SuperLink's and the node's machines to
differ. After that nobody waits for its reply, so the SuperLink no longer hands it out (flwr drops
an expired message instead of delivering it) and a node that gets it late does not run it
(:func:`fedproto.flower.client_app.drop_expired`)."""
log = logging.getLogger("fedproto.flower.flower_executor")  # the executor's logger: its parts log as it does


class MessageExchange:
    """Sending messages to the nodes and sorting their replies (a part of
    :class:`~fedproto.flower.flower_executor.FlowerExecutor`)."""

    def _config(self, entries: dict) -> dict:
        """A message's config record: ``entries`` plus the run key (:data:`fedproto.flower.node_state.RUN_KEY`)
        and the message schema (:data:`fedproto.flower.records.SCHEMA`)."""
        entries = {**entries, "run-key": self.run_key} if self.run_key else dict(entries)
        entries["schema"] = SCHEMA  # the node refuses another version (fedproto.flower.records.schema_problem)
        return {CONFIG: ConfigRecord(entries)}

    def _message(self, config: dict, dst: int, kind: str, content: dict | None = None,
                 group: str | None = None) -> Message:
        """One Flower message to node ``dst``: ``content`` records plus the config record
        (:meth:`_config` of ``config``), with a ``ttl`` of the next exchange's deadline plus
        :data:`TTL_MARGIN` seconds, so that a message whose round is over (the run stopped, the node
        came back late) is never delivered or run. Flower's default ``ttl`` is 12 hours: the nodes
        kept starting ClientApps for a run that had stopped."""
        return Message(RecordDict({**(content or {}), **self._config(config)}), dst_node_id=dst, message_type=kind,
                       ttl=self.deadline.seconds() + TTL_MARGIN, group_id=group)

    def _exchange(self, messages: list[Message], limit: float | None = None) -> tuple[
            dict[int, Message], dict[int, str], dict[int, str], list[int]]:
        """Send, wait up to the deadline (at most ``limit`` s, e.g. what is left of the join wait): (replies
        by node id, failures by node id (the node's error), unavailable nodes by node id (the SuperLink's
        answer for a node it knows is gone: no wait), node ids that did not reply in time).

        A reply counts only for the message it answers: its ``reply_to_message_id`` is that message's id
        and its run id the message's (an error reply the SuperLink sends for an unavailable node carries
        the SuperLink's node id as its source; a reply a node sends late, to an earlier message, is the
        node's but not this message's). Any other reply is left out and logged. A grid that sets no
        message ids (a test double) is matched by source node."""
        if not messages:
            return {}, {}, {}, []
        replies = self._send_and_receive(messages, limit)
        by_message = {rep.metadata.reply_to_message_id: rep for rep in replies if rep.metadata.reply_to_message_id}
        by_node = {rep.metadata.src_node_id: rep for rep in replies}
        ids = {m.metadata.message_id for m in messages if m.metadata.message_id}
        for rep in replies:
            if ids and rep.metadata.reply_to_message_id not in ids:
                log.warning("a reply of node %s to message %r answers no message of this exchange: left out",
                            rep.metadata.src_node_id, rep.metadata.reply_to_message_id[:16])
        run_id = self._run_id()
        ok, failed, unavailable, missing = {}, {}, {}, []
        for m in messages:
            nid = m.metadata.dst_node_id
            rep = by_message.get(m.metadata.message_id) if m.metadata.message_id else by_node.get(nid)
            if rep is not None and m.metadata.message_id and run_id and rep.metadata.run_id != run_id:
                log.warning("the reply to message %r of node %d is of run %d, not this run's %d: left out",
                            m.metadata.message_id[:16], nid, rep.metadata.run_id, run_id)
                rep = None
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

    def _run_id(self) -> int:
        """This run's Flower run id (the grid's), or 0 where the grid has none (a test double)."""
        try:
            return int(self.grid.run.run_id)
        except Exception:  # noqa: BLE001 - a grid without a run
            return 0

    def _send_and_receive(self, messages: list[Message], limit: float | None = None) -> list[Message]:
        """Push ``messages`` and pull their replies every ``poll_interval`` seconds until all are in
        or ``round_timeout`` has passed. Flower's own ``Grid.send_and_receive`` waits a fixed 3 s
        between pulls (flwr 1.42), which made every round last at least 3 s more than its slowest
        node; a grid without push/pull (a test double) is asked with ``send_and_receive``."""
        try:
            pending = set(self._grid("push_messages", messages))
        except NotImplementedError:
            return list(self.grid.send_and_receive(messages, timeout=self.opts.round_timeout))
        start = time.monotonic()
        wait = self.deadline.seconds()  # round-timeout, longer once rounds ran slow (fedproto.flower.deadline)
        end = start + (wait if limit is None else max(0.0, min(wait, limit)))
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

    def _send(self, kind: str, ids: Iterable[int], msgs: dict[int, FedMessage]):
        """Send ``kind`` to the clients ``ids``: (replies by client id, failures by client id,
        client ids that timed out). Failures and timeouts are logged."""
        ids = [i for i in ids if i in self.nodes]
        out = [self._message({"round": self.round, "cid": i}, self.nodes[i], kind, {MESSAGE: to_record(msgs[i])},
                             str(self.round))
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


__all__ = ["NODE_UNAVAILABLE", "REPLY_UNAVAILABLE", "TTL_MARGIN", "MessageExchange"]
