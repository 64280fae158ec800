"""FedProto (Tan et al., arXiv 2105.00243, alg. 1).

Client: cross-entropy + λ · L_R(embeddings, global prototypes) (eq. 7), then local prototypes
(eq. 3) sent up as (classes, protos, counts). Server: per-class aggregation over the clients that
hold the class (eq. 6, see :func:`fedproto.prototypes.aggregate_prototypes`), broadcast as
(classes, protos). Round 1 starts with no global prototypes (official code), so it trains with
cross-entropy only.

Every documented variant is an option (the paper-vs-code choices, the practitioner's options,
robust aggregation, DP). The server's steps are parts (:mod:`fedproto.algorithms.proto_steps`),
its reply and set-up checks :class:`~fedproto.algorithms.fedproto_checks.ProtoServerChecks`
(docs/architecture.md, "Algorithm").
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import numpy as np
import torch

from fedproto.algorithms.algorithm import Algorithm, ClientData, ClientState, Message, optim_config
from fedproto.algorithms.fedproto_checks import ProtoServerChecks
from fedproto.algorithms.fedproto_dp import check_dp_sgd_models
from fedproto.algorithms.method_options import FedProtoOptions, checked_options
from fedproto.algorithms.proto_steps import (
    AggregationRule,
    ClassCheck,
    DistanceMonitor,
    Momentum,
    OutlierExclusion,
    ProtoSteps,
    SampleFilter,
    proto_round,
    prototype_files,
)
from fedproto.algorithms.proto_term import ProtoTerm
from fedproto.algorithms.requirements import ONE_EMBEDDING
from fedproto.algorithms.server_state import ServerState
from fedproto.models.proto_model import ProtoModel
from fedproto.plugins import AlgorithmOptions
from fedproto.prototypes import (
    class_sums,
    embedding_health,
    lambda_at,
    local_prototypes,
    nearest_prototype,
    prototype_table,
)
from fedproto.prototypes.dp import epsilon, noisy_prototypes, secure_rng
from fedproto.training import DPSGD, Objective, OptimConfig, Phase, TrainResult, embed_all, poisson_plan, predict
from fedproto.training.plans import Plan

log = logging.getLogger(__name__)


class FedProto(ProtoServerChecks, Algorithm):
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
            its own (once more than half of the clients have every row nearest its own), or whose log
            distance to its own has a robust z-score above Z over all the round's rows, is left out
            of the aggregation (``flagged`` in the metrics: the clients with a row left out;
            ``flagged_rows``: how many rows; ``flagged_many``: 1, with a warning, when more than a
            third of the round's clients are flagged).
            Catches prototypes sent under the wrong class id, scaled and random ones.
        lambda_schedule: ``linear`` or ``cosine`` warm-up (:func:`fedproto.prototypes.lambda_at`);
            the λ used in each round is ``lambda`` in the metrics.
        dp, dp_noise, dp_clip, dp_grad_clip, dp_delta: differential privacy of the uploaded
            prototypes (:mod:`fedproto.prototypes.dp`); ``dp_epsilon`` per client in ``clients.csv``.
        dp_reproducible_noise: draw the DP noise and DP-SGD's sampling from the client's seeded
            generator (bit-for-bit reproducible runs) instead of :func:`fedproto.prototypes.dp.secure_rng`;
            voids the guarantee against whoever knows the run's seed.

    Every reply is checked before aggregation: a prototype row that is not finite, of another
    size than d, or of a class outside 0..C-1 (or with a count below 1) is dropped and named in
    the log and in the metrics (``dropped``), never averaged in.
    Raises:
        ValueError: an option outside its range or choices (checked once, by
            :class:`~fedproto.algorithms.method_options.FedProtoOptions`, the run options' own bounds).
    """

    model_needs = ONE_EMBEDDING
    """What the clients' models must share (:mod:`fedproto.algorithms.requirements`)."""

    name = "fedproto"
    Options: ClassVar[type[AlgorithmOptions] | None] = FedProtoOptions
    secure_sum: ClassVar[str | None] = "prototypes"

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
        *,
        freeze_after: int = 0,
    ) -> None:
        super().__init__(num_classes, opt, local_epochs, freeze_after=freeze_after)
        o = checked_options(
            FedProtoOptions, lambda_proto=lambda_proto, distance=distance, proto_source=proto_source,
            aggregation=aggregation, proto_classes=proto_classes, lambda_warmup=lambda_warmup,
            proto_momentum=proto_momentum, proto_normalize=proto_normalize, min_proto_samples=min_proto_samples,
            proto_dist_alert=proto_dist_alert, trim=trim, min_contributors=min_contributors,
            exclude_outliers=exclude_outliers, lambda_schedule=lambda_schedule, dp=dp, dp_noise=dp_noise,
            dp_clip=dp_clip, dp_grad_clip=dp_grad_clip, dp_delta=dp_delta, dp_reproducible_noise=dp_reproducible_noise,
            class_check=class_check)
        self.options = o
        self.trim, self.min_contributors = float(o.trim), int(o.min_contributors)
        self.exclude_outliers = float(o.exclude_outliers)
        self.class_check = float(o.class_check)
        self.lambda_schedule = o.lambda_schedule
        self.dp, self.dp_noise, self.dp_clip = o.dp, float(o.dp_noise), float(o.dp_clip)
        self.dp_grad_clip, self.dp_delta = float(o.dp_grad_clip), float(o.dp_delta)
        self.dp_reproducible_noise = bool(o.dp_reproducible_noise)
        self.sequential_only = o.dp == "full"
        self.lambda_warmup = int(o.lambda_warmup)
        self.proto_momentum = float(o.proto_momentum)
        self.proto_normalize = bool(o.proto_normalize)
        self.min_proto_samples = int(o.min_proto_samples)
        self.proto_dist_alert = float(o.proto_dist_alert)
        self.lambda_proto = float(lambda_proto)
        self.distance = o.distance
        self.proto_source = o.proto_source
        self.aggregation = o.aggregation
        self.proto_classes = o.proto_classes
        self.embedding_dim = embedding_dim
        self._steps: ProtoSteps | None = None

    @classmethod
    def from_config(cls, cfg: Any, embedding_dim: int) -> FedProto:
        """Built from the run config: every :class:`~fedproto.algorithms.method_options.FedProtoOptions`
        field is a keyword of the same name (λ: the dataset's when not given, ``cfg.lam``)."""
        values = {k: getattr(cfg, k) for k in FedProtoOptions.model_fields}
        values["lambda_proto"] = cfg.lam
        return cls(cfg.num_classes, optim_config(cfg), cfg.local_epochs, embedding_dim=embedding_dim,
                   freeze_after=cfg.freeze_after, **values)

    def _table(self, message: Message) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The global prototypes of ``message`` as a dense (C, d) float32 table and its (C,) bool
        mask of the classes present; None without prototypes."""
        if "protos" not in message or len(message["classes"]) == 0:
            return None
        return prototype_table(message["classes"], message["protos"], self.num_classes, message["protos"].shape[1])

    def objective(self, state: ClientState, message: Message) -> Objective:
        tm = self._table(message)
        lam = float(np.asarray(message["lambda"]).reshape(-1)[0]) if "lambda" in message else self.lambda_proto
        terms = (ProtoTerm(lam, tm[0], tm[1], self.distance, self.proto_normalize),) if tm is not None and lam > 0 \
            else ()
        return Objective(
            phases=[Phase(self.local_epochs)],
            collect=self.proto_source == "last_epoch" and self.dp == "off",
            terms=terms,
            dp_sgd=DPSGD(self.dp_noise, self.dp_grad_clip, self.opt.batch_size) if self.dp == "full" else None,
        )

    def plan(self, state: ClientState, obj: Objective, n: int, rng: np.random.Generator) -> Plan:
        """The batch plan; with ``dp="full"`` Poisson-sampled (:func:`fedproto.training.poisson_plan`)
        with the DP-SGD noise seed drawn after it, both from :func:`fedproto.prototypes.dp.secure_rng`
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
        if self.dp != "off":  # each sample counted once, in an eval-mode pass (fedproto.prototypes.dp)
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
            if sums is None or counts is None:  # objective() collects them with proto_source last_epoch
                raise RuntimeError(f"method {self.name!r}: training collected no class sums (Objective.collect)")
        else:
            sums, counts = class_sums(embed_all(state.model, data.x), data.y, self.num_classes)
        classes, protos, cnt = local_prototypes(sums, counts)
        return {"classes": classes, "protos": protos, "counts": cnt}

    def client_report(self, state: ClientState) -> dict[str, float]:
        """With ``dp``: the client's privacy spent so far, ``dp_epsilon`` at ``dp_delta``
        (:func:`fedproto.prototypes.dp.epsilon` over its prototype releases and DP-SGD steps)."""
        if self.dp == "off":
            return {}
        hist = [(self.dp_noise, 1.0, int(state.extra.get("dp_releases", 0)))]
        if self.dp == "full":
            hist.append((self.dp_noise, float(state.extra.get("dp_rate", 1.0)), int(state.extra.get("dp_steps", 0))))
        return {"dp_epsilon": epsilon(hist, self.dp_delta)}

    def server_steps(self) -> ProtoSteps:
        """The parts :meth:`aggregate` runs (:mod:`fedproto.algorithms.proto_steps`), built from the
        options once per run: a subclass replaces one (e.g. ``rule``) by overriding this."""
        steps: ProtoSteps | None = getattr(self, "_steps", None)  # None before the first call
        if steps is None:
            steps = self._steps = ProtoSteps(
                SampleFilter(self.min_proto_samples),
                ClassCheck(self.class_check, self.embedding_dim) if self.class_check > 0 else None,
                OutlierExclusion(self.exclude_outliers, self.num_classes) if self.exclude_outliers > 0 else None,
                AggregationRule(self.num_classes, self.aggregation, self.trim, self.min_contributors),
                Momentum(self.proto_momentum), DistanceMonitor(self.proto_dist_alert))
        return steps

    def aggregate(self, round: int, messages: dict[int, Message], state: ServerState | None = None) -> ServerState:
        """Global prototypes from the clients' local ones (eq. 6, ``aggregation``), after
        ``min_proto_samples`` filtering, the class check and outlier exclusion, with
        ``proto_momentum`` against the previous global prototypes (``state.message``), plus the λ
        of round ``round + 1`` when warming up. A class that no client sent this round (client
        sampling, ``min_proto_samples``) keeps its previous global prototype, with 0 contributors
        this round.

        Returns:
            The :class:`~fedproto.algorithms.server_state.ServerState`: the message ``classes`` (K,) int64,
            ``protos`` (K, d) (``lambda`` (1,) while warming up); the metrics ``lambda`` (the λ the
            clients trained with), ``excluded``, ``flagged``/``flagged_rows`` (where those steps
            are on), ``proto_dist``/``proto_dist_max``/``proto_dist_argmax``; distance alerts; the
            checkpoint; ``prototypes.npz`` (classes, protos, contributors per class this round).
        """
        return self.run_steps(self.server_steps(), round, messages, state)

    def run_steps(self, steps: ProtoSteps, round: int, messages: dict[int, Message],
                  state: ServerState | None = None) -> ServerState:
        """:meth:`aggregate` with other ``steps``: a plug-in's ``aggregate`` may swap one part
        (``dataclasses.replace(self.server_steps(), rule=MyRule())``) and keep the metrics, the
        alerts, the checkpoint and ``prototypes.npz`` of the others
        (:func:`fedproto.algorithms.proto_steps.proto_round`), and the λ entries."""
        previous = state.message if state is not None else {}
        had = "protos" in previous and len(previous["classes"]) > 0  # round 1 trains without prototypes
        trained = lambda_at(round, self.lambda_proto, self.lambda_warmup, self.lambda_schedule) if had else 0.0
        nxt = lambda_at(round + 1, self.lambda_proto, self.lambda_warmup, self.lambda_schedule) \
            if self.lambda_warmup > 0 else None
        return proto_round(steps, round, messages, previous, trained, nxt)

    def resume_state(self, message: Message, checkpoint: dict[str, Any]) -> ServerState:
        """The state after a checkpoint's round: its message and, from the checkpoint, the last
        contributors (``prototypes.npz``); a checkpoint written before client sampling has no
        ``last_cids``."""
        checkpoint = {"last_cids": None, **checkpoint}
        return ServerState(message, checkpoint=checkpoint,
                           files=prototype_files(message, checkpoint.get("last_contributors")))

    def check_models(self, models: list[ProtoModel]) -> None:
        """As :meth:`Algorithm.check_models`; with ``dp="full"`` also refuses
        (:func:`~fedproto.algorithms.fedproto_dp.check_dp_sgd_models`) models with
        recurrent layers that train (``nn.GRU``, ``nn.LSTM``, ``nn.RNN``: Opacus has per-sample
        gradients for its own ``DPGRU``/``DPLSTM``/``DPRNN`` only), and models with
        BatchNorm that trains (its statistics mix the samples of a batch, so per-sample gradients do
        not exist; Opacus refuses them too). Frozen BatchNorm layers
        (:func:`fedproto.training.frozen_batchnorms`) run in eval mode, one sample at a time: allowed."""
        super().check_models(models)
        if self.dp == "full":
            check_dp_sgd_models(models)

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
        tm = self._table(message)
        if tm is None:
            out["acc_proto"] = float("nan")
            return out
        table, mask = tm
        allowed = mask.clone()
        if self.proto_classes == "own":
            own = torch.zeros(self.num_classes, dtype=torch.bool)
            own[torch.as_tensor(state.classes)] = True
            allowed &= own
        pred = nearest_prototype(h, table, allowed, self.proto_normalize)
        out["acc_proto"] = float((pred.to(y.device) == y).float().mean()) if n else float("nan")
        return out

    def full_test_metrics(self, state: ClientState, message: Message, logits: torch.Tensor, h: torch.Tensor,
                          y: torch.Tensor) -> dict[str, float]:
        """As :meth:`Algorithm.full_test_metrics`, plus ``acc_proto``: nearest global prototype
        (eq. 4) among all classes with one (``proto_classes`` does not apply: the test set holds
        every class)."""
        out = super().full_test_metrics(state, message, logits, h, y)
        tm = self._table(message)
        if tm is not None and len(y):
            table, mask = tm
            pred = nearest_prototype(h, table, mask, self.proto_normalize)
            out["acc_proto"] = float((pred == y).to(torch.float64).mean())
        return out

    def proto_distance(self, state: ClientState, message: Message, data: ClientData) -> float:
        """Monitoring: mean L2 distance between the client's train embeddings (eval mode) and the
        global prototype of their class, over samples whose class has one (nan if none)."""
        tm = self._table(message)
        if tm is None:
            return float("nan")
        table, mask = tm
        h = embed_all(state.model, data.x)
        table, mask, y = table.to(h.device), mask.to(h.device), data.y.to(h.device)
        cov = mask[y]
        if not bool(cov.any()):
            return float("nan")
        return float((h[cov] - table[y[cov]]).norm(dim=1).mean())
