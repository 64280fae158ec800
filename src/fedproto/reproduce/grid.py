"""The grids of ``fedproto reproduce``: the methods, models and defaults of the paper's grid and
the heterogeneous grid, the parsing of the command's lists, ``--set`` and ``--sweep``, and the
cells with their configs. Part of :mod:`fedproto.reproduce`.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedproto.config.run_config import RunConfig, build_config, config_model, normal_key
from fedproto.data.registry import DATASETS, PAPER_DATASETS
from fedproto.errors import NO_VALUE, ConfigError, opt, same_value, unknown_text
from fedproto.models.names import mh_variant
from fedproto.reproduce import paper_numbers as paper

log = logging.getLogger("fedproto.reproduce")  # one logger for the package

METHODS: dict[str, str] = {
    # method key -> algorithm name (ALGORITHMS registry)
    "local": "local",
    "fesem": "fesem",
    "fedprox": "fedprox",
    "fedper": "fedper",
    "fedavg": "fedavg",
    "fedrep": "fedrep",
    "fedproto": "fedproto",
    "fedproto-mh": "fedproto",
}
"""Method keys of tab. 1 and the algorithm each runs."""

MODELS: dict[str, str] = {n: d.model for n, d in DATASETS.items() if d.loader is not None}
"""Model of every method except FedProto-mh, per dataset (§Experiments; from the dataset registry)."""

MH_MODELS: dict[str, str] = {n: d.mh_model for n, d in DATASETS.items() if d.loader is not None}
"""FedProto-mh's heterogeneous models per dataset (§Experiments: conv channels 18/20/22 for the
CNN, per-client strides for ResNet18; from the dataset registry)."""

HETEROGENEOUS = {"fedproto-mh"}

HETERO_METHODS: dict[str, str] = {
    # method key -> algorithm name: the model-heterogeneous grid
    "local": "local",
    "fedproto": "fedproto",
    "fedtgp": "fedtgp",
    "fd": "fd",
    "fedgh": "fedgh",
    "lgfedavg": "lgfedavg",
}
"""Method keys of ``--grid hetero``: methods that run with clients of different architectures."""

HETERO_MODELS: dict[str, tuple[str, ...]] = {
    "mnist": ("cnn-mh", "projcnn:8-16,projcnn:16-32,projcnn:32-64"),
    "cifar10": ("cnn-mh",),
    "femnist": ("cnn-mh",),
    "digits": ("cnn-mh", "projcnn:8-16,projcnn:16-32,projcnn:32-64"),
}
"""The heterogeneous model sets of ``--grid hetero`` per dataset (each a grid dimension): the paper
CNN with per-client conv widths (``cnn-mh``: 18/20/22 channels) and projected CNNs of three widths
assigned round-robin. Every model has the default embedding size, so LG-FedAvg and FedGH can share
the head. ResNet18 (``--set model=resnet18-mh``) is left out by default: on a 2-core CPU one
CIFAR-10 cell takes hours."""

HETERO_DATASETS = ("mnist", "cifar10", "femnist")
HETERO_WAYS = (3,)
HETERO_SEEDS = (1234, 1235, 1236)
HETERO_ROUNDS = 20
"""Rounds of every ``--grid hetero`` cell unless ``--rounds`` is given (Local: local epochs)."""

GRIDS = ("paper", "hetero")
"""``fedproto reproduce --grid``: ``paper`` (tab. 1-4) or ``hetero`` (model-heterogeneous methods)."""


def algorithm_of(method: str) -> str:
    """The algorithm a method key runs (:data:`METHODS` or :data:`HETERO_METHODS`)."""
    return METHODS.get(method) or HETERO_METHODS[method]

DEFAULT_DATASETS = PAPER_DATASETS
DEFAULT_WAYS = (3, 4, 5)
DEFAULT_SEEDS = (1234,)

SWEEP_ALIASES = {"lambda": "lambda_proto", "lam": "lambda_proto", "k": "shots"}
SWEEP_DEFAULTS: dict[str, tuple[str, int, tuple[str, ...]]] = {
    # field -> (dataset, ways, methods) of the paper's figure
    "lambda_proto": ("femnist", 3, ("fedproto",)),  # fig. 4
    "shots": ("mnist", 3, ("fedproto", "fedavg")),  # fig. 3
}
GRID_KEYS = ("dataset", "ways", "algorithm", "seed", "rounds", "name", "out_dir", "data_dir")
"""Fields the grid sets itself (use --datasets, --ways, --methods, --seeds, --rounds, --data-dir)."""



# ------------------------------------------------------------------------------------------------
# parsing


def parse_list(text: str | None, default: Sequence, kind: str, allowed: Sequence | None = None,
               conv: Callable[[str], Any] = str) -> list:
    """A comma-separated option as a list (``default`` when None); raises ConfigError."""
    if text is None:
        return list(default)
    items = [t.strip() for t in str(text).split(",")]
    if not any(items):
        raise ConfigError(f"--{kind} is empty; give a comma-separated list")
    if not all(items):
        raise ConfigError(f"--{kind} {text!r} has an empty item; give a comma-separated list without empty "
                          f"items, e.g. {','.join(t for t in items if t)}")
    out = []
    for t in items:
        try:
            if conv is int and "_" in t:  # int() reads 1_0 as 10
                raise ValueError(t)
            v = conv(t)
        except ValueError:
            raise ConfigError(f"--{kind}: {t!r} is not a valid value") from None
        if allowed is not None and v not in allowed:
            import difflib

            near = difflib.get_close_matches(t, [str(a) for a in allowed], n=1)
            raise ConfigError(f"--{kind}: unknown {t!r}; " + (f"did you mean {near[0]!r}? " if near else "")
                              + f"choose from {', '.join(map(str, allowed))}")
        if v not in out:
            out.append(v)
    return out


def parse_value(text: str) -> Any:
    """A ``--set``/``--sweep`` value: a TOML scalar (``0.5``, ``true``, ``"x"``) or a bare string
    (:func:`fedproto.config.run_options.parse_value`, which the ``fedproto run`` flags of other types use too)."""
    from fedproto.config.run_options import parse_value as parse

    return parse(text)


def parse_sets(items: Sequence[str] | None, grid: bool = True) -> dict[str, Any]:
    """``key=value`` strings -> overrides; with ``grid``, grid keys are refused (they have their own options)."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: write key=value, e.g. --set lr=0.05")
        k, v = item.split("=", 1)
        k = normal_key(k.strip())
        if grid and k in GRID_KEYS:
            raise ConfigError(f"--set {k}=...: {k!r} is set by the grid; use the reproduce option for it "
                              "(--datasets, --ways, --methods, --seeds, --rounds, --data-dir)")
        if k not in config_model().model_fields:
            from fedproto.config.run_options import keys

            raise ConfigError(f"--set: unknown option {k!r}" + unknown_text(k, keys()))
        if k in out:
            raise ConfigError(f"--set {k} is given twice (or under two spellings); keep one")
        out[k] = parse_value(v.strip())
        _check_set(k, item.split("=", 1)[0].strip(), out[k], v.strip())
    return out


def _check_set(field: str, typed: str, value: Any, text: str) -> None:
    """Refuse a ``--set`` value its option's own type or bounds refuse, before any cell runs,
    named as typed (``--set lambda=abc``, not ``lambda_proto``; ``text``: the value as typed), with the fix."""
    from typing import Annotated

    from pydantic import ConfigDict, TypeAdapter, ValidationError

    from fedproto.config.fixes import bound_fix, pattern_message
    from fedproto.config.run_options import set_wording

    model = config_model()
    info, rules = model.model_fields[field], {k: model.model_config[k] for k in ("strict", "allow_inf_nan")}
    try:
        with warnings.catch_warnings():  # pydantic notes that a TypeAdapter ignores validate_default
            warnings.simplefilter("ignore")
            adapter = TypeAdapter(Annotated[info.annotation, info], config=ConfigDict(**rules))
        adapter.validate_python(value)
    except ValidationError as e:
        err = e.errors()[0]

        def typed_wording(option: str, v: Any = NO_VALUE) -> str | None:
            if option == field and v is not NO_VALUE and type(v) is type(value) and same_value(v, value):
                return f"--set {typed}={text}"  # lr="0.1" keeps its quotes
            return set_wording(option, v).replace(f"--set {field}=", f"--set {typed}=") if option == field else None

        raise ConfigError(f"{opt(field, value)}: {pattern_message(err)}{bound_fix(field, err)}", option=field,
                          value=value).rewritten(typed_wording) from None


def parse_sweep(spec: str) -> tuple[str, str, list[Any]]:
    """``param=v1,v2,...`` -> (name as given, RunConfig field, values)."""
    if "=" not in spec:
        raise ConfigError(f"--sweep {spec!r}: write param=v1,v2,..., e.g. --sweep lambda=0,0.5,1,2,4")
    name, vals = spec.split("=", 1)
    name = name.strip()
    fld = SWEEP_ALIASES.get(name, name).replace("-", "_")
    if fld in GRID_KEYS and fld != "rounds":
        raise ConfigError(f"--sweep {name}: cannot sweep {fld!r}; use the grid options for it")
    if fld not in config_model().model_fields:
        raise ConfigError(f"--sweep: unknown parameter {name!r}; use lambda, shots or a run option name")
    texts = [v.strip() for v in vals.split(",")]
    if any(texts) and not all(texts):
        raise ConfigError(f"--sweep {spec!r} has an empty value; give param=v1,v2,... without empty items")
    values = [parse_value(v) for v in texts if v]
    if not values:
        raise ConfigError(f"--sweep {spec!r}: no values")
    seen: list = []
    for v in values:
        if any(v == w and type(v) is not bool and type(w) is not bool for w in seen):
            raise ConfigError(f"--sweep {spec!r}: the value {v!r} is given twice (1 and 1.0 are the same value); "
                              "give each value once")
        seen.append(v)
    return name, fld, values


# ------------------------------------------------------------------------------------------------
# cells


@dataclass
class Cell:
    """One run of the grid (or of a sweep: then ``param``/``value`` are set)."""

    dataset: str
    ways: int
    method: str
    seed: int
    cfg: RunConfig
    name: str
    param: str | None = None
    value: Any = None


@dataclass
class CellResult:
    cell: Cell
    status: str  # done | skipped | failed
    summary: dict | None = None
    message: str = ""
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)


def default_rounds(dataset: str, method: str) -> int:
    """Tab. 1's rounds of ``method`` on ``dataset``; the dataset default (FedProto's rounds) for
    Local (0 rounds: no communication) and for datasets outside the paper."""
    r = paper.rounds(dataset, method)
    return r if r else DATASETS[dataset].rounds


def model_for(dataset: str, method: str) -> str:
    table = MH_MODELS if method in HETEROGENEOUS else MODELS
    return table.get(dataset, "cnn-mh" if method in HETEROGENEOUS else "cnn")


def cell_config(dataset: str, ways: int, method: str, seed: int, runs_dir: Path, name: str,
                rounds: int | None = None, sets: dict | None = None, data_dir: str | None = None,
                model: str | None = None) -> RunConfig:
    """The RunConfig of one cell: the dataset's defaults (the paper's stdev, tab. 1) < ``sets`` < the
    grid's own keys (raises ConfigError). ``model``: the hetero grid's model set (used as given)."""
    over: dict[str, Any] = {}
    sets = dict(sets or {})
    if model is not None:
        sets.pop("model", None)
    else:
        model = model_for(dataset, method)
    if "model" in sets:  # --set model=cnn: that family for every method, its "-mh" variant for fedproto-mh
        base = str(sets.pop("model"))
        # the family's "-mh" variant where one exists (cnn, resnet18); other specs (a projcnn
        # list, already heterogeneous if the user wants it) are used as given
        model = mh_variant(base) if method in HETEROGENEOUS else base
    over.update(sets)
    over.update(dataset=dataset, ways=ways, algorithm=algorithm_of(method), model=model, seed=seed,
                data_dir=data_dir, out_dir=str(runs_dir), name=name)
    if "rounds" not in over:
        over["rounds"] = rounds if rounds is not None else default_rounds(dataset, method)
    try:
        return build_config(None, over)
    except ConfigError as e:
        raise e.prefixed(f"cell {name}: ") from None


def cell_name(dataset: str, ways: int, method: str, seed: int, param: str | None = None, value: Any = None,
              model: str | None = None) -> str:
    """The cell's run-directory name; a swept value (and the hetero grid's ``model``, after the
    seed) is made a plain folder name (``projcnn:8-8`` -> ``projcnn_8-8``, a path -> its last part),
    as :meth:`RunConfig.run_name` does for models."""
    base = f"{dataset}-n{ways}-{method}-s{seed}"
    if model is not None:
        base += "-" + re.sub(r"[^A-Za-z0-9.+=-]+", "_", model)[:80]
    if param is None:
        return base
    v = str(value)
    if "/" in v or "\\" in v:
        v = Path(v).name or v
    return f"{base}-{param}{re.sub(r'[^A-Za-z0-9.+=-]+', '_', v)[:60]}"


def plan_grid(out: Path, datasets: Sequence[str], ways: Sequence[int], methods: Sequence[str], seeds: Sequence[int],
              rounds: int | None = None, sets: dict | None = None, data_dir: str | None = None) -> list[Cell]:
    """All cells of the grid, configurations validated up front (ConfigError before any training)."""
    runs = Path(out) / "runs"
    cells = []
    for ds in datasets:
        for n in ways:
            for m in methods:
                for s in seeds:
                    name = cell_name(ds, n, m, s)
                    cells.append(Cell(ds, n, m, s, cell_config(ds, n, m, s, runs, name, rounds, sets, data_dir), name))
    return cells


def plan_hetero(out: Path, datasets: Sequence[str], ways: Sequence[int], methods: Sequence[str],
                seeds: Sequence[int], rounds: int | None = None, sets: dict | None = None,
                data_dir: str | None = None) -> list[Cell]:
    """All cells of the model-heterogeneous grid (dataset × model set × ways × method × seed;
    :data:`HETERO_MODELS`, or the one ``model`` of ``sets``), validated up front (ConfigError)."""
    runs = Path(out) / "runs"
    sets = dict(sets or {})
    given = sets.pop("model", None)
    cells = []
    for ds in datasets:
        models = (str(given),) if given is not None else HETERO_MODELS.get(ds, ("cnn-mh",))
        for model in models:
            for n in ways:
                for m in methods:
                    for s in seeds:
                        name = cell_name(ds, n, m, s, model=model)
                        cfg = cell_config(ds, n, m, s, runs, name, HETERO_ROUNDS if rounds is None else rounds, sets,
                                          data_dir, model=model)
                        cells.append(Cell(ds, n, m, s, cfg, name))
    return cells


def plan_sweep(out: Path, param: str, fld: str, values: Sequence, dataset: str, ways: int, methods: Sequence[str],
               seeds: Sequence[int], rounds: int | None = None, sets: dict | None = None,
               data_dir: str | None = None) -> list[Cell]:
    """Cells of a one-parameter sweep (values × methods × seeds), validated up front."""
    runs = Path(out) / "runs"
    if fld == "model" and HETEROGENEOUS & set(methods):
        raise ConfigError("--sweep model with fedproto-mh: the grid turns every value into its '-mh' variant, so "
                          "the values would not be what they say; sweep --methods fedproto and give the "
                          "heterogeneous models as values (e.g. cnn,cnn-mh)")
    cells = []
    named: dict[str, Any] = {}
    for v in values:
        other = named.setdefault(cell_name(dataset, ways, "m", 0, param, v), v)
        if other is not v:
            raise ConfigError(f"--sweep {param}: the values {other!r} and {v!r} would share a run folder; give values "
                              "that differ in their last path part or in letters and digits")
        for m in methods:
            for s in seeds:
                name = cell_name(dataset, ways, m, s, param, v)
                try:
                    cfg = cell_config(dataset, ways, m, s, runs, name, rounds, {**(sets or {}), fld: v}, data_dir)
                except ConfigError as e:  # the swept value named as the --sweep the user typed
                    raise e.rewritten(lambda o, x, v=v: None if o != fld else f"--sweep {param}=..." if x is NO_VALUE
                                      else _sweep_ref(param, v) if same_value(x, v) else None) from None
                cells.append(Cell(dataset, ways, m, s, cfg, name, param, v))
    return cells


def _sweep_ref(param: str, value: Any) -> str:
    """A swept value as the user gave it: ``--sweep lambda=abc``."""
    from fedproto.config.run_config import toml_value

    return f"--sweep {param}={value if isinstance(value, str) else toml_value(value)}"
