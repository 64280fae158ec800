"""Algorithms from outside the library: the ``fedproto.algorithms`` entry-point group and run-time
registration.

A package adds an algorithm with one entry in its ``pyproject.toml``::

    [project.entry-points."fedproto.algorithms"]
    myproto = "mypackage.myproto:MyProto"

where ``MyProto`` subclasses :class:`fedproto.algorithms.algorithm.Algorithm` with ``name = "myproto"``
and, for options of its own, an ``Options`` class (a :class:`AlgorithmOptions`, i.e. a pydantic
model whose fields have defaults and descriptions). Those fields become ``fedproto run`` flags,
TOML keys, ``federate(...)`` keywords and Flower run-config keys, exactly as the library's own
options (:func:`fedproto.config.run_config.config_model`); ``algorithm = "myproto"`` selects it. The same
works at run time with :func:`register` (e.g. in a notebook or a test).

Plug-ins are loaded once, the first time an algorithm or the option set is looked up; a plug-in
that fails to load, or whose name or ``Options`` :func:`register` refuses, is logged and skipped,
so it cannot break the built-in methods.

The library's own methods are declared the same way, in fedproto's own ``pyproject.toml``
(:func:`builtin_entry_points`); their names are read from the package metadata without loading
them (``fedproto --help`` imports no torch) and their classes are imported on first use. They do
not depend on :data:`NO_ENTRY_POINTS` nor on :func:`scope`: both leave out the other
distributions' entry points only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict

log = logging.getLogger(__name__)

GROUP = "fedproto.algorithms"
"""The entry-point group third-party algorithms are declared in."""

NO_ENTRY_POINTS = "FEDPROTO_NO_ENTRY_POINTS"
"""Environment variable: ``1`` leaves the installed plug-ins unloaded in this process and the
processes it starts (the library's test suite sets it, with :func:`scope`)."""

LIBRARY_OPTIONS = "fedproto.algorithms.method_options"
"""The module of the library's own options models (a plug-in's Options may derive from them)."""


class AlgorithmOptions(BaseModel):
    """Base of an algorithm's own options: a pydantic model whose fields (each with a default and a
    ``description``) join the run options. Validated as the run options are (strict types, no
    NaN); field names must not clash with another option's."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


_loaded = False
_version = 0
"""Bumped on every registration that adds options (the option set is rebuilt then)."""

NAME_CHECKS: list = []
"""Functions returning ``{name: why it is taken}`` for the names a plug-in's options may not use:
:mod:`fedproto.config.run_config` adds the run options' names, aliases and off switches when it is imported
(this module sits below it and imports nothing of the package; :func:`fedproto.config.run_config.config_model`
checks every plug-in again when it composes the run options)."""

CLI_NAMES = ("config", "resume", "quiet", "help")
"""Parameters of ``fedproto run`` that are no run option (no plug-in option may take their names)."""

PLUGINS: dict[str, Any] = {}
BROKEN: dict[str, str] = {}
"""Installed plug-ins (entry-point name) that could not be loaded, and why (``Type: message``)."""
"""Algorithm classes registered from outside the library, by name (:func:`register`)."""



def _pyproject_entry_points() -> list[tuple[str, str]]:
    """The :data:`GROUP` entries of fedproto's ``pyproject.toml`` beside the sources (a source tree);
    [] where there is none (an installed wheel) or it cannot be read."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        import tomllib
    except ImportError:  # Python 3.10: no TOML reader in the standard library
        return []
    try:
        project = tomllib.loads(path.read_text(encoding="utf-8")).get("project", {})
    except (OSError, ValueError):
        return []
    if project.get("name") != "fedproto":
        return []
    return list(project.get("entry-points", {}).get(GROUP, {}).items())


def builtin_entry_points() -> list[tuple[str, str]]:
    """``(name, "module:Class")`` of the library's own methods: the :data:`GROUP` entry points of
    fedproto's own ``pyproject.toml``, read without importing anything. In a source tree (the file
    beside the sources, e.g. an editable install) from that file, in its order (also when the
    installed metadata is older than the file); else from the installed distribution's metadata
    (where setuptools writes them in alphabetical order).

    Raises:
        RuntimeError: neither declares any method (fedproto's metadata is broken: reinstall it with
            ``pip install -e .`` in its folder).
    """
    from importlib.metadata import PackageNotFoundError, distribution

    found = _pyproject_entry_points()
    if not found:
        try:
            found = [(ep.name, ep.value) for ep in distribution("fedproto").entry_points if ep.group == GROUP]
        except PackageNotFoundError:
            found = []
    if not found:
        raise RuntimeError(f"fedproto's package metadata declares no method in the {GROUP!r} entry-point group; "
                           "reinstall fedproto (pip install -e . in its folder, or pip install fedproto)")
    return found


BUILTIN_ENTRY_POINTS = tuple(builtin_entry_points())
"""``(name, "module:Class")`` of the library's methods (:func:`builtin_entry_points`)."""

BUILTIN = tuple(name for name, _ in BUILTIN_ENTRY_POINTS)
"""The library's own methods (:data:`fedproto.algorithms.ALGORITHMS`), by name, in declaration order."""


def version() -> int:
    """A number that changes whenever a registration changed the set of options."""
    return _version


LEGACY_HOOKS = ("round_metrics", "server_state", "server_state_keys", "load_server_state", "write_results")
"""Side-attribute hooks of an older server API that the engine no longer reads: metrics, the
checkpoint and run-folder files now come back from ``aggregate`` in one ``ServerState``."""


def register(cls: Any) -> None:
    """Register an algorithm class under ``cls.name`` (a second registration of a name replaces
    the first, e.g. a notebook cell run again).

    Raises:
        ConfigError: ``cls`` has no ``name``, the name is one of the library's methods or not
            lowercase letters, digits, ``-`` and ``_``, or its
            ``Options`` is not an :class:`AlgorithmOptions` subclass, changes its ``model_config``,
            has a field without a default or with a default its own Field refuses (type or bound,
            an inherited option's new default too), redeclares an inherited option (``lambda_proto``
            of a ``FedProto`` subclass) with another type, or has a field another option (or its
            alias, its off switch, a Flower run-config key, a flag of ``fedproto run``) already has (fields inherited
            from a library method's options, e.g. by subclassing ``FedProto``, are shared, not a clash).
    """
    from fedproto.errors import ConfigError

    global _version
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or name == "base":
        raise ConfigError(f"{cls!r} has no name: give the algorithm class a name = \"...\" attribute")
    if name in BUILTIN:
        raise ConfigError(f"algorithm name {name!r} is one of fedproto's own methods; give yours another name")
    if not re.fullmatch(r"[a-z][a-z0-9_-]*", name):
        raise ConfigError(f"algorithm name {name!r} must be lowercase letters, digits, '-' and '_', starting with a "
                          "letter (it is typed after --algorithm and starts run folder names), e.g. "
                          f"{re.sub(r'[^a-z0-9_-]+', '_', name.lower()).strip('_') or 'myalgo'!r}")
    legacy = [h for h in LEGACY_HOOKS if hasattr(cls, h)]
    if legacy:
        raise ConfigError(f"algorithm {name!r} defines {', '.join(legacy)}, which fedproto no longer reads (its "
                          "metrics or checkpoint would be lost): return ServerState(message, metrics=..., "
                          "checkpoint=..., files=...) from aggregate instead (docs/architecture.md)")
    options = getattr(cls, "Options", None)
    if options is not None:
        _check_options(name, options)
    PLUGINS[name] = cls
    _version += 1


def own_fields(options: type[BaseModel]) -> set[str]:
    """The fields of a plug-in's ``options`` that are its own: all but those it inherits from the
    library's option classes (:mod:`fedproto.algorithms.method_options`; a subclass of ``FedProto``
    inherits ``FedProtoOptions``), which the run options already have."""
    shared: set[str] = set()
    for base in options.__mro__:
        if isinstance(base, type) and issubclass(base, BaseModel) and base.__module__ == LIBRARY_OPTIONS:
            shared |= set(base.model_fields)
    return set(options.model_fields) - shared


def _check_inherited_types(name: str, options: type[BaseModel], mine: set[str]) -> None:
    """Refuse an option inherited from a library method's options (``lambda_proto`` of a ``FedProto``
    subclass) redeclared with another type: the run option keeps the library's type, so values valid
    for it (``lambda_proto=0.5``) would fail the plug-in's narrower one at set-up."""
    from fedproto.errors import ConfigError

    for k, field in options.model_fields.items():
        if k in mine:
            continue
        for base in options.__mro__:
            lib = getattr(base, "model_fields", {}).get(k) if base.__module__ == LIBRARY_OPTIONS else None
            if lib is not None and field.annotation != lib.annotation:
                want, got = (a.__name__ if isinstance(a, type) else str(a).replace("typing.", "")
                             for a in (lib.annotation, field.annotation))
                raise ConfigError(f"algorithm {name!r} redeclares the option {k!r} as {got}, but {base.__name__} "
                                  f"declares it as {want} (every method shares one {k!r}); keep its type: "
                                  f"{k}: {want} = Field(<default>, ...)")
            if lib is not None:
                break


def _check_options(name: str, options: Any) -> None:
    """Refuse ``options`` that would break every run once they join the run options (a plug-in
    loaded from an entry point is then skipped with a warning instead)."""
    from fedproto.errors import ConfigError

    if not (isinstance(options, type) and issubclass(options, AlgorithmOptions)):
        raise ConfigError(f"{name}.Options is {options!r}: it must be a fedproto.plugins.AlgorithmOptions subclass "
                          "(class Options(AlgorithmOptions): ...)")
    for key, want in AlgorithmOptions.model_config.items():
        if options.model_config.get(key) != want:
            raise ConfigError(f"{name}.Options sets model_config {key}={options.model_config.get(key)!r}; the run "
                              f"options need {key}={want!r} (remove it from the Options' model_config)")
    mine = own_fields(options)
    for k, field in options.model_fields.items():
        if k in mine and field.is_required():
            raise ConfigError(f"option {k!r} of algorithm {name!r} has no default; give it one "
                              f"({k}: ... = Field(<default>, description=...)): every run has all options")
    _check_inherited_types(name, options, mine)
    given = {k: f.default for k, f in options.model_fields.items() if f.default_factory is None}
    try:  # a default its own Field refuses (type or bound; an inherited option's new default too) would break
        options(**given)  # this algorithm's runs, blaming the user for a flag never typed
    except ValueError as e:  # pydantic's ValidationError
        err = e.errors()[0] if hasattr(e, "errors") else {"loc": ("?",), "input": "?", "msg": str(e)}
        raise ConfigError(f"option {err['loc'][0]!r} of algorithm {name!r} has the default {err['input']!r}: "
                          f"{err['msg']}; fix its Field default") from None
    taken = {k: f"is a flag of fedproto run (--{k})" for k in CLI_NAMES}
    for check in NAME_CHECKS:  # the run options' names (fedproto.config.run_config adds its check when imported)
        taken.update(check())
    for k in sorted(mine):
        if k in taken:
            raise ConfigError(f"algorithm {name!r} declares the option {k!r}, which {taken[k]}; rename it (e.g. with "
                              "the algorithm's name as prefix)")
        for other, ocls in PLUGINS.items():
            oopts = getattr(ocls, "Options", None)
            if other != name and oopts is not None and k in own_fields(oopts):
                raise ConfigError(f"algorithm {name!r} declares the option {k!r}, which algorithm {other!r} declares; "
                                  "rename it (e.g. with the algorithm's name as prefix)")


def unregister(name: str) -> None:
    """Remove the plug-in registered as ``name`` (and its options); nothing if there is none."""
    global _version
    if PLUGINS.pop(name, None) is not None:
        _version += 1


def load_plugins() -> None:
    """Register the algorithms of the ``fedproto.algorithms`` entry-point group that other
    distributions declare (once per process; the library's own are :data:`BUILTIN`)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    if os.environ.get(NO_ENTRY_POINTS) == "1":
        return
    from importlib.metadata import entry_points

    own = set(BUILTIN_ENTRY_POINTS)
    for ep in entry_points(group=GROUP):
        if (ep.name, ep.value) in own:  # fedproto's own declaration of a built-in
            continue
        try:
            register(ep.load())
        except Exception as e:  # a broken plug-in must not break the library's own methods
            BROKEN[ep.name] = f"{ep.value}: {type(e).__name__}: {e}"
            log.warning("algorithm plug-in %r (%s) could not be loaded: %s: %s", ep.name, ep.value,
                        type(e).__name__, e)


@contextlib.contextmanager
def scope(entry_points: bool = False) -> Iterator[None]:
    """A registry of its own for a block of code: the library's methods, the algorithms
    :func:`register` ed inside the block and, only with ``entry_points``, the installed plug-ins
    (the ``fedproto.algorithms`` group); the registry as it was comes back afterwards. The
    library's test suite runs inside ``scope()``, so an installed plug-in package changes none of
    its results (no option, flag or name of a plug-in appears in them)."""
    global _loaded, _version
    saved, was_loaded, broken = dict(PLUGINS), _loaded, dict(BROKEN)
    PLUGINS.clear()
    BROKEN.clear()
    _loaded = not entry_points
    _version += 1
    try:
        yield
    finally:
        PLUGINS.clear()
        PLUGINS.update(saved)
        BROKEN.clear()
        BROKEN.update(broken)
        _loaded = was_loaded
        _version += 1


def unknown_algorithm(name: str):
    """The :class:`~fedproto.errors.ConfigError` for an ``algorithm`` that is not registered: it
    lists the names there are, and for an installed plug-in that failed to load (:data:`BROKEN`)
    says so with the reason instead of calling the name unknown."""
    from fedproto.errors import ConfigError

    if name in BROKEN:
        return ConfigError(f"algorithm {name!r} is an installed plug-in that could not be loaded ({BROKEN[name]})",
                           option="algorithm", value=name,
                           hint="fix or reinstall the package that declares it (entry-point group "
                                f"{GROUP!r}), or choose one of {', '.join(algorithm_names())}")
    import difflib

    near = difflib.get_close_matches(str(name), algorithm_names(), n=1)
    return ConfigError(f"unknown algorithm {name!r}", option="algorithm", value=name,
                       hint=(f"did you mean {near[0]!r}? " if near else "")
                       + f"choose one of {', '.join(algorithm_names())}")


def algorithm_names() -> list[str]:
    """Every algorithm name: the library's methods, then the plug-ins."""
    load_plugins()
    return [*BUILTIN, *PLUGINS]


_METHOD_OPTIONS: dict[type, Any] = {}


def method_options(cls: Any) -> type[AlgorithmOptions] | None:
    """The options an algorithm class reads, declared once per method: the ``Options`` of ``cls``
    and of every method it subclasses (a subclass inherits the code that reads its parent's options:
    ``class MyProto(FedProto)`` with ``Options = MyOptions`` reads λ as FedProto does), merged into
    one class when ``cls.Options`` does not already subclass them. Run names, the resume check,
    the "ignored option" warning and ``self.options`` all come from it
    (:func:`fedproto.algorithms.method_options.owners`). None: the class declares no options."""
    if cls in _METHOD_OPTIONS:
        return _METHOD_OPTIONS[cls]
    found: list[type] = []
    for k in getattr(cls, "__mro__", ()):
        o = k.__dict__.get("Options")
        if isinstance(o, type) and issubclass(o, BaseModel) and not any(issubclass(b, o) for b in found):
            found.append(o)
    if not found:
        out = None
    elif len(found) == 1:
        out = found[0]
    else:
        out = type(f"{cls.__name__}Options", tuple(found), {"__module__": __name__,
                                                             "__doc__": f"The options {cls.__name__} reads."})
    _METHOD_OPTIONS[cls] = out
    return out


def plugin_options() -> list[tuple[str, type[BaseModel]]]:
    """(name, ``Options``) of the plug-ins that have options, in registration order."""
    load_plugins()
    return [(n, cls.Options) for n, cls in PLUGINS.items() if getattr(cls, "Options", None) is not None]
