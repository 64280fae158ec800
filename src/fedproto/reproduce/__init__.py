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

The package: :mod:`~fedproto.reproduce.grid` (methods, grids, cells),
:mod:`~fedproto.reproduce.cells` (one cell's run), :mod:`~fedproto.reproduce.tables` and
:mod:`~fedproto.reproduce.hetero` (results and tables), :mod:`~fedproto.reproduce.runs` (grids
and sweeps), :mod:`~fedproto.reproduce.side_by_side` (cells side by side: ``--jobs``) and
:mod:`~fedproto.reproduce.raycells` (cells as Ray tasks: ``--ray``); every name is importable from
``fedproto.reproduce`` as before.
"""

from __future__ import annotations

from fedproto.reproduce.cells import (
    _valid_summary,
    comparable,
    finished,
    run_cell,
    set_message,
)
from fedproto.reproduce.grid import (
    DEFAULT_DATASETS,
    DEFAULT_SEEDS,
    DEFAULT_WAYS,
    GRID_KEYS,
    GRIDS,
    HETERO_DATASETS,
    HETERO_METHODS,
    HETERO_MODELS,
    HETERO_ROUNDS,
    HETERO_SEEDS,
    HETERO_WAYS,
    HETEROGENEOUS,
    METHODS,
    MH_MODELS,
    MODELS,
    SWEEP_ALIASES,
    SWEEP_DEFAULTS,
    Cell,
    CellResult,
    _sweep_ref,
    algorithm_of,
    cell_config,
    cell_name,
    default_rounds,
    model_for,
    parse_list,
    parse_sets,
    parse_sweep,
    parse_value,
    plan_grid,
    plan_hetero,
    plan_sweep,
)
from fedproto.reproduce.hetero import (
    HETERO_CAPTION,
    HETERO_FIELDS,
    ranking,
    render_hetero_markdown,
    write_hetero_table,
)
from fedproto.reproduce.runs import (
    SWEEP_FIELDS,
    _make_out,
    run_cells,
    run_grid,
    run_hetero,
    run_sweep,
    sweep_rows,
    write_sweep,
)
from fedproto.reproduce.tables import (
    CAPTION,
    TABLE_FIELDS,
    _acc,
    _csv_bytes,
    _last_loss_proto,
    _ordered,
    _ours_cell,
    _pm,
    describe,
    proto_mse,
    render_markdown,
    seed_stats,
    short,
    table_rows,
    write_status,
    write_table,
)

__all__ = [
    "CAPTION",
    "Cell",
    "CellResult",
    "DEFAULT_DATASETS",
    "DEFAULT_SEEDS",
    "DEFAULT_WAYS",
    "GRIDS",
    "GRID_KEYS",
    "HETEROGENEOUS",
    "HETERO_CAPTION",
    "HETERO_DATASETS",
    "HETERO_FIELDS",
    "HETERO_METHODS",
    "HETERO_MODELS",
    "HETERO_ROUNDS",
    "HETERO_SEEDS",
    "HETERO_WAYS",
    "METHODS",
    "MH_MODELS",
    "MODELS",
    "SWEEP_ALIASES",
    "SWEEP_DEFAULTS",
    "SWEEP_FIELDS",
    "TABLE_FIELDS",
    "_acc",
    "_csv_bytes",
    "_last_loss_proto",
    "_make_out",
    "_ordered",
    "_ours_cell",
    "_pm",
    "_sweep_ref",
    "_valid_summary",
    "algorithm_of",
    "cell_config",
    "cell_name",
    "comparable",
    "default_rounds",
    "describe",
    "finished",
    "model_for",
    "parse_list",
    "parse_sets",
    "parse_sweep",
    "parse_value",
    "plan_grid",
    "plan_hetero",
    "plan_sweep",
    "proto_mse",
    "ranking",
    "render_hetero_markdown",
    "render_markdown",
    "run_cell",
    "run_cells",
    "run_grid",
    "run_hetero",
    "run_sweep",
    "seed_stats",
    "set_message",
    "short",
    "sweep_rows",
    "table_rows",
    "write_hetero_table",
    "write_status",
    "write_sweep",
    "write_table",
]
