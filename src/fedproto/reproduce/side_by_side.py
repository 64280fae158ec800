"""Cells side by side: ``fedproto reproduce --jobs N`` (N local processes) and ``--ray`` (a Ray
cluster, :mod:`fedproto.reproduce.raycells`), with the progress lines of both. Part of
:mod:`fedproto.reproduce`; docs/reproducing.md describes the options.

The thread budget: ``--threads`` (0 or not given: the cores this process may use, or the Ray
cluster's CPUs) is shared by the cells that run at once; each cell runs with ``budget // jobs``
threads (at least 1), set in its process's environment (``OMP_NUM_THREADS`` and the BLAS
variables) before torch starts there and as the cell's ``threads`` option. Skipping finished cells
(:func:`~fedproto.reproduce.cells.finished`) happens here, before any process starts. A cell's
numbers depend on its configuration, seed and thread count only, not on the cells beside it.

No process outlives the command: the local processes of ``--jobs`` are started and stopped by
:mod:`fedproto.reproduce.localcells` (:func:`~fedproto.reproduce.localcells.worker_pool`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from rich.markup import escape

from fedproto.errors import ConfigError
from fedproto.reproduce.cells import THREAD_VARIABLES, finished, run_cell
from fedproto.reproduce.grid import Cell, CellResult
from fedproto.reproduce.localcells import PARENT_DEATH_SIGNAL as PARENT_DEATH_SIGNAL  # re-exported: --jobs's processes
from fedproto.reproduce.localcells import STOP_TIMEOUT_S as STOP_TIMEOUT_S
from fedproto.reproduce.localcells import Event as Event
from fedproto.reproduce.localcells import local_events as local_events
from fedproto.reproduce.localcells import stop_workers as stop_workers
from fedproto.reproduce.localcells import worker_pool as worker_pool
from fedproto.reproduce.tables import describe, write_status

log = logging.getLogger("fedproto.reproduce")  # one logger for the package


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def check_jobs(jobs: int, todo: int | None = None) -> int:
    """``--jobs`` checked against the cells left to run: below 1 is an error, more than the cells
    is clamped (logged; ``todo`` None: not clamped).

    Raises:
        ConfigError: ``jobs`` is below 1.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"--jobs {jobs!r}: give the number of cells to run at once, 1 or more (e.g. --jobs 2)")
    if todo is not None and jobs > max(todo, 1):
        if todo:
            log.warning("--jobs %d: only %d cell%s left to run; running %d at once", jobs, todo, "s" * (todo != 1),
                        todo)
        return max(todo, 1)
    return jobs


def thread_share(budget: int, jobs: int) -> int:
    """Threads of each of ``jobs`` cells running at once on ``budget`` threads in all: the integer
    share, at least 1 (then logged: the cells use more threads in all than the budget)."""
    share = budget // jobs
    if share < 1:
        log.warning("%d cells at once on a budget of %d thread%s: each runs with 1 thread (%d in all); "
                    "raise --threads or lower --jobs", jobs, budget, "s" * (budget != 1), jobs)
        return 1
    return share


def with_threads(cells: Sequence[Cell], threads: int) -> list[Cell]:
    """The cells with their ``threads`` option set (a result-neutral option: the skip check and the
    stored configuration's comparison ignore it)."""
    return [replace(c, cfg=c.cfg.model_copy(update={"threads": threads})) for c in cells]


@contextmanager
def thread_environment(threads: int) -> Iterator[None]:
    """Set :data:`THREAD_VARIABLES` to ``threads`` for the processes started inside the block
    (restored after it)."""
    old = {k: os.environ.get(k) for k in THREAD_VARIABLES}
    os.environ.update({k: str(threads) for k in THREAD_VARIABLES})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Tally:
    """Cells done / running / failed and the time left, for the progress lines. Running: the cells
    started and not finished, at most ``width`` (Ray queues the tasks its CPUs cannot hold yet).

    The estimate: the mean wall time of the cells run so far (skipped ones left out) times the
    cells not finished, divided by the cells that run at once (``width``).
    """

    def __init__(self, total: int, width: int):
        self.total, self.width = total, max(1, width)
        self.done = self.failed = self.skipped = self.running = 0
        self.walls: list[float] = []

    def start(self) -> None:
        self.running += 1

    def end(self, r: CellResult) -> None:
        if r.status == "skipped":
            self.skipped += 1
            return
        self.running = max(0, self.running - 1)
        self.walls.append(r.wall_s)
        if r.status == "failed":
            self.failed += 1
        else:
            self.done += 1

    def left_s(self) -> float:
        """Seconds left, estimated (NaN before the first cell has run)."""
        left = self.total - self.done - self.failed - self.skipped
        if not self.walls:
            return math.nan
        return sum(self.walls) / len(self.walls) * left / min(self.width, max(left, 1))

    def line(self) -> str:
        """``3 done, 2 running, 0 failed (1 skipped), about 4 min left`` (the numbers of cells)."""
        s = f"{self.done} done, {min(self.running, self.width)} running, {self.failed} failed"
        s += f" ({self.skipped} skipped)" if self.skipped else ""
        if self.done + self.failed + self.skipped == self.total:
            return s
        left = self.left_s()
        if left != left:
            return s + ", time left: after the first cell"
        return s + f", about {_duration(left)} left"


def _duration(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def run_side_by_side(cells: Sequence[Cell], out: Path, console=None, after: Callable[[list], None] | None = None,
                     jobs: int | None = None, ray: str | None = None, run: Callable[[Cell], CellResult] = run_cell,
                     return_files: bool = False) -> list[CellResult]:
    """Run a grid's cells ``jobs`` at once, in local processes or as Ray tasks (``ray``: ``"auto"``
    or a cluster address; :func:`fedproto.reproduce.raycells.ray_events`).

    Finished cells are skipped first; every other cell runs with its share of the thread budget
    (module docstring). After each cell ``status.json`` is rewritten and ``after`` gets the
    results so far in the grid's order, so the tables are the serial run's once all cells are in.

    Args:
        cells: the planned cells (:func:`~fedproto.reproduce.grid.plan_grid` and the like).
        out: the grid's output folder (``status.json``).
        console: a rich console for the progress lines (None: none).
        after: called with the results so far (grid order) after each cell.
        jobs: cells at once (local: processes; Ray: the budget's divisor). None: 1 locally; with
            Ray, one thread per cell.
        ray: None for local processes, else ``"auto"`` or a Ray address.
        run: what runs one cell in its process (:func:`run_cell`).
        return_files: Ray only: True to bring every run folder back in the task's result even
            where the workers see ``out`` (False: only where they do not).

    Returns:
        Every cell's result, in the grid's order.

    Raises:
        ConfigError: ``jobs`` below 1; Ray asked for but not installed, or its cluster unreachable.
    """
    results: dict[int, CellResult] = {}
    todo: list[int] = []
    for i, c in enumerate(cells):
        s = finished(c)
        if s is not None:
            results[i] = CellResult(c, "skipped", s)
        else:
            todo.append(i)
    width = len(str(len(cells)))
    if jobs is not None:
        check_jobs(jobs)
    session = None
    given = cells[0].cfg.threads if cells else 0
    if ray is not None:
        from fedproto.reproduce import raycells

        raycells.require_ray()
        session = raycells.connect(ray) if todo else None  # nothing to run: no cluster needed
        cpus = raycells.cluster_cpus() if todo else 1
        budget = given or cpus
        jobs = budget if jobs is None else jobs
        threads = thread_share(budget, jobs)
        if todo and threads > (most := raycells.largest_node_cpus()):
            session.close()
            raise ConfigError(f"each cell would ask Ray for {threads} CPUs ({budget} threads over {jobs} jobs) but "
                              f"the largest node has {most}; raise --jobs or lower --threads")
        at_once = max(1, min(len(todo), cpus // threads))
        where = f"Ray cluster ({cpus} CPUs)"
    else:
        jobs = check_jobs(1 if jobs is None else jobs, len(todo))
        threads = thread_share(given or available_cores(), jobs)
        at_once = jobs
        where = f"{jobs} local process{'es' * (jobs != 1)}"
    cells = with_threads(cells, threads)
    for i in results:
        results[i] = replace(results[i], cell=cells[i])
    tally = Tally(len(cells), at_once)
    say = console.print if console is not None else (lambda *a, **k: None)
    say(f"{len(todo)} of {len(cells)} cells to run on {where}, {threads} thread{'s' * (threads != 1)} each",
        highlight=False, soft_wrap=True)

    def report(i: int, r: CellResult) -> None:
        tally.end(r)
        say(f"{escape(f'[{i + 1:>{width}}/{len(cells)}]')} {escape(r.cell.name)}  {describe(r)}  "
            f"[dim]{escape(tally.line())}[/]", markup=True, highlight=False, soft_wrap=True)
        done = [results[k] for k in sorted(results)]
        write_status(out, done)
        if after:
            after(done)

    try:
        for i in sorted(results):
            report(i, results[i])
        if todo:
            events = (raycells.ray_events(cells, todo, Path(out), threads, run, return_files) if ray is not None
                      else local_events(cells, todo, jobs, run))
            try:
                with thread_environment(threads):
                    for ev in events:
                        if ev[0] == "start":
                            tally.start()
                            continue
                        results[ev[1]] = ev[2]
                        report(ev[1], ev[2])
            finally:  # left on an exception (in report, or Ctrl-C/SIGTERM there): stop its processes now
                events.close()
        elif after:
            after([results[k] for k in sorted(results)])
    except KeyboardInterrupt:  # cells that finished while their results were on the way are on disk
        for i in todo:
            if i not in results and (s := finished(cells[i])) is not None:
                results[i] = CellResult(cells[i], "done", s)
        if after and results:
            after([results[k] for k in sorted(results)])
        raise
    finally:
        write_status(out, [results[k] for k in sorted(results)])
        if session is not None:
            session.close()
    return [results[k] for k in sorted(results)]

