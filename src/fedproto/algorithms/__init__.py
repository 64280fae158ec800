"""Algorithms on the shared engine, by name.

``ALGORITHMS`` maps the name of each of the library's methods to its class. Other algorithms are
declared in the ``fedproto.algorithms`` entry-point group or registered at run time with
:func:`register_algorithm` (:mod:`fedproto.plugins`). :func:`get_algorithm` is how
the engine finds any of them.
"""

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
                              FedTGP, FD, FedGH, LGFedAvg)  # issue #24: the model-heterogeneous methods
}


def get_algorithm(name: str) -> type[Algorithm]:
    """The algorithm class registered as ``name`` (:func:`fedproto.plugins.algorithm_names`
    lists them, plug-ins included).

    Raises:
        ConfigError: no algorithm has that name (the error lists those there are).
    """
    from fedproto.plugins import PLUGINS, algorithm_names

    names = algorithm_names()
    if name not in names:
        from fedproto.errors import ConfigError

        raise ConfigError(f"unknown algorithm {name!r}", option="algorithm", value=name,
                          hint=f"choose one of {', '.join(names)}")
    return ALGORITHMS.get(name) or PLUGINS[name]


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    """Register an algorithm class under its ``name`` (usable as a class decorator); its ``Options``
    (a :class:`fedproto.plugins.AlgorithmOptions` subclass) add flags, TOML keys and
    Python options (:func:`fedproto.plugins.register`)."""
    from fedproto.plugins import register

    register(cls)
    return cls


__all__ = ["ALGORITHMS", "FD", "Algorithm", "ClientData", "ClientState", "FeSEM", "FedAvg", "FedGH", "FedPer",
           "FedProto", "FedProx", "FedRep", "FedTGP", "LGFedAvg", "Local", "Message", "get_algorithm", "message_size",
           "register_algorithm"]
