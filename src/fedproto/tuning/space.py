"""The search space of ``fedproto tune``: which run options vary, over what, on which scale.

A dimension is given on the command line as ``name=kind:args`` (``--space``) or in the
``[space]`` table of a TOML file, either in the same short form or as a table::

    lambda_proto = "log:0.01:10"                       # float, log scale
    lr = {type = "float", low = 1e-3, high = 0.1, log = true}
    local_epochs = {type = "int", low = 1, high = 5}
    distance = {type = "categorical", choices = ["mse", "l2"]}

Kinds: ``log`` (float, log scale), ``float`` (uniform), ``int``, ``intlog`` (int, log scale),
``cat`` (a comma list of values, each read as a TOML scalar: ``true``, ``0.5``, ``mse``) and
``bool`` (``true``/``false``). Names are run options (:class:`~fedproto.config.run_config.RunConfig`
fields or their aliases, ``lambda`` for ``lambda_proto``); every bound and choice is validated as
a run option before the first trial.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedproto.config.run_config import build_config, config_model, normal_key, toml_value
from fedproto.errors import ConfigError, FedprotoError, unknown_text

NOT_TUNABLE = {
    "seed": "the search draws its own seeds (--seed; the final runs: --final-seeds)",
    "dataset": "a study tunes one dataset (--dataset)",
    "name": "each trial names itself", "out_dir": "the output folder is --out", "data_dir": "give --set data_dir=...",
    "resume": "each trial runs from round 1", "threads": "give --threads", "device": "give --set device=...",
    "eval_every": "trials evaluate every round (the pruner's steps)",
}
"""Run options a search may not vary, and why."""

KINDS = ("log", "float", "int", "intlog", "cat", "bool")

DEFAULT_SPACE = {"lambda_proto": "log:0.01:10", "lr": "log:0.001:0.1"}
"""The space when none is given: the guide's critical λ and the learning rate."""


@dataclass(frozen=True)
class Dimension:
    """One option of the search space.

    Attributes:
        name: the RunConfig field. kind: one of :data:`KINDS`.
        low, high: the bounds (``log``, ``float``, ``int``, ``intlog``). choices: the values (``cat``, ``bool``).
    """

    name: str
    kind: str
    low: float | None = None
    high: float | None = None
    choices: tuple = ()

    def suggest(self, trial) -> Any:
        """The trial's value (an optuna ``Trial``'s ``suggest_*``)."""
        if self.kind in ("log", "float"):
            return trial.suggest_float(self.name, float(self.low), float(self.high), log=self.kind == "log")
        if self.kind in ("int", "intlog"):
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.kind == "intlog")
        return trial.suggest_categorical(self.name, list(self.choices))

    def spec(self) -> str:
        """The short form (``log:0.01:10``, ``cat:mse,l2``), as ``--space`` takes it."""
        if self.choices:
            return f"{self.kind}:" + ",".join(toml_value(c).strip('"') for c in self.choices)
        return f"{self.kind}:{self.low:g}:{self.high:g}"

    def extremes(self) -> list[Any]:
        """The values to validate before searching: both bounds, or every choice."""
        if self.choices:
            return list(self.choices)
        conv = int if self.kind in ("int", "intlog") else float
        return [conv(self.low), conv(self.high)]


def _tunable(name: str, where: str) -> str:
    """``name`` as a RunConfig field; ConfigError (with "did you mean") when it is none or may not vary."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}: the option name is empty; write name=kind:args, e.g. lambda_proto=log:0.01:10")
    key = normal_key(name.strip())
    if key not in config_model().model_fields:
        from fedproto.config.run_options import keys

        raise ConfigError(f"{where}: unknown option {name.strip()!r} in the search space" + unknown_text(key, keys()))
    if key in NOT_TUNABLE:
        raise ConfigError(f"{where}: {key!r} cannot be searched: {NOT_TUNABLE[key]}")
    return key


def _number(text: Any, where: str) -> float:
    try:
        if isinstance(text, bool):
            raise ValueError
        return float(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {text!r} is not a number; write e.g. log:0.01:10") from None


def parse_dimension(name: str, value: Any, where: str) -> Dimension:
    """One dimension from its short form (``"log:0.01:10"``) or a TOML table (module docstring).

    Raises:
        ConfigError: an unknown kind, a bound that is not a number, low >= high, a log scale
            below or at 0, an empty choice list.
    """
    from fedproto.config.run_options import parse_value

    key = _tunable(name, where)
    if isinstance(value, dict):
        table = dict(value)
        kind = str(table.pop("type", "")).lower()
        kind = {"categorical": "cat", "integer": "int", "boolean": "bool", "uniform": "float"}.get(kind, kind)
        log = table.pop("log", False)
        if not isinstance(log, bool):
            raise ConfigError(f"{where}: log = {log!r} is not a bool; write log = true or log = false")
        if log:
            kind = {"float": "log", "int": "intlog"}.get(kind, kind)
        if kind in ("cat",):
            choices = table.pop("choices", None)
            if not isinstance(choices, list):
                raise ConfigError(f"{where}: a categorical dimension needs choices = [...]")
            text = None
        else:
            text = f"{kind}:{table.pop('low', '')}:{table.pop('high', '')}" if kind != "bool" else "bool"
        if table:
            raise ConfigError(f"{where}: unknown keys {sorted(table)}; use type, low, high, log, choices")
        if text is None:
            return _check(Dimension(key, "cat", choices=tuple(choices)), where)
        value = text
    if not isinstance(value, str):
        raise ConfigError(f"{where}: write kind:args (e.g. log:0.01:10) or a table with type, low, high, log, choices")
    kind, _, rest = value.strip().partition(":")
    kind = kind.lower()
    if kind not in KINDS:
        raise ConfigError(f"{where}: unknown kind {kind!r}; use one of {', '.join(KINDS)} (e.g. {key}=log:0.01:10)")
    if kind == "bool":
        if rest.strip():
            raise ConfigError(f"{where}: bool takes no arguments (it searches false and true); write {key}=bool, or "
                              f"fix the value with --set {key}={rest.strip()}")
        return Dimension(key, "cat", choices=(False, True))
    if kind == "cat":
        items = [t.strip() for t in rest.split(",")]
        if not rest.strip() or not all(items):
            raise ConfigError(f"{where}: give the values as cat:a,b,c without empty items")
        return _check(Dimension(key, "cat", choices=tuple(parse_value(t) for t in items)), where)
    bounds = rest.split(":")
    if len(bounds) != 2:
        raise ConfigError(f"{where}: write {kind}:low:high, e.g. {key}={kind}:{'0.01:10' if 'log' in kind else '1:5'}")
    low, high = (_number(b, where) for b in bounds)
    if kind in ("int", "intlog") and (low != int(low) or high != int(high)):
        raise ConfigError(f"{where}: the bounds of an int dimension are whole numbers")
    return _check(Dimension(key, kind, low, high), where)


def _check(d: Dimension, where: str) -> Dimension:
    if d.kind == "cat":
        if not d.choices:
            raise ConfigError(f"{where}: no choices")
        if len(d.choices) < 2:
            one = toml_value(d.choices[0]).strip('"')
            raise ConfigError(f"{where}: a single choice ({one}) searches nothing; give two or more, or fix the "
                              f"value with --set {d.name}={one}")
        if len({toml_value(c) for c in d.choices}) != len(d.choices):
            raise ConfigError(f"{where}: a choice is given twice; give each once")
        return d
    if not d.low < d.high:
        raise ConfigError(f"{where}: low {d.low:g} is not below high {d.high:g}; give low < high")
    if d.kind in ("log", "intlog") and d.low <= 0:
        raise ConfigError(f"{where}: a log scale needs low > 0 (got {d.low:g}); use float:... or a positive low")
    return d


def parse_space(items: list[str] | None = None, table: dict | None = None) -> dict[str, Dimension]:
    """The space from ``--space name=kind:args`` items and a TOML ``[space]`` table (items win).

    Raises:
        ConfigError: a malformed item, an unknown option (with "did you mean"), one given twice.
    """
    out: dict[str, Dimension] = {}
    for k, v in (table or {}).items():
        d = parse_dimension(k, v, f"[space] {k}")
        if d.name in out:
            raise ConfigError(f"[space]: {d.name!r} is given twice (or under two spellings); keep one")
        out[d.name] = d
    given: set[str] = set()
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--space {item!r}: write name=kind:args, e.g. --space lambda_proto=log:0.01:10")
        k, v = item.split("=", 1)
        d = parse_dimension(k, v, f"--space {item}")
        if d.name in given:
            raise ConfigError(f"--space {d.name} is given twice (or under two spellings); keep one")
        given.add(d.name)
        out[d.name] = d
    return out


def for_method(space: dict[str, Dimension], method: str) -> dict[str, Dimension]:
    """The dimensions ``method`` uses: the common options and its own (λ is left out for Local)."""
    from fedproto.algorithms.method_options import owners
    from fedproto.config.run_config import CommonConfig

    return {k: d for k, d in space.items() if k in CommonConfig.model_fields or method in owners(k)}


def validate(space: dict[str, Dimension], base: dict[str, Any]) -> None:
    """Every bound and choice as a run option on top of ``base`` (ConfigError naming the dimension)."""
    for d in space.values():
        for v in d.extremes():
            try:
                build_config(None, {**base, d.name: v})
            except FedprotoError as e:
                raise ConfigError(f"the search space's {d.name}={d.spec()}: the value {toml_value(v)} is refused: "
                                  f"{e}") from None


__all__ = ["DEFAULT_SPACE", "Dimension", "KINDS", "NOT_TUNABLE", "for_method", "parse_dimension", "parse_space",
           "validate"]
