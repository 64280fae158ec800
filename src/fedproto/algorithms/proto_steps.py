"""FedProto's server steps as parts a method composes (docs/architecture.md, "Server strategy").

One round on a prototype server: the replies become :class:`Rows`; :class:`SampleFilter` drops
prototypes from too few samples, :class:`ClassCheck` the rows that do not fit the previous global
prototypes, :class:`OutlierExclusion` whole clients far from the round's median; an
:class:`AggregationRule` makes the global prototypes (eq. 6 of arXiv 2105.00243 and its robust
variants), :class:`Momentum` blends them with the previous ones and :class:`DistanceMonitor`
measures every client against the result. :class:`fedproto.algorithms.fedproto.FedProto` runs them
in that order; a plug-in reuses any of them (e.g. its own rule between the same filter and monitor).
Each part holds its options and at most a "warned once" flag: the round's results are returned.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from fedproto.algorithms.server_state import Alert, Message, ServerState
from fedproto.prototypes import aggregate_prototypes, class_check, client_distances, momentum_prototypes, robust_z
from fedproto.prototypes.aggregation import AggregationRule as RuleName

log = logging.getLogger(__name__)


@dataclass
class Rows:
    """The round's prototype rows, one entry per reply, in the order of ``cids``.

    Attributes:
        cids: client id of each reply. classes: per reply, (K_j,) int class ids.
        protos: per reply, (K_j, d) prototypes. counts: per reply, (K_j,) samples behind each.
    """

    cids: list[int]
    classes: list[np.ndarray]
    protos: list[np.ndarray]
    counts: list[np.ndarray]

    @classmethod
    def of(cls, messages: dict[int, Message]) -> Rows:
        """The rows of the non-empty replies ``{cid: {"classes", "protos", "counts"}}``."""
        kept = {c: m for c, m in messages.items() if m}
        return cls(list(kept), [np.asarray(m["classes"]) for m in kept.values()],
                   [np.asarray(m["protos"]) for m in kept.values()], [np.asarray(m["counts"]) for m in kept.values()])

    def where(self, masks: list[np.ndarray]) -> Rows:
        """Each reply's rows where its boolean (K_j,) mask is True (replies stay, maybe empty)."""
        return Rows(list(self.cids), [c[k] for c, k in zip(self.classes, masks)],
                    [p[k] for p, k in zip(self.protos, masks)], [n[k] for n, k in zip(self.counts, masks)])

    def without(self, out: list[int]) -> Rows:
        """These rows without the replies at positions ``out``."""
        keep = [j for j in range(len(self.cids)) if j not in set(out)]
        return Rows([self.cids[j] for j in keep], [self.classes[j] for j in keep], [self.protos[j] for j in keep],
                    [self.counts[j] for j in keep])

    def parts(self) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        """(classes, protos, counts), each a list over replies."""
        return self.classes, self.protos, self.counts


class SampleFilter:
    """Drops every prototype computed from fewer than ``min_samples`` samples (``min_proto_samples``)."""

    def __init__(self, min_samples: int = 1):
        self.min_samples = int(min_samples)

    def __call__(self, rows: Rows) -> Rows:
        return rows.where([n >= self.min_samples for n in rows.counts])


class ClassCheck:
    """Leaves out every row :func:`fedproto.prototypes.class_check` flags against the previous global
    prototypes (the origin before the first): nearer another class's prototype than its own, or
    with a robust z-score of its distance above ``z`` (``class_check``).

    Args:
        z: the robust z-score limit (> 0). num_classes: C. embedding_dim: d.
    """

    def __init__(self, z: float, embedding_dim: int):
        self.z, self.embedding_dim = float(z), int(embedding_dim)
        self._warned = False

    def __call__(self, round: int, rows: Rows, previous: Message) -> tuple[Rows, dict[str, Any]]:
        """Returns the kept rows and the metrics ``flagged`` (clients with a row left out),
        ``flagged_rows`` (how many rows) and ``flagged_many`` (1 when more than a third of the
        round's clients are flagged, else 0: a warning is logged then, since the check is
        calibrated to flag few honest clients and more than a third means an attack on a third
        of the federation or a check that does not fit these clients)."""
        if "protos" in previous and len(previous.get("classes", ())):
            ref_c, ref_p = np.asarray(previous["classes"]), np.asarray(previous["protos"])
        else:
            ref_c, ref_p = np.zeros(0, np.int64), np.zeros((0, self.embedding_dim), np.float32)
        flags, acted = class_check(rows.classes, rows.protos, ref_c, ref_p, self.z)
        if len(ref_c) > 1 and not acted and not self._warned:
            self._warned = True
            log.info("round %d: class check: most prototypes lie nearer another class's global prototype than their "
                     "own (the clients' embeddings are not aligned yet), so only the distance test acts; logged once",
                     round)
        flagged = [int(rows.cids[j]) for j, f in enumerate(flags) if f.any()]
        n = sum(int(f.sum()) for f in flags)
        many = 3 * len(flagged) > len(rows.cids)
        if many:
            log.warning("round %d: class check: %d of %d clients flagged (more than a third; %d prototype(s) left "
                        "out: clients %s): either that many clients misbehave, or their prototypes do not fit the "
                        "check; compare a run without class_check, or raise class_check above %g",
                        round, len(flagged), len(rows.cids), n, flagged, self.z)
        elif flagged:
            log.info("round %d: class check: %d prototype(s) of clients %s left out", round, n, flagged)
        return rows.where([~f for f in flags]), {"flagged": flagged, "flagged_rows": n, "flagged_many": int(many)}


class OutlierExclusion:
    """Leaves out of the round the clients whose prototypes lie far from the round's median
    (``exclude_outliers``): each reply's mean L2 distance to the coordinate-wise median of the
    classes at least 3 replies hold (with 1 or 2 holders the median cannot tell who is off),
    scored by :func:`fedproto.prototypes.robust_z`; above ``z`` is out. Nobody is left out when
    fewer than 3 replies can be compared or their MAD is 0 (a warning says so, once), nor when
    everybody would be.

    Args:
        z: the robust z-score limit (> 0). num_classes: C.
    """

    def __init__(self, z: float, num_classes: int):
        self.z, self.num_classes = float(z), int(num_classes)
        self._warned = False

    def outliers(self, round: int, rows: Rows) -> list[int]:
        """The positions in ``rows`` of the replies to leave out."""
        from scipy.stats import median_abs_deviation

        held = [np.asarray(c, np.int64) for c in rows.classes]
        holders = np.bincount(np.concatenate(held) if held else np.zeros(0, np.int64), minlength=self.num_classes)
        shared = np.nonzero(holders >= 3)[0]
        part = rows.where([np.isin(c, shared) for c in held])
        ref_c, ref_p, _ = aggregate_prototypes(*part.parts(), self.num_classes, "median")
        d = client_distances(part.classes, part.protos, ref_c, ref_p)
        ok = np.isfinite(d)
        if ok.sum() < 3 or median_abs_deviation(d[ok]) == 0:
            if not self._warned:
                self._warned = True
                why = ("no class is held by 3 or more clients" if ok.sum() == 0 else
                       f"only {int(ok.sum())} clients hold classes that 3 or more clients hold" if ok.sum() < 3
                       else "half or more of the comparable clients lie at the same distance (MAD 0)")
                log.warning("round %d: exclude_outliers cannot act: %s; nobody is left out while this holds",
                            round, why)
            return []
        z = robust_z(d)
        out = [j for j in range(len(rows.cids)) if z[j] > self.z]
        return out if len(out) < len(rows.cids) else []

    def __call__(self, round: int, rows: Rows) -> tuple[Rows, dict[str, Any]]:
        """Returns the kept rows and the metric ``excluded`` (the clients left out)."""
        out = self.outliers(round, rows)
        excluded = [int(rows.cids[j]) for j in out]
        if excluded:
            log.warning("round %d: clients %s left out of the aggregation (robust z-score of their prototype "
                        "distance > %s)", round, excluded, self.z)
        return (rows.without(out) if out else rows), {"excluded": excluded}


class AggregationRule:
    """Global prototypes from the kept rows (:func:`fedproto.prototypes.aggregate_prototypes`):
    ``mean`` (official code), ``weighted`` (eq. 6, convex), ``median`` or ``trimmed``; a class gets
    one only where at least ``min_contributors`` replies hold it. Warns once when ``trimmed`` cuts
    nothing for some class. A plug-in's own rule is any callable ``rule(round, rows) -> (classes
    (K,) int64, protos (K, d), contributors (K,) int64)``.
    """

    def __init__(self, num_classes: int, rule: str = "mean", trim: float = 0.2, min_contributors: int = 1):
        self.num_classes, self.rule, self.trim, self.min_contributors = num_classes, rule, float(trim), min_contributors
        self._warned = False

    def __call__(self, round: int, rows: Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rule = cast(RuleName, self.rule)  # a str of AGGREGATION_RULES: aggregate_prototypes refuses others (ValueError)
        cls, protos, contrib = aggregate_prototypes(*rows.parts(), self.num_classes, rule, self.trim,
                                                    self.min_contributors)
        if self.rule == "trimmed" and not self._warned:
            self._warn_trim(round, cls, contrib)
        return cls, protos, contrib

    def _warn_trim(self, round: int, cls: np.ndarray, contrib: np.ndarray) -> None:
        plain = [int(c) for c, n in zip(cls.tolist(), contrib.tolist()) if int(self.trim * n) == 0]
        if not plain:  # scipy's trim_mean cuts int(trim * n) values from each end: none for small n
            return
        self._warned = True
        few = (f"fewer than {int(np.ceil(1.0 / self.trim - 1e-9))} contributors" if self.trim > 0
               else "any number of contributors")
        ns = [int(n) for c, n in zip(cls.tolist(), contrib.tolist()) if int(c) in plain]
        cuttable = [n for n in ns if n >= 3]  # int(trim * n) >= 1 for some trim < 0.5 only from n = 3
        fix = (f"raise trim to {1.0 / min(cuttable):.3g} or more (below 0.5) or use aggregation='median'"
               if cuttable else "no trim below 0.5 cuts anything from 2 or fewer contributors: give each "
               "class more contributors per round (participation, clients) for a robust aggregate")
        log.warning("round %d: aggregation='trimmed' with trim=%g cuts nothing for classes with %s (here: "
                    "classes %s, at most %d client%s each), so their global prototypes are the plain mean; "
                    "%s (warned once)", round, self.trim, few, plain[:10], max(ns),
                    "" if max(ns) == 1 else "s", fix)


class Momentum:
    """Server momentum (``proto_momentum`` β in [0, 1), :func:`fedproto.prototypes.momentum_prototypes`)
    against the previous global prototypes; a class nobody sent this round keeps its previous
    prototype with 0 contributors."""

    def __init__(self, beta: float = 0.0):
        self.beta = float(beta)

    def __call__(self, previous: Message, cls: np.ndarray, protos: np.ndarray,
                 contrib: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``previous``: the last server message (no ``protos`` before the first aggregation)."""
        if "protos" not in previous:
            return cls, protos, contrib
        now = dict(zip(cls.tolist(), contrib.tolist()))
        cls, protos = momentum_prototypes(np.asarray(previous["classes"]), np.asarray(previous["protos"]), cls,
                                          protos, self.beta)
        return cls, protos, np.array([now.get(c, 0) for c in cls.tolist()], np.int64)  # 0: kept from before


class DistanceMonitor:
    """Each client's mean L2 distance between its prototypes and the global ones
    (:func:`fedproto.prototypes.client_distances`): ``proto_dist`` (mean over clients),
    ``proto_dist_max`` and ``proto_dist_argmax`` in the metrics, and an :class:`Alert` for each
    client above ``alert`` x the median (0: none; ``proto_dist_alert``). Changes no number."""

    def __init__(self, alert: float = 3.0):
        self.alert = float(alert)

    def distances(self, rows: Rows, cls: np.ndarray, protos: np.ndarray) -> np.ndarray:
        """(n_replies,) distances, NaN for a reply sharing no class with the global prototypes."""
        return client_distances(rows.classes, rows.protos, cls, protos)

    def __call__(self, rows: Rows, d: np.ndarray) -> tuple[dict[str, Any], list[Alert]]:
        """Metrics and alerts of the distances ``d`` of the replies ``rows``."""
        if not np.isfinite(d).any():
            return {}, []
        i = int(np.nanargmax(d))
        metrics = {"proto_dist": float(np.nanmean(d)), "proto_dist_max": float(d[i]),
                   "proto_dist_argmax": int(rows.cids[i])}
        alerts = []
        med = float(np.nanmedian(d))
        for j, x in enumerate(d):
            if self.alert and np.isfinite(x) and x > self.alert * med > 0:
                alerts.append(Alert(int(rows.cids[j]), f"client {rows.cids[j]}'s prototypes lie {x:.3g} from the "
                                    f"global ones, {x / med:.1f}x the median {med:.3g} over clients; check its data "
                                    f"(proto_dist_alert={self.alert:g})", "proto_dist_max in metrics.jsonl"))
        return metrics, alerts


@dataclass
class ProtoSteps:
    """FedProto's server steps in the order they run; ``check`` and ``exclusion`` None where off."""

    filter: SampleFilter
    check: ClassCheck | None
    exclusion: OutlierExclusion | None
    rule: Any
    momentum: Momentum
    monitor: DistanceMonitor


def prototype_files(message: Message, contributors: np.ndarray | None) -> dict[str, dict[str, np.ndarray]]:
    """``prototypes.npz`` of a server message with prototypes: ``classes`` (K,), ``protos`` (K, d)
    and ``contributors`` (K,) (the clients behind each class in the last aggregation; (0,) unknown)."""
    if "protos" not in message:
        return {}
    return {"prototypes.npz": {"classes": message["classes"], "protos": message["protos"], "contributors":
                               contributors if contributors is not None else np.zeros(0, np.int64)}}


def proto_round(steps: ProtoSteps, round: int, messages: dict[int, Message], previous: Message,
                trained_lambda: float | None = None, next_lambda: float | None = None) -> ServerState:
    """One aggregation of a prototype server: ``steps`` over the round's replies ``messages``
    (checked, by client id) given the previous server message ``previous``.

    Args:
        trained_lambda: the λ the clients trained with this round (the ``lambda`` metric; None: none).
        next_lambda: the λ sent for the next round (``lambda`` in the message; None: not sent).
    Returns:
        The :class:`~fedproto.algorithms.server_state.ServerState` (message, metrics, alerts, checkpoint,
        ``prototypes.npz``).
    """
    rows = Rows.of(messages)
    metrics: dict[str, Any] = {} if trained_lambda is None else {"lambda": trained_lambda}
    kept = steps.filter(rows)
    flagged: dict[str, Any] = {}
    if steps.check is not None:
        kept, flagged = steps.check(round, kept, previous)
    if steps.exclusion is not None:
        kept, excluded = steps.exclusion(round, kept)
        metrics.update(excluded)
    metrics.update(flagged)
    cls, protos, contrib = steps.rule(round, kept)
    cls, protos, contrib = steps.momentum(previous, cls, protos, contrib)
    d = steps.monitor.distances(rows, cls, protos)
    watch, alerts = steps.monitor(rows, d)
    metrics.update(watch)
    message: Message = {"classes": cls, "protos": protos}
    if next_lambda is not None:
        message["lambda"] = np.array([next_lambda], np.float32)
    checkpoint = {"last_contributors": contrib, "last_distances": d, "last_cids": np.array(rows.cids, np.int64),
                  "global_classes": cls, "global_protos": protos}
    return ServerState(message, metrics, alerts, checkpoint, prototype_files(message, contrib))
