"""``fedproto reproduce``: the paper's grid (tab. 1-4) and its sweeps (fig. 3, fig. 4).

A grid is dataset × ways × method × seed. Every cell is an ordinary run directory
``OUT/runs/<dataset>-n<ways>-<method>-s<seed>/``; a cell whose ``summary.json`` exists and whose
``config.json`` matches the cell's configuration is skipped, so an interrupted grid resumes where
it stopped. A cell that fails with a :class:`~fedproto.errors.FedprotoError` (missing data, an
unknown model, an impossible partition) is recorded as failed with its message and the grid goes
on. After every cell ``OUT/status.json``, ``OUT/table.md`` and ``OUT/table.csv`` are rewritten
(atomically).

Per-dataset settings follow the paper: stdev of n is MNIST 2, FEMNIST 1, CIFAR-10 1 (tab. 1);
λ is :attr:`RunConfig.lam`'s paper default (app. A); rounds are tab. 1's rounds of the method on the
dataset ("Local" lists 0 rounds, i.e. no communication: it trains for the dataset's FedProto
rounds of local epochs). ``--rounds`` overrides the rounds of every cell, ``--set key=value``
any other :class:`RunConfig` field.

The model-heterogeneous grid (``--grid hetero``) is dataset × model set × ways ×
method × seed over :data:`HETERO_METHODS` (Local, FedProto, FedTGP, FD, FedGH, LG-FedAvg) on the
heterogeneous model sets of :data:`HETERO_MODELS`, :data:`HETERO_ROUNDS` rounds for every method;
cells ``OUT/runs/<dataset>-n<ways>-<method>-s<seed>-<models>/``, resumable as the paper grid, and
its own table (:func:`render_hetero_markdown`: both inference rules, parameters up and down, and
which method leads beyond the spread over seeds).

A sweep (``--sweep lambda=0,0.5,1,2,4``) varies one field for one dataset and ways value, for each
method and seed, and writes ``sweep_<param>.csv`` and ``sweep_<param>.png`` (fig. 3: accuracy vs
shots k for FedProto and FedAvg on MNIST; fig. 4: accuracy and prototype loss vs λ for FedProto
on FEMNIST, n=3).

Size: about 950 lines: the paper's grids (tab. 1-3, fig. 3-4) and the heterogeneous-model grid, cells
that resume and the tables they write; declarations mostly.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.markup import escape

from fedproto import paper
from fedproto.checkpoint import CHECKPOINT_FILE
from fedproto.config import ADDED_FIELDS, RunConfig, build_config, normal_key, result_fields
from fedproto.data.registry import DATASETS, PAPER_DATASETS
from fedproto.errors import CheckpointError, CheckpointMismatch, ConfigError, FedprotoError, same_value, unknown_text
from fedproto.models.names import mh_variant
from fedproto.results import _clean, atomic_write_bytes, atomic_write_json

log = logging.getLogger(__name__)

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
            raise ConfigError(f"--{kind}: unknown {t!r}; choose from {', '.join(map(str, allowed))}")
        if v not in out:
            out.append(v)
    return out


def parse_value(text: str) -> Any:
    """A ``--set``/``--sweep`` value: a TOML scalar (``0.5``, ``true``, ``"x"``) or a bare string
    (:func:`fedproto.options.parse_value`, which the ``fedproto run`` flags of other types use too)."""
    from fedproto.options import parse_value as parse

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
        if k not in RunConfig.model_fields:
            from fedproto.options import keys

            raise ConfigError(f"--set: unknown option {k!r}" + unknown_text(k, keys()))
        if k in out:
            raise ConfigError(f"--set {k} is given twice (or under two spellings); keep one")
        out[k] = parse_value(v.strip())
    return out


def parse_sweep(spec: str) -> tuple[str, str, list[Any]]:
    """``param=v1,v2,...`` -> (name as given, RunConfig field, values)."""
    if "=" not in spec:
        raise ConfigError(f"--sweep {spec!r}: write param=v1,v2,..., e.g. --sweep lambda=0,0.5,1,2,4")
    name, vals = spec.split("=", 1)
    name = name.strip()
    fld = SWEEP_ALIASES.get(name, name).replace("-", "_")
    if fld in GRID_KEYS and fld != "rounds":
        raise ConfigError(f"--sweep {name}: cannot sweep {fld!r}; use the grid options for it")
    if fld not in RunConfig.model_fields:
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
                    raise e.rewritten(lambda o, x, v=v: _sweep_ref(param, v) if o == fld and same_value(x, v)
                                      else None) from None
                cells.append(Cell(dataset, ways, m, s, cfg, name, param, v))
    return cells


def _sweep_ref(param: str, value: Any) -> str:
    """A swept value as the user gave it: ``--sweep lambda=abc``."""
    from fedproto.config import toml_value

    return f"--sweep {param}={value if isinstance(value, str) else toml_value(value)}"


def comparable(cfg: dict) -> dict:
    """The result-relevant RunConfig fields of a config dict (stored config.json or a RunConfig dump).

    Two configs with equal ``comparable`` dicts give the same numbers: a reproduce cell whose stored
    run compares equal is skipped. Fields added since a run was stored (``config.ADDED_FIELDS``)
    take the value that run had.
    """
    return result_fields({**ADDED_FIELDS, **_clean(cfg)})


def finished(cell: Cell) -> dict | None:
    """The cell's summary when its run directory holds a finished run of the same configuration."""
    d = Path(cell.cfg.out_dir) / cell.name
    s, c = d / "summary.json", d / "config.json"
    if not (s.is_file() and c.is_file()):
        return None
    try:
        stored = json.loads(c.read_text())
        summary = json.loads(s.read_text())
    except (OSError, ValueError):  # unreadable, not UTF-8 or not JSON: run the cell again
        return None
    if not (isinstance(stored, dict) and _valid_summary(summary)):
        return None
    return summary if comparable(stored) == comparable(cell.cfg.model_dump()) else None


def _valid_summary(summary: Any) -> bool:
    """Whether a stored summary has the fields the table reads, with numbers where numbers belong
    (a damaged or foreign summary.json makes its cell run again instead of crashing the table)."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if not isinstance(summary, dict):
        return False
    acc, ppr = summary.get("accuracy"), summary.get("params_per_round")
    if not (isinstance(acc, dict) and isinstance(acc.get("acc"), dict) and isinstance(ppr, dict)):
        return False
    return (all(isinstance(v, dict) and number(v.get("mean")) and number(v.get("std")) for v in acc.values())
            and all(number(v) for v in ppr.values()))


def run_cell(cell: Cell, progress: bool = False) -> CellResult:
    """Run (or skip) one cell; FedprotoError -> a failed result (other exceptions propagate)."""
    from fedproto.simulation import Simulation

    summary = finished(cell)
    if summary is not None:
        return CellResult(cell, "skipped", summary)
    d = Path(cell.cfg.out_dir) / cell.name
    # a stale summary (other options, damaged) stays until the rerun finishes: the run directory keeps it
    # aside while training and puts it back if the rerun fails (RunDir.begin / abort)
    t0 = time.perf_counter()
    try:
        sim = Simulation(cell.cfg, out=d, progress=progress)
        try:
            summary = sim.run(resume=(d / CHECKPOINT_FILE).is_file())  # an interrupted cell goes on from it
        except CheckpointMismatch as e:  # an interrupted cell of other options: never thrown away silently
            return CellResult(cell, "failed", None, set_message(e), time.perf_counter() - t0)
        except CheckpointError as e:  # damaged: nothing to keep
            log.warning("%s: %s; running the cell from round 1", cell.name, e)
            (d / CHECKPOINT_FILE).unlink(missing_ok=True)
            sim = Simulation(cell.cfg, out=d, progress=progress)
            summary = sim.run()
    except FedprotoError as e:
        return CellResult(cell, "failed", None, set_message(e), time.perf_counter() - t0)
    return CellResult(cell, "done", summary, "", time.perf_counter() - t0)


def set_message(error: FedprotoError) -> str:
    """An error as ``fedproto reproduce`` words it: run options as ``--set key=value``, the grid's
    own fields as its options (``--ways``, ``--rounds``, ``--out``); see
    :func:`fedproto.options.set_wording`."""
    from fedproto.options import set_wording

    return error.render(set_wording)


# ------------------------------------------------------------------------------------------------
# aggregation


def _acc(summary: dict | None, key: str) -> tuple[float, float]:
    a = ((summary or {}).get("accuracy") or {}).get(key) or {}
    m, s = a.get("mean"), a.get("std")
    return (float("nan") if m is None else float(m), float("nan") if s is None else float(s))


def seed_stats(pairs: Sequence[tuple[float, float]]) -> dict[str, float]:
    """Combine per-seed (mean over clients, std over clients).

    Rule: ``mean`` = mean over seeds of the per-seed means; ``std_clients`` = per-seed std over
    clients, averaged over seeds; ``std_seeds`` = sample std (ddof 1) of the per-seed means (NaN for
    one seed). Seeds without a value (NaN) are left out.
    """
    ok = [(m, s) for m, s in pairs if m == m]
    if not ok:
        return {"mean": float("nan"), "std_clients": float("nan"), "std_seeds": float("nan"), "n": 0}
    ms = np.asarray([m for m, _ in ok])
    ss = np.asarray([s for _, s in ok if s == s])
    return {
        "mean": float(ms.mean()),
        "std_clients": float(ss.mean()) if len(ss) else float("nan"),
        "std_seeds": float(ms.std(ddof=1)) if len(ms) > 1 else float("nan"),
        "n": len(ok),
    }


def proto_mse(run_dir: str | Path) -> float:
    """Prototype loss on the test embeddings of a finished run: per client, the mean squared error
    (official form, mean over samples and dimensions) between each embedding and the global
    prototype of its class, over samples whose class has one; then the mean over clients. NaN
    when the run has no prototypes. Unlike the training ``loss_proto`` (0 when λ = 0), it is
    defined for every λ, so fig. 4's curve can start at λ = 0."""
    d = Path(run_dir)
    ef, pf = d / "embeddings.npz", d / "prototypes.npz"
    if not (ef.is_file() and pf.is_file()):
        return float("nan")
    try:
        e, p = np.load(ef), np.load(pf)
        if len(p["classes"]) == 0:
            return float("nan")
        table = {int(c): v for c, v in zip(p["classes"], p["protos"])}
        per_client = []
        for c in np.unique(e["client"]):
            m = (e["client"] == c) & np.isin(e["y"], list(table))
            if not m.any():
                continue
            target = np.stack([table[int(k)] for k in e["y"][m]])
            per_client.append(float(((e["h"][m] - target) ** 2).mean()))
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:  # damaged or foreign files
        log.warning("no prototype distance for %s: %s", d, err)
        return float("nan")
    return float(np.mean(per_client)) if per_client else float("nan")


def _last_loss_proto(run_dir: Path) -> float:
    from fedproto.results import read_metrics

    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return float("nan")
    rows = read_metrics(f)
    v = rows[-1].get("loss_proto") if rows else None
    return float("nan") if v is None else float(v)


def short(message: str, limit: int = 240) -> str:
    """First line of an error message, cut to ``limit`` characters (full text: status.json)."""
    line = (message or "").strip().splitlines()[0] if (message or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _pm(m: float, s: float) -> str:
    if m != m:
        return "–"
    return f"{m:.2f} ± {s:.2f}" if s == s else f"{m:.2f}"


def _ordered(values: Sequence, order: Sequence) -> list:
    seen = list(dict.fromkeys(values))
    return [v for v in order if v in seen] + [v for v in seen if v not in order]


def table_rows(results: Sequence[CellResult]) -> list[dict]:
    """One row per (dataset, stdev, method, ways): our seed-combined accuracies (%), the paper's,
    rounds and parameters per round."""
    groups: dict[tuple, list[CellResult]] = {}
    for r in results:
        c = r.cell
        groups.setdefault((c.dataset, c.cfg.stdev, c.method, c.ways, c.cfg.model), []).append(r)
    rows = []
    for (ds, sd, method, n, _), rs in groups.items():
        ok = [r for r in rs if r.status in ("done", "skipped") and r.summary]
        failed = [r for r in rs if r.status == "failed"]
        acc = seed_stats([tuple(100 * v for v in _acc(r.summary, "acc")) for r in ok])
        accp = seed_stats([tuple(100 * v for v in _acc(r.summary, "acc_proto")) for r in ok])
        accg = seed_stats([tuple(100 * v for v in _acc(r.summary, "acc_global")) for r in ok])
        pp = paper.accuracy(ds, sd, method, n)
        up = [r.summary["params_per_round"]["up"] for r in ok if r.summary.get("params_per_round")]
        down = [r.summary["params_per_round"].get("down", math.nan) for r in ok if r.summary.get("params_per_round")]
        wall = [r.summary.get("wall_time_s", r.wall_s) for r in ok]
        rows.append({
            "dataset": ds, "stdev": sd, "method": method, "algorithm": rs[0].cell.cfg.algorithm,
            "model": rs[0].cell.cfg.model, "ways": n, "seeds": acc["n"] if ok else 0, "failed": len(failed),
            "acc_mean": acc["mean"], "acc_std_clients": acc["std_clients"], "acc_std_seeds": acc["std_seeds"],
            "acc_proto_mean": accp["mean"], "acc_proto_std_clients": accp["std_clients"],
            "acc_proto_std_seeds": accp["std_seeds"],
            "acc_global_mean": accg["mean"], "acc_global_std_clients": accg["std_clients"],
            "acc_global_std_seeds": accg["std_seeds"],
            "paper_mean": pp[0] if pp else float("nan"), "paper_std": pp[1] if pp else float("nan"),
            "rounds": rs[0].cell.cfg.rounds, "paper_rounds": paper.rounds(ds, method),
            "params_up_per_round": float(np.mean(up)) if up else float("nan"),
            "params_down_per_round": float(np.mean(down)) if down else float("nan"),
            "paper_params_k": paper.params_k(ds, method),
            "wall_s_per_seed": float(np.mean(wall)) if wall else float("nan"),
            "message": "; ".join(f"{r.cell.name}: {short(r.message)}" for r in failed),
            "failed_cells": [(r.cell.name, r.message) for r in failed],
        })
    return rows


CAPTION = (
    "Accuracy in % on each client's own test classes (test split), after the last round, as "
    "mean ± std over clients (each client once). **Ours** is the classifier (argmax of the client's "
    "head) under the *personal* protocol: each client's own model after its local training of the last "
    "round. The weight-sharing methods' *global* protocol (the server's aggregated model of the last round, "
    "before local training, on each client's test set; FedPer/FedRep: the global body with the client's "
    "own head; FeSEM: the client's cluster centre) is in the table \"Global vs personal\" and in table.csv "
    "(acc_global_*); nearest-prototype accuracy (eq. 4) is in its own table and in table.csv. With several "
    "seeds: the mean over seeds of the per-seed client means ± the per-seed std over clients averaged "
    "over seeds; `[±x, s seeds]` is the sample std (ddof 1) of the per-seed means. **Paper**: tab. 1 "
    "(main stdev) or appendix tab. 2–4 (second stdev), 20 clients; n.a. where the paper has no such "
    "setting. Rounds: ours / paper (tab. 1; Local: 0 rounds, no communication). Params: parameters sent "
    "up per round summed over clients, ×10³, ours / paper (tab. 1)."
)


def _ours_cell(row: dict, key: str = "acc") -> str:
    if row["seeds"] == 0:
        return "failed" if row["failed"] else "–"
    s = _pm(row[f"{key}_mean"], row[f"{key}_std_clients"])
    if row["seeds"] > 1 and row[f"{key}_std_seeds"] == row[f"{key}_std_seeds"]:
        s += f" [±{row[f'{key}_std_seeds']:.2f}, {row['seeds']} seeds]"
    if row["failed"]:
        s += f" ({row['failed']} failed)"
    return s


def render_markdown(rows: Sequence[dict], methods_order: Sequence[str] = tuple(METHODS)) -> str:
    """The side-by-side table (one block per dataset and stdev)."""
    out = ["# FedProto reproduction vs the paper", "", CAPTION, ""]
    blocks: dict[tuple, list[dict]] = {}
    for r in rows:
        blocks.setdefault((r["dataset"], r["stdev"]), []).append(r)
    proto_lines: list[str] = []
    global_lines: list[str] = []
    failures: dict[str, list[str]] = {}
    for (ds, sd), rs in blocks.items():
        ways = sorted({r["ways"] for r in rs})
        by = {(r["method"], r["ways"]): r for r in rs}
        methods = _ordered([r["method"] for r in rs], methods_order)
        out += [f"## {ds} (stdev {sd})", ""]
        models = _ordered([r["model"] for r in rs if r.get("model")], [])
        if models:
            paper_models = {model_for(ds, m) for m in methods}
            note = "" if set(models) <= paper_models else " (not the paper's models for this dataset)"
            out += [f"Models: {', '.join(models)}{note}.", ""]
        head = ["method"] + [f"n={n} {w}" for n in ways for w in ("ours", "paper")] + [
            "rounds ours / paper", "params ×10³ ours / paper"]
        out += ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["--:"] * (len(head) - 1)) + "|"]
        for m in methods:
            cells = [m]
            rounds, params = [], []
            for n in ways:
                r = by.get((m, n))
                if r is None:
                    cells += ["–", "–"]
                    continue
                cells.append(_ours_cell(r))
                cells.append(_pm(r["paper_mean"], r["paper_std"]) if r["paper_mean"] == r["paper_mean"] else "n.a.")
                rounds.append(r["rounds"])
                if r["params_up_per_round"] == r["params_up_per_round"]:
                    params.append(r["params_up_per_round"] / 1e3)
                for name, msg in r.get("failed_cells", []):
                    failures.setdefault(short(msg), []).append(name)
            any_r = next(r for r in rs if r["method"] == m)
            pr = any_r["paper_rounds"]
            pk = any_r["paper_params_k"]
            ours_r = (f"{min(rounds)}–{max(rounds)}" if rounds and min(rounds) != max(rounds)
                      else (str(rounds[0]) if rounds else "–"))
            if params and f"{min(params):.1f}" != f"{max(params):.1f}":
                ours_p = f"{min(params):.1f}–{max(params):.1f}"
            else:
                ours_p = f"{params[0]:.1f}" if params else "–"
            cells.append(f"{ours_r} / {pr if pr is not None else 'n.a.'}")
            cells.append(f"{ours_p} / {f'{pk:g}' if pk is not None else 'n.a.'}")
            out.append("| " + " | ".join(cells) + " |")
            for n in ways:
                r = by.get((m, n))
                if r is not None and r["acc_proto_mean"] == r["acc_proto_mean"]:
                    proto_lines.append(f"| {ds} (stdev {sd}) | {m} | {n} | {_ours_cell(r, 'acc_proto')} | "
                                       f"{_ours_cell(r)} |")
                if r is not None and r.get("acc_global_mean", math.nan) == r.get("acc_global_mean", math.nan):
                    paper_cell = (_pm(r["paper_mean"], r["paper_std"]) if r["paper_mean"] == r["paper_mean"]
                                  else "n.a.")
                    global_lines.append(f"| {ds} (stdev {sd}) | {m} | {n} | {_ours_cell(r, 'acc_global')} | "
                                        f"{_ours_cell(r)} | {paper_cell} |")
        out.append("")
    if global_lines:
        out += ["## Global vs personal (weight-sharing methods)", "",
                "Same runs. **global**: the server's aggregated model of the last round (FedPer/FedRep: global body "
                "with the client's own head; FeSEM: the client's cluster centre), before local training, on each "
                "client's test set; **personal**: the client's model after its local training of the last round "
                "(the main table's ours).", "",
                "| dataset | method | n | global | personal | paper |", "|---|---|--:|--:|--:|--:|", *global_lines, ""]
    if proto_lines:
        out += ["## Nearest-prototype accuracy (eq. 4)", "",
                "Same runs and aggregation rule; classifier accuracy repeated for comparison.", "",
                "| dataset | method | n | nearest prototype | classifier |", "|---|---|--:|--:|--:|", *proto_lines, ""]
    if failures:
        out += ["## Failed cells", "", "First line of each error; full messages in status.json.", ""]
        out += [f"- {', '.join(names)}: {msg}" for msg, names in failures.items()] + [""]
    return "\n".join(out)


HETERO_CAPTION = (
    "Model-heterogeneous grid (`fedproto reproduce --grid hetero`): clients of different architectures, "
    "each method on the same clients, data and seeds. Accuracy in % on each client's own test classes after "
    "the last round, mean over seeds of the per-seed client means ± the per-seed std over clients averaged "
    "over seeds; `[±x]` is the sample std (ddof 1) of the per-seed means (the spread over seeds). "
    "**classifier**: each client's own model after its local training of the last round (personal, every "
    "method). **nearest prototype**: the same model, nearest global prototype (FedProto eq. 4; FedProto and "
    "FedTGP). **global head**: the server's head of the last round on the client's own body (LG-FedAvg: the "
    "averaged head; FedGH: the head the server trained on the prototypes). Params: parameters sent per round "
    "summed over clients, ×10³, up / down. Rounds are fewer than tab. 1's (see the rounds column): the grid "
    "is sized for a CPU; Local trains for the same number of local epochs without communicating."
)
"""Caption of the heterogeneous grid's table."""

HETERO_FIELDS = ("dataset", "model", "method", "algorithm", "ways", "seeds", "failed", "acc_mean", "acc_std_clients",
                 "acc_std_seeds", "acc_proto_mean", "acc_proto_std_clients", "acc_proto_std_seeds", "acc_global_mean",
                 "acc_global_std_clients", "acc_global_std_seeds", "rounds", "params_up_per_round",
                 "params_down_per_round", "wall_s_per_seed", "message")


def ranking(rows: Sequence[dict], key: str = "acc") -> tuple[str | None, list[str], list[str]]:
    """The leader of ``rows`` (one dataset, model set and ways) by ``<key>_mean``, the methods whose
    order against it is undecided and those it leads clearly.

    Rule: a method's gap to the leader (difference of the means over seeds) is compared with the
    larger of the two methods' std over seeds (``<key>_std_seeds``); a gap at most that large leaves
    the order undecided. With one seed (no std over seeds) every order is undecided.

    Returns:
        (leader, undecided, behind); leader None when no row has a value.
    """
    ok = [r for r in rows if r.get(f"{key}_mean", math.nan) == r.get(f"{key}_mean", math.nan)]
    if not ok:
        return None, [], []
    ok.sort(key=lambda r: -r[f"{key}_mean"])
    lead = ok[0]
    undecided, behind = [], []
    for r in ok[1:]:
        spread = max(lead[f"{key}_std_seeds"], r[f"{key}_std_seeds"])
        gap = lead[f"{key}_mean"] - r[f"{key}_mean"]
        (undecided if not gap > spread else behind).append(r["method"])  # NaN spread: undecided
    return lead["method"], undecided, behind


def render_hetero_markdown(rows: Sequence[dict], methods_order: Sequence[str] = tuple(HETERO_METHODS)) -> str:
    """The heterogeneous grid's table: one block per dataset, model set and ways, one row per
    method, with the leader and the undecided orders (:func:`ranking`) under each block."""
    out = ["# Model-heterogeneous methods", "", HETERO_CAPTION, ""]
    blocks: dict[tuple, list[dict]] = {}
    for r in rows:
        blocks.setdefault((r["dataset"], r["model"], r["ways"]), []).append(r)
    failures: dict[str, list[str]] = {}

    def cell(r: dict, key: str) -> str:
        if r.get(f"{key}_mean", math.nan) != r.get(f"{key}_mean", math.nan):
            return "–"
        s = _pm(r[f"{key}_mean"], r[f"{key}_std_clients"])
        return s + (f" [±{r[f'{key}_std_seeds']:.2f}]" if r[f"{key}_std_seeds"] == r[f"{key}_std_seeds"] else "")

    for (ds, model, n), rs in blocks.items():
        by = {r["method"]: r for r in rs}
        out += [f"## {ds}, n={n}, models `{model}`", "",
                "| method | classifier | nearest prototype | global head | params ×10³ up / down | rounds | seeds |",
                "|---|--:|--:|--:|--:|--:|--:|"]
        for m in _ordered(list(by), methods_order):
            r = by[m]
            for name, msg in r.get("failed_cells", []):
                failures.setdefault(short(msg), []).append(name)
            if r["seeds"] == 0:
                out.append(f"| {m} | failed | – | – | – | {r['rounds']} | 0 |")
                continue
            up, down = r["params_up_per_round"] / 1e3, r["params_down_per_round"] / 1e3
            fail = f" ({r['failed']} failed)" if r["failed"] else ""
            out.append(f"| {m} | {cell(r, 'acc')} | {cell(r, 'acc_proto')} | {cell(r, 'acc_global')} | "
                       f"{up:.1f} / {down:.1f} | {r['rounds']} | {r['seeds']}{fail} |")
        lead, undecided, behind = ranking(rs)
        if lead is not None:
            line = f"Classifier accuracy: **{lead}** leads"
            line += (f"; its order against {', '.join(undecided)} is undecided (gap to the leader within the larger "
                     "std over seeds)" if undecided else "")
            line += f"; it leads {', '.join(behind)} by more than the std over seeds." if behind else "."
            out += ["", line]
        out.append("")
    if failures:
        out += ["## Failed cells", "", "First line of each error; full messages in status.json.", ""]
        out += [f"- {', '.join(names)}: {msg}" for msg, names in failures.items()] + [""]
    return "\n".join(out)


def write_hetero_table(out: Path, results: Sequence[CellResult],
                       methods_order: Sequence[str] = tuple(HETERO_METHODS)) -> list[dict]:
    """Write the heterogeneous grid's ``table.md`` and ``table.csv`` (atomically); returns the rows."""
    rows = table_rows(results)
    atomic_write_bytes(Path(out) / "table.md", render_hetero_markdown(rows, methods_order).encode())
    atomic_write_bytes(Path(out) / "table.csv", _csv_bytes(rows, HETERO_FIELDS))
    return rows


def _csv_bytes(rows: Sequence[dict], fields: Sequence[str]) -> bytes:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(fields), extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if v is None or (isinstance(v, float) and math.isnan(v)) else
                        (round(v, 4) if isinstance(v, float) else v)) for k, v in r.items()})
    return buf.getvalue().encode()


TABLE_FIELDS = ("dataset", "stdev", "method", "algorithm", "model", "ways", "seeds", "failed", "acc_mean",
                "acc_std_clients", "acc_std_seeds", "acc_proto_mean", "acc_proto_std_clients", "acc_proto_std_seeds",
                "acc_global_mean", "acc_global_std_clients", "acc_global_std_seeds", "paper_mean", "paper_std",
                "rounds", "paper_rounds", "params_up_per_round", "paper_params_k", "message")


def write_status(out: Path, results: Sequence[CellResult]) -> None:
    atomic_write_json(Path(out) / "status.json", [
        {"name": r.cell.name, "dataset": r.cell.dataset, "ways": r.cell.ways, "method": r.cell.method,
         "seed": r.cell.seed, "param": r.cell.param, "value": r.cell.value, "status": r.status,
         "message": r.message, "wall_s": r.wall_s}
        for r in results
    ])


def write_table(out: Path, results: Sequence[CellResult], methods_order: Sequence[str] = tuple(METHODS)) -> list[dict]:
    """Write ``table.md`` and ``table.csv`` (atomically); returns the rows."""
    rows = table_rows(results)
    atomic_write_bytes(Path(out) / "table.md", render_markdown(rows, methods_order).encode())
    atomic_write_bytes(Path(out) / "table.csv", _csv_bytes(rows, TABLE_FIELDS))
    return rows


def describe(r: CellResult) -> str:
    """One progress line for a finished cell."""
    if r.status == "failed":
        return f"[red]failed[/]: {escape(short(r.message))}"
    m, s = _acc(r.summary, "acc")
    txt = f"acc {_pm(100 * m, 100 * s)}"
    mp, sp = _acc(r.summary, "acc_proto")
    if mp == mp:
        txt += f", proto {_pm(100 * mp, 100 * sp)}"
    mg, sg = _acc(r.summary, "acc_global")
    if mg == mg:
        txt += f", global {_pm(100 * mg, 100 * sg)}"
    up = (r.summary.get("params_per_round") or {}).get("up")
    if up is not None:
        txt += f", up {up / 1e3:.1f}k/round"
    if r.status == "skipped":
        return f"[yellow]skipped[/] (finished earlier): {txt}"
    return f"[green]done[/] in {r.wall_s:.1f} s: {txt}"


def run_cells(cells: Sequence[Cell], out: Path, console=None, after: Callable[[list], None] | None = None,
              progress: bool = False) -> list[CellResult]:
    """Run cells in order, print one line per cell, call ``after(results)`` after each."""
    results: list[CellResult] = []
    total = len(cells)
    width = len(str(total))
    try:
        for i, cell in enumerate(cells, 1):
            r = run_cell(cell, progress=progress)
            results.append(r)
            if console is not None:
                console.print(f"{escape(f'[{i:>{width}}/{total}]')} {escape(cell.name)}  {describe(r)}", markup=True,
                              highlight=False, soft_wrap=True)
            write_status(out, results)
            if after:
                after(results)
    finally:
        write_status(out, results)
    return results


def _make_out(out: Path) -> None:
    """Create OUT and OUT/runs; refuse an OUT whose runs/, table or status paths are not files/folders
    of the right kind (raises ConfigError before any cell runs)."""
    try:
        (out / "runs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the output folder {str(out / 'runs')!r}: {e.strerror or e}; "
                          "choose another --out") from None
    for name in ("table.md", "table.csv", "status.json"):
        if (out / name).is_dir():
            raise ConfigError(f"{str(out / name)!r} is a folder; remove it or choose another --out")


def run_grid(out: str | Path, datasets: Sequence[str] = DEFAULT_DATASETS, ways: Sequence[int] = DEFAULT_WAYS,
             methods: Sequence[str] = tuple(METHODS), seeds: Sequence[int] = DEFAULT_SEEDS,
             rounds: int | None = None, sets: dict | None = None, data_dir: str | None = None,
             console=None, progress: bool = False) -> list[CellResult]:
    """Run the grid and write the tables; returns every cell's result."""
    out = Path(out)
    cells = plan_grid(out, datasets, ways, methods, seeds, rounds, sets, data_dir)
    _make_out(out)
    return run_cells(cells, out, console, after=lambda rs: write_table(out, rs, methods), progress=progress)


def run_hetero(out: str | Path, datasets: Sequence[str] = HETERO_DATASETS, ways: Sequence[int] = HETERO_WAYS,
               methods: Sequence[str] = tuple(HETERO_METHODS), seeds: Sequence[int] = HETERO_SEEDS,
               rounds: int | None = None, sets: dict | None = None, data_dir: str | None = None,
               console=None, progress: bool = False) -> list[CellResult]:
    """Run the model-heterogeneous grid (:func:`plan_hetero`) and write its tables
    (:func:`write_hetero_table`); returns every cell's result."""
    out = Path(out)
    cells = plan_hetero(out, datasets, ways, methods, seeds, rounds, sets, data_dir)
    _make_out(out)
    return run_cells(cells, out, console, after=lambda rs: write_hetero_table(out, rs, methods), progress=progress)


# ------------------------------------------------------------------------------------------------
# sweeps

SWEEP_FIELDS = ("param", "value", "method", "dataset", "ways", "seeds", "failed", "acc_mean", "acc_std",
                "acc_std_seeds", "acc_global_mean", "acc_global_std", "acc_proto_mean", "acc_proto_std",
                "loss_proto_train", "proto_mse_test", "rounds", "params_up_per_round", "message")


def sweep_rows(results: Sequence[CellResult]) -> list[dict]:
    """One row per (method, value), seeds combined by :func:`seed_stats` (accuracies in %)."""
    groups: dict[tuple, list[CellResult]] = {}
    for r in results:
        groups.setdefault((r.cell.method, json.dumps(r.cell.value)), []).append(r)
    rows = []
    for (method, _), rs in groups.items():
        ok = [r for r in rs if r.status in ("done", "skipped") and r.summary]
        acc = seed_stats([tuple(100 * v for v in _acc(r.summary, "acc")) for r in ok])
        accp = seed_stats([tuple(100 * v for v in _acc(r.summary, "acc_proto")) for r in ok])
        accg = seed_stats([tuple(100 * v for v in _acc(r.summary, "acc_global")) for r in ok])
        d = [Path(r.cell.cfg.out_dir) / r.cell.name for r in ok]
        lp = [x for x in (_last_loss_proto(p) for p in d) if x == x]
        pm = [x for x in (proto_mse(p) for p in d) if x == x]
        up = [r.summary["params_per_round"]["up"] for r in ok if r.summary.get("params_per_round")]
        c = rs[0].cell
        rows.append({
            "param": c.param, "value": c.value, "method": method, "dataset": c.dataset, "ways": c.ways,
            "seeds": acc["n"], "failed": sum(r.status == "failed" for r in rs),
            "acc_mean": acc["mean"], "acc_std": acc["std_clients"], "acc_std_seeds": acc["std_seeds"],
            "acc_global_mean": accg["mean"], "acc_global_std": accg["std_clients"],
            "acc_proto_mean": accp["mean"], "acc_proto_std": accp["std_clients"],
            "loss_proto_train": float(np.mean(lp)) if lp else float("nan"),
            "proto_mse_test": float(np.mean(pm)) if pm else float("nan"),
            "rounds": c.cfg.rounds, "params_up_per_round": float(np.mean(up)) if up else float("nan"),
            "message": "; ".join(f"{r.cell.name}: {short(r.message)}" for r in rs if r.status == "failed"),
        })
    return rows


def write_sweep(out: Path, param: str, fld: str, results: Sequence[CellResult]) -> tuple[Path, Path]:
    """``sweep_<param>.csv`` and ``sweep_<param>.png`` (fig. 3 / fig. 4 style)."""
    from fedproto.plots import plot_sweep

    rows = sweep_rows(results)
    csv_path = Path(out) / f"sweep_{param}.csv"
    atomic_write_bytes(csv_path, _csv_bytes(rows, SWEEP_FIELDS))
    c = results[0].cell if results else None
    where = f"{c.dataset}, n={c.ways}, {c.cfg.clients} clients" if c else ""
    is_lambda = fld == "lambda_proto"
    label = {"lambda_proto": "λ", "shots": "samples per class k"}.get(fld, param)
    fig = "fig. 4" if is_lambda else ("fig. 3" if fld == "shots" else "sweep")
    png = plot_sweep(rows, "value", Path(out) / f"sweep_{param}.png", y="acc_mean", yerr="acc_std",
                     y2="proto_mse_test" if is_lambda else None, group="method", xlabel=label,
                     y2label="prototype loss (test MSE to global prototypes)" if is_lambda else None,
                     title=f"{fig}: accuracy vs {label} ({where})", percent=False)
    return csv_path, png


def run_sweep(out: str | Path, spec: str, dataset: str | None = None, ways: int | None = None,
              methods: Sequence[str] | None = None, seeds: Sequence[int] = DEFAULT_SEEDS,
              rounds: int | None = None, sets: dict | None = None, data_dir: str | None = None,
              console=None, progress: bool = False) -> tuple[list[CellResult], Path, Path]:
    """Run a one-parameter sweep; dataset/ways/methods default to the paper figure's setting."""
    out = Path(out)
    param, fld, values = parse_sweep(spec)
    d_ds, d_n, d_m = SWEEP_DEFAULTS.get(fld, ("mnist", 3, ("fedproto",)))
    cells = plan_sweep(out, param, fld, values, dataset or d_ds, ways or d_n, list(methods or d_m), seeds, rounds,
                       sets, data_dir)
    _make_out(out)
    results = run_cells(cells, out, console, progress=progress)
    csv_path, png = write_sweep(out, param, fld, results)
    return results, csv_path, png
