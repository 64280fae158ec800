"""Validated run configuration: defaults < TOML file (``--config``) < command-line flags.

Every value is checked before any training starts; errors are :class:`fedproto.errors.ConfigError`
naming the field, the bad value and what is allowed. The options are declared in
:mod:`fedproto.config.fields` and checked in :mod:`fedproto.config.common_options`; this module composes
them with every method's own options (:class:`RunConfig`, :func:`config_model`) and reads TOML
files (:func:`build_config`). See docs/architecture.md, "Module map".
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fedproto.config.common_options import NAME_ABBREV, CommonConfig, result_fields_in
from fedproto.config.fields import ADDED_FIELDS, DATASETS, RESULT_NEUTRAL, CommonFields
from fedproto.config.fixes import bound_fix, pattern_message, toml_value
from fedproto.errors import NO_VALUE, UNKNOWN, ConfigError, opt, register_option_names, same_value

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def result_fields(cfg: dict) -> dict[str, Any]:
    """The fields of a config dict that can change a run's numbers
    (:func:`fedproto.config.common_options.result_fields_in` over the options in force, :func:`config_model`).
    Used to decide whether a checkpoint may be resumed and whether a reproduce cell is already done."""
    return result_fields_in(cfg, config_model().model_fields)


def _compose(name: str, bases: tuple[type, ...]) -> type:
    """A pydantic model of the given bases (their fields and validators), as :data:`RunConfig` is."""
    from pydantic import create_model

    return create_model(name, __base__=bases, __module__=__name__)


def _builtin_options() -> tuple[type, ...]:
    from fedproto.algorithms.method_options import BUILTIN_OPTIONS

    seen: list[type] = []
    for o in BUILTIN_OPTIONS.values():  # one base per options class (several methods share one)
        if o not in seen and not any(issubclass(s_, o) for s_ in seen):
            seen = [s_ for s_ in seen if not issubclass(o, s_)] + [o]
    return tuple(seen)


RunConfig = _compose("RunConfig", (*_builtin_options(), CommonConfig))
RunConfig.__doc__ = """One run: the common options (:class:`CommonConfig`) and every method's own
(:mod:`fedproto.algorithms.method_options`), validated together. Build it with :func:`build_config`
(defaults < TOML file < overrides); :func:`config_model` adds the options of algorithm plug-ins.
Defaults are the paper's MNIST setting (§Experiments, app. A)."""



_MODELS: dict[int, type[RunConfig]] = {}


FLOWER_KEYS = ("round_timeout", "min_replies", "round_retries", "wait_nodes", "class_names", "resume_from",
               "poll_interval")
"""Keys of a Flower run config that are no run option (:class:`fedproto.flower.records.FlowerOptions`;
kept equal to ``fedproto.flower.records.FLOWER_KEYS`` by a test)."""


def taken_names() -> dict[str, str]:
    """The names a plug-in's option may not have, and why: the run options, their aliases and
    their off switches (``no_<boolean>``), and the Flower run config's own keys."""
    taken = {f: "is a fedproto option" for f in RunConfig.model_fields}
    taken.update({a: f"is another spelling of fedproto's option {f!r}" for a, f in KEY_ALIASES.items()})
    taken.update({f"no_{f}": f"is the off switch of fedproto's option {f!r} (--no-{f.replace('_', '-')})"
                  for f, info in RunConfig.model_fields.items() if info.annotation is bool})
    taken.update({k: "is a key of the Flower run config (FlowerOptions)" for k in FLOWER_KEYS})
    return taken


def config_model() -> type[RunConfig]:
    """The run options in force: :class:`RunConfig`, plus the ``Options`` of every algorithm
    registered from outside the library (:mod:`fedproto.plugins`) as a subclass of it
    (so a config is still a RunConfig). Flags, TOML keys, keywords and the options page come from
    its fields; rebuilt when a registration adds options.

    Raises:
        ConfigError: a plug-in's option has the name of another option (names both).
    """
    from fedproto.plugins import own_fields, plugin_options, version

    plugins = plugin_options()
    key = version()
    if key not in _MODELS:
        # a plug-in that subclasses a library method shares its options (already RunConfig's)
        plugins = [(n, o) for n, o in plugins if not issubclass(RunConfig, o)]
        for name, opts in plugins:  # registered before this module was imported: not checked then
            bad = sorted(k for k in own_fields(opts) if k in taken_names())
            if bad:
                from fedproto.plugins import unregister

                unregister(name)  # one bad plug-in must not break the runs of every algorithm
                raise ConfigError(f"algorithm {name!r} declares the option {bad[0]!r}, which "
                                  f"{taken_names()[bad[0]]}; rename it (e.g. with the algorithm's name as prefix); "
                                  f"{name!r} is unregistered")
        if not plugins:
            _MODELS[key] = RunConfig
        else:
            seen = {k: "fedproto" for k in RunConfig.model_fields}
            for name, opts in plugins:
                for k in sorted(own_fields(opts)):
                    if k in seen:
                        other = "is a fedproto option" if seen[k] == "fedproto" else f"algorithm {seen[k]!r} declares"
                        raise ConfigError(f"algorithm {name!r} declares the option {k!r}, which {other}; rename it "
                                          "(e.g. with the algorithm's name as prefix)")
                    seen[k] = name
            from pydantic import create_model

            bases = [RunConfig]
            for _, o in plugins:  # once each (plug-ins may share an options class)
                if not any(issubclass(b, o) for b in bases):
                    bases.append(o)
            model = create_model("RunConfig", __base__=tuple(bases), __module__=__name__)
            model.__reduce__ = _reduce  # pickled by value: it is not fedproto.config.run_config.RunConfig
            _MODELS[key] = model
    return _MODELS[key]


def _reduce(cfg: RunConfig) -> tuple:
    """How a config of a composed model (:func:`config_model` with plug-ins) pickles: the plug-in
    classes with options (by reference: their modules are imported where it is unpickled) and the
    values, so a spawned process (``reproduce --jobs``, ``--workers``) rebuilds it with
    :func:`rebuild_config`."""
    from fedproto.plugins import PLUGINS

    used = tuple(c for c in PLUGINS.values() if getattr(c, "Options", None) is not None)
    return rebuild_config, (used, dict(cfg), tuple(cfg.model_fields_set))


def rebuild_config(classes: tuple, values: dict[str, Any], given: tuple[str, ...] = ()) -> RunConfig:
    """A config pickled by a process where plug-ins with options were registered, in another
    process: registers those plug-ins that are missing there (:func:`fedproto.plugins.register`;
    an installed one is usually loaded already), then builds the config of :func:`config_model`
    from ``values`` as they were (already validated: not checked again).

    Args:
        classes: the algorithm classes with options registered where the config was pickled.
        values: the config's fields. given: the fields that were set (``model_fields_set``).
    Returns:
        The config (a :class:`RunConfig`).
    Raises:
        ConfigError: a plug-in cannot be registered here (:func:`fedproto.plugins.register`).
    """
    from fedproto.plugins import PLUGINS, load_plugins, register

    load_plugins()
    for cls in classes:
        if PLUGINS.get(cls.name) is not cls:
            register(cls)
    model = config_model()
    fields = {k: v for k, v in values.items() if k in model.model_fields}
    return model.model_construct(_fields_set={k for k in given if k in fields}, **fields)


def _format(key: str, value: Any, file: Path) -> str:
    """A value read from a TOML file, named as the user wrote it: ``rounds = "3" in 'run.toml'``."""
    return f"{key} = {toml_value(value)} in {str(file)!r}"


def _config_error(err: ValidationError, from_file: dict[str, tuple[str, Any]] | None = None,
                  file: Path | None = None) -> ConfigError:
    """One ConfigError for all problems pydantic found: the option, the value and the hint of
    the first, the messages of all (option references kept for each front end to word).

    ``from_file`` maps the fields whose value came from the TOML ``file`` (not overridden) to
    (the key as written there, the value read): those values are named as the TOML line, not as
    a flag."""
    from_file = from_file or {}

    def where(option: str, value: Any) -> str | None:  # a reference to a value read from the file
        if option in from_file and value is not NO_VALUE and same_value(value, from_file[option][1]):
            return _format(from_file[option][0], from_file[option][1], file)
        return None

    lines = []
    first: dict[str, Any] = {}
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigError):
            cause = cause.rewritten(where)
            lines.append(cause.message if not cause.hint else f"{cause.message}; {cause.hint}")
            first = first or {"option": cause.option, "value": cause.value}
        elif e["type"] == "extra_forbidden":
            key, place = (from_file[loc][0], f" in {str(file)!r}") if loc in from_file else (loc, "")
            lines.append(f"unknown option {key!r}{place}" + opt(UNKNOWN + key))
            first = first or {"option": loc, "value": e.get("input")}
        elif "input" in e and e["loc"]:
            in_file = where(loc, e["input"])
            ref = in_file or opt(loc, e["input"])
            fix = bound_fix(loc, e, from_file[loc][0] if in_file else None)
            lines.append(f"{ref}: {pattern_message(e)}{fix}")
            first = first or {"option": loc, "value": e["input"]}
        else:
            lines.append(e["msg"].removeprefix("Value error, "))
    causes = [(e.get("ctx") or {}).get("error") for e in err.errors()]
    if len(causes) == 1 and isinstance(causes[0], ConfigError):
        c = causes[0].rewritten(where)
        return ConfigError(f"invalid configuration: {c.message}", option=c.option, value=c.value, hint=c.hint)
    return ConfigError("invalid configuration: " + "; ".join(lines), **first)


def _aliases() -> dict[str, str]:
    """Each alias -> its field, from the fields' ``json_schema_extra["aliases"]`` (as
    :func:`fedproto.config.run_options.aliases` reads them; config does not import options, options imports config)."""
    out = {}
    for name, info in RunConfig.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        out.update({a: name for a in extra.get("aliases", ())})
    return out


register_option_names(lambda: config_model().model_fields)  # the plug-ins' options too


KEY_ALIASES = _aliases()
"""Other names accepted for options in TOML files, ``--set`` and Flower run configs (each field's
``json_schema_extra["aliases"]``): ``lambda`` for ``lambda_proto``; ``-`` may stand for ``_``."""


def _register_name_check() -> None:
    """Let :func:`fedproto.plugins.register` refuse a plug-in option named like a run option."""
    from fedproto import plugins

    if taken_names not in plugins.NAME_CHECKS:
        plugins.NAME_CHECKS.append(taken_names)


_register_name_check()


def normal_key(key: str) -> str:
    """An option name as a RunConfig field: ``-`` read as ``_``, :data:`KEY_ALIASES` applied."""
    key = key.replace("-", "_") if isinstance(key, str) else key
    return KEY_ALIASES.get(key, key)


def _normal_keys(data: dict[str, Any], file: Path | None = None,
                 given: dict[str, str] | None = None) -> dict[str, Any]:
    """Option names with ``-`` read as ``_`` and :data:`KEY_ALIASES` applied; a name given twice
    that way is a ConfigError. ``given`` (when passed) receives each field's name as written."""
    out: dict[str, Any] = {}
    given = {} if given is None else given
    for k, v in data.items():
        key = normal_key(k)
        if key in out:
            where = f" in {str(file)!r}" if file else ""
            raise ConfigError(f"option {key!r} is given twice{where} (as {given[key]!r} and {k!r}); keep one")
        out[key], given[key] = v, k
    return out


def _plain(value: Any) -> Any:
    """An override as the Python value it stands for: a Path as its string, a numpy scalar
    (``np.int64(3)``, ``np.float32(0.1)``, ``np.bool_(True)``) as the Python int, float or bool it holds."""
    if isinstance(value, Path):
        return str(value)
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == () and hasattr(value, "item"):
        return value.item()  # np.bool_ -> bool, np.integer -> int, np.floating -> float
    return value


def build_config(file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Merge defaults, an optional TOML file and overrides (None values are ignored).

    TOML keys are the field names of :class:`RunConfig`, at the top level or under a ``[run]``
    table (both may be used in one file; only the same key in both places is refused); ``-`` may
    stand for ``_`` and ``lambda`` for ``lambda_proto`` (:data:`KEY_ALIASES`). Numpy scalars among the
    overrides are read as the Python numbers they hold (``np.int64(3)`` as ``3``; a bool stays a bool).

    Raises:
        ConfigError: missing/unreadable/invalid TOML, unknown keys, a key given twice, or invalid
            values.
    """
    if isinstance(file, dict):
        raise ConfigError("build_config's first argument is a TOML file path; pass options as "
                          "build_config(overrides={...})")
    if overrides is not None and not isinstance(overrides, dict):
        raise ConfigError(f"overrides must be a dict of option names to values, not a {type(overrides).__name__}")
    overrides = {k: _plain(v) for k, v in (overrides or {}).items() if v is not None}
    data: dict[str, Any] = {}
    if file is not None:
        p = Path(file)
        if not p.is_file():
            what = "is not a regular file" if p.exists() else "does not exist"
            raise ConfigError(f"config file {str(p)!r} {what}", hint="pass an existing TOML file")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8-sig"))  # a leading BOM is not an error
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}",
                              hint="write each option as key = value, one per line (strings in quotes: model = "
                              "\"cnn\", numbers bare: rounds = 3, lr = 0.05), and fix the line named") from None
        if "run" in data and isinstance(data["run"], dict):
            top = {k: v for k, v in data.items() if k != "run"}
            both = sorted(set(_normal_keys(top, p)) & set(_normal_keys(data["run"], p)))
            if both:
                raise ConfigError(f"config file {str(p)!r} sets {', '.join(both)} both at the top level and under "
                                  "[run]; keep one")
            data = {**top, **data["run"]}
        written: dict[str, str] = {}
        data = _normal_keys(data, p, written)
        from_file = {k: (written[k], v) for k, v in data.items()}
    else:
        from_file, p = {}, None
    for k, v in _normal_keys(overrides or {}).items():
        if v is not None:
            data[k] = v
            from_file.pop(k, None)
    try:
        return config_model()(**data)
    except ValidationError as e:
        raise _config_error(e, from_file, p) from None


__all__ = ["ADDED_FIELDS", "DATASETS", "FLOWER_KEYS", "KEY_ALIASES", "NAME_ABBREV", "RESULT_NEUTRAL", "CommonConfig",
           "CommonFields", "RunConfig", "build_config", "config_model", "normal_key", "rebuild_config", "result_fields",
           "taken_names", "toml_value"]
