"""The round loop (docs/architecture.md, "One round in the simulator"): one loop for the simulator and for Flower.

Each round: sample the clients (:func:`~fedproto.engine.seeding.sample_clients` over the
executor's available clients), send each its downlink view of the server message, let the
executor run their client step, pass the replies through the stages (simulated attacks), check
them (:func:`~fedproto.engine.checks.check_replies`), aggregate, evaluate every ``eval_every``
rounds and after the last, and notify the observers (metrics and run folder, checkpoints, health
checks, progress). Everything that is not this sequence is an observer or a stage in its own module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from fedproto.algorithms.algorithm import HEALTH_KEYS, Algorithm, Message, message_size
from fedproto.algorithms.server_state import ServerState, server_update
from fedproto.config.common_options import CommonConfig
from fedproto.engine.checks import check_replies
from fedproto.engine.executors.executor import Executor, RoundReplies
from fedproto.engine.seeding import sample_clients
from fedproto.engine.summary import ClientMetrics, Row, Summary, build_summary, rounds_trained, summarize

log = logging.getLogger(__name__)

TOTALS = ("up_params", "up_bytes", "down_params", "down_bytes")
"""The metrics row entries summed over rounds (``summary.json``'s communication)."""


class Observer:
    """Something that hangs on the round loop; every hook is optional.

    Hooks, in the order a run calls them: :meth:`start` (before round 1, or the first round after
    a resume), then per round :meth:`replies` (the checked replies, before aggregation: health
    checks may stop the run here), :meth:`aggregated`, :meth:`evaluated` (evaluation rounds),
    :meth:`round_done` (the finished metrics row); after the last round :meth:`summary` (add to
    the summary and the per-client rows) and :meth:`finish`.
    """

    def start(self, loop: RoundLoop) -> None:
        """Before the first round of this process."""

    def replies(self, loop: RoundLoop, round: int, replies: RoundReplies) -> None:
        """The round's replies, after the stages and before the reply check."""

    def aggregated(self, loop: RoundLoop, round: int) -> None:
        """After the server aggregated round ``round`` (``loop.message`` is the new message)."""

    def evaluated(self, loop: RoundLoop, round: int, per_client: list[ClientMetrics]) -> None:
        """After an evaluation (per-client metrics, indexed by client id)."""

    def round_done(self, loop: RoundLoop, row: Row) -> None:
        """The round's metrics row, appended to ``loop.history``."""

    def summary(self, loop: RoundLoop, summary: Summary, per_client: list[ClientMetrics]) -> None:
        """Add entries to ``summary`` or to the per-client rows (``clients.csv``) in place."""

    def finish(self, loop: RoundLoop, summary: Summary, per_client: list[ClientMetrics]) -> None:
        """The run finished; ``summary`` and ``per_client`` are final."""


class Stage:
    """A step between the executor and the reply check that may change replies (in the simulator:
    :class:`fedproto.engine.attacks.SimulatedAttack`)."""

    def apply(self, round: int, replies: RoundReplies) -> None:
        """Change ``replies.replies`` in place."""


class RoundLoop:
    """Run a federation's rounds with one executor.

    Args:
        cfg: the run configuration (rounds, participation, seed, eval_every).
        algorithm: the server side of the algorithm (aggregate, downlink, broadcast).
        executor: runs the client side (:class:`~fedproto.engine.executors.executor.Executor`).
        embedding_dim: d (reply checks).
        observers: what hangs on the loop (:class:`Observer`), called in this order.
        stages: what may change the replies before the check (:class:`Stage`).
    Attributes:
        message: the server message of the next round. server: the last aggregation's
            :class:`~fedproto.algorithms.server_state.ServerState` (metrics, alerts, checkpoint, files).
            history: the metrics rows so far.
        totals: communication summed over rounds. train_time: seconds in rounds (without evaluation).
    """

    def __init__(self, cfg: CommonConfig, algorithm: Algorithm, executor: Executor, embedding_dim: int,
                 observers: Sequence[Observer] = (), stages: Sequence[Stage] = ()) -> None:
        self.cfg, self.algorithm, self.executor, self.embedding_dim = cfg, algorithm, executor, embedding_dim
        self.observers, self.stages = list(observers), list(stages)
        self.message: Message = {}
        self.server = ServerState({})  # the last aggregation's explicit state (the initial message before round 1)
        self.history: list[Row] = []
        self.totals = dict.fromkeys(TOTALS, 0)
        self.train_time = 0.0
        self.wall_before = 0.0  # wall seconds of the rounds run before a resume
        self.start_round = 1
        self.t_start = time.perf_counter()

    def initial_message(self) -> Message:
        """The first broadcast, from the clients' join messages (may refuse the set-up, e.g.
        weight sharing across architectures)."""
        first = self.executor.initial_message(self.algorithm)
        self.server = ServerState(first)
        return self.algorithm.broadcast(1, first)

    def sample(self, round: int) -> list[int]:
        """The clients of ``round``: ``participation`` of the executor's available clients (all by
        default), drawn with (seed, round)."""
        live = self.executor.available(round)
        if not live:
            return []
        p = self.cfg.participation
        if p > 1:
            p = min(p, len(live))
        return [live[j] for j in sample_clients(self.cfg.seed, round, len(live), p)]

    def elapsed(self) -> float:
        """Wall seconds of the run so far (rounds before a resume included)."""
        return time.perf_counter() - self.t_start

    def run(self) -> Summary:
        """Rounds ``start_round..rounds``, the final evaluation and the summary (returned)."""
        cfg, alg = self.cfg, self.algorithm
        self.t_start = time.perf_counter() - self.wall_before
        for o in self.observers:
            o.start(self)
        per_client: list[ClientMetrics] = []
        for r in range(self.start_round, cfg.rounds + 1):
            row, evaluated = self.round(r)
            per_client = evaluated or per_client
            self.history.append(row)
            for o in self.observers:
                o.round_done(self, row)
        if not per_client:  # resumed after the last round's checkpoint: evaluate the restored models
            per_client = self.evaluate(cfg.rounds)
        ex = self.executor
        per_client = [{**m, **ex.client_report(i)} for i, m in enumerate(per_client)]
        summary = build_summary(cfg, alg, ex, self.history, per_client, self.totals, self.elapsed(), self.train_time)
        for o in self.observers:
            o.summary(self, summary, per_client)
        for o in self.observers:
            o.finish(self, summary, per_client)
        return summary

    def round(self, r: int) -> tuple[Row, list[ClientMetrics] | None]:
        """One round: returns its metrics row and the per-client metrics if it evaluated."""
        cfg, alg = self.cfg, self.algorithm
        t0 = time.perf_counter()
        ids = self.sample(r)
        got = self.executor.train(r, {i: alg.downlink(self.message, i) for i in ids},
                                  lambda i: alg.downlink(self.message, i))
        for s in self.stages:
            s.apply(r, got)
        down = [message_size(m) for m in got.sent.values()]
        ids = sorted(got.replies)  # the clients that replied (all of them in-process)
        up = [message_size(got.replies[i][0]) for i in ids]
        for o in self.observers:
            o.replies(self, r, got)
        dropped, whole = check_replies(alg, self.embedding_dim, r, got.sent, got.replies, self.executor.who)
        kept = {i: got.replies[i][0] for i in ids if i not in whole}
        metrics: dict[str, Any] = {}
        if kept:
            self.server = server_update(alg, r, kept, self.server)
            self.message = alg.broadcast(r + 1, self.server.message)
            metrics = self.server.metrics
        else:
            log.warning("round %d: no reply to aggregate; the server message stays that of the round before", r)
            self.server = replace(self.server, metrics={}, alerts=[])
            self.message = alg.broadcast(r + 1, self.message)
        t_train = time.perf_counter() - t0
        for o in self.observers:
            o.aggregated(self, r)
        seen = [got.replies[i][1] for i in ids if got.replies[i][1].loss_ce is not None]  # DP nodes send no losses
        self.train_time += t_train
        row: Row = {
            "round": r,
            "loss_ce": float(np.mean([x.loss_ce for x in seen])) if seen else None,
            "loss_proto": float(np.mean([x.loss_proto for x in seen])) if seen else None,
            "lr": alg.opt.lr_of_round(r),  # the round's learning rate (lr_schedule)
            **({"loss_terms": float(np.mean([x.loss_terms for x in seen]))}  # an algorithm's own loss terms
               if any(x.loss_terms for x in seen) else {}),
            "up_params": sum(u[0] for u in up),
            "up_bytes": sum(u[1] for u in up),
            "down_params": sum(d[0] for d in down),
            "down_bytes": sum(d[1] for d in down),
            "train_time_s": t_train,
            **metrics,
        }
        if len(ids) < self.executor.num_clients:
            row["sampled"] = ids
        row.update(got.status)
        if dropped:  # replies dropped whole or in part, and why
            row["dropped"] = sorted(dropped)
            row["dropped_why"] = {str(i): why for i, why in dropped.items()}
        for k in TOTALS:
            self.totals[k] += row[k]
        per_client: list[ClientMetrics] | None = None
        if r == cfg.rounds or (cfg.eval_every and r % cfg.eval_every == 0):
            t1 = time.perf_counter()
            per_client = self.evaluate(r)
            for key in per_client[0]:
                if key not in HEALTH_KEYS:
                    row[f"{key}_mean"], row[f"{key}_std"] = summarize([m[key] for m in per_client])
            row["eval_time_s"] = time.perf_counter() - t1
        return row, per_client

    def evaluate(self, round: int) -> list[ClientMetrics]:
        """Per-client metrics on each client's own test set (list indexed by client id)."""
        alg = self.algorithm
        per_client = self.executor.evaluate({i: alg.downlink(self.message, i)
                                             for i in range(self.executor.num_clients)})
        for o in self.observers:
            o.evaluated(self, round, per_client)
        return per_client

    def rounds_trained(self) -> list[int]:
        """Per client: the rounds of this run (so far) in which it trained and replied, from the
        metrics rows (:func:`fedproto.engine.summary.rounds_trained`)."""
        return rounds_trained(self.history, self.executor.num_clients)
