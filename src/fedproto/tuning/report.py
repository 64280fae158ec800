"""What ``fedproto tune`` hands back: the best settings as a run TOML, the study's plots, the
final runs (the best settings retrained on the full training data over several seeds, scored on
the test data, :mod:`fedproto.reproduce`'s cells) and the table of every method tuned.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import warnings
from pathlib import Path
from typing import Any

from fedproto.config.run_config import toml_value
from fedproto.outputs.run_folder import atomic_write_bytes

log = logging.getLogger("fedproto.tuning")

TABLE_FIELDS = ("method", "best_validation", "test_mean", "test_std", "seeds", "trials_complete", "trials_pruned",
                "trials_failed", "settings")


def best_of(study) -> tuple[dict, float, int] | None:
    """(the best trial's params, its validation value, its number); None without a complete trial."""
    try:
        t = study.best_trial
    except ValueError:
        return None
    return dict(t.params), float(t.value), int(t.number)


def write_best_toml(path: Path, base: dict[str, Any], params: dict[str, Any], note: str) -> Path:
    """A run configuration ``fedproto run --config`` takes: ``base``'s options, then the tuned ones.

    Args:
        path: the file written (atomically). base: the fixed run options. params: the tuned
            options (field -> value). note: a comment line on top (where they come from).
    """
    lines = [f"# {line}" for line in note.splitlines()]
    skip = {"out_dir", "name", "threads"}
    lines += ["", "# the fixed options of the search"]
    lines += [f"{k} = {toml_value(v)}" for k, v in base.items() if k not in skip and k not in params and v is not None]
    lines += ["", "# tuned on the clients' validation data"]
    lines += [f"{k} = {toml_value(v)}" for k, v in params.items()]
    atomic_write_bytes(Path(path), ("\n".join(lines) + "\n").encode())
    return Path(path)


def write_plots(study, out: Path, prefix: str = "") -> list[Path]:
    """The study's optimization history, parameter importances and a slice for ``lambda_proto``
    (when searched) as PNGs in ``out`` (optuna.visualization.matplotlib); a plot the study cannot
    give yet (importances need two complete trials) is left out with a log line."""
    import sys

    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:  # no window: the figures go to files (a notebook keeps its backend)
        matplotlib.use("Agg")
    from optuna.visualization import matplotlib as ovm

    from fedproto.plots.canvas import save_figure

    space = {k for t in study.get_trials(deepcopy=False) for k in t.params}
    plots = [("optimization_history", lambda: ovm.plot_optimization_history(study)),
             ("param_importances", lambda: ovm.plot_param_importances(study, evaluator=_evaluator()))]
    if "lambda_proto" in space:
        plots.append(("slice_lambda_proto", lambda: ovm.plot_slice(study, params=["lambda_proto"])))
    written = []
    for name, draw in plots:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ax = draw()
            first = ax.flat[0] if hasattr(ax, "flat") else ax
            fig = first.figure
            fig.set_size_inches(7, 4.5)
            written.append(save_figure(fig, Path(out) / f"{prefix}{name}.png"))
            import matplotlib.pyplot as plt

            plt.close(fig)
        except (ValueError, RuntimeError, ZeroDivisionError) as e:
            log.warning("%s: no %s plot yet (%s)", study.study_name, name, e)
    return written


def _evaluator():
    """fANOVA importances with 16 trees (Optuna's default 64 takes seconds for a handful of trials), seeded."""
    from optuna.importance import FanovaImportanceEvaluator

    return FanovaImportanceEvaluator(n_trees=16, seed=0)


def final_cells(method: str, base: dict, params: dict, seeds: list[int], runs: Path) -> list:
    """The final runs of a method's best settings: one :class:`~fedproto.reproduce.grid.Cell` per
    seed on the full training data, scored on the test data."""
    from fedproto.config.run_config import build_config
    from fedproto.reproduce.grid import Cell

    cells = []
    for s in seeds:
        name = f"{method}-s{s}"
        cfg = build_config(None, {**base, **params, "seed": s, "out_dir": str(runs), "name": name})
        cells.append(Cell(cfg.dataset, cfg.ways, method, s, cfg, name))
    return cells


def trial_counts(study) -> dict[str, int]:
    """Complete, pruned and failed trials (interrupted ones left out)."""
    from optuna.trial import TrialState

    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("interrupted")]
    return {k: sum(t.state == s for t in trials) for k, s in (("complete", TrialState.COMPLETE),
                                                              ("pruned", TrialState.PRUNED),
                                                              ("failed", TrialState.FAIL))}


def table_row(method: str, study, results: list, metric: str) -> dict[str, Any]:
    """One method's line: its best validation value, its final runs' test accuracy (mean and
    std over seeds of the mean over clients), its trials and settings."""
    best = best_of(study)
    accs = [r.summary["accuracy"][metric]["mean"] for r in results
            if r.summary and metric in r.summary.get("accuracy", {})]
    mean = sum(accs) / len(accs) if accs else math.nan
    std = (math.sqrt(sum((a - mean) ** 2 for a in accs) / (len(accs) - 1)) if len(accs) > 1
           else 0.0 if accs else math.nan)
    n = trial_counts(study)
    return {"method": method, "best_validation": best[1] if best else math.nan, "test_mean": mean,
            "test_std": std, "seeds": len(accs), "trials_complete": n["complete"], "trials_pruned": n["pruned"],
            "trials_failed": n["failed"],
            "settings": ", ".join(f"{k}={_short(v)}" for k, v in (best[0] if best else {}).items())}


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _pct(x: float) -> str:
    return "—" if x != x else f"{100 * x:.1f}"


def write_table(rows: list[dict], out: Path, caption: str) -> tuple[Path, Path]:
    """``table.md`` (the fair table) and ``table.csv`` in ``out``."""
    md = [caption, "", "| method | validation (best trial) | test, mean ± std over seeds | trials (complete / pruned "
          "/ failed) | tuned settings |", "|---|---|---|---|---|"]
    for r in rows:
        test = f"{_pct(r['test_mean'])} ± {_pct(r['test_std'])} ({r['seeds']})" if r["seeds"] else "—"
        md.append(f"| {r['method']} | {_pct(r['best_validation'])} | {test} | {r['trials_complete']} / "
                  f"{r['trials_pruned']} / {r['trials_failed']} | {r['settings'] or '—'} |")
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=TABLE_FIELDS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    p_md, p_csv = Path(out) / "table.md", Path(out) / "table.csv"
    atomic_write_bytes(p_md, ("\n".join(md) + "\n").encode())
    atomic_write_bytes(p_csv, buf.getvalue().encode())
    return p_md, p_csv


__all__ = ["TABLE_FIELDS", "best_of", "final_cells", "table_row", "trial_counts", "write_best_toml", "write_plots",
           "write_table"]
