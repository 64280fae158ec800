"""FedGH (Yi et al., "FedGH: Heterogeneous Federated Learning with Generalized Global Header",
ACM MM 2023, arXiv 2303.13137).

Client: replace its head by the global head, train the whole model with cross-entropy for
``local_epochs`` epochs, then send its local prototypes (per-class mean embeddings, computed in an
eval-mode pass over its training data after training, as PFLlib/HtFLlib ``collect_protos``) with
their counts. Server: train the global head, a (C, d) linear layer, with cross-entropy on the
uploaded (prototype, class) pairs (:func:`fedproto.algorithms.hetero_math.fedgh_train_head`) and send it back.

Where we follow the paper: the server takes one SGD step per uploaded (prototype, class) pair,
once per round, in upload order (client by client, class by class): ``server_epochs`` 1 and
``server_batch_size`` 1, the defaults here. The reference implementations (PFLlib/HtFLlib
``serverGH``) run ``server_epochs`` passes over shuffled mini-batches: any other epochs or batch
size here shuffles the pairs every epoch as they do (seeded from the run's seed and the round, so a
run reproduces). Prototypes as the reference's ``collect_protos`` (after training, eval mode).

Evaluation: ``acc``, each client's model after its local training (its head trained locally from
the global head); ``acc_global``, the server's trained head on the client's own body (the paper's
inference: the generalised global header on the local feature extractor; HtFLlib's reported number,
its clients evaluate after receiving the head;
:func:`~fedproto.algorithms.lgfedavg.global_head_accuracy`).

Messages: down ``head/weight`` (C, d), ``head/bias`` (C,); up ``classes`` (K,) int64, ``protos``
(K, d) float32, ``counts`` (K,) int64. The server's head starts as the initial head of the client
with the lowest id (sent once when the clients join).
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from fedproto.algorithms.algorithm import Algorithm, ClientData, ClientState, Message
from fedproto.algorithms.hetero_math import fedgh_train_head
from fedproto.algorithms.lgfedavg import (
    GLOBAL_HEAD_PROTOCOL,
    check_heads,
    global_head_accuracy,
    head_message,
    load_head,
)
from fedproto.algorithms.method_options import FedGHOptions, checked_options
from fedproto.algorithms.requirements import ONE_EMBEDDING
from fedproto.algorithms.server_state import ServerState
from fedproto.prototypes import class_sums, local_prototypes
from fedproto.training import OptimConfig, TrainResult, embed_all

T = TypeVar("T")


def protos_problem(reply: Message, num_classes: int, embedding_dim: int) -> str:
    """'' if ``reply`` is exactly (K,) int ``classes`` within 0..C-1 without repeats, (K, d) finite
    ``protos`` and (K,) ``counts`` >= 1; else what is wrong."""
    if set(reply) != {"classes", "protos", "counts"}:
        return f"entries {sorted(reply)[:6]}, expected ['classes', 'counts', 'protos']"
    c, p, n = reply["classes"], reply["protos"], reply["counts"]
    if c.ndim != 1 or c.dtype.kind not in "iu" or p.shape != (len(c), embedding_dim) or n.shape != c.shape:
        return (f"arrays that do not fit: classes {c.shape} {c.dtype}, protos {p.shape}, counts {n.shape} "
                f"(expected (K,) int, (K, {embedding_dim}), (K,))")
    if len(c) and (c.min() < 0 or c.max() >= num_classes):
        return f"names classes outside 0..{num_classes - 1}"
    if len(np.unique(c)) != len(c):
        return "repeats a class id"
    if not np.isfinite(p).all() or (len(n) and n.min() < 1):
        return "has values that are not finite or a count below 1"
    return ""


class FedGH(Algorithm):
    """FedGH: a global head trained by the server on the clients' prototypes (module docstring).

    Args:
        num_classes, opt, local_epochs: as :class:`Algorithm`.
        server_epochs: passes of the server's head training per round (>= 0).
        server_lr: its SGD step size (> 0). server_batch_size: pairs per SGD step (>= 1).
        seed: the run's seed.
    """

    model_needs = ONE_EMBEDDING
    """What the clients' models must share (:mod:`fedproto.algorithms.requirements`)."""

    name = "fedgh"
    Options = FedGHOptions

    def __init__(self, num_classes: int, opt: OptimConfig, local_epochs: int = 1, server_epochs: int = 1,
                 server_lr: float = 0.01, server_batch_size: int = 1, seed: int = 0, *, freeze_after: int = 0) -> None:
        super().__init__(num_classes, opt, local_epochs, freeze_after=freeze_after)
        self.options = checked_options(FedGHOptions, server_epochs=server_epochs, server_lr=server_lr,
                                       server_batch_size=server_batch_size)
        self.seed = seed

    @property
    def server_epochs(self) -> int:
        """``self.options.server_epochs`` (the run's, set by :meth:`Algorithm.from_config`); None: 1."""
        return 1 if self.options.server_epochs is None else int(self.options.server_epochs)

    @property
    def server_lr(self) -> float:
        """``self.options.server_lr``; None: 0.01."""
        return 0.01 if self.options.server_lr is None else float(self.options.server_lr)

    @property
    def server_batch_size(self) -> int:
        """``self.options.server_batch_size``; None: 1."""
        return 1 if self.options.server_batch_size is None else int(self.options.server_batch_size)

    @property
    def shuffles(self) -> bool:
        """The paper's regime (one pass, one pair per step) keeps the upload order; any other
        shuffles as the reference."""
        return self.server_epochs > 1 or self.server_batch_size > 1

    # -- server ---------------------------------------------------------------------------------
    def join_message(self, state: ClientState) -> Message:
        """The client's initial head (to start the server's head)."""
        return head_message(state.model)

    def initial_message_from(self, joins: dict[int, Message]) -> Message:
        """The lowest id's initial head, after :func:`~fedproto.algorithms.lgfedavg.check_heads`."""
        check_heads(joins, self.name)
        return dict(joins[min(joins)])

    def reply_problem(self, reply: Message, sent: Message, embedding_dim: int) -> str:
        """See :func:`protos_problem`."""
        return protos_problem(reply, self.num_classes, embedding_dim)

    def aggregate(self, round: int, messages: dict[int, Message], state: ServerState | None = None) -> ServerState:
        """Train the global head on the round's prototypes (:func:`fedproto.algorithms.hetero_math.fedgh_train_head`),
        from the head the previous ``state`` holds (its checkpoint's ``head_w`` (C, d) and ``head_b``
        (C,) as trained; before round 1 the initial message's float32 head).

        Returns:
            The head (float32) as the message, ``server_loss`` (the head training's mean loss in its
            last epoch) as the round's metric, the head as trained in the checkpoint.

        Raises:
            ValueError: ``state`` is None (the server holds no head to start from).
        """
        if state is None:
            raise ValueError("FedGH.aggregate needs the previous ServerState (its head); pass the initial "
                             "message's: ServerState(initial_message)")
        w0, b0 = state.checkpoint.get("head_w"), state.checkpoint.get("head_b")
        if w0 is None or b0 is None:
            w0 = np.asarray(state.message["head/weight"], np.float32)
            b0 = np.asarray(state.message["head/bias"], np.float32)
        msgs = list(messages.values())
        w, b, info = fedgh_train_head([m["classes"] for m in msgs], [m["protos"] for m in msgs], w0, b0,
                                      self.server_epochs, self.server_lr, self.server_batch_size,
                                      shuffle=self.shuffles, seed=self.seed * 100_003 + round)
        return ServerState({"head/weight": w.astype(np.float32), "head/bias": b.astype(np.float32)},
                           metrics={"server_loss": info["loss"]}, checkpoint={"head_w": w, "head_b": b})

    def resume_state(self, message: Message, checkpoint: dict[str, Any]) -> ServerState:
        """The state after a checkpoint's round: its message and its head as trained.

        Raises:
            KeyError: the checkpoint holds no ``head_w`` or ``head_b``.
        """
        return ServerState(message, checkpoint={"head_w": checkpoint["head_w"], "head_b": checkpoint["head_b"]})

    # -- client ---------------------------------------------------------------------------------
    def prepare(self, state: ClientState, message: Message) -> None:
        """Replace the client's head by the global head."""
        load_head(state.model, message)

    def finish(self, state: ClientState, message: Message, data: ClientData, result: TrainResult) -> Message:
        """Local prototypes from an eval-mode pass over the training data after training."""
        sums, counts = class_sums(embed_all(state.model, data.x), data.y, self.num_classes)
        classes, protos, cnt = local_prototypes(sums, counts)
        return {"classes": classes, "protos": protos, "counts": cnt}

    # -- evaluation -----------------------------------------------------------------------------
    def eval_protocols(self) -> dict[str, str]:
        """``acc`` (personal) and ``acc_global`` (:data:`~fedproto.algorithms.lgfedavg.GLOBAL_HEAD_PROTOCOL`)."""
        return {**super().eval_protocols(), "acc_global": GLOBAL_HEAD_PROTOCOL}

    def evaluate(self, state: ClientState, message: Message, data: ClientData) -> dict[str, float]:
        """:meth:`Algorithm.evaluate` plus ``acc_global``
        (:func:`~fedproto.algorithms.lgfedavg.global_head_accuracy`: the trained global head on the
        client's own body, the paper's inference), in [0, 1]."""
        return {**super().evaluate(state, message, data), "acc_global": global_head_accuracy(state, message, data)}
