"""Health checks of a run: a diverged loss stops the run with what to change; exploding or
non-finite embeddings and the method's alerts (FedProto: far-off prototypes) are warned about,
naming the client and round. The method supplies its own words (``divergence_hint``,
``attack_fix``, ``blowup_causes``, :class:`~fedproto.algorithms.server_state.Alert`)."""

from __future__ import annotations

import logging
from typing import Literal, overload

import numpy as np

from fedproto.algorithms.algorithm import Algorithm, ClientData
from fedproto.config.common_options import CommonConfig
from fedproto.data.inputs import finite
from fedproto.engine.executors.executor import RoundReplies
from fedproto.engine.loop import Observer, RoundLoop
from fedproto.engine.summary import ClientMetrics
from fedproto.errors import TrainingError, opt
from fedproto.training import EMBED_NORM_LIMIT, EVAL_TRAIN_NORM_RATIO

log = logging.getLogger(__name__)

ALERTS_PER_CLIENT = 3
"""Prototype-distance warnings (``proto_dist_alert``) logged per client in a run; later rounds are
only in the metrics."""


class Health(Observer):
    """Divergence, embedding-norm checks and the method's alerts; the same on every front end.

    Args:
        cfg: the run's options (named in the hints).
        attackers: simulated misbehaving clients (their divergence does not stop the run: their
            messages go through the server's checks; the run stops when an honest client diverges).
        data: the clients' data where the server holds it (in-process), to say whether a diverged
            client's inputs hold NaN; None otherwise.
        algorithm: the run's algorithm (its ``divergence_hint``, ``attack_fix``, ``blowup_causes``);
            None: the loop's, taken at :meth:`start`.
    Attributes:
        train_norm: client -> largest training embedding norm of its last round.
    """

    def __init__(self, cfg: CommonConfig, attackers: frozenset[int] = frozenset(), data: list[ClientData] | None = None,
                 algorithm: Algorithm | None = None) -> None:
        self.cfg, self.attackers, self.data = cfg, frozenset(attackers), data
        self.train_norm: dict[int, float] = {}
        self._alerts: dict[int, int] = {}  # client -> alerts logged
        self.algorithm = algorithm  # whose words the messages use (else the loop's, from start())

    def replies(self, loop: RoundLoop, round: int, replies: RoundReplies) -> None:
        r = round
        seen = [(i, replies.replies[i][1]) for i in sorted(replies.replies)
                if replies.replies[i][1].loss_ce is not None]  # a node under DP sends no losses
        # (loss_proto is None only where loss_ce is: those replies are not in seen)
        bad = [i for i, x in seen if not np.isfinite(np.asarray([x.loss_ce, x.loss_proto, x.loss_terms])).all()
               and i not in self.attackers]
        if bad:
            dirty = [i for i in bad if self.data is not None and self.data[i].in_memory and not finite(self.data[i].x)]
            if dirty:
                raise TrainingError(f"training diverged in round {r}: the training inputs of clients {dirty[:10]} "
                                    "hold NaN or infinite values; clean or drop those samples")
            # bad data before lr: NaN in a Dataset's items is refused when read, extreme values are not
            raise TrainingError(f"training diverged in round {r}: the loss of clients {bad[:10]} is not finite; "
                                "check their data first for extreme values (unscaled features, e.g. raw pixels in "
                                f"0..255, or huge outliers), then lower {opt('lr')} (now {self.cfg.lr})"
                                f"{loop.algorithm.divergence_hint(self.cfg)}{self.attack_hint()}")
        for i, x in seen:
            self.train_norm[i] = x.emb_norm_max
            if not x.emb_norm_max <= EMBED_NORM_LIMIT:
                log.warning("round %d: client %d's training embeddings reached norm %.3g (limit %.0e)%s; its numbers "
                            "may be meaningless: %s", r, i, x.emb_norm_max, EMBED_NORM_LIMIT,
                            "" if np.isfinite(x.emb_norm_max) else " (not finite)", self.blowup_causes())

    def aggregated(self, loop: RoundLoop, round: int) -> None:
        """Log the method's alerts of this aggregation (:attr:`ServerState.alerts`), at most
        :data:`ALERTS_PER_CLIENT` per client and run."""
        for alert in loop.server.alerts:
            seen = self._alerts[alert.cid] = self._alerts.get(alert.cid, 0) + 1
            if seen <= ALERTS_PER_CLIENT:
                log.warning("round %d: %s%s", round, alert.text, f"; not repeated for this client ({alert.later})"
                            if seen == ALERTS_PER_CLIENT else "")

    def evaluated(self, loop: RoundLoop, round: int, per_client: list[ClientMetrics]) -> None:
        """Warn, naming the client and round, where evaluation embeddings or scores were not finite,
        the median embedding norm exceeded :data:`EMBED_NORM_LIMIT`, or it exceeded
        :data:`EVAL_TRAIN_NORM_RATIO` times the client's largest training embedding norm (without
        these warnings a blown-up client shows only as a chance-level accuracy)."""
        r = round
        for i, m in enumerate(per_client):
            seen = self.train_norm.get(i, 0.0)
            if (not m.get("nonfinite") and m.get("emb_norm", 0.0) <= EMBED_NORM_LIMIT
                    and 0 < seen < m.get("emb_norm", 0.0) / EVAL_TRAIN_NORM_RATIO):
                log.warning("round %d: client %d's test embeddings (median norm %.3g) are %.0fx larger than any of "
                            "its training embeddings (%.3g): evaluation mode changes its model, as BatchNorm "
                            "running statistics from too few values do; check its batch sizes", r, i,
                            m["emb_norm"], m["emb_norm"] / seen, seen)
            if m.get("nonfinite"):
                log.warning("round %d: client %d's test embeddings or scores are not finite (NaN or inf); its "
                            "accuracy is not meaningful (flagged in clients.csv: nonfinite = 1)", r, i)
            elif m.get("emb_norm", 0.0) > EMBED_NORM_LIMIT:
                log.warning("round %d: client %d's test embeddings have median norm %.3g (limit %.0e): the model "
                            "blew up; %s", r, i, m["emb_norm"], EMBED_NORM_LIMIT, self.blowup_causes())

    @overload
    def algorithm_hints(self, hook: Literal["attack_fix"]) -> str: ...

    @overload
    def algorithm_hints(self, hook: Literal["blowup_causes"]) -> list[str]: ...

    def algorithm_hints(self, hook: Literal["attack_fix", "blowup_causes"]) -> str | list[str]:
        """The run's algorithm's ``hook(cfg)`` (``attack_fix``, ``blowup_causes``: the method's own
        words in the health messages), '' or [] before an algorithm is set."""
        alg = self.algorithm
        if alg is None:
            return "" if hook == "attack_fix" else []
        return alg.attack_fix(self.cfg) if hook == "attack_fix" else alg.blowup_causes(self.cfg)

    def start(self, loop: RoundLoop) -> None:
        self.algorithm = loop.algorithm

    def attack_hint(self) -> str:
        """The simulated attack's part of a divergence error ('' without one): the options through
        which misbehaving clients reach the honest ones."""
        cfg = self.cfg
        if not self.attackers:
            return ""
        what = f"{opt('attack', cfg.attack)}" + (f" x{cfg.attack_scale:g}" if cfg.attack == "scale" else "")
        fix = self.algorithm_hints("attack_fix")
        n = len(self.attackers)
        return f"; {n} simulated misbehaving client{'s' if n > 1 else ''} ({what}) reach the others through " \
               f"aggregation" + (f": {fix}" if fix else "")

    def blowup_causes(self) -> str:
        """What a warning about exploding embeddings asks to check, given this run's options: DP
        noise and the simulated attack where they are on, then the data, lr and BatchNorm batches."""
        cfg = self.cfg
        causes = list(self.algorithm_hints("blowup_causes") or [])
        if self.attackers:
            causes.append(f"the simulated attack (attack={cfg.attack}, attackers={cfg.attackers}; a robust "
                          "aggregation holds it off)")
        causes.append(f"its data and lr (now {cfg.lr:g}), or for BatchNorm models its batch sizes")
        return "check " + "; ".join(causes)
