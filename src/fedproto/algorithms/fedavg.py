"""FedAvg (McMahan et al., arXiv 1602.05629), the weight-averaging baseline of tab. 1.

Client: load the global weights, train with cross-entropy for ``local_epochs`` epochs, send the
weights back. Server: average them weighted by the clients' numbers of training samples
(eq. 1 of the FedProto paper: |D_i|/N), broadcast the average.

What is sent:
    up (per client): ``w/<name>`` float32 array for every shared tensor of the model (all
        parameters, plus floating-point buffers such as BatchNorm running statistics when the
        model has them; the paper CNN has none) and ``n``: (1,) int64, the number of local
        training samples (the aggregation weight).
    down (broadcast): ``w/<name>`` for every shared tensor (no count).
The first broadcast (:meth:`FedAvg.initial_message`) is client 0's initial weights, so all clients
start round 1 from one global model.

Frozen tensors are not shared (:func:`shared_tensors`): a parameter its client froze
(``requires_grad=False``, e.g. a pretrained backbone) and the running statistics of a BatchNorm
whose parameters are all frozen are neither sent up nor overwritten on download; they stay the
client's own, and the communication cost counts only what is sent. Every client must freeze the
same tensors (their values may differ): a tensor shared by some clients and kept by others has no
one global value to average, so the run is refused at the start, naming the clients and the tensor
(:func:`check_same_shapes`, :func:`check_message_shapes`).

Evaluation: two protocols, both recorded (``summary.json``'s ``evaluation`` says which
key is which). ``acc``, *personal* (as for every method here): each client's model *after its
local training of the last round*, on the client's own test set (:meth:`Algorithm.evaluate`; the
engine evaluates after aggregation, before the next ``prepare``), the "FedAvg + one round of local
fine-tuning" reading. ``acc_global``, *global*: the server's aggregated model of the last round
(after aggregation, before any local training) on each client's own test set
(:meth:`FedAvg.global_accuracy`); this is the protocol whose numbers match tab. 1's FedAvg
(docs/reproducing.md). For FedPer/FedRep "global" is the global body with the client's own head,
for FeSEM the centre of the client's cluster.

The functions here (:func:`check_same_shapes`, :func:`weights_message`, :func:`load_weights`,
:func:`weighted_average`) are shared by the other weight-sharing baselines (FedProx, FedPer,
FedRep, FeSEM), which subclass :class:`FedAvg` and change only what they share or how they train.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch

from fedproto.algorithms.algorithm import Algorithm, ClientData, ClientState, Message
from fedproto.algorithms.method_options import WeightsOptions
from fedproto.algorithms.requirements import ONE_ARCHITECTURE, architecture_groups
from fedproto.algorithms.server_state import ServerState
from fedproto.errors import ConfigError, opt
from fedproto.models.proto_model import ProtoModel
from fedproto.plugins import AlgorithmOptions
from fedproto.training import TrainResult, frozen_batchnorms, frozen_params, predict

log = logging.getLogger(__name__)

WEIGHT_PREFIX = "w/"
COUNT_KEY = "n"


def shared_tensors(model: ProtoModel, include: Callable[[str], bool] | None = None) -> OrderedDict[str, torch.Tensor]:
    """Name -> tensor of what ``model`` shares: its parameters and floating-point buffers that pass
    ``include(name)`` (None: all), in ``named_parameters`` then ``named_buffers`` order, without
    the frozen ones (:func:`frozen_tensors`), which stay the client's own."""
    frozen = frozen_tensors(model)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, p in model.named_parameters():
        if name not in frozen and (include is None or include(name)):
            out[name] = p
    for name, b in model.named_buffers():
        if b.is_floating_point() and name not in frozen and (include is None or include(name)):
            out[name] = b
    return out


def frozen_tensors(model: ProtoModel) -> frozenset[str]:
    """Names of the tensors of ``model`` its owner froze, which weight sharing leaves alone: the
    parameters with ``requires_grad=False`` (:func:`fedproto.training.frozen_params`) and the
    buffers (running statistics) of the BatchNorm layers whose parameters are all frozen
    (:func:`fedproto.training.frozen_batchnorms`; training leaves those statistics alone too)."""
    out = set(frozen_params(model))
    bns = {id(m) for m in frozen_batchnorms(model)}
    if bns:
        for prefix, m in model.named_modules():
            if id(m) in bns:
                out.update(f"{prefix}.{n}" if prefix else n for n, _ in m.named_buffers(recurse=False))
    return frozenset(out)


def weights_message(model: ProtoModel, include: Callable[[str], bool] | None = None) -> Message:
    """``{"w/<name>": float32 copy}`` of the shared tensors of ``model``."""
    return {
        WEIGHT_PREFIX + name: t.detach().cpu().numpy().astype(np.float32, copy=True)
        for name, t in shared_tensors(model, include).items()
    }


@torch.no_grad()
def load_weights(model: ProtoModel, message: Message, include: Callable[[str], bool] | None = None) -> None:
    """Copy every ``w/<name>`` of ``message`` into the model's shared tensor ``name``.

    Tensors without an entry are left alone (e.g. an empty message). Raises ``ValueError`` on a
    shape mismatch (the heterogeneity check at start should make that impossible).
    """
    for name, t in shared_tensors(model, include).items():
        arr = message.get(WEIGHT_PREFIX + name)
        if arr is None:
            continue
        if tuple(arr.shape) != tuple(t.shape):
            raise ValueError(f"server weight {name!r} has shape {tuple(arr.shape)}, model has {tuple(t.shape)}")
        t.copy_(torch.as_tensor(np.asarray(arr), dtype=t.dtype))


def check_same_shapes(states: list[ClientState], method: str, include: Callable[[str], bool] | None = None) -> None:
    """Raise :class:`ConfigError` unless all clients share the same tensors (:func:`shared_tensors`:
    names and shapes, frozen tensors left out).

    The message names the clients that freeze a tensor others share (freeze the same tensors on
    every client), else groups the clients by architecture and names the first tensor that differs.
    """
    sigs = [tuple((n, tuple(t.shape)) for n, t in shared_tensors(s.model, include).items()) for s in states]
    if len(set(sigs)) <= 1:
        return
    frozen = [frozen_tensors(s.model) for s in states]
    for name in dict.fromkeys(n for sig in sigs for n, _ in sig):
        keep = [s.cid for s, f in zip(states, frozen) if name in f]
        if keep:
            send = [s.cid for s, sig in zip(states, sigs) if name in dict(sig)]
            raise ConfigError(_frozen_differs(method, name, keep, send))
    parts = architecture_groups(sigs, [s.cid for s in states])
    raise ConfigError(
        f"{method} averages model weights, so every client needs the same architecture, but the "
        f"client models differ: {'; '.join(parts)}. Give every client a model of one architecture, "
        f"or an algorithm for heterogeneous models: {opt('algorithm', 'fedproto')} (shares prototypes) or "
        f"{opt('algorithm', 'local')} (no communication)"
    )


def _frozen_differs(method: str, name: str, keep: list[int], send: list[int], seen: bool = True) -> str:
    """The error for tensor ``name`` frozen by clients ``keep`` (``seen``: known from their models;
    else only missing from their messages) and shared by clients ``send``."""
    why = (f"froze {name!r} (requires_grad=False" if seen else
           f"do not send {name!r} (frozen, requires_grad=False, or another architecture")
    return (f"{method} averages the tensors the clients share, but clients {keep[:10]} {why}; a frozen tensor "
            f"stays the client's own and is not sent) while clients {send[:10]} train and share it, so it has no "
            "one global value; freeze the same parameters on every client (their values may differ), or use "
            "algorithm='fedproto' or 'local'")


def check_message_shapes(joins: dict[int, Message], method: str) -> None:
    """Raise :class:`ConfigError` unless the ``w/`` tensors of every client's message (keyed by
    client id) have the same names and shapes; names the clients that differ from the lowest id.
    When one of two clients sends a subset of the other's tensors (same shapes), the message names
    the missing tensor as one those clients froze (or another architecture). Logs a warning when
    the clients share no tensor at all (all frozen or personal: each client trains alone)."""
    if not joins:
        raise ConfigError(f"{method}: no client sent its initial weights")
    sig = {c: tuple((k, tuple(np.shape(v))) for k, v in m.items() if k.startswith(WEIGHT_PREFIX))
           for c, m in sorted(joins.items())}
    first = min(sig)
    odd = [c for c in sig if sig[c] != sig[first]]
    if odd:
        a, b = dict(sig[first]), dict(sig[odd[0]])
        diff = next((n for n in list(a) + list(b) if a.get(n) != b.get(n)), "?")
        name = diff.removeprefix(WEIGHT_PREFIX)
        common = set(a) & set(b)
        if all(a[k] == b[k] for k in common) and common in (set(a), set(b)):  # one sends less: frozen there?
            send = [c for c in sig if diff in dict(sig[c])]
            keep = [c for c in sig if diff not in dict(sig[c])]
            raise ConfigError(_frozen_differs(method, name, keep, send, seen=False))
        raise ConfigError(f"{method} averages model weights, so every client needs the same architecture, but "
                          f"clients {odd[:10]} differ from client {first} (at {name!r}: "
                          f"{b.get(diff)} vs {a.get(diff)}); use one model for all clients, or algorithm='fedproto'")
    if not sig[first]:
        log.warning("%s: the clients share no tensor (every one is frozen, requires_grad=False, or personal), so "
                    "each trains alone as with algorithm='local'", method)


def weights_problem(reply: Message, sent: Message) -> str:
    """What is wrong with a reply of weights ('' if nothing): it must hold exactly the ``w/``
    tensors of ``sent`` (the client's view of the server message), of the same shapes, finite,
    and ``n``: one positive whole number (the client's sample count)."""
    want = {k: np.shape(v) for k, v in sent.items() if k.startswith(WEIGHT_PREFIX)}
    got = {k for k in reply if k.startswith(WEIGHT_PREFIX)}
    if got != set(want):
        missing, extra = sorted(set(want) - got), sorted(got - set(want))
        return f"weights missing {missing[:3]} / unexpected {extra[:3]}"
    other = sorted(set(reply) - got - {COUNT_KEY})
    if other:
        return f"unexpected entries {other[:5]}"
    for k, shape in want.items():
        v = reply[k]
        if v.shape != shape:
            return f"weight {k.removeprefix(WEIGHT_PREFIX)!r} has shape {v.shape}, expected {shape}"
        if v.dtype.kind != "f" or not np.isfinite(v).all():
            return f"weight {k.removeprefix(WEIGHT_PREFIX)!r} holds NaN or infinite values"
    n = reply.get(COUNT_KEY)
    if n is None or n.size != 1 or not np.isfinite(n).all() or float(n.reshape(-1)[0]) < 1 \
            or float(n.reshape(-1)[0]) != round(float(n.reshape(-1)[0])):
        return "sample count 'n' is not one positive whole number"
    return ""


def client_count(message: Message) -> float:
    """The sample count ``n`` of a client message (1 when absent)."""
    n = message.get(COUNT_KEY)
    return float(np.asarray(n).reshape(-1)[0]) if n is not None else 1.0


def weighted_average(messages: list[Message], weights: np.ndarray | None = None) -> Message:
    """Average the ``w/`` arrays of ``messages`` with ``weights`` (default: their counts ``n``),
    normalised to sum 1 (equal weights when all are 0). Computed in float64, returned float32."""
    if not messages:
        return {}
    w = np.asarray([client_count(m) for m in messages] if weights is None else weights, dtype=np.float64)
    w = w / w.sum() if w.sum() > 0 else np.full(len(messages), 1.0 / len(messages))
    keys = [k for k in messages[0] if k.startswith(WEIGHT_PREFIX)]
    out = {}
    for k in keys:
        acc = np.zeros(messages[0][k].shape, np.float64)
        for wi, m in zip(w, messages):
            acc += wi * m[k]
        out[k] = acc.astype(np.float32)
    return out


class FedAvg(Algorithm):
    """FedAvg: share all weights, sample-weighted average on the server (see module docstring)."""

    model_needs = ONE_ARCHITECTURE
    """What the clients' models must share (:mod:`fedproto.algorithms.requirements`)."""

    name = "fedavg"
    Options: ClassVar[type[AlgorithmOptions] | None] = WeightsOptions
    shares_weights = True
    secure_sum: ClassVar[str | None] = "weights"

    def include(self, model: ProtoModel) -> Callable[[str], bool] | None:
        """Predicate on tensor names: which tensors are shared (FedAvg: all; None means all)."""
        return None

    # -- server ---------------------------------------------------------------------------------
    def join_message(self, state: ClientState) -> Message:
        """The client's initial shared weights, ``w/<name>`` (what :meth:`initial_message_from` needs)."""
        return weights_message(state.model, self.include(state.model))

    def initial_message(self, states: list[ClientState]) -> Message:
        """Check that all client models match (naming the clients that differ), then
        :meth:`initial_message_from`."""
        check_same_shapes(states, self.name, self.include(states[0].model))
        return super().initial_message(states)

    def initial_message_from(self, joins: dict[int, Message]) -> Message:
        """The initial weights of the client with the lowest id, after checking that every
        joining client shares the same tensors (raises :class:`ConfigError` naming the clients)."""
        check_message_shapes(joins, self.name)
        return dict(joins[min(joins)])

    def reply_problem(self, reply: Message, sent: Message, embedding_dim: int) -> str:
        """A reply holds exactly the ``w/`` tensors of what the client received, with their shapes
        and finite values, plus its sample count ``n``: one positive whole number."""
        return weights_problem(reply, sent)

    def aggregate(self, round: int, messages: dict[int, Message], state: ServerState | None = None) -> ServerState:
        """Sample-weighted average (weights n_i / sum n) as the next message; nothing else kept."""
        return ServerState(weighted_average(list(messages.values())))

    # -- client ---------------------------------------------------------------------------------
    def load_global(self, state: ClientState, message: Message) -> None:
        """Load the server's weights for this client (FedAvg: every shared tensor of ``message``)
        into ``state.model``; what :meth:`prepare` does and what :meth:`global_accuracy` scores."""
        load_weights(state.model, message, self.include(state.model))

    def prepare(self, state: ClientState, message: Message) -> None:
        """Load the global weights into the client model."""
        self.load_global(state, message)

    def finish(self, state: ClientState, message: Message, data: ClientData, result: TrainResult) -> Message:
        msg = weights_message(state.model, self.include(state.model))
        msg[COUNT_KEY] = np.array([len(data.y)], dtype=np.int64)
        return msg

    # -- evaluation -----------------------------------------------------------------------------
    global_protocol = ("global: the server's aggregated model after the last round's aggregation, before any local "
                       "training, on each client's own test set")
    """What ``acc_global`` scores (:meth:`eval_protocols`); subclasses say what "global" is for them."""

    def eval_protocols(self) -> dict[str, str]:
        """``acc`` (personal) and ``acc_global`` (:attr:`global_protocol`)."""
        return {**super().eval_protocols(), "acc_global": self.global_protocol}

    def evaluate(self, state: ClientState, message: Message, data: ClientData) -> dict[str, float]:
        """:meth:`Algorithm.evaluate` (``acc``: the personal protocol) plus ``acc_global``
        (:meth:`global_accuracy`), both in [0, 1]."""
        out = super().evaluate(state, message, data)
        out["acc_global"] = self.global_accuracy(state, message, data)
        return out

    @torch.no_grad()
    def global_accuracy(self, state: ClientState, message: Message, data: ClientData) -> float:
        """Accuracy in [0, 1] of the server's model for this client on its own test set (NaN with
        no test samples): the weights of ``message`` (:meth:`load_global`; the tensors the server
        does not send, e.g. FedPer's personal layers or frozen ones, are the client's own) in eval
        mode. The client's model is left exactly as it was (its shared tensors are restored)."""
        n = len(data.test_y)
        if not n:
            return float("nan")
        shared = shared_tensors(state.model, self.include(state.model))
        saved = {k: t.detach().clone() for k, t in shared.items()}
        try:
            self.load_global(state, message)
            logits, _ = predict(state.model, data.test_x)
        finally:
            for k, t in shared.items():
                t.copy_(saved[k])
        return float((logits.argmax(1) == data.test_y.to(logits.device)).float().mean())
