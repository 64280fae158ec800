"""Simulated misbehaving clients in the simulator (options ``attack``, ``attackers``;
:mod:`fedproto.engine.attacks`): their outgoing messages are altered between the executor and the
server's reply check, and the summary reports the honest clients apart."""

from __future__ import annotations

import numpy as np

from fedproto.algorithms.algorithm import HEALTH_KEYS
from fedproto.config.common_options import CommonConfig
from fedproto.engine.attacks import attacker_ids, corrupt_message
from fedproto.engine.executors.executor import RoundReplies
from fedproto.engine.loop import Observer, RoundLoop, Stage
from fedproto.engine.summary import ClientMetrics, Summary, summarize


class SimulatedAttack(Stage, Observer):
    """Corrupts the messages of the run's attackers (:func:`~fedproto.engine.attacks.attacker_ids`) with
    :func:`~fedproto.engine.attacks.corrupt_message`, each from a generator of (seed, round, client); adds
    ``attack`` and ``accuracy_honest`` to the summary and ``attacker`` to ``clients.csv``.

    Args:
        cfg: the run's options. num_clients: m.
    """

    def __init__(self, cfg: CommonConfig, num_clients: int) -> None:
        self.cfg = cfg
        self.attackers = frozenset(attacker_ids(cfg.seed, num_clients, cfg.attackers))

    def apply(self, round: int, replies: RoundReplies) -> None:
        cfg = self.cfg
        for i in sorted(self.attackers.intersection(replies.replies)):
            rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, round, i, 0xA77]))
            msg, res = replies.replies[i]
            replies.replies[i] = (corrupt_message(msg, cfg.attack, rng, cfg.num_classes, cfg.attack_scale), res)

    def summary(self, loop: RoundLoop, summary: Summary, per_client: list[ClientMetrics]) -> None:
        if not self.attackers:
            return
        honest = [m for i, m in enumerate(per_client) if i not in self.attackers]
        summary["attack"] = {"kind": self.cfg.attack, "clients": sorted(self.attackers)}
        summary["accuracy_honest"] = {
            "test_set": summary["test_set"] + f"; the {len(honest)} clients that did not misbehave",
            **{k: dict(zip(("mean", "std"), summarize([m[k] for m in honest])))
               for k in summary["accuracy_all_clients"]  # the measured keys (not clients.csv's other columns)
               if k not in HEALTH_KEYS and k != "dp_epsilon" and not k.startswith("full_")}}
        for i, m in enumerate(per_client):
            m["attacker"] = int(i in self.attackers)
