"""Command line: ``fedproto run`` (and friends).

Every :class:`~fedproto.config.run_config.RunConfig` field is a flag; ``--config FILE`` reads a TOML file
first, flags override it. Any :class:`~fedproto.errors.FedprotoError` ends the program with one
message on stderr and exit code 2, before training when the cause is the configuration or data.

This module holds the command group, ``reproduce`` and the entry point :func:`main`; ``run`` is in
:mod:`fedproto.cli.run_command`, ``plot``, ``site-data`` and ``onboard`` in :mod:`fedproto.cli.tool_commands`, the
consoles in :mod:`fedproto.cli.console` (docs/architecture.md, "Module map": ``cli``). A command
imports what it needs when it runs: ``--help`` loads no torch, numpy or result tables.
"""

from __future__ import annotations

import logging
import re
import signal
import sys
from pathlib import Path
from typing import Optional

import click
import typer
from rich.markup import escape

from fedproto.cli.console import HELP_OPTIONS, _error, console, err_console
from fedproto.cli.run_command import RUN_HELP, run_command
from fedproto.cli.tool_commands import onboard, plot, site_data
from fedproto.cli.tune_command import tune
from fedproto.errors import FedprotoError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings=HELP_OPTIONS, help="Federated prototype learning (FedProto, arXiv 2105.00243).")


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


app.command()(plot)
app.command("site-data")(site_data)
app.command()(onboard)
app.command()(tune)  # fedproto.cli.tune_command


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
                                                 "pip install \"fedproto\\[ray]\""),
):
    """Run the paper's grid (tab. 1-4) or a sweep (fig. 3, 4); resumable; writes table.md/.csv."""
    if ray:  # an address where nothing answers is refused at once, before torch and Ray are imported
        from fedproto.deploy.netcheck import check_ray_address

        try:
            check_ray_address(ray)
        except FedprotoError as e:
            _error(str(e))
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


def command() -> click.Group:
    """The whole command line as a click group: the typer app's commands and ``run``."""
    group = typer.main.get_command(app)
    group.add_command(run_command(), "run")
    group.commands = {"run": group.commands.pop("run"), **group.commands}  # `run` first in --help
    return group


VERBOSE = ("-v", "--verbose")
_SHORT = re.compile(r"-[A-Za-z]{2,}")
"""Short switches given together (``-qv``)."""


def _hoist_verbose(args: list[str], group: click.Group | None = None) -> list[str]:
    """``-v``/``--verbose`` anywhere before ``--`` (``fedproto run -v`` as well as ``fedproto -v run``):
    moved to the front, where the root command reads it; not the value of an option that takes one
    (``--name -v``: ``group``'s commands say which options take a value). Short switches given
    together are taken apart where ``-v`` is among them and the others are the command's own
    (``fedproto run -qv``: ``-q`` for ``run``, ``-v`` for the root)."""
    end = args.index("--") if "--" in args else len(args)
    takes_value: set[str] = set()
    sub = next((a for a in args[:end] if group is not None and a in group.commands), None)
    if sub is not None:
        takes_value = {o for p in group.commands[sub].params if isinstance(p, click.Option) and not p.is_flag
                       and not p.count for o in p.opts}
    flags = set() if sub is None else {o[1] for p in group.commands[sub].params if isinstance(p, click.Option)
                                       and (p.is_flag or p.count) for o in p.opts if len(o) == 2 and o[0] == "-"}
    found, rest, i = [], [], 0
    while i < end:
        if args[i] in VERBOSE:
            found.append(args[i])
        elif _SHORT.fullmatch(args[i]) and "v" in args[i] and set(args[i][1:]) - {"v"} <= flags:
            found.append("-v")  # -qv, -vq: the command's own short switches, with -v among them
            others = args[i][1:].replace("v", "")
            rest.extend([f"-{others}"] if others else [])
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
        from fedproto.config.run_options import cli_wording

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


__all__ = ["HELP_OPTIONS", "RUN_HELP", "app", "command", "console", "err_console", "main", "run_command"]
