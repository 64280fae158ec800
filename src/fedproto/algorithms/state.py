"""The server strategy's explicit state (docs/architecture.md, "Server strategy").

:meth:`~fedproto.algorithms.server.ServerPart.aggregate` returns a :class:`ServerState`: the next
server message and everything else the round produced on the server (its entries of the metrics
row, health alerts, what a checkpoint must keep to resume, the run folder's files). The engine
keeps the last one (``RoundLoop.server``), hands it back to the next ``aggregate`` and reads
nothing else from the algorithm object. A method may still return its message alone (a plain
``dict``): :func:`server_update` wraps it, with ``round_metrics()`` and ``server_state()``.

Torch-free (numpy only).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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


def server_update(algorithm: Any, round: int, messages: dict[int, Message], previous: ServerState) -> ServerState:
    """``algorithm.aggregate(round, messages, previous)`` as a :class:`ServerState`. A method whose
    ``aggregate(round, messages)`` returns the message alone gets its metrics from
    ``round_metrics()`` and its checkpoint from ``server_state()``."""
    fn = algorithm.aggregate
    out = fn(round, messages, previous) if takes_state(fn) else fn(round, messages)
    if isinstance(out, ServerState):
        return out
    return ServerState(dict(out), metrics=dict(algorithm.round_metrics()), checkpoint=algorithm.server_state())
