"""The server strategy's explicit state (docs/architecture.md, "Server strategy").

:meth:`~fedproto.algorithms.server_part.ServerPart.aggregate` returns a :class:`ServerState`: the next
server message and everything else the round produced on the server (its entries of the metrics
row, health alerts, what a checkpoint must keep to resume, the run folder's files). The engine
keeps the last one (``RoundLoop.server``), hands it back to the next ``aggregate`` and reads
nothing else from the algorithm object. A method with nothing but a message to keep may return
the message alone (a plain ``dict``): :func:`server_update` wraps it as ``ServerState(message)``.

Torch-free (numpy only).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedproto.plugins import LEGACY_HOOKS

Message = dict[str, np.ndarray]


@dataclass
class Alert:
    """A health alert a method raises about one client after aggregating; the engine's ``Health``
    observer logs it as ``round R: <text>``, at most a few times per client.

    Attributes:
        cid: the client the alert names.
        text: what is wrong and what to check, one sentence (no round: the engine adds it).
        later: where the later rounds' values are, named when the engine stops repeating the
            alert for this client (e.g. ``"proto_dist_max in metrics.jsonl"``).
    """

    cid: int
    text: str
    later: str = "metrics.jsonl"


@dataclass
class ServerState:
    """What one aggregation produced, returned by ``aggregate`` and held by the engine.

    Attributes:
        message: the next server message (before ``broadcast`` adds the round's stage entries).
        metrics: entries of the round's ``metrics.jsonl`` row (numbers, lists of client ids).
        alerts: :class:`Alert` s the health observer logs.
        checkpoint: what the server needs besides the message to resume after this round: numpy
            arrays, numbers, lists and dicts of them, or None (``checkpoint.pt``'s ``server_state``).
        files: the run folder's own files of this method, name -> arrays, each written as one
            ``.npz`` when the run finishes (FedProto: ``prototypes.npz``).
    """

    message: Message
    metrics: dict[str, Any] = field(default_factory=dict)
    alerts: list[Alert] = field(default_factory=list)
    checkpoint: dict[str, Any] = field(default_factory=dict)
    files: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)


def takes_state(aggregate: Any) -> bool:
    """True when ``aggregate`` accepts the previous :class:`ServerState` as third argument."""
    try:
        params = list(inspect.signature(aggregate).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)




def as_state(algorithm: Any, out: Any) -> ServerState:
    """What ``algorithm.aggregate`` returned, as a :class:`ServerState`: the state itself, or a
    plain message wrapped as ``ServerState(message)`` (no metrics, alerts, checkpoint or files).

    Raises:
        TypeError: ``out`` is neither, or it is a plain message from an algorithm that defines one
            of :data:`~fedproto.plugins.LEGACY_HOOKS` (its metrics or checkpoint would be lost in silence): the error
            names the hook and says to return a ``ServerState`` instead.
    """
    if isinstance(out, ServerState):
        return out
    if not isinstance(out, dict):
        raise TypeError(f"{type(algorithm).__name__}.aggregate returned {type(out).__name__}: return a "
                        "fedproto.algorithms.server_state.ServerState (or the next message, a dict of numpy arrays)")
    legacy = [h for h in LEGACY_HOOKS if hasattr(algorithm, h)]
    if legacy:
        raise TypeError(f"{type(algorithm).__name__}.aggregate returned its message alone and the class defines "
                        f"{', '.join(legacy)}, which fedproto no longer reads: return ServerState(message, "
                        "metrics=..., checkpoint=..., files=...) from aggregate and read the previous one from its "
                        "state argument (docs/architecture.md, 'Server strategy')")
    return ServerState(dict(out))


def server_update(algorithm: Any, round: int, messages: dict[int, Message], previous: ServerState) -> ServerState:
    """``algorithm.aggregate(round, messages, previous)`` (``aggregate(round, messages)`` where it
    takes no state) as a :class:`ServerState` (:func:`as_state`)."""
    fn = algorithm.aggregate
    out = fn(round, messages, previous) if takes_state(fn) else fn(round, messages)
    return as_state(algorithm, out)
