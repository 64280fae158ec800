"""FedProto (Tan et al., arXiv 2105.00243, alg. 1).

Client: cross-entropy + λ · L_R(embeddings, global prototypes) (eq. 7), then local prototypes
(eq. 3) sent up as (classes, protos, counts). Server: per-class aggregation over the clients that
hold the class (eq. 6, see :func:`fedproto.prototypes.aggregate_prototypes`), broadcast as
(classes, protos). Round 1 starts with no global prototypes (official code), so it trains with
cross-entropy only.
"""

from __future__ import annotations

import numpy as np
import torch

from fedproto.algorithms.base import Algorithm, ClientData, ClientState, Message, optim_config
from fedproto.prototypes import (
    AGGREGATION_RULES,
    DISTANCE_FORMS,
    aggregate_prototypes,
    class_sums,
    client_distances,
    embedding_health,
    lambda_at,
    local_prototypes,
    momentum_prototypes,
    nearest_prototype,
    prototype_table,
)
from fedproto.training import Objective, OptimConfig, Phase, TrainResult, embed_all, predict


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
    Raises:
        ValueError: an option outside its range.
    """

    name = "fedproto"
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
    ):
        super().__init__(num_classes, opt, local_epochs)
        if lambda_warmup < 0 or not 0.0 <= proto_momentum < 1.0 or min_proto_samples < 1 or proto_dist_alert < 0:
            raise ValueError(f"lambda_warmup={lambda_warmup} (>= 0), proto_momentum={proto_momentum} (in [0, 1)), "
                             f"min_proto_samples={min_proto_samples} (>= 1), proto_dist_alert={proto_dist_alert} "
                             "(>= 0): one is out of range")
        for opt_name, value, allowed in (("distance", distance, DISTANCE_FORMS),
                                         ("proto_source", proto_source, ("last_epoch", "after_training")),
                                         ("aggregation", aggregation, AGGREGATION_RULES),
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
                   cfg.proto_momentum, cfg.proto_normalize, cfg.min_proto_samples, cfg.proto_dist_alert)

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
            collect=self.proto_source == "last_epoch",
            normalize=self.proto_normalize,
        )

    def finish(self, state: ClientState, message: Message, data: ClientData, result: TrainResult) -> Message:
        if self.proto_source == "last_epoch":
            sums, counts = result.sums, result.counts
        else:
            sums, counts = class_sums(embed_all(state.model, data.x), data.y, self.num_classes)
        classes, protos, cnt = local_prototypes(sums, counts)
        return {"classes": classes, "protos": protos, "counts": cnt}

    def aggregate(self, round: int, messages: dict[int, Message]) -> Message:
        """Global prototypes from the clients' local ones (eq. 6, ``aggregation``), after
        ``min_proto_samples`` filtering, with ``proto_momentum`` against the previous global
        prototypes, plus the λ of round ``round + 1`` when warming up. A class that no client sent this
        round (client sampling, ``min_proto_samples``) keeps its previous global prototype, with 0
        contributors this round."""
        cids = list(messages)
        messages = list(messages.values())
        keep = [np.asarray(m["counts"]) >= self.min_proto_samples for m in messages]
        cls, protos, contrib = aggregate_prototypes(
            [np.asarray(m["classes"])[k] for m, k in zip(messages, keep)],
            [np.asarray(m["protos"])[k] for m, k in zip(messages, keep)],
            [np.asarray(m["counts"])[k] for m, k in zip(messages, keep)],
            self.num_classes,
            self.aggregation,
        )
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
            out["lambda"] = np.array([lambda_at(round + 1, self.lambda_proto, self.lambda_warmup)], np.float32)
        return out

    def check_setup(self, cfg, train_labels: list[np.ndarray]) -> None:
        """``min_proto_samples`` must leave some prototype to send: refused when it exceeds every
        client's count of every class."""
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

        return f" or {opt('lambda_proto')} (now {self.lambda_proto})" if self.lambda_proto > 0 else ""

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

    def load_server_state(self, state: dict) -> None:
        """Restore :meth:`server_state`; a checkpoint written before client sampling has no
        ``last_cids`` (its messages came from clients 0..m-1 in order)."""
        super().load_server_state({"last_cids": None, **state})

    def round_metrics(self) -> dict[str, float]:
        """Prototype-distance monitoring of the last aggregation: mean and max over clients of
        each client's mean L2 distance to the global prototypes, and the client with the max."""
        d = self.last_distances
        if d is None or not np.isfinite(d).any():
            return {}
        i = int(np.nanargmax(d))
        return {"proto_dist": float(np.nanmean(d)), "proto_dist_max": float(d[i]),
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
