"""Flower records <-> fedproto messages and run options (shared by the ClientApp and ServerApp).

Raises ImportError with the install command when ``flwr`` is missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

try:
    from flwr.app import Array, ArrayRecord
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the Flower app needs the flwr package, which is not installed: pip install \"fedproto[flower]\""
    ) from e

from fedproto.algorithms.base import Message
from fedproto.config import RunConfig, build_config, normal_key
from fedproto.errors import ConfigError

MESSAGE = "fedproto.message"
"""RecordDict key of the algorithm message (an ArrayRecord) in both directions."""
CONFIG = "fedproto.config"
"""RecordDict key of the ConfigRecord with ``round`` and ``cid`` (server -> client)."""
METRICS = "fedproto.metrics"
"""RecordDict key of the MetricRecord a client returns (train losses or evaluation metrics)."""
QUERY = "query"
"""Message type the ServerApp sends once to learn each node's client id (``partition-id``)."""


def to_record(msg: Message) -> ArrayRecord:
    """A message as an :class:`ArrayRecord` (one Array per key; dtype and shape kept, 0-d included)."""
    return ArrayRecord({k: Array(np.asarray(v).copy(order="C")) for k, v in msg.items()})


def from_record(rec: ArrayRecord) -> Message:
    """Inverse of :func:`to_record`."""
    return {k: a.numpy() for k, a in rec.items()}


def run_config(user_config: Mapping[str, Any], node_overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """The :class:`RunConfig` of a Flower run config (``[tool.flwr.app.config]`` / ``--run-config``).

    Keys are RunConfig option names; ``-`` may stand for ``_`` (Flower's own style, e.g.
    ``local-epochs``). ``node_overrides`` (a node's ``data-dir``) are applied last and are
    result-neutral. Raises :class:`ConfigError` naming unknown keys or invalid values.
    """
    data = {normal_key(str(k)): v for k, v in user_config.items()}
    data.update(node_overrides or {})
    try:
        return build_config(None, data)
    except ConfigError as e:
        raise e.prefixed("Flower run config: ") from None

