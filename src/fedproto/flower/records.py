"""Flower records <-> fedproto messages and run options (shared by the ClientApp and ServerApp).

Raises ImportError with the install command when ``flwr`` is missing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    from flwr.app import Array, ArrayRecord
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the Flower app needs the flwr package, which is not installed: pip install \"fedproto[flower]\""
    ) from e

from fedproto.algorithms.algorithm import Message
from fedproto.config.run_config import RunConfig, build_config, normal_key
from fedproto.errors import ConfigError, opt

MESSAGE = "fedproto.message"
"""RecordDict key of the algorithm message (an ArrayRecord) in both directions."""
CONFIG = "fedproto.config"
"""RecordDict key of the ConfigRecord with ``round``, ``cid`` and ``schema`` (server -> client; the
query reply's node description, client -> server)."""
METRICS = "fedproto.metrics"
"""RecordDict key of the MetricRecord a client returns (train losses or evaluation metrics)."""
SCHEMA = 1
"""Version of fedproto's Flower messages: the entries of :data:`CONFIG` (``round``, ``cid``,
``run-key``, ``schema``), of the query reply (``cid``, ``classes``, sample counts, ``params``,
``embedding-dim``, ``schema``) and of :data:`METRICS` (``loss_ce``, ``loss_proto``, ``steps``,
``emb-norm-max``, ``loss-terms``, ``num-examples``, the method's evaluation keys), each read by name.
The server sends it in every message and a node in its query reply; each side refuses the other's
when it differs (:func:`schema_problem`). Raised when an entry changes meaning or name."""


def schema_problem(got: object, side: str) -> str:
    """Why a message of ``side`` (``"server"``, ``"node"``) with schema ``got`` (None: none sent,
    a fedproto before the schema) cannot be read here ('' when it is :data:`SCHEMA`)."""
    if got is not None and int(got) == SCHEMA:
        return ""
    theirs = "no message schema (an older fedproto)" if got is None else f"message schema {int(got)}"
    return (f"the {side} speaks {theirs}, this fedproto speaks schema {SCHEMA}: install the same fedproto version "
            "on the server and every SuperNode")


QUERY = "query"
"""Message type the ServerApp sends once to each new node: the reply names its client and
carries what the server needs of it (:func:`fedproto.flower.client_app.query`)."""


def to_record(msg: Message) -> ArrayRecord:
    """A message as an :class:`ArrayRecord` (one Array per key; dtype and shape kept, 0-d included)."""
    return ArrayRecord({k: Array(np.asarray(v).copy(order="C")) for k, v in msg.items()})


def from_record(rec: ArrayRecord) -> Message:
    """Inverse of :func:`to_record`."""
    return {k: a.numpy() for k, a in rec.items()}


@dataclass(frozen=True)
class FlowerOptions:
    """Run config keys of the Flower engine only (not :class:`RunConfig` options).

    Attributes:
        round_timeout: seconds the server waits for the replies of one round (``round-timeout``,
            default 120); a sampled node that has not replied by then counts as timed out.
        min_replies: fewest valid replies a round needs (``min-replies``, default 1); below it the
            round is retried.
        round_retries: retries of a round below ``min_replies`` before the run stops with an
            error (``round-retries``, default 2); the rounds already logged stay in the run folder.
        wait_nodes: seconds to wait at the start for ``clients`` nodes (``wait-nodes``, default
            60); the run starts with fewer if at least ``min_replies`` have joined.
        class_names: names of classes 0..C-1 for image folders named by class (``class-names``,
            comma-separated; default none: folders are named by class id).
        poll_interval: seconds between the server's pulls of replies (``poll-interval``, default
            0.2; Flower's own ``send_and_receive`` waits 3 s): 0.01 to 60, and below ``round_timeout``.
        resume_from: the run folder of an interrupted run to continue from its checkpoint (its last
            completed round), e.g. on a new SuperLink (``resume-from``; default ``""``: a new run; the
            example apps list ``resume-from = ""`` so that ``flwr run --run-config`` may set it).
    """

    round_timeout: float = 120.0
    min_replies: int = 1
    round_retries: int = 2
    wait_nodes: float = 60.0
    class_names: tuple[str, ...] = ()
    poll_interval: float = 0.2
    resume_from: str = ""

    @classmethod
    def from_user_config(cls, user_config: Mapping[str, Any]) -> FlowerOptions:
        """The options in a Flower run config (other keys ignored). Raises ConfigError naming a bad value
        (also a ``poll-interval`` outside 0.01..60 s or not below ``round-timeout``)."""
        data = {normal_key(str(k)): v for k, v in user_config.items()}
        out = {}
        for k, lo, kind in (("round_timeout", 0.0, float), ("min_replies", 1, int), ("round_retries", 0, int),
                            ("wait_nodes", 0.0, float), ("poll_interval", 0.0, float)):
            if k not in data:
                continue
            v = data[k]
            ok = (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
                  and (kind is float or float(v).is_integer()))
            positive = k in ("round_timeout", "poll_interval")
            if not ok or v < lo or (positive and v <= 0):
                need = "a number of seconds > 0" if positive else f"a {'whole ' if kind is int else ''}" \
                       f"number >= {lo}"
                if isinstance(v, float) and not math.isfinite(v):
                    need += " (not NaN or infinity)"
                raise ConfigError(f"Flower run config: {k.replace('_', '-')}={v!r}; give {need}")
            out[k] = kind(v)
        poll, timeout = out.get("poll_interval", cls.poll_interval), out.get("round_timeout", cls.round_timeout)
        if "poll_interval" in out and not 0.01 <= poll <= 60:
            raise ConfigError(f"Flower run config: poll-interval={data['poll_interval']!r}; give seconds between "
                              "0.01 and 60 (default 0.2): shorter floods the SuperLink with pulls, longer delays every "
                              "round")
        if poll >= timeout:
            raise ConfigError(f"Flower run config: poll-interval={poll:g} is not below round-timeout={timeout:g}; "
                              "every round would last the whole round-timeout: the replies are pulled only at its end; "
                              f"give a poll-interval below {timeout:g} (default 0.2) or a longer round-timeout")
        if "class_names" in data:
            names = data["class_names"]
            if not isinstance(names, str) or not names.strip():
                raise ConfigError(f"Flower run config: class-names={names!r}; give the names comma-separated, e.g. "
                                  "\"cat,dog,bird\"")
            out["class_names"] = tuple(n.strip() for n in names.split(","))
        if "resume_from" in data:  # "" (the apps' default, so that flwr run --run-config may set it): a new run
            v = data["resume_from"]
            if not isinstance(v, str):
                raise ConfigError(f"Flower run config: resume-from={v!r}; give the run folder of the interrupted run, "
                                  "e.g. resume-from=\"runs/fedproto-custom-m3-s1234-run42\" (\"\": a new run)")
            out["resume_from"] = v.strip()
        return cls(**out)


FLOWER_KEYS = ("round_timeout", "min_replies", "round_retries", "wait_nodes", "class_names", "resume_from",
               "poll_interval")
"""Run config keys read by :class:`FlowerOptions` rather than :class:`RunConfig`."""


def run_config(user_config: Mapping[str, Any], node_overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """The :class:`RunConfig` of a Flower run config (``[tool.flwr.app.config]`` / ``--run-config``).

    Keys are RunConfig option names; ``-`` may stand for ``_`` (Flower's own style, e.g.
    ``local-epochs``); the keys of :class:`FlowerOptions` are left out. With ``dataset =
    "custom"`` (nodes bring their own data and models: :mod:`fedproto.flower.node`) ``model``
    is ``custom``. ``node_overrides`` (a node's ``data-dir``) are applied last and are
    result-neutral. Raises :class:`ConfigError` naming unknown keys or invalid values, and for
    ``dp_reproducible_noise`` (DP noise the server could regenerate from the seed it sets).
    """
    data = {normal_key(str(k)): v for k, v in user_config.items() if normal_key(str(k)) not in FLOWER_KEYS}
    if data.get("dataset") == "custom":
        data.setdefault("model", "custom")
    data.update(node_overrides or {})
    try:
        cfg = build_config(None, data)
    except ConfigError as e:
        raise e.prefixed("Flower run config: ") from None
    if cfg.dp_reproducible_noise:
        raise ConfigError(f"Flower run config: {opt('dp_reproducible_noise', True)} draws the DP noise from the run's "
                          "seed, which the server sets, so the server could subtract it; it is for simulations only",
                          option="dp_reproducible_noise", value=True,
                          hint=f"leave it out ({opt('dp_reproducible_noise', False)})")
    return cfg

