"""FedProto (Tan et al., arXiv 2105.00243, alg. 1).

Client: cross-entropy + λ · L_R(embeddings, global prototypes) (eq. 7), then local prototypes
(eq. 3) sent up as (classes, protos, counts). Server: per-class aggregation over the clients that
hold the class (eq. 6, see :func:`fedproto.prototypes.aggregate_prototypes`), broadcast as
(classes, protos). Round 1 starts with no global prototypes (official code), so it trains with
cross-entropy only.

Size: about 620 lines: FedProto with every documented variant as an option (the paper-vs-code
choices, the practitioner's options, robust aggregation, DP), each a few lines inside the same
hooks.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from fedproto.algorithms.base import Algorithm, ClientData, ClientState, Message, optim_config
from fedproto.algorithms.options import FedProtoOptions
from fedproto.algorithms.requirements import ONE_EMBEDDING
from fedproto.privacy import DP_MODES, epsilon, noisy_prototypes, secure_rng
from fedproto.prototypes import (
    AGGREGATION_RULES,
    DISTANCE_FORMS,
    LAMBDA_SCHEDULES,
    aggregate_prototypes,
    class_check,
    class_sums,
    client_distances,
    embedding_health,
    lambda_at,
    local_prototypes,
    momentum_prototypes,
    nearest_prototype,
    prototype_table,
    robust_z,
)
from fedproto.training import DPSGD, Objective, OptimConfig, Phase, TrainResult, embed_all, poisson_plan, predict

log = logging.getLogger(__name__)


class FedProto(Algorithm):
    """FedProto with every documented variant as an option.

    Args:
        num_classes: C. opt: SGD settings. local_epochs: E.
        lambda_proto: λ >= 0 (app. A: MNIST 1, FEMNIST 1, CIFAR-10 0.1, tied to ``mse``).
        distance: ``mse`` (official code, default), ``squared_l2`` (app. B), ``l2`` (main text).
        proto_source: ``last_epoch`` (official code: embeddings of the last local epoch's training
            passes, train mode) or ``after_training`` (eq. 3 as written: a separate eval-mode pass
            over all local data after training).
        aggregation: ``mean`` (official code), ``weighted`` (convex eq. 6), ``median`` (robust).
        proto_classes: prototype inference (eq. 4) among the client's ``own`` classes (official
            code) or ``all`` classes with a global prototype.

    Practitioner options (the practitioner's guide §4.2-4.3; none is in the paper, all off by
    default):
        lambda_warmup: rounds of a linear λ warm-up (:func:`fedproto.prototypes.lambda_at`); the
            server then sends the round's λ with the prototypes (``lambda``, one float32).
        proto_momentum: β in [0, 1) of server-side prototype momentum
            (:func:`fedproto.prototypes.momentum_prototypes`).
        proto_normalize: L2-normalize embeddings and global prototypes in the prototype loss
            and in prototype inference (cosine geometry).
        min_proto_samples: the server ignores a local prototype computed from fewer samples
            (client filtering against noisy prototypes; counts are sent with the prototypes).
        proto_dist_alert: monitoring: each round the server measures every client's mean L2
            distance between its local and the global prototypes (``proto_dist``, the mean over
            clients, ``proto_dist_max`` and ``proto_dist_argmax`` in the metrics) and logs a
            warning for clients above ``proto_dist_alert`` x the median (0: no warning). Changes no number.

    Robustness and privacy (the practitioner's guide §4.2; off by default):
        trim: the fraction cut from each end by ``aggregation="trimmed"``.
        min_contributors: a class gets (or changes) its global prototype only in rounds where at
            least this many clients send it (else it keeps the previous one, if any).
        exclude_outliers: Z > 0: each round, each client's mean L2 distance between its local
            prototypes and a provisional coordinate-wise median of the round's prototypes is
            scored with :func:`fedproto.prototypes.robust_z`; clients scoring above Z are left
            out of that round's aggregation (``excluded`` in the metrics). The median is the
            reference because a mean is dragged toward the very clients to be found.
        class_check: Z > 0: each round, every prototype row is checked against the previous round's
            global prototypes (:func:`fedproto.prototypes.class_check`; in the first aggregation
            against the origin, i.e. on its norm): a row nearer another class's global prototype than
            its own (once most rows are nearest their own), or whose distance to its own has a robust
            z-score above Z over all the round's rows, is left out of the aggregation (``flagged``
            in the metrics: the clients with a row left out; ``flagged_rows``: how many rows).
            Catches prototypes sent under the wrong class id, scaled and random ones.
        lambda_schedule: ``linear`` or ``cosine`` warm-up (:func:`fedproto.prototypes.lambda_at`);
            the λ used in each round is ``lambda`` in the metrics.
        dp, dp_noise, dp_clip, dp_grad_clip, dp_delta: differential privacy of the uploaded
            prototypes (:mod:`fedproto.privacy`); ``dp_epsilon`` per client in ``clients.csv``.
        dp_reproducible_noise: draw the DP noise and DP-SGD's sampling from the client's seeded
            generator (bit-for-bit reproducible runs) instead of :func:`fedproto.privacy.secure_rng`;
            voids the guarantee against whoever knows the run's seed.

    Every reply is checked before aggregation: a prototype row that is not finite, of another
    size than d, or of a class outside 0..C-1 (or with a count below 1) is dropped and named in
    the log and in the metrics (``dropped``), never averaged in.
    Raises:
        ValueError: an option outside its range.
    """

    model_needs = ONE_EMBEDDING
    """What the clients' models must share (:mod:`fedproto.algorithms.requirements`)."""

    name = "fedproto"
    Options = FedProtoOptions
    server_state_keys = ("last_contributors", "last_distances", "last_cids", "global_classes", "global_protos")

    def __init__(
        self,
        num_classes: int,
        opt: OptimConfig,
        local_epochs: int = 1,
        lambda_proto: float = 1.0,
        distance: str = "mse",
        proto_source: str = "last_epoch",
        aggregation: str = "mean",
        proto_classes: str = "own",
        embedding_dim: int = 50,
        lambda_warmup: int = 0,
        proto_momentum: float = 0.0,
        proto_normalize: bool = False,
        min_proto_samples: int = 1,
        proto_dist_alert: float = 3.0,
        trim: float = 0.2,
        min_contributors: int = 1,
        exclude_outliers: float = 0.0,
        lambda_schedule: str = "linear",
        dp: str = "off",
        dp_noise: float = 1.0,
        dp_clip: float = 5.0,
        dp_grad_clip: float = 1.0,
        dp_delta: float = 1e-5,
        dp_reproducible_noise: bool = False,
        class_check: float = 0.0,
    ):
        super().__init__(num_classes, opt, local_epochs)
        if not 0.0 <= trim < 0.5 or min_contributors < 1 or exclude_outliers < 0:
            raise ValueError(f"trim={trim} (in [0, 0.5)), min_contributors={min_contributors} (>= 1), "
                             f"exclude_outliers={exclude_outliers} (>= 0): one is out of range")
        if dp not in DP_MODES or dp_noise < 0 or not dp_clip > 0 or not dp_grad_clip > 0 or not 0 < dp_delta < 1:
            raise ValueError(f"dp={dp!r} (one of {', '.join(DP_MODES)}), dp_noise={dp_noise} (>= 0), dp_clip={dp_clip} "
                             f"(> 0), dp_grad_clip={dp_grad_clip} (> 0), dp_delta={dp_delta} (in (0, 1)): one is "
                             "out of range")
        self.trim, self.min_contributors = float(trim), int(min_contributors)
        self._trim_warned = False  # the trimmed mean's "cuts nothing" warning is logged once per run
        self.exclude_outliers = float(exclude_outliers)
        if class_check < 0:
            raise ValueError(f"class_check={class_check}: give 0 (off) or a robust z-score above 0 (e.g. 3)")
        self.class_check = float(class_check)
        self.last_flagged: list[int] = []
        self.last_flagged_rows = 0
        self._warned_nearer = False  # the class check's nearer test could not act yet (logged once)
        self.lambda_schedule = lambda_schedule
        self.dp, self.dp_noise, self.dp_clip = dp, float(dp_noise), float(dp_clip)
        self.dp_grad_clip, self.dp_delta = float(dp_grad_clip), float(dp_delta)
        self.dp_reproducible_noise = bool(dp_reproducible_noise)
        self.sequential_only = dp == "full"
        self.last_excluded: list[int] = []
        self._warned_exclusion = False  # exclude_outliers could not act (logged once)
        self._had_protos = False  # the clients of the last aggregated round had global prototypes
        self.last_round = 0
        if lambda_warmup < 0 or not 0.0 <= proto_momentum < 1.0 or min_proto_samples < 1 or proto_dist_alert < 0:
            raise ValueError(f"lambda_warmup={lambda_warmup} (>= 0), proto_momentum={proto_momentum} (in [0, 1)), "
                             f"min_proto_samples={min_proto_samples} (>= 1), proto_dist_alert={proto_dist_alert} "
                             "(>= 0): one is out of range")
        for opt_name, value, allowed in (("distance", distance, DISTANCE_FORMS),
                                         ("proto_source", proto_source, ("last_epoch", "after_training")),
                                         ("aggregation", aggregation, AGGREGATION_RULES),
                                         ("lambda_schedule", lambda_schedule, LAMBDA_SCHEDULES),
                                         ("proto_classes", proto_classes, ("own", "all"))):
            if value not in allowed:
                raise ValueError(f"{opt_name}={value!r}: choose one of {', '.join(allowed)}")
        self.lambda_warmup = int(lambda_warmup)
        self.proto_momentum = float(proto_momentum)
        self.proto_normalize = bool(proto_normalize)
        self.min_proto_samples = int(min_proto_samples)
        self.proto_dist_alert = float(proto_dist_alert)
        self.last_distances: np.ndarray | None = None
        self.global_classes: np.ndarray | None = None  # last global prototypes (for momentum)
        self.global_protos: np.ndarray | None = None
        self.lambda_proto = float(lambda_proto)
        self.distance = distance
        self.proto_source = proto_source
        self.aggregation = aggregation
        self.proto_classes = proto_classes
        self.embedding_dim = embedding_dim
        self.last_contributors: np.ndarray | None = None
        self.last_cids: np.ndarray | None = None  # client ids of the last aggregation's messages, in order

    @classmethod
    def from_config(cls, cfg, embedding_dim: int) -> FedProto:
        return cls(cfg.num_classes, optim_config(cfg), cfg.local_epochs, cfg.lam, cfg.distance,
                   cfg.proto_source, cfg.aggregation, cfg.proto_classes, embedding_dim, cfg.lambda_warmup,
                   cfg.proto_momentum, cfg.proto_normalize, cfg.min_proto_samples, cfg.proto_dist_alert,
                   cfg.trim, cfg.min_contributors, cfg.exclude_outliers, cfg.lambda_schedule, cfg.dp, cfg.dp_noise,
                   cfg.dp_clip, cfg.dp_grad_clip, cfg.dp_delta, cfg.dp_reproducible_noise, cfg.class_check)

    def _table(self, message: Message):
        if "protos" not in message or len(message["classes"]) == 0:
            return None, None
        return prototype_table(message["classes"], message["protos"], self.num_classes, message["protos"].shape[1])

    def objective(self, state: ClientState, message: Message) -> Objective:
        table, mask = self._table(message)
        lam = float(np.asarray(message["lambda"]).reshape(-1)[0]) if "lambda" in message else self.lambda_proto
        return Objective(
            phases=[Phase(self.local_epochs)],
            lambda_proto=lam if table is not None else 0.0,
            table=table,
            mask=mask,
            form=self.distance,
            collect=self.proto_source == "last_epoch" and self.dp == "off",
            normalize=self.proto_normalize,
            dp_sgd=DPSGD(self.dp_noise, self.dp_grad_clip, self.opt.batch_size) if self.dp == "full" else None,
        )

    def plan(self, state: ClientState, obj, n: int, rng: np.random.Generator):
        """The batch plan; with ``dp="full"`` Poisson-sampled (:func:`fedproto.training.poisson_plan`)
        with the DP-SGD noise seed drawn after it, both from :func:`fedproto.privacy.secure_rng`
        (which the server cannot regenerate) unless ``dp_reproducible_noise``, which draws them
        from ``rng``, the client's seeded generator, and then also draws the seed of the release
        noise (kept in the client's state; the noise never leaves the client)."""
        if self.dp != "full":
            plan = super().plan(state, obj, n, rng)
        else:
            m = state.model
            src = rng if self.dp_reproducible_noise else secure_rng()
            plan = poisson_plan(n, obj.phases, self.opt.batch_size, m.noise_widths(), m.dropout, src)
            plan.seed = int(src.integers(2**62))
            state.extra["dp_rate"] = min(1.0, self.opt.batch_size / max(n, 1))
            if obj.dp_sgd is not None:
                obj.dp_sgd.expected_batch_size = max(1, round(state.extra["dp_rate"] * n))
        if self.dp != "off" and self.dp_reproducible_noise:
            state.extra["dp_seed"] = int(rng.integers(2**62))
        return plan

    def finish(self, state: ClientState, message: Message, data: ClientData, result: TrainResult) -> Message:
        if self.dp != "off":  # each sample counted once, in an eval-mode pass (fedproto.privacy)
            seed = state.extra.pop("dp_seed", None)
            rng = np.random.default_rng(seed) if self.dp_reproducible_noise and seed is not None else secure_rng()
            classes, protos, cnt = noisy_prototypes(embed_all(state.model, data.x), data.y, state.classes,
                                                    self.dp_clip, self.dp_noise, rng)
            state.extra["dp_releases"] = int(state.extra.get("dp_releases", 0)) + 1
            if self.dp == "full":
                state.extra["dp_steps"] = int(state.extra.get("dp_steps", 0)) + int(result.steps)
            return {"classes": classes, "protos": protos, "counts": cnt}
        if self.proto_source == "last_epoch":
            sums, counts = result.sums, result.counts
        else:
            sums, counts = class_sums(embed_all(state.model, data.x), data.y, self.num_classes)
        classes, protos, cnt = local_prototypes(sums, counts)
        return {"classes": classes, "protos": protos, "counts": cnt}

    def client_report(self, state: ClientState) -> dict[str, float]:
        """With ``dp``: the client's privacy spent so far, ``dp_epsilon`` at ``dp_delta``
        (:func:`fedproto.privacy.epsilon` over its prototype releases and DP-SGD steps)."""
        if self.dp == "off":
            return {}
        hist = [(self.dp_noise, 1.0, int(state.extra.get("dp_releases", 0)))]
        if self.dp == "full":
            hist.append((self.dp_noise, float(state.extra.get("dp_rate", 1.0)), int(state.extra.get("dp_steps", 0))))
        return {"dp_epsilon": epsilon(hist, self.dp_delta)}

    def _outlier_rows(self, round: int, kept) -> list[int]:
        """Which of the round's replies ``kept`` (classes, protos, counts per reply) to leave out:
        each reply's mean L2 distance to the coordinate-wise median of the class's prototypes,
        over the classes at least 3 replies hold (with 1 or 2 holders the median cannot tell who is
        off), scored by :func:`robust_z`; above ``exclude_outliers`` is out. Nobody is left out
        when fewer than 3 replies can be compared or their MAD is 0 (a warning says so, once)."""
        from scipy.stats import median_abs_deviation

        classes, protos, counts = kept
        held = [np.asarray(c, np.int64) for c in classes]
        holders = np.bincount(np.concatenate(held) if held else np.zeros(0, np.int64), minlength=self.num_classes)
        shared = np.nonzero(holders >= 3)[0]
        sel = [np.isin(c, shared) for c in held]
        cc = [c[m] for c, m in zip(held, sel)]
        pp = [np.asarray(p)[m] for p, m in zip(protos, sel)]
        nn = [np.asarray(n)[m] for n, m in zip(counts, sel)]
        ref_c, ref_p, _ = aggregate_prototypes(cc, pp, nn, self.num_classes, "median")
        d = client_distances(cc, pp, ref_c, ref_p)
        ok = np.isfinite(d)
        if ok.sum() < 3 or median_abs_deviation(d[ok]) == 0:
            if not self._warned_exclusion:
                self._warned_exclusion = True
                why = ("no class is held by 3 or more clients" if ok.sum() == 0 else
                       f"only {int(ok.sum())} clients hold classes that 3 or more clients hold" if ok.sum() < 3
                       else "half or more of the comparable clients lie at the same distance (MAD 0)")
                log.warning("round %d: exclude_outliers cannot act: %s; nobody is left out while this holds",
                            round, why)
            return []
        z = robust_z(d)
        out = [j for j in range(len(classes)) if z[j] > self.exclude_outliers]
        return out if len(out) < len(classes) else []

    def reply_problems(self, cid: int, message: Message) -> tuple[Message, list[str]]:
        """A client's reply with its bad prototype rows dropped, and why each was dropped: rows
        whose values are not finite, whose class is outside 0..C-1 or whose count is below 1 or not
        a whole number, and the whole reply (``{}``) when no row is left or its arrays do not fit
        together ((K,) classes, (K, d) protos, (K,) counts with d the embedding size)."""
        try:
            c = np.asarray(message["classes"])
            p = np.asarray(message["protos"])
            n = np.asarray(message["counts"])
        except KeyError as e:
            return {}, [f"no {e.args[0]!r} entry"]
        if (c.ndim != 1 or p.ndim != 2 or n.shape != c.shape or len(p) != len(c) or c.dtype.kind not in "iu"
                or (len(c) and p.shape[1] != self.embedding_dim)):
            return {}, [f"arrays that do not fit: classes {c.shape} {c.dtype}, protos {p.shape}, counts {n.shape} "
                        f"(expected (K,) int, (K, {self.embedding_dim}), (K,))"]
        ok = np.ones(len(c), bool)
        why = []
        for j in range(len(c)):
            reason = ("values that are not finite" if not np.isfinite(p[j]).all() else
                      f"class {c[j]} outside 0..{self.num_classes - 1}" if not 0 <= c[j] < self.num_classes else
                      f"count {n[j]} below 1" if not n[j] >= 1 else
                      f"count {n[j]} not a whole number" if n[j] != np.round(n[j]) else "")
            if reason:
                ok[j] = False
                why.append(f"the prototype of class {c[j]}: {reason}")
        if len(c) and not ok.any():
            return {}, why  # nothing usable left
        return {"classes": c[ok], "protos": p[ok], "counts": n[ok]}, why

    def _class_checked(self, round: int, cids: list, kept):
        """``kept`` (classes, protos, counts per reply) without the rows :func:`class_check` flags
        against the previous global prototypes (none in the first aggregation: the origin); the
        clients with a flagged row go to ``last_flagged``, the number of rows to ``last_flagged_rows``."""
        classes, protos, counts = kept
        if self.global_classes is not None and len(self.global_classes):
            ref_c, ref_p = self.global_classes, self.global_protos
        else:
            ref_c, ref_p = np.zeros(0, np.int64), np.zeros((0, self.embedding_dim), np.float32)
        flags, acted = class_check(classes, protos, ref_c, ref_p, self.class_check)
        if len(ref_c) > 1 and not acted and not self._warned_nearer:
            self._warned_nearer = True
            log.info("round %d: class check: most prototypes lie nearer another class's global prototype than their "
                     "own (the clients' embeddings are not aligned yet), so only the distance test acts; logged once",
                     round)
        self.last_flagged = [int(cids[j]) for j, f in enumerate(flags) if f.any()]
        self.last_flagged_rows = sum(int(f.sum()) for f in flags)
        if self.last_flagged:
            log.info("round %d: class check: %d prototype(s) of clients %s left out", round, self.last_flagged_rows,
                     self.last_flagged)
        return tuple([np.asarray(v)[~f] for v, f in zip(part, flags)] for part in kept)

    def aggregate(self, round: int, messages: dict[int, Message]) -> Message:
        """Global prototypes from the clients' local ones (eq. 6, ``aggregation``), after
        ``min_proto_samples`` filtering, with ``proto_momentum`` against the previous global
        prototypes, plus the λ of round ``round + 1`` when warming up. A class that no client sent this
        round (client sampling, ``min_proto_samples``) keeps its previous global prototype, with 0
        contributors this round."""
        self.last_round = round
        self._had_protos = self.global_classes is not None and len(self.global_classes) > 0
        # the replies come checked (fedproto.engine.checks.check_replies: reply_problem, then reply_problems)
        messages = {cid: m for cid, m in messages.items() if m}
        cids = list(messages)
        messages = list(messages.values())
        keep = [np.asarray(m["counts"]) >= self.min_proto_samples for m in messages]
        kept = ([np.asarray(m["classes"])[k] for m, k in zip(messages, keep)],
                [np.asarray(m["protos"])[k] for m, k in zip(messages, keep)],
                [np.asarray(m["counts"])[k] for m, k in zip(messages, keep)])
        self.last_flagged, self.last_flagged_rows = [], 0
        if self.class_check > 0:
            kept = self._class_checked(round, cids, kept)
        self.last_excluded = []
        if self.exclude_outliers > 0:
            out = self._outlier_rows(round, kept)
            if out:
                self.last_excluded = [int(cids[j]) for j in out]
                log.warning("round %d: clients %s left out of the aggregation (robust z-score of their prototype "
                            "distance > %s)", round, self.last_excluded, self.exclude_outliers)
                kept = tuple([v for j, v in enumerate(part) if j not in out] for part in kept)
        cls, protos, contrib = aggregate_prototypes(*kept, self.num_classes, self.aggregation, self.trim,
                                                    self.min_contributors)
        if self.aggregation == "trimmed" and not self._trim_warned:
            plain = [int(c) for c, n in zip(cls.tolist(), contrib.tolist()) if int(self.trim * n) == 0]
            if plain:  # scipy's trim_mean cuts int(trim * n) values from each end: none for small n
                self._trim_warned = True
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
        if self.global_classes is not None:
            # a class no (sampled) client sent this round keeps its previous global prototype
            now = dict(zip(cls.tolist(), contrib.tolist()))
            cls, protos = momentum_prototypes(self.global_classes, self.global_protos, cls, protos,
                                              self.proto_momentum)
            contrib = np.array([now.get(c, 0) for c in cls.tolist()], np.int64)  # 0: kept from before
        self.global_classes, self.global_protos = cls, protos
        self.last_contributors = contrib
        self.last_distances = client_distances([m["classes"] for m in messages], [m["protos"] for m in messages],
                                               cls, protos)
        self.last_cids = np.array(cids, np.int64)
        out = {"classes": cls, "protos": protos}
        if self.lambda_warmup > 0:
            out["lambda"] = np.array([lambda_at(round + 1, self.lambda_proto, self.lambda_warmup,
                                                self.lambda_schedule)], np.float32)
        return out

    def check_models(self, models) -> None:
        """As :meth:`Algorithm.check_models`; with ``dp="full"`` also refuses models with
        recurrent layers that train (``nn.GRU``, ``nn.LSTM``, ``nn.RNN``: Opacus has per-sample
        gradients for its own ``DPGRU``/``DPLSTM``/``DPRNN`` only), and models with
        BatchNorm that trains (its statistics mix the samples of a batch, so per-sample gradients do
        not exist; Opacus refuses them too). Frozen BatchNorm layers
        (:func:`fedproto.training.frozen_batchnorms`) run in eval mode, one sample at a time: allowed."""
        super().check_models(models)
        if self.dp == "full":
            from torch import nn

            from fedproto.errors import ConfigError
            from fedproto.training import frozen_batchnorms

            def trains_bn(m) -> bool:
                frozen = {id(b) for b in frozen_batchnorms(m)}
                return any(isinstance(b, nn.modules.batchnorm._BatchNorm) and id(b) not in frozen for b in m.modules())

            bn = [i for i, m in enumerate(models) if trains_bn(m)]
            if bn:
                raise ConfigError(f"dp='full' trains with DP-SGD, which needs per-sample gradients, but the models of "
                                  f"clients {bn[:10]} have BatchNorm layers that train; use models without BatchNorm "
                                  "(e.g. GroupNorm, or model='cnn'), freeze them (requires_grad=False), or "
                                  "dp='prototypes'")
            rnn = [(i, type(r).__name__) for i, m in enumerate(models) for r in m.modules()
                   if isinstance(r, nn.RNNBase) and any(p.requires_grad for p in r.parameters())]
            if rnn:  # Opacus computes their per-sample gradients only as its own DPGRU / DPLSTM / DPRNN layers
                kind = rnn[0][1]
                raise ConfigError(f"dp='full' trains with DP-SGD, which needs per-sample gradients, but the models of "
                                  f"clients {sorted({i for i, _ in rnn})[:10]} have torch.nn.{kind} layers, for which "
                                  f"Opacus has none; use opacus.layers.DP{kind} in their place (the same layer with "
                                  "per-sample gradients), freeze them (requires_grad=False), or dp='prototypes'")

    def check_setup(self, cfg, train_labels: list[np.ndarray]) -> None:
        """``min_proto_samples`` must leave some prototype to send: refused when it exceeds every
        client's count of every class; ``min_contributors`` must be reachable: refused when it
        exceeds the clients taking part in a round or the holders of every class."""
        if self.min_contributors > 1:
            from fedproto.errors import ConfigError, opt

            holders = np.zeros(self.num_classes, np.int64)
            for y in train_labels:
                if len(y):
                    holders[np.unique(np.asarray(y))] += 1
            p = float(getattr(cfg, "participation", 1.0))
            per_round = len(train_labels) if p == 1.0 else (int(p) if p > 1 else max(1, round(p * len(train_labels))))
            most = int(min(holders.max(initial=0), per_round))
            if self.min_contributors > most:
                raise ConfigError(f"{opt('min_contributors', self.min_contributors)} is more than any class ever has "
                                  f"in a round (at most {most}: {int(holders.max(initial=0))} clients hold the most "
                                  f"widely held class, {per_round} take part per round), so no global prototype "
                                  "would be made", option="min_contributors", value=self.min_contributors,
                                  hint=f"use {opt('min_contributors', most)} or less")
        if self.min_proto_samples > 1:
            most = max((int(np.bincount(np.asarray(y)).max()) for y in train_labels if len(y)), default=0)
            if self.min_proto_samples > most:
                from fedproto.errors import ConfigError, opt

                raise ConfigError(f"{opt('min_proto_samples', self.min_proto_samples)} is more than any client's "
                                  f"samples of a class (largest: {most}), so no prototype would reach the server",
                                  option="min_proto_samples", value=self.min_proto_samples,
                                  hint=f"use {opt('min_proto_samples', most)} or less")

    def divergence_hint(self, cfg) -> str:
        from fedproto.errors import opt

        out = f" or {opt('lambda_proto')} (now {self.lambda_proto})" if self.lambda_proto > 0 else ""
        if self.dp != "off":
            out += f", or {opt('dp_noise')} (now {self.dp_noise:g}) or {opt('dp_clip')} (now {self.dp_clip:g})"
        if getattr(cfg, "attackers", 0) and not self.class_check:
            if self.aggregation in ("mean", "weighted") and not self.exclude_outliers:
                out += (f"; with misbehaving clients ({opt('attack')}) the mean follows their prototypes: use "
                        f"{opt('aggregation', 'median')}, {opt('aggregation', 'trimmed')}, {opt('exclude_outliers')} "
                        f"or {opt('class_check', 3)}")
            else:
                out += (f"; with misbehaving clients ({opt('attack')}), where half of a class's senders misbehave the "
                        f"median, the trimmed mean and {opt('exclude_outliers')} follow them: {opt('class_check', 3)} "
                        "checks each prototype against the last global prototypes instead")
        return out

    def message_problem(self, message: Message, embedding_dim: int) -> str:
        """A stored server message needs a (K,) integer ``classes`` within 0..C-1 and (K, d) ``protos``."""
        if "protos" not in message and "classes" not in message:
            return ""
        c, p = message.get("classes"), message.get("protos")
        C, d = self.num_classes, embedding_dim
        if c is None or p is None or c.ndim != 1 or c.dtype.kind not in "iu":
            return "has no proper 'classes' and 'protos' pair"
        if len(c) and (c.min() < 0 or c.max() >= C):
            return f"names classes outside 0..{C - 1} ({c.min()}..{c.max()})"
        if p.shape != (len(c), d):
            return f"prototypes have shape {p.shape}, expected ({len(c)}, {d}) (embedding size {d})"
        return ""

    def reply_problem(self, reply: Message, sent: Message, embedding_dim: int) -> str:
        """The form of a client's reply (the engine then drops bad rows with :meth:`reply_problems`):
        (K,) distinct integer ``classes``, (K, d) float ``protos`` with d the embedding size, (K,)
        numeric ``counts``, nothing else."""
        extra = sorted(set(reply) - {"classes", "protos", "counts"})
        if extra:
            return f"unexpected entries {extra[:5]}"
        c, p, n = reply.get("classes"), reply.get("protos"), reply.get("counts")
        if c is None or p is None or n is None:
            return "lacks 'classes', 'protos' or 'counts'"
        if c.ndim != 1 or c.dtype.kind not in "iu":
            return f"'classes' has shape {c.shape} and dtype {c.dtype}, expected (K,) integers"
        if len(np.unique(c)) != len(c):
            return "repeats a class id"
        if p.shape != (len(c), embedding_dim) or p.dtype.kind != "f":
            return (f"prototypes have shape {p.shape} and dtype {p.dtype}, expected ({len(c)}, {embedding_dim}) floats "
                    f"(embedding size {embedding_dim})")
        if n.shape != c.shape:
            return f"'counts' has shape {n.shape}, expected ({len(c)},)"
        return ""

    def load_server_state(self, state: dict) -> None:
        """Restore :meth:`server_state`; a checkpoint written before client sampling has no
        ``last_cids`` (its messages came from clients 0..m-1 in order)."""
        super().load_server_state({"last_cids": None, **state})

    def summary_entries(self, cfg, per_client: list[dict]) -> dict:
        """``privacy`` under DP: the mode, noise, clips, delta, the clients' largest and mean ε (from
        their reports; under Flower NaN for a node that did not answer, none under ``dp=full``:
        each node keeps its own), the accountant and the neighbouring relation."""
        if self.dp == "off":
            return {}
        eps = [m["dp_epsilon"] for m in per_client if m.get("dp_epsilon", math.nan) == m.get("dp_epsilon")]
        privacy = {
            "mode": self.dp, "noise_multiplier": self.dp_noise, "embedding_clip": self.dp_clip,
            "grad_clip": self.dp_grad_clip if self.dp == "full" else None, "delta": self.dp_delta,
            "epsilon_max": float(max(eps)) if eps else None, "epsilon_mean": float(np.mean(eps)) if eps else None,
            "accountant": "Opacus RDP (subsampled Gaussian per DP-SGD step, Gaussian per prototype release)",
            "neighbouring": "one training sample of a client added or removed, its label set unchanged (the label set "
                            "is public)" + ("; for a fixed feature extractor (the extractor's training is not covered)"
                                            if self.dp == "prototypes" else ""),
            "noise": "seeded by the run's seed (dp_reproducible_noise: no guarantee against whoever knows the seed)"
                     if self.dp_reproducible_noise else "the operating system's secure randomness",
        }
        if not eps:
            privacy["epsilon_note"] = ("each node logs its own epsilon: under dp=full it depends on the node's sample "
                                       "count, which the node does not send")
        return {"privacy": privacy}

    def write_results(self, run_dir, message: Message) -> None:
        """``prototypes.npz``: the final global prototypes (classes, protos) and, per class, how many
        clients contributed in the last aggregation."""
        if "protos" in message:
            run_dir.write_prototypes(message["classes"], message["protos"], self.last_contributors)

    def round_metrics(self) -> dict[str, float]:
        """Prototype-distance monitoring of the last aggregation: mean and max over clients of
        each client's mean L2 distance to the global prototypes, and the client with the max."""
        d = self.last_distances
        out: dict = {}
        if self.last_round:  # the λ the clients trained with in that round (0 while no global prototype exists)
            out["lambda"] = lambda_at(self.last_round, self.lambda_proto, self.lambda_warmup,
                                      self.lambda_schedule) if self._had_protos else 0.0
        if self.exclude_outliers > 0:
            out["excluded"] = list(self.last_excluded)
        if self.class_check > 0:
            out["flagged"] = list(self.last_flagged)
            out["flagged_rows"] = self.last_flagged_rows
        if d is None or not np.isfinite(d).any():
            return out
        i = int(np.nanargmax(d))
        return {**out, "proto_dist": float(np.nanmean(d)), "proto_dist_max": float(d[i]),
                "proto_dist_argmax": int(self._cid(i))}

    def _cid(self, j: int) -> int:
        """Client id of the j-th message of the last aggregation."""
        cids = self.last_cids
        return int(cids[j]) if cids is not None and len(cids) > j else j

    def outliers(self) -> list[tuple[int, float, float]]:
        """Clients whose distance exceeds ``proto_dist_alert`` x the median: (client, distance, median)."""
        d = self.last_distances
        if not self.proto_dist_alert or d is None or not np.isfinite(d).any():
            return []
        med = float(np.nanmedian(d))
        return [(self._cid(i), float(x), med) for i, x in enumerate(d)
                if np.isfinite(x) and x > self.proto_dist_alert * med > 0]

    def eval_protocols(self) -> dict[str, str]:
        """``acc`` (personal, the classifier head) and ``acc_proto`` (eq. 4)."""
        return {**super().eval_protocols(),
                "acc_proto": "personal, eq. 4: each client's own model after its local training of the last round, "
                             "nearest global prototype of its embedding, on the client's own test set"}

    def evaluate(self, state: ClientState, message: Message, data: ClientData) -> dict[str, float]:
        """Classifier accuracy and nearest-global-prototype accuracy (eq. 4), both in [0, 1],
        computed for this client alone (no running totals across clients or modes), and the
        outputs' health (``emb_norm``, ``nonfinite``: :func:`fedproto.prototypes.embedding_health`)."""
        logits, h = predict(state.model, data.test_x)
        y = data.test_y
        n = len(y)
        out = {"acc": float((logits.argmax(1) == y).float().mean()) if n else float("nan"),
               **embedding_health(h, logits)}
        table, mask = self._table(message)
        if table is None:
            out["acc_proto"] = float("nan")
            return out
        allowed = mask.clone()
        if self.proto_classes == "own":
            own = torch.zeros(self.num_classes, dtype=torch.bool)
            own[torch.as_tensor(state.classes)] = True
            allowed &= own
        pred = nearest_prototype(h, table, allowed, self.proto_normalize)
        out["acc_proto"] = float((pred.to(y.device) == y).float().mean()) if n else float("nan")
        return out

    def full_test_metrics(self, state: ClientState, message: Message, logits, h, y) -> dict[str, float]:
        """As :meth:`Algorithm.full_test_metrics`, plus ``acc_proto``: nearest global prototype
        (eq. 4) among all classes with one (``proto_classes`` does not apply: the test set holds
        every class)."""
        out = super().full_test_metrics(state, message, logits, h, y)
        table, mask = self._table(message)
        if table is not None and len(y):
            pred = nearest_prototype(h, table, mask, self.proto_normalize)
            out["acc_proto"] = float((pred == y).to(torch.float64).mean())
        return out

    def proto_distance(self, state: ClientState, message: Message, data: ClientData) -> float:
        """Monitoring: mean L2 distance between the client's train embeddings (eval mode) and the
        global prototype of their class, over samples whose class has one (nan if none)."""
        table, mask = self._table(message)
        if table is None:
            return float("nan")
        h = embed_all(state.model, data.x)
        table, mask, y = table.to(h.device), mask.to(h.device), data.y.to(h.device)
        cov = mask[y]
        if not bool(cov.any()):
            return float("nan")
        return float((h[cov] - table[y[cov]]).norm(dim=1).mean())
