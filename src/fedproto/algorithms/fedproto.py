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
    aggregate_prototypes,
    class_sums,
    local_prototypes,
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
    """

    name = "fedproto"
    server_state_keys = ("last_contributors",)

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
    ):
        super().__init__(num_classes, opt, local_epochs)
        self.lambda_proto = float(lambda_proto)
        self.distance = distance
        self.proto_source = proto_source
        self.aggregation = aggregation
        self.proto_classes = proto_classes
        self.embedding_dim = embedding_dim
        self.last_contributors: np.ndarray | None = None

    @classmethod
    def from_config(cls, cfg, embedding_dim: int) -> "FedProto":
        return cls(cfg.num_classes, optim_config(cfg), cfg.local_epochs, cfg.lam, cfg.distance,
                   cfg.proto_source, cfg.aggregation, cfg.proto_classes, embedding_dim)

    def _table(self, message: Message):
        if "protos" not in message or len(message["classes"]) == 0:
            return None, None
        return prototype_table(message["classes"], message["protos"], self.num_classes, message["protos"].shape[1])

    def objective(self, state: ClientState, message: Message) -> Objective:
        table, mask = self._table(message)
        return Objective(
            phases=[Phase(self.local_epochs)],
            lambda_proto=self.lambda_proto if table is not None else 0.0,
            table=table,
            mask=mask,
            form=self.distance,
            collect=self.proto_source == "last_epoch",
        )

    def finish(self, state: ClientState, message: Message, data: ClientData, result: TrainResult) -> Message:
        if self.proto_source == "last_epoch":
            sums, counts = result.sums, result.counts
        else:
            sums, counts = class_sums(embed_all(state.model, data.x), data.y, self.num_classes)
        classes, protos, cnt = local_prototypes(sums, counts)
        return {"classes": classes, "protos": protos, "counts": cnt}

    def aggregate(self, round: int, messages: list[Message], states: list[ClientState]) -> Message:
        cls, protos, contrib = aggregate_prototypes(
            [m["classes"] for m in messages],
            [m["protos"] for m in messages],
            [m["counts"] for m in messages],
            self.num_classes,
            self.aggregation,
        )
        self.last_contributors = contrib
        return {"classes": cls, "protos": protos}

    def evaluate(self, state: ClientState, message: Message, data: ClientData) -> dict[str, float]:
        """Classifier accuracy and nearest-global-prototype accuracy (eq. 4), both in [0, 1],
        computed for this client alone (no running totals across clients or modes)."""
        logits, h = predict(state.model, data.test_x)
        y = data.test_y
        n = len(y)
        out = {"acc": float((logits.argmax(1) == y).float().mean()) if n else float("nan")}
        table, mask = self._table(message)
        if table is None:
            out["acc_proto"] = float("nan")
            return out
        allowed = mask.clone()
        if self.proto_classes == "own":
            own = torch.zeros(self.num_classes, dtype=torch.bool)
            own[torch.as_tensor(state.classes)] = True
            allowed &= own
        pred = nearest_prototype(h, table, allowed)
        out["acc_proto"] = float((pred == y).float().mean()) if n else float("nan")
        return out

    def proto_distance(self, state: ClientState, message: Message, data: ClientData) -> float:
        """Monitoring: mean L2 distance between the client's train embeddings (eval mode) and the
        global prototype of their class, over samples whose class has one (nan if none)."""
        table, mask = self._table(message)
        if table is None:
            return float("nan")
        h = embed_all(state.model, data.x)
        cov = mask[data.y]
        if not bool(cov.any()):
            return float("nan")
        return float((h[cov] - table[data.y[cov]]).norm(dim=1).mean())
