"""Command line: ``fedproto run`` (and friends).

Every :class:`~fedproto.config.RunConfig` field is a flag; ``--config FILE`` reads a TOML file
first, flags override it. Any :class:`~fedproto.errors.FedprotoError` ends the program with one
message on stderr and exit code 2, before training when the cause is the configuration or data.

Size: about 470 lines: the commands (run, reproduce, plot, onboard, ...) and their output tables;
each command is short.
"""

from __future__ import annotations

import errno
import logging
import re
import signal
import sys
import time
import zipfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Optional

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from fedproto.config import build_config
from fedproto.errors import FedprotoError

HELP_OPTIONS = {"help_option_names": ["--help", "-h"]}
"""-h works like --help in every command."""
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings=HELP_OPTIONS, help="Federated prototype learning (FedProto, arXiv 2105.00243).")
# markup off: messages carry paths and "[...]" text; markup is asked for where it is used; emoji off:
# user values such as "cuda:abc" or "x:fire:y" are printed as typed, not as emoji
err_console = Console(stderr=True, markup=False, emoji=False)
console = Console(markup=False, emoji=False)


def _version(value: bool) -> None:
    if value:
        from fedproto import __version__

        console.print(f"fedproto {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO level."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
):
    """Federated prototype learning (FedProto, arXiv 2105.00243)."""
    if verbose:
        logging.getLogger().setLevel(logging.INFO)


RUN_HELP = """Train with the in-process simulator and write a run directory.

Every run option below can also be set in the --config TOML file: its key is the option's field
name, the first flag without the leading dashes ('-' or '_' between words), and a switch is
true or false there (--drop-last/--keep-last: drop_last = false; --no-download: download =
false). Flags override the file. Defaults marked "per dataset" are the paper's for the dataset
chosen. The options page of the docs (docs/options.md) lists every key."""


class _RunCommand(click.Command):
    """``fedproto run``: its help in titled panels like the other commands' (each option's
    ``rich_help_panel``, from :data:`fedproto.options.PANELS`), laid out for its many options: flags
    and value in one column, the help beside them; refuses an option given twice (under one flag or
    two, e.g. --lambda-proto and --lambda), which click would settle silently by taking the last."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from rich.padding import Padding
        from rich.panel import Panel
        from rich.table import Table

        out = Console(markup=False, emoji=False, highlight=False)  # the terminal's width, or $COLUMNS
        out.print(Text.assemble(("\n Usage: ", "yellow"), (f"{ctx.command_path} [OPTIONS]", "bold"), "\n"))
        for paragraph in (self.help or "").split("\n\n"):
            out.print(Padding(Text(" ".join(paragraph.split())), (0, 1, 1, 1)))
        panels: dict[str, list[click.Option]] = {}
        for p in self.get_params(ctx):
            if isinstance(p, click.Option) and not p.hidden:
                panels.setdefault(getattr(p, "rich_help_panel", None) or "Options", []).append(p)
        if "Options" in panels:  # --config and --help first, as typer puts its default panel
            panels = {"Options": panels.pop("Options"), **panels}
        cells = {p.name: self._flags_cell(p, ctx) for ps in panels.values() for p in ps}
        longest = max(len(w) for c in cells.values() for w in c.plain.split())
        width = min(max(len(c.plain) for c in cells.values()), max(longest, int(0.38 * out.width)))
        for title, params in panels.items():
            table = Table(box=None, show_header=False, expand=True, padding=(0, 2, 0, 0), pad_edge=False)
            table.add_column(width=width, overflow="fold")
            table.add_column(ratio=1)
            for p in params:
                table.add_row(cells[p.name], Text(p.help or ""))
            out.print(Panel(table, title=title, title_align="left", border_style="dim"))

    @staticmethod
    def _flags_cell(p: click.Option, ctx: click.Context) -> Text:
        """``--flag, --alias METAVAR`` or ``--switch / --no-switch``, styled as typer styles them."""
        cell = Text()
        for i, f in enumerate(p.opts):
            cell.append(", " if i else "")
            cell.append(f, style="bold cyan")
        for f in p.secondary_opts:
            cell.append(" / ")
            cell.append(f, style="bold magenta")
        if not p.is_flag:
            cell.append(" " + p.make_metavar(ctx), style="bold yellow")
        return cell

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        by_flag = {o: p for p in self.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}
        seen: dict[str, str] = {}
        i = 0
        while i < len(args):
            token = args[i]
            if token == "--":
                break
            name, eq, _ = token.partition("=") if token.startswith("--") else (token, "", "")
            p = by_flag.get(name)
            if p is not None:
                if p.name in seen and not (p.is_flag and seen[p.name] == name):  # -q -q: harmless
                    twice = (f"{name} is given twice" if seen[p.name] == name
                             else f"{seen[p.name]} and {name} both set {p.name}")
                    raise click.UsageError(f"{twice}; give it once", ctx)
                seen[p.name] = name
                if not p.is_flag and not eq:
                    i += 1  # its value, which may look like a flag
            i += 1
        return super().parse_args(ctx, args)


def _python_only(config: Optional[Path], overrides: dict) -> str:
    """How the user set ``dataset = custom`` or ``classes`` (Python-only: own clients come from
    ``federate``), by flag or in the ``--config`` file; '' when neither is set. A file that cannot
    be read is left to :func:`~fedproto.config.build_config`, which reports it."""
    if overrides.get("dataset") == "custom":
        return "--dataset custom"
    if "classes" in overrides:
        return "--classes"
    if config is None:
        return ""
    from fedproto.config import normal_key
    from fedproto.options import tomllib

    try:
        data = tomllib.loads(Path(config).read_text(encoding="utf-8-sig"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError):
        return ""
    run = data.get("run") if isinstance(data.get("run"), dict) else {}
    keys = {normal_key(k): v for k, v in {**data, **run}.items()}
    if keys.get("dataset") == "custom" and "dataset" not in overrides:
        return f'dataset = "custom" in {str(config)!r}'
    if "classes" in keys:
        return f"classes in {str(config)!r}"
    return ""


def _run(config: Optional[Path], resume: bool, quiet: bool, **fields) -> None:
    """``fedproto run``: the flags of every RunConfig field (None: not given) -> one run."""
    overrides = {k: v for k, v in fields.items() if v is not None}
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.table import Table

    from fedproto.engine.setup import prepare

    # here, not at the top: fedproto.results imports numpy, which --help does not need
    from fedproto.results import PREVIOUS, RunDir, round_line
    from fedproto.results import pct as _pct
    from fedproto.simulation import Simulation

    named = _python_only(config, overrides)
    if named:  # Python-only options: say so before what they would need
        from fedproto.errors import ConfigError

        raise ConfigError(f"{named} is for your own clients, built from Python with fedproto.federation.federate("
                          "clients, num_classes, ...); the command line runs mnist, femnist, cifar10, digits (each "
                          "with its own classes)")
    cfg = build_config(config, overrides)
    if cfg.tensorboard:  # a missing extra stops the run before its folder (and any parent) is made
        from fedproto.tensorboard import require_tensorboard

        require_tensorboard()
    out = Path(cfg.out_dir) / cfg.run_name()
    run_dir = RunDir(out)  # fails early (exit 2) if the folder cannot be written; clears nothing yet
    try:
        setup = prepare(cfg, progress=not quiet)
    except BaseException:
        run_dir.discard_if_unused()  # a failed set-up leaves no empty folder and loses no earlier run
        raise
    show = not quiet and console.is_terminal
    plain = not quiet and not (show and err_console.is_terminal)  # a log file, CI: one line per evaluated round
    started = time.perf_counter()
    progress = Progress(TextColumn("[bold]round"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
                        TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=not show)
    with progress:
        task = progress.add_task("rounds", total=cfg.rounds, info="")

        def on_round(row):
            info = f"loss {row['loss_ce']:.3f}" if row.get("loss_ce") is not None else ""
            if "acc_mean" in row:
                info += f"  acc {_pct(row['acc_mean'])}"
            progress.update(task, advance=1, info=info)
            if plain and "acc_mean" in row:
                print(round_line(row, cfg.rounds, time.perf_counter() - started), file=sys.stderr, flush=True)

        sim = Simulation(cfg, setup=setup, out=run_dir, on_round=on_round)
        if resume and run_dir.checkpoint.is_file():
            err_console.print(f"resuming from the checkpoint in {out}")
        try:
            summary = sim.run(resume=resume)
        except KeyboardInterrupt:
            progress.stop()
            saved = ""
            if run_dir.checkpoint.is_file():
                saved = ("; it holds a checkpoint: continue with the same command"
                         + ("" if resume else " plus --resume"))
            if (out / "summary.json").is_file():  # the engine has logged that the earlier run is back
                err_console.print(f"interrupted after round {len(sim.history)}")
            else:
                if saved and (out / PREVIOUS).is_dir():
                    saved += f"; the earlier finished run waits in {out / PREVIOUS} until this one finishes"
                err_console.print(f"interrupted after round {len(sim.history)}; partial metrics in {out} "
                                  f"(no summary.json: the run did not finish){saved}")
            raise typer.Exit(130) from None
    part = {"fewshot": f"ways {cfg.ways}, shots {cfg.shots}", "natural": "one client per writer",
            "dirichlet": f"Dirichlet alpha {cfg.alpha:g}"}[cfg.partition]
    table = Table(title=f"{cfg.algorithm} on {cfg.dataset}: {summary['clients']} clients, {part}, "
                        f"{cfg.rounds} round{'' if cfg.rounds == 1 else 's'} (per-client test sets)")
    table.add_column("inference")
    from fedproto.engine.summary import over_clients

    table.add_column(f"accuracy % (mean ± std over {over_clients(summary)} clients)", justify="right")
    for key, label in (("acc", "classifier"), ("acc_global", "classifier, global model (before local training)"),
                       ("acc_proto", "nearest prototype (eq. 4)")):
        if key in summary["accuracy"]:
            a = summary["accuracy"][key]
            table.add_row(label, f"{_pct(a['mean'])} ± {_pct(a['std'])}")
        if key in summary.get("accuracy_trained", {}):
            a = summary["accuracy_trained"][key]
            table.add_row(f"{label}, the {summary['clients_trained']} clients that trained",
                          f"{_pct(a['mean'])} ± {_pct(a['std'])}")
        if key in summary.get("accuracy_honest", {}):
            a = summary["accuracy_honest"][key]
            table.add_row(f"{label}, honest clients", f"{_pct(a['mean'])} ± {_pct(a['std'])}")
    full = summary.get("accuracy_full_test")
    if full:
        for key, label in (("acc", "classifier"), ("acc_proto", "nearest prototype")):
            if key in full:
                table.add_row(f"{label}, full test split", f"{_pct(full[key]['mean'])} ± {_pct(full[key]['std'])}")
        table.add_row("ensemble (mean softmax), full test split", _pct(full["ensemble_softmax"]))
        table.add_row("ensemble (vote), full test split", _pct(full["ensemble_vote"]))
    console.print(table)
    if "privacy" in summary:
        pv = summary["privacy"]
        console.print(f"privacy ({pv['mode']}, noise {pv['noise_multiplier']:g}): epsilon {pv['epsilon_max']:.3g} "
                      f"at delta {pv['delta']:g} (largest over clients; {pv['neighbouring']})",
                      highlight=False, soft_wrap=True)
    ppr = summary["params_per_round"]
    console.print(f"params per round: up {ppr['up']:.0f}, down {ppr['down']:.0f}; "
                  f"wall time {summary['wall_time_s']:.1f} s; results in {out}", highlight=False, soft_wrap=True)


@app.command()
def plot(
    run_dir: Path = typer.Argument(..., help="A run directory written by `fedproto run` or `fedproto reproduce`."),
    max_per_client: int = typer.Option(200, min=0, help="t-SNE: at most this many test samples per client (0: all)."),
    tsne: bool = typer.Option(True, "--tsne/--no-tsne", help="Also draw the t-SNE (fig. 2) when embeddings exist."),
):
    """Draw curves.png (accuracy and losses per round) and tsne.png (fig. 2) into RUN_DIR."""
    from fedproto.plots import EMBEDDINGS_FILE, TooFewPoints, plot_curves, plot_tsne_run

    if not run_dir.is_dir():
        what = "is a file, not a folder" if run_dir.exists() else "does not exist"
        raise FedprotoError(f"run directory {str(run_dir)!r} {what}; pass a folder written by `fedproto run`")
    with _damaged_files(run_dir):
        console.print(str(plot_curves(run_dir)), highlight=False, soft_wrap=True)
    if not tsne:
        return
    if not (run_dir / EMBEDDINGS_FILE).is_file():  # prototypes, when the method has them, are drawn as stars
        err_console.print(f"no t-SNE: {run_dir} has no {EMBEDDINGS_FILE} (written at the end of a finished "
                          "`fedproto run`)", highlight=False, soft_wrap=True)
        return
    err_console.print(f"t-SNE of the test embeddings (at most {max_per_client or 'all'} per client): this takes a "
                      "while, up to a minute or two on a CPU (--no-tsne skips it)", highlight=False, soft_wrap=True)
    try:
        with err_console.status("t-SNE", spinner="dots") if err_console.is_terminal else nullcontext(), \
                _damaged_files(run_dir):
            path = plot_tsne_run(run_dir, max_per_client=max_per_client or None)
    except TooFewPoints as e:
        err_console.print(f"no t-SNE: {e} (curves.png was written)", highlight=False, soft_wrap=True)
        return
    console.print(str(path), highlight=False, soft_wrap=True)


@app.command("site-data")
def site_data(
    out: Path = typer.Argument(..., help="Where the data files go: OUT/site<i>/ per client of the run's partition, "
                               "or OUT/ itself with --from."),
    from_: Optional[Path] = typer.Option(None, "--from", help="A site's own data: a folder with one sub-folder of "
                                         "images per class, a .npz with x and y, or a .csv with a label column."),
    test_fraction: float = typer.Option(0.2, help="--from: share of each class held out as the test split."),
    normalize: str = typer.Option("standardize", help="--from: standardize (train mean and std), mnist, cifar10 "
                                  "(those loaders' constants, for images in [0, 1]) or none."),
    label_column: str = typer.Option("label", help="--from a .csv: the label column."),
    class_names: Optional[str] = typer.Option(None, help="--from: the run's class names in id order (comma-"
                                              "separated), when labels are names rather than class ids."),
    seed: int = typer.Option(0, help="--from: the seed of the train/test split."),
    config: Optional[Path] = typer.Option(None, "--config", help="The run's options (TOML): dataset, clients, ways, "
                                          "shots, seed... (without --from)."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="A run option as key=value (repeatable; without "
                                             "--from), e.g. --set dataset=mnist --set clients=3."),
    client_ids: Optional[str] = typer.Option(None, help="Only these clients of the partition (comma-separated ids)."),
):
    """Write a site's train.npz and test.npz for a Flower SuperNode (docs/flower.md, "Node data")."""
    from fedproto import sitedata

    if from_ is not None:
        if config is not None or set_ or client_ids:
            raise FedprotoError("--from writes one site from its own files; --config, --set and --client-ids choose "
                                "clients of a run's partition: give one or the other")
        names = [n.strip() for n in class_names.split(",")] if class_names else None
        got = sitedata.write_site_from(from_, out, test_fraction, normalize, label_column, seed, names)
        console.print(f"wrote {got['train']} ({got['train_samples']} samples) and {got['test']} "
                      f"({got['test_samples']}); one sample {got['shape']}, classes {got['classes']}",
                      highlight=False, soft_wrap=True)
        return
    from fedproto.reproduce import parse_sets

    cfg = build_config(config, parse_sets(set_, grid=False))
    ids = None
    if client_ids:
        try:
            ids = [int(v) for v in client_ids.split(",")]
        except ValueError:
            raise FedprotoError(f"--client-ids {client_ids!r}: give whole numbers separated by commas, e.g. 0,1,2") \
                from None
    for folder in sitedata.write_partition_sites(cfg, out, ids):
        console.print(str(folder), highlight=False, soft_wrap=True)


@contextmanager
def _damaged_files(run_dir: Path):
    """Turn what a damaged or foreign run folder raises (bad JSON, missing keys, wrong types or
    shapes, unreadable files) into one FedprotoError naming the folder."""
    try:
        yield
    except FedprotoError:
        raise
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.ENAMETOOLONG):
            raise FedprotoError(f"cannot plot {str(run_dir)!r}: {e.strerror} ({e.filename}); the run's files are "
                                "fine, free space or fix the permissions and run `fedproto plot` again") from None
        raise FedprotoError(f"cannot plot {str(run_dir)!r}: cannot read its files "
                            f"({e.strerror}: {e.filename})") from None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, EOFError, zipfile.BadZipFile) as e:
        raise FedprotoError(f"cannot plot {str(run_dir)!r}: its files are damaged or not written by fedproto "
                            f"({type(e).__name__}: {e}); run `fedproto run` again to rewrite them") from None


@app.command()
def onboard(
    run_dir: str = typer.Argument(..., help="A finished fedproto run directory"),
    clients: int = typer.Option(5, help="New clients to draw (the run's n-way k-shot protocol, unused samples)"),
    epochs: Optional[int] = typer.Option(None, help="Local epochs per new client (default: the run's rounds x "
                                               "local epochs)"),
    seed: Optional[int] = typer.Option(None, help="Seed of the new clients (default: the run's)"),
    data_dir: Optional[str] = typer.Option(None, help="Dataset folder (default: the run's look-up order)"),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: the run's setting)"),
):
    """Onboard new clients: train each with the run's global prototypes and without (local only)."""
    from rich.table import Table

    from fedproto.onboarding import onboard as do_onboard
    from fedproto.results import pct as _pct

    s = do_onboard(run_dir, clients, epochs, seed, data_dir, threads=threads)
    table = Table(title=f"{s['clients']} new clients, {s['epochs']} local epochs each (per-client test sets)")
    table.add_column("training")
    table.add_column("classifier acc. %", justify="right")
    table.add_column("nearest-prototype acc. % (eq. 4)", justify="right")
    names = {"prototypes": f"with the global prototypes (λ = {s['lambda_proto']:g})", "local": "local only (λ = 0)"}
    for arm, v in s["arms"].items():
        table.add_row(names[arm], *(f"{_pct(v[k]['mean'])} ± {_pct(v[k]['std'])}" for k in ("acc", "acc_proto")))
    console.print(table)
    console.print(f"results in {Path(run_dir) / 'onboard'}", highlight=False, soft_wrap=True)


@app.command()
def reproduce(
    datasets: Optional[str] = typer.Option(None, help="Comma list (default: mnist,femnist,cifar10; "
                                                      "a sweep: its figure's dataset)"),
    ways: Optional[str] = typer.Option(None, help="Comma list of n (default: 3,4,5; a sweep: 3)"),
    methods: Optional[str] = typer.Option(None, help="Comma list of local, fesem, fedprox, fedper, fedavg, fedrep, "
                                                     "fedproto, fedproto-mh (default: all; a sweep: its figure's); "
                                                     "--grid hetero: local, fedproto, fedtgp, fd, fedgh, lgfedavg"),
    seeds: Optional[str] = typer.Option(None, help="Comma list of seeds (default: 1234; --grid hetero: "
                                                   "1234,1235,1236)."),
    rounds: Optional[int] = typer.Option(None, help="Rounds for every cell (default: the paper's (tab. 1); "
                                                    "--grid hetero: 20)"),
    grid: str = typer.Option("paper", help="paper: tab. 1-4's grid; hetero: the model-heterogeneous methods on "
                                           "clients of different architectures (docs/heterogeneous.md)."),
    out: Path = typer.Option(Path("reproduce"), "--out", help="Output folder (run directories under OUT/runs)."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="key=value override of any run option "
                                                                "(repeatable), e.g. --set threads=8"),
    data_dir: Optional[str] = typer.Option(None, help="Folder with the dataset files."),
    sweep: Optional[str] = typer.Option(None, help="One-parameter sweep instead of the grid, e.g. lambda=0,0.5,1,2,4 "
                                                   "(fig. 4) or shots=10,25,50,100 (fig. 3)."),
    threads: Optional[int] = typer.Option(None, help="torch threads for every cell (same as --set threads=N; "
                                                     "0: torch's default); with --jobs or --ray: the budget "
                                                     "the cells running at once share"),
    jobs: Optional[int] = typer.Option(None, help="Cells at once, each in its own process with its share of "
                                                  "--threads (docs/reproducing.md)"),
    ray: Optional[str] = typer.Option(None, help="Run each cell as a task on a Ray cluster: auto (this machine's "
                                                 "cluster, or a new local one), local (a new local one) or the "
                                                 "head's address; needs "
                                                 "pip install \"fedproto[ray]\""),
):
    """Run the paper's grid (tab. 1-4) or a sweep (fig. 3, 4); resumable; writes table.md/.csv."""
    try:
        _reproduce(datasets, ways, methods, seeds, rounds, out, set_, data_dir, sweep, threads, grid,
                   side={"jobs": jobs, "ray": ray})
    except FedprotoError as e:  # run options worded as reproduce takes them (--set key=value)
        from fedproto.reproduce import set_message

        _error(set_message(e))
    except KeyboardInterrupt:
        err_console.print(f"interrupted; the cells finished so far are in {out / 'status.json'} and the table "
                          "(a sweep: after its last cell); run the same command again to resume",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None


def _reproduce(datasets, ways, methods, seeds, rounds, out, set_, data_dir, sweep, threads, grid="paper",
               side=None) -> None:
    from fedproto import reproduce as rp

    if grid not in rp.GRIDS:
        raise FedprotoError(f"--grid {grid!r}: unknown grid; choose from {', '.join(rp.GRIDS)}")
    if grid == "hetero" and sweep:
        raise FedprotoError("--sweep runs on the paper's methods; leave out --grid hetero (or --sweep)")

    sets = rp.parse_sets(set_)
    if threads is not None:
        if "threads" in sets and sets["threads"] != threads:
            raise FedprotoError(f"--threads {threads} and --set threads={sets['threads']} disagree; give one of them")
        sets["threads"] = threads
    seed_list = rp.parse_list(seeds, rp.HETERO_SEEDS if grid == "hetero" else rp.DEFAULT_SEEDS, "seeds", conv=int)
    known_ds = list(rp.MODELS)
    if grid == "hetero":
        ds = rp.parse_list(datasets, rp.HETERO_DATASETS, "datasets", known_ds)
        ns = rp.parse_list(ways, rp.HETERO_WAYS, "ways", conv=int)
        ms = rp.parse_list(methods, list(rp.HETERO_METHODS), "methods", list(rp.HETERO_METHODS))
        results = rp.run_hetero(out, ds, ns, ms, seed_list, rounds, sets, data_dir, console=console, **(side or {}))
        _finish(results, f"{out / 'table.md'} and {out / 'table.csv'}")
        return
    if sweep:
        ds = rp.parse_list(datasets, [], "datasets", known_ds)
        ns = rp.parse_list(ways, [], "ways", conv=int)
        ms = rp.parse_list(methods, [], "methods", list(rp.METHODS))
        if len(ds) > 1 or len(ns) > 1:
            raise FedprotoError("--sweep runs one dataset and one ways value; give at most one of each")
        results, csv_path, png = rp.run_sweep(out, sweep, ds[0] if ds else None, ns[0] if ns else None,
                                              ms or None, seed_list, rounds, sets, data_dir, console=console,
                                              **(side or {}))
        _finish(results, f"{csv_path} and {png}")
        return
    ds = rp.parse_list(datasets, rp.DEFAULT_DATASETS, "datasets", known_ds)
    ns = rp.parse_list(ways, rp.DEFAULT_WAYS, "ways", conv=int)
    ms = rp.parse_list(methods, list(rp.METHODS), "methods", list(rp.METHODS))
    results = rp.run_grid(out, ds, ns, ms, seed_list, rounds, sets, data_dir, console=console, **(side or {}))
    _finish(results, f"{out / 'table.md'} and {out / 'table.csv'}")


def _finish(results, wrote: str) -> None:
    """The closing line of a grid or sweep; exit code 1 when any cell failed (the outputs are
    written either way)."""
    counts = {k: sum(r.status == k for r in results) for k in ("done", "skipped", "failed")}
    console.print(f"{len(results)} cells: {counts['done']} run, {counts['skipped']} skipped, "
                  f"{counts['failed']} failed; wrote {wrote}", highlight=False, soft_wrap=True)
    if counts["failed"]:
        raise typer.Exit(1)


def run_command() -> click.Command:
    """``fedproto run`` as a click command whose options are generated from RunConfig's fields
    (:func:`fedproto.options.run_params`): a field added to RunConfig is a flag with no edit here."""
    from fedproto.options import run_params

    params = [
        click.Option(["config", "--config"], type=click.Path(path_type=Path), default=None, metavar="FILE",
                     help="TOML file with run options (flags override it)."),
        *run_params(),
        click.Option(["resume", "--resume"], is_flag=True, default=False,
                     help="Continue from the run directory's checkpoint, if it has one (same options required)."),
        click.Option(["quiet", "--quiet", "-q"], is_flag=True, default=False,
                     help="No progress: no bar on a terminal, no per-round lines in a log."),
    ]
    params[-2].rich_help_panel, params[-1].rich_help_panel = "Execution", "Output"
    return _RunCommand("run", callback=_run, params=params, help=RUN_HELP,
                       short_help="Train with the in-process simulator and write a run directory.",
                       context_settings={"max_content_width": 100, **HELP_OPTIONS})


def command() -> click.Group:
    """The whole command line as a click group: the typer app's commands and ``run``."""
    group = typer.main.get_command(app)
    group.add_command(run_command(), "run")
    group.commands = {"run": group.commands.pop("run"), **group.commands}  # `run` first in --help
    return group


def _error(message: str) -> None:
    """Print ``error: message`` on stderr and exit with code 2."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True, markup=True)
    sys.exit(2)


VERBOSE = ("-v", "--verbose")


def _hoist_verbose(args: list[str], group: click.Group | None = None) -> list[str]:
    """``-v``/``--verbose`` anywhere before ``--`` (``fedproto run -v`` as well as ``fedproto -v run``):
    moved to the front, where the root command reads it; not the value of an option that takes one
    (``--name -v``: ``group``'s commands say which options take a value)."""
    end = args.index("--") if "--" in args else len(args)
    takes_value: set[str] = set()
    sub = next((a for a in args[:end] if group is not None and a in group.commands), None)
    if sub is not None:
        takes_value = {o for p in group.commands[sub].params if isinstance(p, click.Option) and not p.is_flag
                       and not p.count for o in p.opts}
    found, rest, i = [], [], 0
    while i < end:
        if args[i] in VERBOSE:
            found.append(args[i])
        else:
            rest.append(args[i])
            if args[i] in takes_value and i + 1 < end:  # its value, whatever it looks like
                rest.append(args[i + 1])
                i += 1
        i += 1
    return [*found[:1], *rest, *args[end:]]


def main() -> None:
    """Console entry point. Usage errors: click's message and exit code 2; any FedprotoError: one
    message on stderr and exit code 2, no traceback."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    terminated = []

    def on_term(signum, frame):  # `kill`, `timeout`, Slurm, docker stop: end like Ctrl-C (results restored), exit 143
        terminated.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        group = command()
        code = group.main(args=_hoist_verbose(sys.argv[1:], group), prog_name="fedproto", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:  # `fedproto` alone: the help
        e.show()
        sys.exit(e.exit_code)
    except click.UsageError as e:  # a flag or value click refused: the same one-line style as a FedprotoError
        cmd = e.ctx.command_path if e.ctx is not None else "fedproto"
        msg = re.sub(r"\.? ?\(Did you mean (.*)\?\)$", r"; did you mean \1?", e.format_message().rstrip("."))
        _error(f"{msg} If not, see {cmd} --help" if msg.endswith("?") else f"{msg}; see {cmd} --help")
    except click.ClickException as e:
        _error(e.format_message())
    except click.Abort:
        sys.exit(143 if terminated else 130)
    except FedprotoError as e:
        from fedproto.options import cli_wording

        _error(e.render(cli_wording))
    except OSError as e:  # a path the checks above did not cover: too long, full disk, permissions
        where = f" {str(e.filename)[:200]!r}" if e.filename else ""
        err_console.print(f"[bold red]error:[/] {escape(e.strerror or str(e))}:{escape(where)}; fix that path "
                          "(or free space) and run the command again", highlight=False, soft_wrap=True, markup=True)
        sys.exit(2)
    if isinstance(code, int) and code:  # typer.Exit(n) inside a command; 130 (interrupted) is 143 after SIGTERM
        sys.exit(143 if code == 130 and terminated else code)


if __name__ == "__main__":
    main()
