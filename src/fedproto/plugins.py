"""Algorithms from outside the library: the ``fedproto.algorithms`` entry-point group and run-time
registration.

A package adds an algorithm with one entry in its ``pyproject.toml``::

    [project.entry-points."fedproto.algorithms"]
    myproto = "mypackage.myproto:MyProto"

where ``MyProto`` subclasses :class:`fedproto.algorithms.base.Algorithm` with ``name = "myproto"``
and, for options of its own, an ``Options`` class (a :class:`AlgorithmOptions`, i.e. a pydantic
model whose fields have defaults and descriptions). Those fields become ``fedproto run`` flags,
TOML keys, ``federate(...)`` keywords and Flower run-config keys, exactly as the library's own
options (:func:`fedproto.config.config_model`); ``algorithm = "myproto"`` selects it. The same
works at run time with :func:`register` (e.g. in a notebook or a test).

Plug-ins are loaded once, the first time an algorithm or the option set is looked up; a plug-in
that fails to load is logged and skipped, so it cannot break the built-in methods.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict

log = logging.getLogger(__name__)

GROUP = "fedproto.algorithms"
"""The entry-point group third-party algorithms are declared in."""


class AlgorithmOptions(BaseModel):
    """Base of an algorithm's own options: a pydantic model whose fields (each with a default and a
    ``description``) join the run options. Validated as the run options are (strict types, no
    NaN); field names must not clash with another option's."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


_loaded = False
_version = 0
"""Bumped on every registration that adds options (the option set is rebuilt then)."""

PLUGINS: dict[str, Any] = {}
"""Algorithm classes registered from outside the library, by name (:func:`register`)."""

BUILTIN = ("fedproto", "local", "fedavg", "fedprox", "fedper", "fedrep", "fesem", "fedtgp", "fd", "fedgh", "lgfedavg")
"""The library's own methods (:data:`fedproto.algorithms.ALGORITHMS`)."""


def version() -> int:
    """A number that changes whenever a registration changed the set of options."""
    return _version


def register(cls: Any) -> None:
    """Register an algorithm class under ``cls.name`` (a second registration of a name replaces
    the first, e.g. a notebook cell run again).

    Raises:
        ConfigError: ``cls`` has no ``name``, the name is one of the library's methods, or its
            ``Options`` is not a pydantic model.
    """
    from fedproto.errors import ConfigError

    global _version
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or name == "base":
        raise ConfigError(f"{cls!r} has no name: give the algorithm class a name = \"...\" attribute")
    if name in BUILTIN:
        raise ConfigError(f"algorithm name {name!r} is one of fedproto's own methods; give yours another name")
    options = getattr(cls, "Options", None)
    if options is not None and not (isinstance(options, type) and issubclass(options, BaseModel)):
        raise ConfigError(f"{name}.Options must be a fedproto.plugins.AlgorithmOptions subclass")
    PLUGINS[name] = cls
    _version += 1


def unregister(name: str) -> None:
    """Remove the plug-in registered as ``name`` (and its options); nothing if there is none."""
    global _version
    if PLUGINS.pop(name, None) is not None:
        _version += 1


def load_plugins() -> None:
    """Register the algorithms of the ``fedproto.algorithms`` entry-point group (once per process)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=GROUP):
        try:
            register(ep.load())
        except Exception as e:  # a broken plug-in must not break the library's own methods
            log.warning("algorithm plug-in %r (%s) could not be loaded: %s: %s", ep.name, ep.value,
                        type(e).__name__, e)


def algorithm_names() -> list[str]:
    """Every algorithm name: the library's methods, then the plug-ins."""
    load_plugins()
    return [*BUILTIN, *PLUGINS]


def plugin_options() -> list[tuple[str, type[BaseModel]]]:
    """(name, ``Options``) of the plug-ins that have options, in registration order."""
    load_plugins()
    return [(n, cls.Options) for n, cls in PLUGINS.items() if getattr(cls, "Options", None) is not None]
