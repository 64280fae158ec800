"""Algorithms on the shared engine, by name.

``ALGORITHMS`` maps the name of each of the library's methods to its class. The library's methods
are declared in the ``fedproto.algorithms`` entry-point group of fedproto's own ``pyproject.toml``
(:data:`fedproto.plugins.BUILTIN_ENTRY_POINTS`), as other packages declare theirs; algorithms are
also registered at run time with :func:`register_algorithm` (:mod:`fedproto.plugins`).
:func:`get_algorithm` is how the engine finds any of them.
"""

from __future__ import annotations

import importlib
from typing import Any

_BASE = ("Algorithm", "ClientData", "ClientState", "Message", "message_size")


def __getattr__(name: str) -> Any:
    """The method classes, the base names and ``ALGORITHMS``, imported when first asked for (the
    options of :mod:`fedproto.algorithms.method_options` are read by ``fedproto run --help`` without torch)."""
    from fedproto.plugins import BUILTIN_ENTRY_POINTS

    classes = {value.partition(":")[2]: value.partition(":")[0] for _, value in BUILTIN_ENTRY_POINTS}
    if name in classes:
        return getattr(importlib.import_module(classes[name]), name)
    if name in _BASE:
        return getattr(importlib.import_module("fedproto.algorithms.algorithm"), name)
    if name == "ALGORITHMS":
        table = {n: __getattr__(value.partition(":")[2]) for n, value in BUILTIN_ENTRY_POINTS}
        globals()["ALGORITHMS"] = table
        return table
    raise AttributeError(f"module 'fedproto.algorithms' has no attribute {name!r}")


def get_algorithm(name: str) -> Any:
    """The algorithm class registered as ``name`` (:func:`fedproto.plugins.algorithm_names`
    lists them, plug-ins included).

    Raises:
        ConfigError: no algorithm has that name (the error lists those there are).
    """
    from fedproto.plugins import PLUGINS, algorithm_names, unknown_algorithm

    if name not in algorithm_names():
        raise unknown_algorithm(name)
    return __getattr__("ALGORITHMS").get(name) or PLUGINS[name]


def register_algorithm(cls: Any) -> Any:
    """Register an algorithm class under its ``name`` (usable as a class decorator); its ``Options``
    (a :class:`fedproto.plugins.AlgorithmOptions` subclass) add flags, TOML keys and
    Python options (:func:`fedproto.plugins.register`)."""
    from fedproto.plugins import register

    register(cls)
    return cls


__all__ = ["ALGORITHMS", "FD", "Algorithm", "ClientData", "ClientState", "FeSEM", "FedAvg", "FedGH", "FedPer",
           "FedProto", "FedProx", "FedRep", "FedTGP", "LGFedAvg", "Local", "Message", "get_algorithm", "message_size",
           "register_algorithm"]
