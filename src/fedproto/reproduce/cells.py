"""One cell of ``fedproto reproduce``: whether it is done already (:func:`finished`) and running it
(:func:`run_cell`). Part of :mod:`fedproto.reproduce`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from fedproto.config.run_config import ADDED_FIELDS, result_fields
from fedproto.errors import CheckpointError, CheckpointMismatch, FedprotoError
from fedproto.outputs.checkpoint import CHECKPOINT_FILE
from fedproto.outputs.run_folder import _clean
from fedproto.reproduce.grid import (
    Cell,
    CellResult,
)

log = logging.getLogger("fedproto.reproduce")  # one logger for the package

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
"""The environment variables that size the thread pools of torch and the BLAS libraries; set in a
cell's own process (``--jobs``, ``--ray``) before torch is imported there."""


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
    :func:`fedproto.config.run_options.set_wording`."""
    from fedproto.config.run_options import set_wording

    return error.render(set_wording)
