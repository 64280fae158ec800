"""The commands around a run: ``fedproto plot``, ``site-data`` and ``onboard`` (registered on the
command line by :mod:`fedproto.cli.app`; docs/architecture.md, "Module map": ``cli``).
"""

from __future__ import annotations

import errno
import zipfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Optional

import typer

from fedproto.cli.console import console, err_console
from fedproto.errors import FedprotoError


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
    seed: int = typer.Option(0, min=0, help="--from: the seed of the train/test split (0 or more)."),
    config: Optional[Path] = typer.Option(None, "--config", help="The run's options (TOML): dataset, clients, ways, "
                                          "shots, seed... (without --from)."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="A run option as key=value (repeatable; without "
                                             "--from), e.g. --set dataset=mnist --set clients=3."),
    client_ids: Optional[str] = typer.Option(None, help="Only these clients of the partition (comma-separated ids)."),
):
    """Write a site's train.npz and test.npz for a Flower SuperNode (docs/flower.md, "Node data")."""
    from fedproto.deploy import site_data as sitedata

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
    from fedproto.config.run_config import build_config
    from fedproto.reproduce import parse_sets

    cfg = build_config(config, parse_sets(set_, grid=False))
    ids = None
    if client_ids is not None:
        try:
            ids = [int(v) for v in client_ids.split(",")]
        except ValueError:
            raise FedprotoError(f"--client-ids {client_ids!r}: give whole numbers separated by commas, e.g. 0,1,2") \
                from None
        ids = list(dict.fromkeys(ids))  # each site once, in the order given
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


def onboard(
    run_dir: str = typer.Argument(..., help="A finished fedproto run directory"),
    clients: int = typer.Option(5, help="New clients to draw (the run's n-way k-shot protocol, unused samples)"),
    epochs: Optional[int] = typer.Option(None, help="Local epochs per new client (default: the run's rounds x "
                                               "local epochs)"),
    seed: Optional[int] = typer.Option(None, min=0, help="Seed of the new clients (default: the run's)"),
    data_dir: Optional[str] = typer.Option(None, help="Dataset folder (default: the run's look-up order)"),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: the run's setting)"),
):
    """Onboard new clients: train each with the run's global prototypes and without (local only)."""
    from rich.table import Table

    from fedproto.federation.onboarding import onboard as do_onboard
    from fedproto.outputs.run_folder import pct as _pct

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
