"""Reply and message checks, in one place (the server validates every reply once before it
aggregates; docs/architecture.md).

:func:`check_replies` is what the round loop runs on every round's replies, whatever the executor;
the Flower executor asks :func:`unusable` (the same checks) to decide whether a round has enough
usable replies or must be retried; :func:`message_problem` checks a server message read back from
a checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from fedproto.algorithms.algorithm import Algorithm, Message
from fedproto.training import TrainResult

log = logging.getLogger(__name__)


def reply_problem(alg: Algorithm, reply: Any, sent: Message, embedding_dim: int) -> str:
    """What is wrong with a client's reply as a whole ('' if nothing): it must be a dict of
    numeric numpy arrays, then pass the algorithm's own check (:meth:`Algorithm.reply_problem`:
    shapes, finite values, class ids, counts).

    Args:
        alg: the run's algorithm. reply: what the client sent. sent: what it received this round
            (the shapes a reply of weights must have). embedding_dim: d.
    """
    if not isinstance(reply, dict):
        return f"is a {type(reply).__name__}, not a dict of arrays"
    for k, v in reply.items():
        if not isinstance(v, np.ndarray):
            return f"entry {k!r} is a {type(v).__name__}, not an array"
        if v.dtype.kind not in "biuf":
            return f"entry {k!r} has dtype {v.dtype}, not a number type"
    return alg.reply_problem(reply, sent, embedding_dim)


def _joined(parts: list[str]) -> str:
    return "; ".join(parts[:3]) + (f" (and {len(parts) - 3} more)" if len(parts) > 3 else "")


def unusable(alg: Algorithm, cid: int, reply: Any, sent: Message, embedding_dim: int) -> str:
    """Why :func:`check_replies` would drop client ``cid``'s reply whole ('' if some of it is usable)."""
    why = reply_problem(alg, reply, sent, embedding_dim)
    if why or not reply:
        return why
    clean, parts = alg.reply_problems(cid, reply)
    return "" if clean else (_joined(parts) or "nothing usable")


def check_replies(alg: Algorithm, embedding_dim: int, round: int, sent: dict[int, Message],
                  replies: dict[int, tuple[Message, TrainResult]],
                  who: Callable[[int], str] = lambda i: f"client {i}") -> tuple[dict[int, str], set[int]]:
    """Check every reply of round ``round`` before aggregation. A reply that is not what the
    algorithm sends (:func:`reply_problem`: types, keys, shapes) is dropped whole; then the
    algorithm drops its bad parts (:meth:`Algorithm.reply_problems`, e.g. a prototype row with NaN
    values), replacing the message in ``replies``; a reply with no usable part left is dropped
    whole. Each is logged with the client (``who(cid)``) and the reason.

    Args:
        replies: client id -> (message, train result); bad parts are removed in place.
    Returns:
        (client id -> reason, for every reply dropped whole or in part; the ids dropped whole).
    """
    reasons: dict[int, str] = {}
    whole: set[int] = set()
    for i in sorted(replies):
        msg, res = replies[i]
        why = reply_problem(alg, msg, sent.get(i, {}), embedding_dim)
        if why:
            whole.add(i)
        else:
            clean, parts = alg.reply_problems(i, msg)
            if parts:
                why = _joined(parts)
                if clean:
                    replies[i] = (clean, res)
                else:
                    whole.add(i)
        if why:
            reasons[i] = why
            log.warning("round %d: dropped %sthe reply of %s: %s", round, "" if i in whole else "part of ", who(i), why)
    return reasons, whole


def message_problem(alg: Algorithm, msg: Any, reference: Message, embedding_dim: int) -> str:
    """What is wrong with a server message read back from a checkpoint ('' if nothing): arrays
    only, finite, the shapes of the algorithm's first message ``reference``, then the algorithm's
    own check (:meth:`Algorithm.message_problem`: prototypes of the embedding size for classes in range)."""
    if not isinstance(msg, dict):
        return f"is a {type(msg).__name__}, not a dict of arrays"
    for k, v in msg.items():
        if not isinstance(v, np.ndarray):
            return f"entry {k!r} is a {type(v).__name__}, not an array"
        if v.dtype.kind == "f" and not np.isfinite(v).all():
            return f"entry {k!r} holds non-finite values"
        if k in reference and np.shape(reference[k]) != v.shape:
            return f"entry {k!r} has shape {v.shape}, the model needs {np.shape(reference[k])}"
    return alg.message_problem(msg, embedding_dim)
