"""Algorithms on the shared engine. ``ALGORITHMS`` maps a name to its class; ``make_algorithm``
builds one from a :class:`~fedproto.config.RunConfig`."""

from __future__ import annotations

from fedproto.algorithms.base import Algorithm, ClientData, ClientState, Message, message_size
from fedproto.algorithms.fedproto import FedProto

ALGORITHMS: dict[str, type[Algorithm]] = {"fedproto": FedProto}

__all__ = ["ALGORITHMS", "Algorithm", "ClientData", "ClientState", "FedProto", "Message", "message_size"]
