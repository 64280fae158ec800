"""Algorithms on the shared engine. ``ALGORITHMS`` maps a name to its class; ``make_algorithm``
builds one from a :class:`~fedproto.config.RunConfig`."""

from __future__ import annotations

from fedproto.algorithms.base import Algorithm, ClientData, ClientState, Message, message_size
from fedproto.algorithms.fedavg import FedAvg
from fedproto.algorithms.fedper import FedPer
from fedproto.algorithms.fedproto import FedProto
from fedproto.algorithms.fedprox import FedProx
from fedproto.algorithms.fedrep import FedRep
from fedproto.algorithms.fesem import FeSEM
from fedproto.algorithms.local import Local

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (FedProto, Local, FedAvg, FedProx, FedPer, FedRep, FeSEM)
}

__all__ = ["ALGORITHMS", "Algorithm", "ClientData", "ClientState", "FeSEM", "FedAvg", "FedPer", "FedProto",
           "FedProx", "FedRep", "Local", "Message", "message_size"]
