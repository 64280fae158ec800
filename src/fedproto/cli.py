"""Command line: ``fedproto run`` (and friends).

Every :class:`~fedproto.config.RunConfig` field is a flag; ``--config FILE`` reads a TOML file
first, flags override it. Any :class:`~fedproto.errors.FedprotoError` ends the program with one
message on stderr and exit code 2, before training when the cause is the configuration or data.
"""

from __future__ import annotations

import errno
import logging
import signal
import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from fedproto.config import build_config
from fedproto.errors import FedprotoError
from fedproto.results import PREVIOUS

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Federated prototype learning (FedProto, arXiv 2105.00243).")
# markup off: messages carry paths and "[...]" text; markup is asked for where it is used
err_console = Console(stderr=True, markup=False)
console = Console(markup=False)


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


def _pct(x) -> str:
    return "-" if x is None or x != x else f"{100 * x:.2f}"


@app.command()
def run(
    config: Optional[Path] = typer.Option(None, "--config", help="TOML file with run options (flags override it)."),
    dataset: Optional[str] = typer.Option(None, help="mnist | femnist | cifar10 | digits (default: mnist)"),
    data_dir: Optional[str] = typer.Option(None, help="Folder with the dataset files (else $FEDPROTO_DATA, else the user cache)."),
    download: Optional[bool] = typer.Option(None, "--download/--no-download", help="Download missing files (with checksums) (default: download)"),
    clients: Optional[int] = typer.Option(None, help="Number of clients m (default: 20)"),
    ways: Optional[int] = typer.Option(None, help="Average classes per client n (default: 3)"),
    shots: Optional[int] = typer.Option(None, help="Average training samples per class k (default: 100; digits 10; the shared FEMNIST sample needs about 10)"),
    stdev: Optional[int] = typer.Option(None, help="Spread of n and k across clients (default: MNIST 2 (tab. 1); FEMNIST, CIFAR-10, digits 1)"),
    test_shots: Optional[int] = typer.Option(None, help="Test samples per own class per client (default: 40; FEMNIST 3, digits 10)"),
    noise: Optional[str] = typer.Option(None, help="uniform (official code) | gaussian (paper) (default: uniform)"),
    partition: Optional[str] = typer.Option(None, help="fewshot (n-way k-shot, paper) | natural (one client per FEMNIST writer) | dirichlet (label skew, --alpha) (default: fewshot)"),
    alpha: Optional[float] = typer.Option(None, help="Dirichlet concentration for --partition dirichlet (0.1: strong skew, 100: ~IID) (default: 0.5)"),
    min_client_samples: Optional[int] = typer.Option(None, help="Dirichlet: redraw until every client holds this many training samples (default: 10)"),
    augment: Optional[bool] = typer.Option(None, "--augment/--no-augment", help="Random crop (pad 4) + horizontal flip at train time (CIFAR-10) (default: off)"),
    algorithm: Optional[str] = typer.Option(None, help="fedproto | local | fedavg | fedprox | fedper | fedrep | fesem (default: fedproto)"),
    model: Optional[str] = typer.Option(None, help="cnn | cnn-mh | resnet18 | resnet18-mh | projcnn:<c1>-<c2>[,...] (default: the paper's: cnn; cifar10: resnet18)"),
    pretrained: Optional[str] = typer.Option(None, help="ResNet18 state dict file (torchvision layout) loaded into all but conv1, bn1, fc"),
    embedding_dim: Optional[int] = typer.Option(None, help="Embedding (prototype) size d (default: 50)"),
    dropout: Optional[float] = typer.Option(None, help="Dropout p of the CNN (default: 0.5)"),
    rounds: Optional[int] = typer.Option(None, help="Communication rounds (default: tab. 1: mnist 100, femnist 120, cifar10 110, digits 20)"),
    local_epochs: Optional[int] = typer.Option(None, help="Local epochs per round (default: 1)"),
    participation: Optional[float] = typer.Option(None, help="Clients sampled each round: a fraction in (0, 1] (max(1, round(fraction x clients)) take part) or a whole number of clients (default: 1, every client as in the paper)"),
    batch_size: Optional[int] = typer.Option(None, help="Local batch size (default: 8, paper app. A)"),
    lr: Optional[float] = typer.Option(None, help="SGD learning rate (default: 0.01)"),
    momentum: Optional[float] = typer.Option(None, help="SGD momentum (default: 0.5)"),
    weight_decay: Optional[float] = typer.Option(None, help="SGD weight decay (default: 0)"),
    drop_last: Optional[bool] = typer.Option(None, "--drop-last/--keep-last", help="Skip the last partial batch (official code) (default: keep)"),
    lambda_proto: Optional[float] = typer.Option(None, "--lambda", "--lambda-proto", help="λ (default: 1 MNIST/FEMNIST, 0.1 CIFAR-10)"),
    distance: Optional[str] = typer.Option(None, help="mse (official) | squared_l2 (app. B) | l2 (main text) (default: mse)"),
    proto_source: Optional[str] = typer.Option(None, help="last_epoch (official) | after_training (eq. 3) (default: last_epoch)"),
    aggregation: Optional[str] = typer.Option(None, help="mean (official) | weighted (eq. 6, convex) | median | trimmed (--trim) (default: mean)"),
    proto_classes: Optional[str] = typer.Option(None, help="Prototype inference among own | all classes (default: own)"),
    lambda_warmup: Optional[int] = typer.Option(None, help="FedProto: rounds of linear λ warm-up (0: constant λ) (default: 0)"),
    proto_momentum: Optional[float] = typer.Option(None, help="FedProto: server prototype momentum β in [0, 1) (default: 0)"),
    proto_normalize: Optional[bool] = typer.Option(None, "--proto-normalize/--no-proto-normalize", help="FedProto: L2-normalize embeddings and prototypes in the loss and inference (default: off)"),
    min_proto_samples: Optional[int] = typer.Option(None, help="FedProto: the server ignores local prototypes from fewer samples (default: 1)"),
    proto_dist_alert: Optional[float] = typer.Option(None, help="FedProto: warn when a client's prototype distance exceeds this x the median (0: off) (default: 3)"),
    trim: Optional[float] = typer.Option(None, help="FedProto, --aggregation trimmed: fraction of a class's contributors cut from each end, per coordinate (default: 0.2)"),
    min_contributors: Optional[int] = typer.Option(None, help="FedProto: a class gets (or changes) its global prototype only in rounds where at least this many clients send it (default: 1)"),
    exclude_outliers: Optional[float] = typer.Option(None, help="FedProto: leave out of a round's aggregation clients whose prototype distance has a robust z-score (median, MAD) above Z (0: off; e.g. 3) (default: 0)"),
    lambda_schedule: Optional[str] = typer.Option(None, help="FedProto: linear | cosine shape of the λ warm-up (--lambda-warmup) (default: linear)"),
    freeze_after: Optional[int] = typer.Option(None, help="Two-stage training: after this round only the head trains (0: off) (default: 0)"),
    eval_full_test: Optional[bool] = typer.Option(None, "--eval-full-test/--no-eval-full-test", help="Also evaluate every client model and their ensemble on the full test split (all classes) after the last round (default: off)"),
    dp: Optional[str] = typer.Option(None, help="Differential privacy: off | prototypes (noised prototype release; guarantee for a fixed feature extractor) | full (DP-SGD + noised release) (default: off)"),
    dp_noise: Optional[float] = typer.Option(None, help="DP noise multiplier sigma (default: 1)"),
    dp_clip: Optional[float] = typer.Option(None, help="DP: L2 bound on each sample's embedding in the prototype release (default: 5)"),
    dp_grad_clip: Optional[float] = typer.Option(None, help="DP-SGD (--dp full): per-sample gradient L2 bound (default: 1)"),
    dp_delta: Optional[float] = typer.Option(None, help="DP: delta of the reported epsilon (default: 1e-5)"),
    attack: Optional[str] = typer.Option(None, help="Simulated misbehaving clients: none | scale | random | nan | flip (default: none)"),
    attackers: Optional[int] = typer.Option(None, help="Number of misbehaving clients, drawn from the seed (default: 0)"),
    attack_scale: Optional[float] = typer.Option(None, help="Factor of --attack scale (default: 100)"),
    prox_mu: Optional[float] = typer.Option(None, help="FedProx proximal weight mu (default: 0.01)"),
    personal_layers: Optional[str] = typer.Option(None, help="FedPer/FedRep layers kept on the client: fc (every fully connected layer, tab. 1's Params) | head (last layer only) (default: fc)"),
    rep_head_epochs: Optional[int] = typer.Option(None, help="FedRep head epochs per round (default: 9)"),
    fesem_clusters: Optional[int] = typer.Option(None, help="FeSEM clusters K (default: 3)"),
    execution: Optional[str] = typer.Option(None, help="auto | sequential | batched (default: auto)"),
    group_size: Optional[int] = typer.Option(None, help="Most clients trained as one batched computation (default: 128)"),
    eval_every: Optional[int] = typer.Option(None, help="Evaluate every N rounds and after the last; 0: only after the last (default: 10)"),
    checkpoint_every: Optional[int] = typer.Option(None, help="Write a checkpoint every N rounds, removed when the run finishes; 0: none (default: 0)"),
    seed: Optional[int] = typer.Option(None, help="Seed (default: 1234)"),
    out_dir: Optional[str] = typer.Option(None, help="Parent folder of run directories (default: runs)"),
    name: Optional[str] = typer.Option(None, help="Run directory name (default: derived from the config)"),
    threads: Optional[int] = typer.Option(None, help="torch threads (0: torch's default) (default: 0)"),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda | cuda:N | mps: where clients train; auto takes the first CUDA GPU if torch sees one (default: cpu)"),
    resume: bool = typer.Option(False, "--resume", help="Continue from the run directory's checkpoint, if it has one (same options required)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
):
    """Train with the in-process simulator and write a run directory."""
    overrides = {k: v for k, v in locals().items() if k not in ("config", "quiet", "resume")}
    from fedproto.simulation import Simulation, prepare

    from fedproto.results import RunDir

    cfg = build_config(config, overrides)
    out = Path(cfg.out_dir) / cfg.run_name()
    run_dir = RunDir(out)  # fails early (exit 2) if the folder cannot be written; clears nothing yet
    try:
        setup = prepare(cfg, progress=not quiet)
    except BaseException:
        run_dir.discard_if_unused()  # a failed set-up leaves no empty folder and loses no earlier run
        raise
    show = not quiet and console.is_terminal
    progress = Progress(TextColumn("[bold]round"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
                        TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=not show)
    with progress:
        task = progress.add_task("rounds", total=cfg.rounds, info="")

        def on_round(row):
            info = f"loss {row['loss_ce']:.3f}"
            if "acc_mean" in row:
                info += f"  acc {_pct(row['acc_mean'])}"
            progress.update(task, advance=1, info=info)

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
            raise typer.Exit(130)
    from fedproto.plots import save_embeddings

    save_embeddings(sim, out)  # test embeddings for `fedproto plot` (t-SNE, fig. 2)
    part = {"fewshot": f"ways {cfg.ways}, shots {cfg.shots}", "natural": "one client per writer",
            "dirichlet": f"Dirichlet alpha {cfg.alpha:g}"}[cfg.partition]
    table = Table(title=f"{cfg.algorithm} on {cfg.dataset}: {summary['clients']} clients, {part}, "
                        f"{cfg.rounds} round{'' if cfg.rounds == 1 else 's'} (per-client test sets)")
    table.add_column("inference")
    table.add_column("accuracy % (mean ± std over clients)", justify="right")
    for key, label in (("acc", "classifier"), ("acc_proto", "nearest prototype (eq. 4)")):
        if key in summary["accuracy"]:
            a = summary["accuracy"][key]
            table.add_row(label, f"{_pct(a['mean'])} ± {_pct(a['std'])}")
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
    try:
        with _damaged_files(run_dir):
            path = plot_tsne_run(run_dir, max_per_client=max_per_client or None)
    except TooFewPoints as e:
        err_console.print(f"no t-SNE: {e} (curves.png was written)", highlight=False, soft_wrap=True)
        return
    console.print(str(path), highlight=False, soft_wrap=True)


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
        raise FedprotoError(f"cannot plot {str(run_dir)!r}: cannot read its files ({e.strerror}: {e.filename})") from None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, EOFError, zipfile.BadZipFile) as e:
        raise FedprotoError(f"cannot plot {str(run_dir)!r}: its files are damaged or not written by fedproto "
                            f"({type(e).__name__}: {e}); run `fedproto run` again to rewrite them") from None


@app.command()
def onboard(
    run_dir: str = typer.Argument(..., help="A finished fedproto run directory"),
    clients: int = typer.Option(5, help="New clients to draw (the run's n-way k-shot protocol, unused samples)"),
    epochs: Optional[int] = typer.Option(None, help="Local epochs per new client (default: the run's rounds x local epochs)"),
    seed: Optional[int] = typer.Option(None, help="Seed of the new clients (default: the run's)"),
    data_dir: Optional[str] = typer.Option(None, help="Dataset folder (default: the run's look-up order)"),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: the run's setting)"),
):
    """Onboard new clients: train each with the run's global prototypes and without (local only)."""
    from fedproto.onboarding import onboard as do_onboard

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
                                                     "fedproto, fedproto-mh (default: all; a sweep: its figure's)"),
    seeds: str = typer.Option("1234", help="Comma list of seeds."),
    rounds: Optional[int] = typer.Option(None, help="Rounds for every cell (default: the paper's (tab. 1))"),
    out: Path = typer.Option(Path("reproduce"), "--out", help="Output folder (run directories under OUT/runs)."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="key=value override of any run option "
                                                                "(repeatable), e.g. --set threads=8"),
    data_dir: Optional[str] = typer.Option(None, help="Folder with the dataset files."),
    sweep: Optional[str] = typer.Option(None, help="One-parameter sweep instead of the grid, e.g. lambda=0,0.5,1,2,4 "
                                                   "(fig. 4) or shots=10,25,50,100 (fig. 3)."),
    threads: Optional[int] = typer.Option(None, help="torch threads for every cell (same as --set threads=N; "
                                                     "0: torch's default)"),
):
    """Run the paper's grid (tab. 1-4) or a sweep (fig. 3, 4); resumable; writes table.md/.csv."""
    try:
        _reproduce(datasets, ways, methods, seeds, rounds, out, set_, data_dir, sweep, threads)
    except KeyboardInterrupt:
        err_console.print(f"interrupted; the cells finished so far are in {out / 'status.json'} and the table "
                          "(a sweep: after its last cell); run the same command again to resume",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(130)


def _reproduce(datasets, ways, methods, seeds, rounds, out, set_, data_dir, sweep, threads) -> None:
    from fedproto import reproduce as rp

    sets = rp.parse_sets(set_)
    if threads is not None:
        if "threads" in sets and sets["threads"] != threads:
            raise FedprotoError(f"--threads {threads} and --set threads={sets['threads']} disagree; give one of them")
        sets["threads"] = threads
    seed_list = rp.parse_list(seeds, rp.DEFAULT_SEEDS, "seeds", conv=int)
    known_ds = list(rp.MODELS)
    if sweep:
        ds = rp.parse_list(datasets, [], "datasets", known_ds)
        ns = rp.parse_list(ways, [], "ways", conv=int)
        ms = rp.parse_list(methods, [], "methods", list(rp.METHODS))
        if len(ds) > 1 or len(ns) > 1:
            raise FedprotoError("--sweep runs one dataset and one ways value; give at most one of each")
        results, csv_path, png = rp.run_sweep(out, sweep, ds[0] if ds else None, ns[0] if ns else None,
                                              ms or None, seed_list, rounds, sets, data_dir, console=console)
        _finish(results, f"{csv_path} and {png}")
        return
    ds = rp.parse_list(datasets, rp.DEFAULT_DATASETS, "datasets", known_ds)
    ns = rp.parse_list(ways, rp.DEFAULT_WAYS, "ways", conv=int)
    ms = rp.parse_list(methods, list(rp.METHODS), "methods", list(rp.METHODS))
    results = rp.run_grid(out, ds, ns, ms, seed_list, rounds, sets, data_dir, console=console)
    _finish(results, f"{out / 'table.md'} and {out / 'table.csv'}")


def _finish(results, wrote: str) -> None:
    """The closing line of a grid or sweep; exit code 1 when any cell failed (the outputs are
    written either way)."""
    counts = {k: sum(r.status == k for r in results) for k in ("done", "skipped", "failed")}
    console.print(f"{len(results)} cells: {counts['done']} run, {counts['skipped']} skipped, {counts['failed']} failed; "
                  f"wrote {wrote}", highlight=False, soft_wrap=True)
    if counts["failed"]:
        raise typer.Exit(1)


def main() -> None:
    """Console entry point. Usage errors: click's message and exit code 2; any FedprotoError: one
    message on stderr and exit code 2, no traceback."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    def on_term(signum, frame):  # `kill`, `timeout`, Slurm, docker stop: end like Ctrl-C (results restored)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        app()
    except FedprotoError as e:
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True, markup=True)
        sys.exit(2)
    except OSError as e:  # a path the checks above did not cover: too long, full disk, permissions
        where = f" {str(e.filename)[:200]!r}" if e.filename else ""
        err_console.print(f"[bold red]error:[/] {escape(e.strerror or str(e))}:{escape(where)}; fix that path "
                          "(or free space) and run the command again", highlight=False, soft_wrap=True, markup=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
