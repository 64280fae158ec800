"""``fedproto tune``: hyperparameter search over any run options, never on the test data
(docs/tuning.md).

For the method and each baseline, one Optuna study (TPE sampler, seeded; median pruning on the
validation accuracy of the rounds so far) stored in a database (SQLite in the output folder by
default), so a stopped search resumes and several processes or machines fill one study. Each
trial trains on the clients' training data minus a per-class validation share and is scored on
that share (:mod:`fedproto.tuning.split`); the test split is never read. The best settings are
then retrained on the full training data over several seeds and scored on the test data, every
method with the same budget and procedure: the table is fair.

The package: :mod:`~fedproto.tuning.space` (the search space), :mod:`~fedproto.tuning.split`
(validation splits), :mod:`~fedproto.tuning.study` (studies, trials, workers),
:mod:`~fedproto.tuning.report` (best TOML, plots, final runs, table), :mod:`~fedproto.tuning.preflight`
(what is refused before any study is made). Needs the ``tune`` extra
(``pip install "fedproto[tune]"``: Optuna).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedproto.errors import ConfigError

log = logging.getLogger("fedproto.tuning")

OUTPUTS = {"storage": "study.db", "best": "best.toml", "table": "table.md", "plots": "plots", "final": "final"}
"""What ``fedproto tune`` writes in its output folder."""


@dataclass
class TuneResult:
    """What :func:`tune` returns.

    Attributes:
        studies: method -> its ``optuna.Study``. best: method -> its best settings (None: no
            complete trial). rows: the table's rows (:data:`fedproto.tuning.report.TABLE_FIELDS`).
        files: what was written (``best``, ``table``, ``storage``, the plots, ...).
    """

    studies: dict[str, Any]
    best: dict[str, dict | None]
    rows: list[dict]
    files: dict[str, Any] = field(default_factory=dict)


def require_optuna() -> None:
    """ConfigError (with the install line) when Optuna is missing."""
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise ConfigError('fedproto tune needs Optuna, which is not installed; pip install "fedproto[tune]"') from None


def read_config(path: str | Path | None) -> tuple[dict, dict]:
    """A tune TOML file -> (its run options: top level and ``[run]``, its ``[space]`` table).

    Raises:
        ConfigError: the file is missing or not TOML.
    """
    if path is None:
        return {}, {}
    from fedproto.config.run_options import tomllib

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing TOML file")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8-sig"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    space = data.pop("space", {})
    if not isinstance(space, dict):
        raise ConfigError(f"config file {str(p)!r}: space must be a table ([space])")
    run = data.pop("run", {}) if isinstance(data.get("run"), dict) else {}
    return {**data, **run}, space


def _space_args(space: Any) -> tuple[list[str], dict]:
    if space is None:
        return [], {}
    if isinstance(space, dict):
        return [], dict(space)
    if isinstance(space, str):
        return [space], {}
    return list(space), {}


def tune(space: dict | Sequence[str] | str | None = None, *, dataset: str | None = None, method: str = "fedproto",
         options: dict | None = None, config: str | Path | None = None, trials: int | None = None,
         timeout: float | None = None, out: str | Path = "tune", storage: str | None = None,
         study_name: str = "tune", jobs: int = 1, threads: int | None = None, seed: int = 1234,
         val_fraction: float = 0.2, final_seeds: int = 3, baselines: Sequence[str] = (), metric: str = "acc",
         plots: bool = True, clients: Callable[[int], Sequence[Any]] | None = None, num_classes: int | None = None,
         console: Any = None) -> TuneResult:
    """Search run options for ``method`` (and each baseline, with the same budget), on the clients'
    validation data; retrain the best settings and report them on the test data.

    Args:
        space: the dimensions: ``{"lambda_proto": "log:0.01:10", "distance": {"type": "categorical",
            "choices": [...]}}`` or ``["lr=log:1e-3:0.1", ...]`` (:mod:`fedproto.tuning.space`);
            None: the ``[space]`` of ``config``, else :data:`~fedproto.tuning.space.DEFAULT_SPACE`.
        dataset: the dataset (or in ``options``/``config``). method: the algorithm tuned.
        options: fixed run options (field -> value; over ``config``'s). config: a TOML file of run
            options and a ``[space]`` table.
        trials: trials per study (None with ``timeout``: time only; both None: 20).
        timeout: seconds per study after which no trial starts.
        out: the output folder. storage: an Optuna storage URL (default: SQLite ``out/study.db``).
        study_name: the studies are ``<study_name>-<method>``. jobs: trials at once (processes).
        threads: the thread budget the jobs share (None: this machine's cores).
        seed: the sampler's, the split's and the trials' run seed; the final runs use
            ``seed .. seed + final_seeds - 1``; written into ``best.toml``. val_fraction: each
            class's held-out share.
        final_seeds: final runs per method (0: none). baselines: other methods, tuned alike (a
            string: one name or a comma list); the caption names each method's trial count and
            warns when they differ.
        metric: ``acc``, ``acc_proto`` or ``acc_global`` (validation and test).
        plots: write the study's plots (``out/plots``).
        clients: your own federation instead of a named dataset: ``make_clients(seed)`` returning a
            list of :class:`fedproto.federation.Client` built anew (:mod:`fedproto.tuning.own`; a
            module-level function for ``jobs > 1``); ``options`` go to ``federate``.
        num_classes: your clients' classes (``federate``'s).
        console: a rich console for the progress bar and lines (None: silent).
    Returns:
        A :class:`TuneResult`.
    Raises:
        ConfigError: Optuna missing, an unknown option in the space ("did you mean"), a bound
            the option refuses, bad budget values, a stored study made with other options, an
            option both fixed and searched, a tune option among the run options, a metric a
            method does not report, a space the method uses none of, an output folder that
            cannot be written (:mod:`fedproto.tuning.preflight`; all before any study is made).
    """
    require_optuna()
    from fedproto.config.run_config import build_config, normal_key
    from fedproto.reproduce.side_by_side import available_cores, check_jobs, thread_share
    from fedproto.tuning import preflight as ck
    from fedproto.tuning import report
    from fedproto.tuning import space as sp
    from fedproto.tuning import study as st

    if metric not in st.METRICS:
        raise ConfigError(f"--metric {metric!r}: choose one of {', '.join(st.METRICS)}")
    for name, v in (("trials", trials), ("final-seeds", final_seeds)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "final-seeds" else 1)):
            raise ConfigError(f"--{name} {v!r}: give a whole number, {'0' if name == 'final-seeds' else '1'} or more")
    if timeout is not None and not timeout > 0:
        raise ConfigError(f"--timeout {timeout!r}: give the seconds per study, more than 0")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"--threads {threads!r}: give a whole number, 1 or more (or leave it out: the cores)")
    if isinstance(baselines, str):  # one name (or a comma list), not its letters
        baselines = [b.strip() for b in baselines.split(",") if b.strip()]
    trials = 20 if trials is None and timeout is None else trials
    jobs = check_jobs(jobs)
    file_opts, file_space = read_config(config)
    ck.check_fixed(file_opts, options or {}, config)
    base = {normal_key(k): v for k, v in {**file_opts, **(options or {})}.items() if v is not None}
    if dataset is not None:
        base["dataset"] = dataset
    if "seed" in base:
        raise ConfigError(f"seed={base['seed']!r} among the fixed options: fedproto tune seeds every run itself; give "
                          "--seed (Python: seed=...) instead")
    items, table = _space_args(space)
    dims = sp.parse_space(items, {**file_space, **table}) if (items or table or file_space) else sp.parse_space(
        [f"{k}={v}" for k, v in sp.DEFAULT_SPACE.items()])
    methods = [method, *[b for b in baselines if b != method]]
    ck.check_not_searched(base, dims, default=not (items or table or file_space))
    ck.check_metric(metric, methods)
    ck.check_space_used(dims, sp.for_method(dims, method), method)
    budget = threads or available_cores()
    share = thread_share(budget, jobs)
    from fedproto.tuning.split import tuning_setup

    if clients is not None and not callable(clients):
        raise ConfigError("clients: give a function make_clients(seed) -> list of fedproto.federation.Client "
                          "(the clients built anew for each run), not a list")
    for m in methods:  # an unknown method, option or bound, data that cannot be split: refused before any trial
        cfg = build_config(None, {**base, "algorithm": m, "seed": seed})
        sp.validate(sp.for_method(dims, m), {**base, "algorithm": m})
        if clients is None:
            tuning_setup(cfg, val_fraction, seed)
    out = Path(out)
    created = ck.prepare_out(out, [OUTPUTS["best"], "table.md", "table.csv", "tune.json",
                                   *[f"best-{m}.toml" for m in methods[1:]]],
                             [OUTPUTS["final"], *([OUTPUTS["plots"]] if plots else [])])
    url = storage or st.sqlite_url(out / OUTPUTS["storage"])
    say = console.print if console is not None else (lambda *a, **k: None)

    studies, best, files = {}, {}, {"storage": url, "plots": [], "best": {}}
    for m in methods:
        mbase = {**base, "algorithm": m, "threads": share}
        mdims = sp.for_method(dims, m)
        left_out = sorted(set(dims) - set(mdims))
        if left_out:
            say(f"{m}: leaves out {', '.join(left_out)} (options it does not use)", highlight=False, soft_wrap=True)
        spec = st.StudySpec(url, f"{study_name}-{m}", m, mbase, mdims, trials if mdims else 1,
                            None if timeout is None else time.time() + timeout, seed, val_fraction, metric,
                            str(out / ".tune.lock"),
                            st.fingerprint(m, mbase, mdims, val_fraction, metric, seed), clients, num_classes)
        try:
            studies[m] = study = st.open_study(spec, create=True)
        except ConfigError:
            ck.undo_out(created)  # a --storage that fails leaves no empty --out behind
            raise
        created = []
        _fill(spec, study, jobs, share, console)
        b = report.best_of(study)
        best[m] = b[0] if b else None
        if b is None:
            errors = [t.user_attrs["error"] for t in study.trials if "error" in t.user_attrs]
            say(f"{m}: no trial completed" + (f"; the first failed with: {errors[0]}" if errors else ""),
                highlight=False, soft_wrap=True)
            continue
        name = OUTPUTS["best"] if m == method else f"best-{m}.toml"
        how = (f"fedproto run --config {out / name}" if clients is None else
               "federate(clients, num_classes, **tomllib.load(open(FILE, 'rb')))")
        files["best"][m] = report.write_best_toml(
            out / name, {**base, "algorithm": m, "seed": seed}, b[0],
            f"fedproto tune: the best of study {spec.study_name!r} ({url}), trial {b[2]}, validation {metric} "
            f"{b[1]:.4f}\nrun it with: {how}")
        files["plots"] += [] if not plots else report.write_plots(study, out / OUTPUTS["plots"], prefix=f"{m}-")

    results: dict[str, list] = {m: [] for m in methods}
    if final_seeds and clients is not None:
        from fedproto.tuning.own import own_final

        for m in methods:
            if best[m] is not None:
                results[m] = own_final(clients, num_classes, {**base, "algorithm": m, "threads": budget, **best[m]},
                                       [seed + i for i in range(final_seeds)], out / OUTPUTS["final"] / "runs", m)
    elif final_seeds:
        from fedproto.reproduce.runs import run_cells

        cells = [c for m in methods if best[m] is not None
                 for c in report.final_cells(m, {**base, "algorithm": m, "threads": budget}, best[m],
                                             [seed + i for i in range(final_seeds)], out / OUTPUTS["final"] / "runs")]
        if cells:
            say(f"final runs: the best settings on the full training data, {final_seeds} seed(s), scored on the test "
                "data", highlight=False, soft_wrap=True)
            (out / OUTPUTS["final"]).mkdir(exist_ok=True)
            side = None if jobs == 1 else min(jobs, len(cells))  # one job: in this process
            for r in run_cells(cells, out / OUTPUTS["final"], console, jobs=side):
                results[r.cell.method].append(r)
    rows = [report.table_row(m, studies[m], results[m], metric) for m in methods]
    data = "your clients" if clients is not None else base.get("dataset", "mnist")
    counts = {m: r["trials_complete"] + r["trials_pruned"] + r["trials_failed"] for m, r in zip(methods, rows)}
    searched = {m: n for m, n in counts.items() if sp.for_method(dims, m)}  # the others: one run of their defaults
    budget_text = (f"{next(iter(searched.values()))} trials per method" if len(set(searched.values())) == 1
                   and len(searched) == len(counts) else "trials per method: " + ", ".join(
                       f"{m} {n}" + ("" if m in searched else " (nothing to search: its defaults)")
                       for m, n in counts.items()))
    if len(set(searched.values())) > 1:
        unfair = (f"the methods were tuned with different budgets ({', '.join(f'{m} {n}' for m, n in searched.items())}"
                  f" trials): not a fair comparison; run again with --trials {max(searched.values())} to top the "
                  "others up")
        budget_text += f" (WARNING: {unfair})"
        log.warning("%s", unfair)
        say(f"warning: {unfair}", highlight=False, soft_wrap=True)
    caption = (f"fedproto tune on {data}: {budget_text}"
               f"{f', {timeout:g} s' if timeout else ''}, scored on {val_fraction:g} of each client's training data "
               f"({metric}); test: the best settings retrained on the full training data, {final_seeds} seed(s)")
    files["table"], files["csv"] = report.write_table(rows, out, caption)
    (out / "tune.json").write_text(json.dumps({"caption": caption, "rows": rows, "best": best, "storage": url},
                                              indent=1, default=str) + "\n")
    return TuneResult(studies, best, rows, files)


def _fill(spec, study, jobs: int, threads: int, console) -> None:
    """Run the study's missing trials with a progress bar over trials."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fedproto.tuning import report
    from fedproto.tuning import study as st

    total = spec.trials
    progress = Progress(TextColumn(f"[bold]{spec.method}[/] trials"), MofNCompleteColumn(), BarColumn(),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
                        disable=console is None)

    def update(s) -> None:
        b = report.best_of(s)
        n = report.trial_counts(s)
        progress.update(task, completed=sum(n.values()),
                        info=f"best {b[1]:.3f}  ({n['pruned']} pruned, {n['failed']} failed)" if b else "")

    with progress:
        task = progress.add_task("trials", total=total, info="")
        update(study)
        if jobs == 1:  # in this process (each trial's run sets torch's threads: the option threads)
            st.work(spec, on_trial=update)
        else:
            st.run_parallel(spec, jobs, threads, on_poll=update)
        update(study)


__all__ = ["OUTPUTS", "TuneResult", "read_config", "require_optuna", "tune"]
