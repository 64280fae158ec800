"""``fedproto reproduce --ray``: each cell a Ray task (Ray's own task API: ``ray.remote`` with
``num_cpus`` = the cell's threads, ``max_retries`` for a worker that dies). Part of
:mod:`fedproto.reproduce`; docs/reproducing.md describes the cluster set-up.

Run folders: where the workers see the driver's output folder (a shared filesystem, or one
machine) each cell writes its folder in place; elsewhere it runs in a temporary folder on the
worker and its files come back in the task's result, written under ``OUT/runs`` by the driver.
Which one holds is found per task: the driver leaves a marker file with a random token in
``OUT/runs`` and a worker that reads the same token writes in place.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedproto.deploy.netcheck import check_ray_address
from fedproto.errors import ConfigError
from fedproto.outputs.run_folder import atomic_write_bytes, is_private
from fedproto.reproduce.cells import THREAD_VARIABLES
from fedproto.reproduce.grid import Cell, CellResult

log = logging.getLogger("fedproto.reproduce")  # one logger for the package

RAY_EXTRA = "ray"
"""The optional extra that installs Ray (``pip install "fedproto[ray]"``)."""

RETRIES = 2
"""Times a cell is run again when its worker process dies (Ray's ``max_retries``); a cell that
fails with an error is not retried (its error is the result)."""

MARKER = ".fedproto-ray-{token}"


def require_ray():
    """The ``ray`` module.

    Raises:
        ConfigError: Ray is not installed (names the extra to install).
    """
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--ray needs Ray, which is not installed; install the extra: pip install "
                          f"\"fedproto[{RAY_EXTRA}]\" (or leave out --ray and use --jobs N on this machine)") from None
    return ray


class _Session:
    """A connection to a Ray cluster; ``close`` shuts Ray down only when this session started it."""

    def __init__(self, ray, owned: bool):
        self.ray, self.owned = ray, owned

    def close(self) -> None:
        if self.owned:
            self.ray.shutdown()


def connect(address: str) -> _Session:
    """Connect to a Ray cluster: ``"auto"`` (``RAY_ADDRESS``, else the cluster last started on this
    machine, else a new local one: :func:`ray.init` without an address), ``"local"`` (a new local
    cluster) or an address (``host:port``, ``ray://host:port``). A Ray already initialised in this
    process is used as it is.

    Raises:
        ConfigError: Ray is not installed, or the cluster cannot be reached.
    """
    ray = require_ray()
    if ray.is_initialized():
        return _Session(ray, False)
    check_ray_address(address)
    try:
        ray.init(address=None if address == "auto" else address, log_to_driver=False,
                 configure_logging=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise ConfigError(f"--ray {address!r}: cannot connect to the Ray cluster ({e}); give the head node's "
                          "address (host:port), or auto") from None
    return _Session(ray, True)


def cluster_cpus() -> int:
    """The CPUs of the connected Ray cluster (at least 1)."""
    ray = require_ray()
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def largest_node_cpus() -> int:
    """The CPUs of the connected cluster's largest live node: no task may ask for more."""
    ray = require_ray()
    return max([int(n.get("Resources", {}).get("CPU", 0)) for n in ray.nodes() if n.get("Alive")] or [1])


def _run_task(cell: Cell, token: str, run: Callable[[Cell], CellResult], return_files: bool) -> dict:
    """The Ray task: run one cell on a worker; returns its result and, where the worker does not
    see the driver's folder (or ``return_files``), the run folder's files (relative path -> bytes)."""
    runs = Path(cell.cfg.out_dir)
    shared = not return_files and (runs / MARKER.format(token=token)).is_file()
    tmp = None
    if not shared:
        tmp = Path(tempfile.mkdtemp(prefix="fedproto-cell-"))
        cell = replace(cell, cfg=cell.cfg.model_copy(update={"out_dir": str(tmp)}))
    try:
        r = run(cell)
        files: dict[str, bytes] = {}
        if tmp is not None:
            folder = tmp / cell.name
            files = {p.relative_to(folder).as_posix(): p.read_bytes()
                     for p in sorted(folder.rglob("*")) if p.is_file()} if folder.is_dir() else {}
        return {"status": r.status, "summary": r.summary, "message": r.message, "wall_s": r.wall_s, "files": files}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def write_files(folder: Path, files: dict[str, bytes]) -> None:
    """Write a run folder's files brought back from a worker (atomically each; parent folders made).

    Raises:
        ConfigError: a path that would leave the folder (a damaged or foreign result).
    """
    root = folder.resolve()
    for rel, data in files.items():
        target = (folder / rel).resolve()
        if root not in target.parents:
            raise ConfigError(f"a Ray worker returned the file {rel!r}, outside the cell's folder {str(folder)!r}")
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(target, data, is_private(target))  # models and prototypes: 0600 in a 0700 folder


def _failure(e: BaseException) -> str:
    name = type(e).__name__
    if "WorkerCrashed" in name or "NodeDied" in name or "ActorDied" in name:
        return (f"its Ray worker died {RETRIES + 1} times ({name}); run the same command again to retry it, or look at "
                "the worker's memory")
    cause = getattr(e, "cause", None)
    return f"{type(cause).__name__}: {cause}" if cause is not None else f"{name}: {e}"


def ray_events(cells: Sequence[Cell], todo: Sequence[int], out: Path, threads: int,
               run: Callable[[Cell], CellResult], return_files: bool = False) -> Iterator[tuple]:
    """Send ``cells[i]`` for ``i`` in ``todo`` to the connected cluster as Ray tasks of
    ``num_cpus=threads`` (the thread variables set to ``threads`` in their workers' environment),
    all at once: Ray runs as many as its CPUs hold. Yields ``("start", i)`` for every cell, then
    ``("end", i, result)`` as the tasks finish, the run folders written under ``out/runs``."""
    ray = require_ray()
    token = secrets.token_hex(8)
    marker = Path(out) / "runs" / MARKER.format(token=token)
    marker.write_text(token)
    env = {k: str(threads) for k in THREAD_VARIABLES}
    task = ray.remote(num_cpus=threads, max_retries=RETRIES, retry_exceptions=False,
                      runtime_env={"env_vars": env})(_run_task)
    try:
        refs: dict[Any, int] = {}
        for i in todo:
            refs[task.remote(cells[i], token, run, return_files)] = i
            yield ("start", i)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            i = refs[ready[0]]
            cell = cells[i]
            try:
                got = ray.get(ready[0])
            except Exception as e:  # the worker died RETRIES + 1 times, or a bug in the cell
                yield ("end", i, CellResult(cell, "failed", None, _failure(e)))
                continue
            if got["files"]:
                write_files(Path(cell.cfg.out_dir) / cell.name, got["files"])
            yield ("end", i, CellResult(cell, got["status"], got["summary"], got["message"], got["wall_s"]))
    finally:
        marker.unlink(missing_ok=True)
