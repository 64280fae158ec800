"""``fedproto run``: its flags, generated from the run options (:func:`fedproto.config.run_options.run_params`),
its help in titled panels, and the run with its progress bar and result table (docs/architecture.md,
"Module map": ``cli``). Only what a run needs is imported when it starts: torch, the engine and the
result files, never Flower, plotting or TensorBoard unless the options ask for them.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Optional

import click
import typer
from rich.console import Console
from rich.text import Text

from fedproto.cli.console import HELP_OPTIONS, console, err_console
from fedproto.errors import ConfigError

RUN_HELP = """Train with the in-process simulator and write a run directory.

Every run option below can also be set in the --config TOML file: its key is the option's field
name, the first flag without the leading dashes ('-' or '_' between words), and a switch is
true or false there (--drop-last/--keep-last: drop_last = false; --no-download: download =
false). Flags override the file. Defaults marked "per dataset" are the paper's for the dataset
chosen. The options page of the docs (docs/options.md) lists every key."""


class _RunCommand(click.Command):
    """``fedproto run``: its help in titled panels like the other commands' (each option's
    ``rich_help_panel``, from :data:`fedproto.config.run_options.PANELS`), laid out for its many options: flags
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

    @property
    def params(self) -> list[click.Parameter]:  # type: ignore[override]
        """The flags, built from the run options on first use: ``fedproto --help`` lists ``run``
        without building them (nor importing the validated options)."""
        if self._params is None:
            self._params = _params()
        return self._params

    @params.setter
    def params(self, value: list[click.Parameter] | None) -> None:
        self._params = value or None

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
    be read is left to :func:`~fedproto.config.run_config.build_config`, which reports it."""
    if overrides.get("dataset") == "custom":
        return "--dataset custom"
    if "classes" in overrides:
        return "--classes"
    if config is None:
        return ""
    from fedproto.config.run_config import normal_key
    from fedproto.config.run_options import tomllib

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

    from fedproto.config.run_config import build_config
    from fedproto.engine.setup import prepare

    # here, not at the top: fedproto.outputs.run_folder imports numpy, which --help does not need
    from fedproto.outputs.run_folder import PREVIOUS, RunDir, round_line
    from fedproto.outputs.run_folder import pct as _pct
    from fedproto.simulation import Simulation

    named = _python_only(config, overrides)
    if named:  # Python-only options: say so before what they would need
        raise ConfigError(f"{named} is for your own clients, built from Python with fedproto.federation.federate("
                          "clients, num_classes, ...); the command line runs mnist, femnist, cifar10, digits (each "
                          "with its own classes)")
    try:
        cfg = build_config(config, overrides)
    except ConfigError as e:  # the command line offers the datasets it runs (as its help does), not custom
        from fedproto.config.fields import CLI_DATASETS

        if e.option == "dataset" and e.hint and e.value not in CLI_DATASETS:
            import difflib

            near = difflib.get_close_matches(str(e.value), list(CLI_DATASETS), n=1)
            e.hint = (f"did you mean {near[0]!r}? " if near else "") + f"choose one of {', '.join(CLI_DATASETS)}"
        raise
    if cfg.tensorboard:  # a missing extra stops the run before its folder (and any parent) is made
        from fedproto.engine.observers.tensorboard_log import require_tensorboard

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
    # under -v the engine's logger writes that line already (fedproto.simulation at INFO): not twice
    plain = plain and not logging.getLogger("fedproto.simulation").isEnabledFor(logging.INFO)
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


def _params() -> list[click.Parameter]:
    """``--config``, a flag per RunConfig field (:func:`fedproto.config.run_options.run_params`), ``--resume``,
    ``--quiet``."""
    from fedproto.config.run_options import run_params

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
    return params


def run_command() -> click.Command:
    """``fedproto run`` as a click command whose options are generated from RunConfig's fields
    (:func:`fedproto.config.run_options.run_params`): a field added to RunConfig is a flag with no edit here.
    The flags are built when first asked for (:attr:`_RunCommand.params`)."""
    return _RunCommand("run", callback=_run, params=None, help=RUN_HELP,
                       short_help="Train with the in-process simulator and write a run directory.",
                       context_settings={"max_content_width": 100, **HELP_OPTIONS})
