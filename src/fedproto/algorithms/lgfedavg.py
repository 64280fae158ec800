"""LG-FedAvg (Liang et al., "Think Locally, Act Globally", arXiv 2001.01523).

The global part (here: the model's head g, its final linear layer) is averaged by the server,
weighted by the clients' numbers of training samples (FedAvg's n_i / n;
:func:`fedproto.algorithms.hetero_math.lg_aggregate`); the local representation (the body) never leaves the client.
Works with heterogeneous bodies whose embedding size d is equal: every head is a (C, d) linear
layer. Local training: cross-entropy on the whole model for ``local_epochs`` epochs.

Where we follow the paper: the global layers averaged with FedAvg's weights, the local
representation never sent. Where we differ, as the reference implementations (PFLlib ``serverlg``,
HtFLlib ``serverLG``) do: the paper shares the top layers (for MNIST/CIFAR-10 several fully
connected layers) and first trains a FedAvg global model before switching to LG; we share the
model's head (its final linear layer) from round 1, the only part heterogeneous bodies have in
common.

Evaluation: ``acc``, each client's model after its local training of the last round (body and
locally trained head); ``acc_global``, the averaged head of the last round on the client's own body
(the paper's "local test" model: local representation, global layers; the number PFLlib/HtFLlib
report; :func:`global_head_accuracy`).

Messages: the head's tensors under model-independent names ``head/<tensor>`` (``head/weight``
(C, d), ``head/bias`` (C,)), so clients of different architectures (their head layers named
differently) share one head; up also ``n`` (1,) int64, the sample count. The first broadcast is
the initial head of the client with the lowest id.
"""

from __future__ import annotations

import numpy as np
import torch

from fedproto.algorithms.algorithm import Algorithm, ClientData, ClientState, Message
from fedproto.algorithms.hetero_math import lg_aggregate
from fedproto.algorithms.method_options import WeightsOptions
from fedproto.algorithms.requirements import ONE_EMBEDDING
from fedproto.algorithms.server_state import ServerState
from fedproto.errors import ConfigError
from fedproto.models.proto_model import ProtoModel
from fedproto.training import TrainResult, predict

HEAD_PREFIX = "head/"
COUNT_KEY = "n"


def head_tensors(model: ProtoModel) -> dict[str, torch.Tensor]:
    """The model's head parameters under model-independent names ``head/<tensor>`` (the name
    after the head layer's prefix, e.g. ``fc2.weight`` -> ``head/weight``).

    Raises:
        ConfigError: a model without a known head (:meth:`ProtoModel.is_head_param`).
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if model.is_head_param(name):
            prefix = next(pre for pre in model.head_prefixes if name.startswith(pre))
            out[HEAD_PREFIX + name[len(prefix):].lstrip(".")] = p
    if not out:
        raise ConfigError("the model names no head layer; give Client(..., head='<name of its final layer>')")
    return out


def head_message(model: ProtoModel) -> Message:
    """``head/<tensor>`` -> float32 array of the model's head."""
    return {k: v.detach().cpu().numpy().astype(np.float32) for k, v in head_tensors(model).items()}


@torch.no_grad()
def load_head(model: ProtoModel, message: Message) -> None:
    """Copy the ``head/`` entries of ``message`` into the model's head (shapes checked by the engine)."""
    for k, p in head_tensors(model).items():
        p.copy_(torch.as_tensor(message[k], dtype=p.dtype, device=p.device))


GLOBAL_HEAD_PROTOCOL = (
    "global: the server's head of the last round (after aggregation, before any local training) on the client's "
    "own body after its local training of the last round, on the client's own test set")
"""What ``acc_global`` scores for LG-FedAvg and FedGH (:func:`global_head_accuracy`)."""


@torch.no_grad()
def global_head_accuracy(state: ClientState, message: Message, data: ClientData) -> float:
    """Accuracy in [0, 1] of the client's model with its head replaced by the server's head of
    ``message`` (``head/<tensor>`` entries), on the client's own test set, in eval mode; NaN with no
    test samples or no head in ``message``. The client's head is restored exactly afterwards.

    The body is the client's own (it never leaves the client in LG-FedAvg and FedGH), so this is
    the only "global" model these methods have: the heterogeneous bodies have no global average.
    HtFLlib and PFLlib report this number (their clients evaluate after receiving the global head).
    """
    n = len(data.test_y)
    head = head_tensors(state.model)
    if not n or any(k not in message for k in head):
        return float("nan")
    saved = {k: t.detach().clone() for k, t in head.items()}
    try:
        load_head(state.model, message)
        logits, _ = predict(state.model, data.test_x)
    finally:
        for k, t in head.items():
            t.copy_(saved[k])
    return float((logits.argmax(1) == data.test_y.to(logits.device)).float().mean())


def check_heads(joins: dict[int, Message], method: str) -> None:
    """Every joining client's head has the same tensors and shapes (raises :class:`ConfigError`
    naming the clients that differ from the lowest id's)."""
    ref_id = min(joins)
    ref = {k: np.asarray(v).shape for k, v in joins[ref_id].items()}
    bad = [cid for cid, m in sorted(joins.items()) if {k: np.asarray(v).shape for k, v in m.items()} != ref]
    if bad:
        raise ConfigError(f"{method} shares the head, but the heads of clients {bad[:10]} differ from client "
                          f"{ref_id}'s {ref}: use one embedding size and one linear head layer for all clients")


def head_reply_problem(reply: Message, sent: Message) -> str:
    """'' if ``reply`` holds exactly the ``head/`` tensors of ``sent`` (same shapes, finite) and a
    positive whole count ``n``; else what is wrong."""
    want = {k for k in sent if k.startswith(HEAD_PREFIX)} | {COUNT_KEY}
    if set(reply) != want:
        return f"entries {sorted(reply)[:6]}, expected {sorted(want)}"
    for k in want - {COUNT_KEY}:
        if reply[k].shape != sent[k].shape:
            return f"{k} has shape {reply[k].shape}, expected {sent[k].shape}"
        if not np.isfinite(reply[k]).all():
            return f"{k} has values that are not finite"
    n = reply[COUNT_KEY]
    if n.shape != (1,) or not n[0] >= 1 or float(n[0]) != int(n[0]):
        return f"count {n.tolist()} is not one whole number >= 1"
    return ""


class LGFedAvg(Algorithm):
    """LG-FedAvg: average the heads, keep the bodies (module docstring)."""

    model_needs = ONE_EMBEDDING
    """What the clients' models must share (:mod:`fedproto.algorithms.requirements`)."""

    name = "lgfedavg"
    Options = WeightsOptions
    shares_weights = True  # the head's weights; heterogeneous bodies are fine

    def join_message(self, state: ClientState) -> Message:
        """The client's initial head (``head/<tensor>``)."""
        return head_message(state.model)

    def initial_message_from(self, joins: dict[int, Message]) -> Message:
        """The initial head of the client with the lowest id, after :func:`check_heads`."""
        check_heads(joins, self.name)
        return dict(joins[min(joins)])

    def reply_problem(self, reply: Message, sent: Message, embedding_dim: int) -> str:
        """See :func:`head_reply_problem`."""
        return head_reply_problem(reply, sent)

    def aggregate(self, round: int, messages: dict[int, Message], state: ServerState | None = None) -> ServerState:
        """The sample-weighted mean of the heads (:func:`fedproto.algorithms.hetero_math.lg_aggregate`) as the
        next message."""
        msgs = list(messages.values())
        heads = [{k: v for k, v in m.items() if k.startswith(HEAD_PREFIX)} for m in msgs]
        out = lg_aggregate(heads, [float(m[COUNT_KEY][0]) for m in msgs])
        return ServerState({k: v.astype(np.float32) for k, v in out.items()})

    def prepare(self, state: ClientState, message: Message) -> None:
        """Load the global head into the client model."""
        load_head(state.model, message)

    def finish(self, state: ClientState, message: Message, data: ClientData, result: TrainResult) -> Message:
        """The trained head and the client's sample count."""
        return {**head_message(state.model), COUNT_KEY: np.array([len(data.y)], np.int64)}

    # -- evaluation -----------------------------------------------------------------------------
    def eval_protocols(self) -> dict[str, str]:
        """``acc`` (personal) and ``acc_global`` (:data:`GLOBAL_HEAD_PROTOCOL`)."""
        return {**super().eval_protocols(), "acc_global": GLOBAL_HEAD_PROTOCOL}

    def evaluate(self, state: ClientState, message: Message, data: ClientData) -> dict[str, float]:
        """:meth:`Algorithm.evaluate` plus ``acc_global`` (:func:`global_head_accuracy`), in [0, 1]."""
        return {**super().evaluate(state, message, data), "acc_global": global_head_accuracy(state, message, data)}
