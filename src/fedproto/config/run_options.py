"""Every run option, derived from one source: the fields of :class:`~fedproto.config.run_config.RunConfig`.

A field's name is its TOML key (``-`` may stand for ``_``), its ``Field(description=...)`` is its
help text, and its type, bounds and default say the rest. From them this module builds

* the ``fedproto run`` flags (:func:`run_params`): ``--field-name``; a boolean field is a
  ``--x/--no-x`` switch; a ``Literal`` field takes one of its values;
* the options page of the docs (:func:`options_markdown`, put into ``docs/options.md`` when
  the site is built);
* how each front end names an option in an error message (:func:`cli_wording`,
  :func:`set_wording`, :func:`flower_wording`; Python keywords: :func:`fedproto.errors.python_wording`).

A field added to RunConfig appears in all of them with no further edits. Per-field extras, in
``Field(json_schema_extra=...)``: ``"flag"`` (another flag name), ``"aliases"`` (more flag and
key names), ``"off_flag"`` (the off switch of a boolean, default ``--no-<name>``), ``"python_only"``
(set from Python only: its flag is left out of ``fedproto run --help``). Each field's group (its
panel of ``--help``, its section of the options page) is :data:`PANELS`.
"""

from __future__ import annotations

import shlex
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import click
from pydantic.fields import FieldInfo

from fedproto.config.run_config import FLOWER_KEYS
from fedproto.errors import NO_VALUE, UNKNOWN, TypedFloat, suggestion, unknown_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _fields() -> dict[str, FieldInfo]:
    from fedproto.config.run_config import config_model

    return config_model().model_fields


def _extra(info: FieldInfo) -> dict[str, Any]:
    extra = info.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def base_type(annotation: Any) -> tuple[type | None, tuple]:
    """(scalar type, Literal values) of a field annotation, ``Optional`` removed.

    ``int`` -> (int, ()); ``Optional[float]`` -> (float, ()); ``Literal["a", "b"]`` -> (str, ("a", "b"));
    a type this module has no flag for (a list, a dict) -> (None, ()): its flag takes a TOML value.
    """
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return base_type(args[0]) if len(args) == 1 else (None, ())
    if origin is Literal:
        values = get_args(annotation)
        return type(values[0]), tuple(values)
    if annotation in (bool, int, float, str):
        return annotation, ()
    return None, ()


def flag(field: str) -> str:
    """The main flag of a field: ``--lambda-proto`` for ``lambda_proto``."""
    info = _fields().get(field)
    name = _extra(info).get("flag") if info is not None else None
    return name or "--" + field.replace("_", "-")


def off_flag(field: str) -> str:
    """The off switch of a boolean field: ``--no-download``, ``--keep-last`` for ``drop_last``."""
    info = _fields().get(field)
    return (_extra(info).get("off_flag") if info is not None else None) or "--no-" + field.replace("_", "-")


def aliases(field: str) -> tuple[str, ...]:
    """Other names of a field, as TOML/``--set`` keys and flags (``lambda`` for ``lambda_proto``)."""
    info = _fields().get(field)
    return tuple(_extra(info).get("aliases", ())) if info is not None else ()


def flags(field: str) -> list[str]:
    """All flags of a field, main flag first (a boolean: ``--x`` and its off switch)."""
    kind, _ = base_type(_fields()[field].annotation)
    out = [flag(field), *("--" + a.replace("_", "-") for a in aliases(field))]
    if kind is bool:
        out.append(off_flag(field))
    return out


def default_text(field: str) -> str:
    """The default as help and docs show it: the value, the dataset's values, ``on``/``off``."""
    from fedproto.config.common_options import method_defaults
    from fedproto.data.registry import PER_DATASET, per_dataset_default
    from fedproto.plugins import PLUGINS

    info = _fields()[field]
    kind, _ = base_type(info.annotation)

    def text(d: Any) -> str:
        if kind is bool:
            if "off_flag" in _extra(info):  # a pair of differently named switches: name the one in force
                return (flag(field) if d else off_flag(field)).removeprefix("--")
            return "on" if d else "off"
        return f"{d:g}" if isinstance(d, float) else str(d)

    # a plug-in's Options may give an option it inherits another default
    # (fedproto.config.common_options.method_defaults)
    own = [f"{n} {text(d[field])}" for n in PLUGINS if field in (d := method_defaults(n, _fields()))]
    if field in PER_DATASET:
        out = f"per dataset: {per_dataset_default(field)}"
    else:
        d = info.get_default()
        out = "" if d is None else text(d)
    return "; ".join([out, *own]) if own and out else ", ".join(own) if own else out


def help_text(field: str) -> str:
    """The help of a field's flag: its description and its default."""
    info = _fields()[field]
    text = (info.description or "").strip()
    d = default_text(field)
    return f"{text} (default: {d})" if d else text


def parse_value(text: str) -> Any:
    """A command-line value of a type without its own flag parser: a TOML scalar or array
    (``0.5``, ``true``, ``[1, 2]``, ``"x"``), else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


class _TomlValue(click.ParamType):
    name = "value"

    def convert(self, value, param, ctx):
        return parse_value(value) if isinstance(value, str) else value


class _Choice(click.Choice):
    """click's Choice whose refusal names the nearest choice: ``'dirichlt' is not one of ...; did
    you mean --partition dirichlet?`` (as TOML files and build_config do)."""

    def convert(self, value, param, ctx):
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter as e:
            near = suggestion(str(value), [str(c) for c in self.choices])
            if near is None or param is None or not param.opts:
                raise
            self.fail(f"{e.message.rstrip('.')}; did you mean {param.opts[0]} {near}?", param, ctx)


class _Int(click.types.IntParamType):
    """click's INT without Python's digit separators (``1_0`` is no way to write 10 on a command line)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and "_" in value:
            self.fail(f"{value!r} is not a valid integer ('_' is not allowed in numbers).", param, ctx)
        return super().convert(value, param, ctx)


class _Float(click.types.FloatParamType):
    """click's FLOAT without Python's digit separators; the value keeps its text for messages
    (:class:`fedproto.errors.TypedFloat`: ``--participation 0``, as typed)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and "_" in value:
            self.fail(f"{value!r} is not a valid float ('_' is not allowed in numbers).", param, ctx)
        out = super().convert(value, param, ctx)
        return TypedFloat.of(out, value.strip()) if isinstance(value, str) else out


_METAVAR = {int: "INT", float: "FLOAT", str: "TEXT"}


def field_option(field: str) -> click.Option:
    """The ``fedproto run`` option of one RunConfig field (default None: not given)."""
    info = _fields()[field]
    kind, choices = base_type(info.annotation)
    names = flags(field)
    hidden = bool(_extra(info).get("python_only"))  # set by fedproto.federation only: not offered by --help
    if kind is bool and not choices:
        return click.Option([field, f"{names[0]}/{names[-1]}", *names[1:-1]], default=None, help=help_text(field),
                            hidden=hidden)
    if choices:
        return click.Option([field, *names], type=_Choice([str(c) for c in choices]), default=None,
                            metavar="[" + "|".join(map(str, choices)) + "]", help=help_text(field), hidden=hidden)
    ptype = {int: _Int(), float: _Float(), str: click.STRING}.get(kind, _TomlValue())
    return click.Option([field, *names], type=ptype, default=None, metavar=_METAVAR.get(kind, "VALUE"),
                        help=help_text(field), hidden=hidden)


PANELS: dict[str, tuple[str, ...]] = {
    "Data and partition": ("dataset", "classes", "data_dir", "download", "clients", "ways", "shots", "stdev",
                           "test_shots", "overlap", "noise", "partition", "alpha", "min_client_samples", "augment"),
    "Model": ("model", "pretrained", "embedding_dim", "dropout"),
    "Method and training": ("algorithm", "rounds", "local_epochs", "participation", "batch_size", "optimizer", "lr",
                            "momentum", "weight_decay", "lr_schedule", "lr_step_rounds", "lr_gamma", "lr_min",
                            "drop_last", "freeze_after", "seed", "shared_init", "prox_mu", "personal_layers",
                            "rep_head_epochs", "fesem_clusters", "server_epochs", "server_lr", "server_batch_size",
                            "tgp_margin", "fd_lambda", "fd_temperature"),
    "FedProto": ("lambda_proto", "distance", "proto_source", "aggregation", "proto_classes", "lambda_warmup",
                 "lambda_schedule", "proto_momentum", "proto_normalize", "min_proto_samples"),
    "Robustness and privacy": ("trim", "min_contributors", "exclude_outliers", "proto_dist_alert", "class_check", "dp",
                               "dp_noise",
                               "dp_clip", "dp_grad_clip", "dp_delta", "dp_reproducible_noise", "attack", "attackers",
                               "attack_scale", "secagg", "secagg_threshold", "secagg_neighbours",
                               "secagg_honest", "secagg_min_contributors", "secagg_hide_labels"),
    "Execution": ("execution", "group_size", "threads", "workers", "device", "precision",
                  "checkpoint_every"),
    "Output": ("eval_every", "eval_full_test", "out_dir", "name", "save_models", "tensorboard"),
}
"""The groups of ``fedproto run --help`` (its panels) and of the options page (its sections), in
order, each with its RunConfig fields in order: every field is listed once (a test checks it); a
field not listed yet joins the group of the field before it in RunConfig."""

_PANEL_OF = {name: panel for panel, names in PANELS.items() for name in names}

PLUGIN_PANEL = "Algorithm plug-ins"
"""The group of the options that algorithms from outside the library declare (:mod:`fedproto.plugins`)."""


def panel(field: str) -> str:
    """The group of a RunConfig field (:data:`PANELS`); a field missing there joins the group of
    the field before it in RunConfig's order (the first group for the first field)."""
    if field in _PANEL_OF:
        return _PANEL_OF[field]
    from fedproto.config.run_config import RunConfig

    if field not in RunConfig.model_fields:  # an algorithm plug-in's own option
        return PLUGIN_PANEL
    names = list(_fields())
    before = names[: names.index(field)] if field in names else []
    return next((_PANEL_OF[n] for n in reversed(before) if n in _PANEL_OF), next(iter(PANELS)))


def grouped_fields() -> list[str]:
    """Every RunConfig field, grouped as :data:`PANELS` (groups in order, RunConfig's order within
    a group)."""
    order = {p: i for i, p in enumerate([*PANELS, PLUGIN_PANEL])}
    names = list(_fields())
    return sorted(names, key=lambda n: (order[panel(n)], names.index(n)))


def run_params() -> list[click.Option]:
    """One click option per RunConfig field, grouped as :data:`PANELS`; each option's
    ``rich_help_panel`` names its group (the panel it is listed in by ``fedproto run --help``)."""
    out = []
    for name in grouped_fields():
        option = field_option(name)
        option.rich_help_panel = panel(name)
        out.append(option)
    return out


# ------------------------------------------------------------------------------------------------
# how each front end names an option (errors carry references, see fedproto.errors.opt)





def keys() -> list[str]:
    """Every TOML / ``--set`` key: the field names, then their aliases."""
    return [*_fields(), *(a for name in _fields() for a in aliases(name))]


def _cli_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    text = str(value)
    if text.startswith("<") and text.endswith(">"):  # a placeholder, e.g. <folder>
        return text
    return shlex.quote(text)


def cli_wording(option: str, value: Any = NO_VALUE) -> str:
    """An option as a ``fedproto run`` flag: ``--shots``, ``--shots 10``, ``--keep-last``."""
    fields = _fields()
    if option.startswith(UNKNOWN):  # an unknown key of a TOML file: suggest a TOML key
        return unknown_text(option[1:], keys())
    words = []
    for name in option.split("|"):
        if name not in fields:  # an action of the command line (--resume, --config)
            words.append("--" + name.replace("_", "-"))
        elif value is NO_VALUE:
            words.append(flag(name))
        elif base_type(fields[name].annotation)[0] is bool and isinstance(value, bool):
            words.append(flag(name) if value else off_flag(name))
        else:
            words.append(f"{flag(name)} {_cli_value(value)}")
    return " / ".join(words)


REPRODUCE_OPTIONS = {"dataset": "--datasets", "ways": "--ways", "seed": "--seeds", "algorithm": "--methods",
                     "rounds": "--rounds", "data_dir": "--data-dir", "out_dir": "--out", "name": "--out",
                     "threads": "--threads"}
"""RunConfig fields that ``fedproto reproduce`` sets with an option of its own."""


def set_wording(option: str, value: Any = NO_VALUE) -> str:
    """An option as ``fedproto reproduce`` takes it: ``--set shots=10`` (or the grid's own option,
    ``--ways 3``, ``--out``)."""
    fields = _fields()
    if option.startswith(UNKNOWN):
        return unknown_text(option[1:], keys())
    words: list[str] = []
    for name in option.split("|"):
        if name in REPRODUCE_OPTIONS:
            w = REPRODUCE_OPTIONS[name] + ("" if value is NO_VALUE or name in ("out_dir", "name")
                                           else f" {_cli_value(value)}")
        elif name not in fields:
            w = "--" + name.replace("_", "-")
        else:
            w = f"--set {name}=" + ("..." if value is NO_VALUE else _cli_value(value))
        if w not in words:
            words.append(w)
    return " / ".join(words)


def flower_wording(option: str, value: Any = NO_VALUE) -> str:
    """An option as a Flower run-config key: ``local-epochs``, ``shots=10``."""
    if option.startswith(UNKNOWN):  # the Flower engine's own keys are run-config keys too
        return unknown_text(option[1:].replace("_", "-"), [k.replace("_", "-") for k in (*keys(), *FLOWER_KEYS)])
    names = [n.replace("_", "-") for n in option.split("|")]
    if value is NO_VALUE:
        return " / ".join(names)
    if isinstance(value, str):
        return f'{names[0]}="{value}"'
    return f"{names[0]}={str(value).lower() if isinstance(value, bool) else value}"


# ------------------------------------------------------------------------------------------------
# the options page


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _type_text(field: str) -> str:
    kind, choices = base_type(_fields()[field].annotation)
    if choices:
        return " \\| ".join(f"`{c}`" for c in choices)
    return {bool: "switch", int: "integer", float: "number", str: "text"}.get(kind, "TOML value")


def options_markdown() -> str:
    """The options table of the docs (``docs/options.md``): per field its TOML key, its flags, its
    type, its default and its description, in the sections of :data:`PANELS` (the panels of
    ``fedproto run --help``)."""
    out: list[str] = []
    section = None
    for name in grouped_fields():
        if panel(name) != section:
            section = panel(name)
            out += ["", f"### {section}", "", "| TOML key | flag | type | default | description |",
                    "|---|---|---|---|---|"]
        keys = ", ".join(f"`{k}`" for k in (name, *aliases(name)))
        fl = " ".join(f"`{f}`" for f in flags(name))
        desc = _md((_fields()[name].description or "").strip())
        out.append(f"| {keys} | {fl} | {_type_text(name)} | {_md(default_text(name)) or '-'} | {desc} |")
    return "\n".join(out).strip() + "\n"


def write_options_page(path: str | Path) -> None:
    """Replace the table between the ``<!-- options:start -->`` and ``<!-- options:end -->``
    markers of ``path`` with :func:`options_markdown` (``python -m fedproto.config.run_options docs/options.md``)."""
    p = Path(path)
    p.write_text(fill_options_page(p.read_text(encoding="utf-8")), encoding="utf-8")


START, END = "<!-- options:start -->", "<!-- options:end -->"


def fill_options_page(markdown: str) -> str:
    """``markdown`` with the part between :data:`START` and :data:`END` replaced by the table.

    Raises:
        ValueError: the markers are missing.
    """
    if START not in markdown or END not in markdown:
        raise ValueError(f"the options page needs the markers {START} and {END}")
    head, rest = markdown.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{options_markdown()}{END}{tail}"


if __name__ == "__main__":  # pragma: no cover
    for arg in sys.argv[1:] or ["docs/options.md"]:
        write_options_page(arg)
