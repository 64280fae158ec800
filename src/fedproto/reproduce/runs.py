"""Running a grid or a sweep of ``fedproto reproduce`` (:func:`run_grid`, :func:`run_hetero`,
:func:`run_sweep`) and the sweep's table. Part of :mod:`fedproto.reproduce`.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
from rich.markup import escape

from fedproto.errors import ConfigError
from fedproto.outputs.atomic import outermost_new, remove_empty_folders
from fedproto.outputs.run_folder import atomic_write_bytes
from fedproto.reproduce.cells import (
    run_cell,
)
from fedproto.reproduce.grid import (
    DEFAULT_DATASETS,
    DEFAULT_SEEDS,
    DEFAULT_WAYS,
    HETERO_DATASETS,
    HETERO_METHODS,
    HETERO_SEEDS,
    HETERO_WAYS,
    METHODS,
    SWEEP_DEFAULTS,
    Cell,
    CellResult,
    parse_sweep,
    plan_grid,
    plan_hetero,
    plan_sweep,
)
from fedproto.reproduce.hetero import (
    write_hetero_table,
)
from fedproto.reproduce.tables import (
    _acc,
    _csv_bytes,
    _last_loss_proto,
    describe,
    proto_mse,
    seed_stats,
    short,
    write_status,
    write_table,
)

log = logging.getLogger("fedproto.reproduce")  # one logger for the package


def run_cells(cells: Sequence[Cell], out: Path, console=None, after: Callable[[list], None] | None = None,
              progress: bool = False, jobs: int | None = None, ray: str | None = None) -> list[CellResult]:
    """Run cells, print one line per cell (with cells done / running / failed and the time left),
    call ``after(results)`` after each. ``jobs`` (cells at once in local processes) or ``ray`` (a
    Ray cluster: ``"auto"`` or an address) run them side by side
    (:func:`fedproto.reproduce.side_by_side.run_side_by_side`); neither: one after the other in this
    process.

    Raises:
        ConfigError: ``jobs`` below 1; ``ray`` without Ray installed or its cluster unreachable.
    """
    if jobs is not None or ray is not None:
        from fedproto.reproduce.side_by_side import run_side_by_side

        return run_side_by_side(cells, out, console, after, jobs=jobs, ray=ray)
    from fedproto.reproduce.side_by_side import Tally

    results: list[CellResult] = []
    total = len(cells)
    width = len(str(total))
    tally = Tally(total, 1)
    try:
        for i, cell in enumerate(cells, 1):
            tally.start()
            r = run_cell(cell, progress=progress)
            tally.end(r)
            results.append(r)
            if console is not None:
                console.print(f"{escape(f'[{i:>{width}}/{total}]')} {escape(cell.name)}  {describe(r)}  "
                              f"[dim]{escape(tally.line())}[/]", markup=True, highlight=False, soft_wrap=True)
            write_status(out, results)
            if after:
                after(results)
    finally:
        write_status(out, results)
    return results


@contextlib.contextmanager
def _make_out(out: Path) -> Iterator[None]:
    """Create OUT and OUT/runs for the block; refuse an OUT whose runs/, table or status paths are not
    files/folders of the right kind (raises ConfigError before any cell runs). A block refused with a
    ConfigError before any cell ran (a bad ``--jobs``, an unreachable ``--ray``) leaves no folder it
    created (only empty folders are removed)."""
    top = outermost_new(out)
    new = not (out / "runs").exists()
    _create_out(out)
    try:
        yield
    except ConfigError:
        if new:
            status = out / "status.json"
            if status.is_file() and status.read_text().strip() in ("", "[]"):
                status.unlink()
            remove_empty_folders(out / "runs", top)  # runs/, then OUT and the parents created for it
        raise


def _create_out(out: Path) -> None:
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
             console=None, progress: bool = False, jobs: int | None = None,
             ray: str | None = None) -> list[CellResult]:
    """Run the grid and write the tables; returns every cell's result. ``jobs``, ``ray``: cells
    side by side (:func:`run_cells`)."""
    out = Path(out)
    cells = plan_grid(out, datasets, ways, methods, seeds, rounds, sets, data_dir)
    with _make_out(out):
        return run_cells(cells, out, console, after=lambda rs: write_table(out, rs, methods), progress=progress,
                         jobs=jobs, ray=ray)


def run_hetero(out: str | Path, datasets: Sequence[str] = HETERO_DATASETS, ways: Sequence[int] = HETERO_WAYS,
               methods: Sequence[str] = tuple(HETERO_METHODS), seeds: Sequence[int] = HETERO_SEEDS,
               rounds: int | None = None, sets: dict | None = None, data_dir: str | None = None,
               console=None, progress: bool = False, jobs: int | None = None,
               ray: str | None = None) -> list[CellResult]:
    """Run the model-heterogeneous grid (:func:`plan_hetero`) and write its tables
    (:func:`write_hetero_table`); returns every cell's result. ``jobs``, ``ray``: cells side by
    side (:func:`run_cells`)."""
    out = Path(out)
    cells = plan_hetero(out, datasets, ways, methods, seeds, rounds, sets, data_dir)
    with _make_out(out):
        return run_cells(cells, out, console, after=lambda rs: write_hetero_table(out, rs, methods),
                         progress=progress, jobs=jobs, ray=ray)


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
              console=None, progress: bool = False, jobs: int | None = None,
              ray: str | None = None) -> tuple[list[CellResult], Path, Path]:
    """Run a one-parameter sweep; dataset/ways/methods default to the paper figure's setting.
    ``jobs``, ``ray``: cells side by side (:func:`run_cells`)."""
    out = Path(out)
    param, fld, values = parse_sweep(spec)
    d_ds, d_n, d_m = SWEEP_DEFAULTS.get(fld, ("mnist", 3, ("fedproto",)))
    cells = plan_sweep(out, param, fld, values, dataset or d_ds, ways or d_n, list(methods or d_m), seeds, rounds,
                       sets, data_dir)
    with _make_out(out):
        results = run_cells(cells, out, console, progress=progress, jobs=jobs, ray=ray)
    csv_path, png = write_sweep(out, param, fld, results)
    return results, csv_path, png
