"""Algorithms on the shared engine. ``ALGORITHMS`` maps a name to its class; ``make_algorithm``
builds one from a :class:`~fedproto.config.RunConfig`."""

from __future__ import annotations

from fedproto.algorithms.base import Algorithm, ClientData, ClientState, Message, message_size
from fedproto.algorithms.fd import FD
from fedproto.algorithms.fedavg import FedAvg
from fedproto.algorithms.fedgh import FedGH
from fedproto.algorithms.fedper import FedPer
from fedproto.algorithms.fedproto import FedProto
from fedproto.algorithms.fedprox import FedProx
from fedproto.algorithms.fedrep import FedRep
from fedproto.algorithms.fedtgp import FedTGP
from fedproto.algorithms.fesem import FeSEM
from fedproto.algorithms.lgfedavg import LGFedAvg
from fedproto.algorithms.local import Local

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (FedProto, Local, FedAvg, FedProx, FedPer, FedRep, FeSEM,
                              FedTGP, FD, FedGH, LGFedAvg)  # issue #24: drafts of the model-heterogeneous methods
}

__all__ = ["ALGORITHMS", "FD", "Algorithm", "ClientData", "ClientState", "FeSEM", "FedAvg", "FedGH", "FedPer",
           "FedProto", "FedProx", "FedRep", "FedTGP", "LGFedAvg", "Local", "Message", "message_size"]
