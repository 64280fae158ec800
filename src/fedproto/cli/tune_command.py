"""``fedproto tune``: hyperparameter search on the clients' validation data, the best settings
retrained and reported on the test data beside the baselines tuned alike (:mod:`fedproto.tuning`,
docs/tuning.md; docs/architecture.md, "Module map": ``cli``). Optuna and the engine are imported
when the command runs: ``--help`` needs neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from fedproto.cli.console import _error, console, err_console
from fedproto.errors import NO_VALUE, FedprotoError


def tune(
    dataset: Optional[str] = typer.Option(None, help="Dataset (default: the --config file's, else mnist)."),
    method: str = typer.Option("fedproto", help="The method tuned."),
    space: Optional[list[str]] = typer.Option(None, "--space", help="A dimension, repeatable: name=log:LOW:HIGH, "
                                              "float:LOW:HIGH, int:LOW:HIGH, intlog:LOW:HIGH, cat:A,B,C or bool, "
                                              "e.g. --space lambda_proto=log:0.01:10 (default: lambda_proto and lr)"),
    config: Optional[Path] = typer.Option(None, "--config", help="TOML file: run options (top level or \\[run]) and "
                                          "a \\[space] table (docs/tuning.md)."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="key=value: a fixed run option (repeatable), "
                                             "e.g. --set clients=10"),
    rounds: Optional[int] = typer.Option(None, help="Rounds of every trial and final run (same as --set rounds=N)."),
    trials: Optional[int] = typer.Option(None, help="Trials per method (default 20; with --timeout: none)."),
    timeout: Optional[float] = typer.Option(None, help="Seconds per method after which no trial starts."),
    baselines: Optional[str] = typer.Option(None, help="Comma list of methods tuned alike for the table, e.g. "
                                            "local,fd"),
    val_fraction: float = typer.Option(0.2, help="Share of each class of each client's training data held out "
                                       "for validation."),
    final_seeds: int = typer.Option(3, help="Seeds of the final runs of each method's best settings (0: none)."),
    metric: str = typer.Option("acc", help="acc (classifier), acc_proto (nearest prototype) or acc_global."),
    seed: int = typer.Option(1234, help="Seed of the sampler, the split and the trials; the final runs use "
                             "SEED..SEED+final_seeds-1."),
    out: Path = typer.Option(Path("tune"), "--out", help="Output folder (study.db, best.toml, plots/, table.md)."),
    storage: Optional[str] = typer.Option(None, help="Optuna storage URL (default: sqlite:///OUT/study.db), e.g. "
                                          "postgresql://user@host/db for several machines."),
    study_name: str = typer.Option("tune", help="Study name prefix (one study per method: NAME-METHOD); the "
                                   "same name resumes."),
    jobs: int = typer.Option(1, help="Trials at once, each in its own process."),
    threads: Optional[int] = typer.Option(None, help="Thread budget the jobs share (default: the cores)."),
):
    """Search run options on validation data (Optuna); retrain the best, report on test data.

    Exits 2 on a bad option (before any trial), 1 when a method has no complete trial."""
    from fedproto import tuning
    from fedproto.reproduce import parse_list, parse_sets

    try:
        sets = parse_sets(set_, grid=False)
        if rounds is not None:
            sets["rounds"] = rounds
        result = tuning.tune(space, dataset=dataset, method=method, options=sets, config=config, trials=trials,
                             timeout=timeout, out=out, storage=storage, study_name=study_name, jobs=jobs,
                             threads=threads, seed=seed, val_fraction=val_fraction, final_seeds=final_seeds,
                             baselines=parse_list(baselines, [], "baselines"), metric=metric, console=console)
    except FedprotoError as e:
        _error(e.render(_wording))
    except KeyboardInterrupt:
        err_console.print(f"interrupted; the trials finished so far are in the study ({out}); run the same command "
                          "again to resume", highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    _print_table(result)
    empty = [m for m, b in result.best.items() if b is None]
    if empty:  # nothing to report for them: not a success
        err_console.print(f"no trial of {', '.join(empty)} completed (all pruned or failed, or the --timeout came "
                          "first): no best settings; see the errors above, or give more --trials or --timeout",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _wording(option: str, value: Any = NO_VALUE) -> str:
    """An option as ``fedproto tune`` takes it: ``--set shots=10``, ``--rounds 3``, ``--method fd``
    (:func:`fedproto.config.run_options.set_wording` without reproduce's grid options)."""
    from fedproto.config.run_options import set_wording

    own = {"rounds": "--rounds", "dataset": "--dataset", "algorithm": "--method", "seed": "--seed"}
    if option in own:
        return own[option] + ("" if value is NO_VALUE else f" {value}")
    if option in ("ways", "out_dir", "name", "data_dir"):  # reproduce's own options there; --set here
        return f"--set {option}=" + ("..." if value is NO_VALUE else str(value))
    return set_wording(option, value)


def _print_table(result) -> None:
    from rich.table import Table

    table = Table(title="tuned on validation data; test accuracy of the best settings, retrained",
                  caption="validation: the best trial's, %; test: mean ± std over the final seeds, %; trials: "
                          "complete/pruned/failed")
    for col, just in (("method", "left"), ("validation", "right"), ("test", "right"), ("trials", "right"),
                      ("settings", "left")):
        table.add_column(col, justify=just, overflow="fold")
    def pct(x: float) -> str:
        return "—" if x != x else f"{100 * x:.1f}"

    for r in result.rows:
        table.add_row(r["method"], pct(r["best_validation"]),
                      f"{pct(r['test_mean'])} ± {pct(r['test_std'])}" if r["seeds"] else "—",
                      f"{r['trials_complete']}/{r['trials_pruned']}/{r['trials_failed']}", r["settings"] or "—")
    console.print(table)
    best = result.files.get("best", {})
    console.print(f"wrote {', '.join(str(p) for p in best.values()) or 'no best settings'}, "
                  f"{len(result.files.get('plots', []))} plots, {result.files.get('table')}; study: "
                  f"{result.files.get('storage')}", highlight=False, soft_wrap=True)


__all__ = ["tune"]
