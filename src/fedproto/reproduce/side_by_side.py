"""Cells side by side: ``fedproto reproduce --jobs N`` (N local processes) and ``--ray`` (a Ray
cluster, :mod:`fedproto.reproduce.raycells`), with the progress lines of both. Part of
:mod:`fedproto.reproduce`; docs/reproducing.md describes the options.

The thread budget: ``--threads`` (0 or not given: the cores this process may use, or the Ray
cluster's CPUs) is shared by the cells that run at once; each cell runs with ``budget // jobs``
threads (at least 1), set in its process's environment (``OMP_NUM_THREADS`` and the BLAS
variables) before torch starts there and as the cell's ``threads`` option. Skipping finished cells
(:func:`~fedproto.reproduce.cells.finished`) happens here, before any process starts. A cell's
numbers depend on its configuration, seed and thread count only, not on the cells beside it.

No process outlives the command: every worker process of ``--jobs`` gets a parent-death signal
(``PR_SET_PDEATHSIG`` on Linux; elsewhere a thread that watches the parent), ignores SIGINT (a
Ctrl-C at a terminal reaches the whole process group; the parent stops the workers instead of
each cell dying half-written), and is terminated and joined when the command leaves the pool on
any path but a normal finish: an exception, Ctrl-C (SIGINT) or SIGTERM (which ``fedproto``'s
entry point turns into the same ``KeyboardInterrupt``). See :func:`worker_pool`.
"""

from __future__ import annotations

import ctypes
import logging
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from rich.markup import escape

from fedproto.errors import ConfigError
from fedproto.reproduce.cells import THREAD_VARIABLES, finished, run_cell
from fedproto.reproduce.grid import Cell, CellResult
from fedproto.reproduce.tables import describe, write_status

log = logging.getLogger("fedproto.reproduce")  # one logger for the package

Event = tuple  # ("start", index) or ("end", index, CellResult)


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


PARENT_DEATH_SIGNAL = signal.SIGTERM
"""What a worker process gets when the process that started it dies (SIGKILL included)."""

STOP_TIMEOUT_S = 10.0
"""Seconds a terminated worker is given to end before it is killed (SIGKILL)."""


def _die_with_parent(parent: int) -> None:
    """Make this process end when ``parent`` (the process that started it) ends: on Linux the
    kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG)``), elsewhere a daemon thread that
    checks the parent once a second. A parent that died before this ran ends the process at once."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(1, int(PARENT_DEATH_SIGNAL), 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # no libc symbol: fall back to the watcher
            armed = False
    if os.getppid() != parent:  # the parent is already gone (before the signal was armed)
        os._exit(1)
    if not armed:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, name="fedproto-parent-watch", daemon=True).start()


def _worker_init(parent: int) -> None:
    """Run first in every worker process of ``--jobs``: die with the parent and leave SIGINT to
    it (a terminal's Ctrl-C reaches the whole process group; the parent stops the workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent)


def stop_workers(pool: ProcessPoolExecutor, terminate: bool) -> None:
    """Shut ``pool`` down and join every process it started. ``terminate``: SIGTERM them first
    (the cells they run are given up), SIGKILL any still alive after :data:`STOP_TIMEOUT_S`;
    otherwise wait for them to finish what they run (a normal finish: none runs anything)."""
    procs = list((getattr(pool, "_processes", None) or {}).values())  # the executor's own; no public API in 3.11
    if terminate:
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        for p in procs:
            p.join(STOP_TIMEOUT_S)
            if p.exitcode is None:
                log.warning("worker process %s did not end on SIGTERM within %.0f s; killing it", p.pid,
                            STOP_TIMEOUT_S)
                p.kill()
                p.join()
    pool.shutdown(wait=True, cancel_futures=True)
    for p in procs:
        p.join()


@contextmanager
def worker_pool(jobs: int) -> Iterator[ProcessPoolExecutor]:
    """A pool of ``jobs`` spawned worker processes (a fresh torch each) that leaves no process
    behind: each dies with this process (:func:`_worker_init`), and on every way out of the block
    but a normal end (an exception, ``KeyboardInterrupt`` from Ctrl-C or SIGTERM, a generator
    closed early) the workers are terminated and joined before the exception goes on."""
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                               initargs=(os.getpid(),))
    clean = False
    try:
        yield pool
        clean = True
    finally:
        stop_workers(pool, terminate=not clean)


def _child(cell: Cell, run: Callable[[Cell], CellResult]) -> tuple:
    """In a cell's own process: run it; the result without the cell (the parent has it)."""
    r = run(cell)
    return r.status, r.summary, r.message, r.wall_s


def _in_own_process(cell: Cell, run: Callable[[Cell], CellResult]) -> CellResult:
    """Run one cell alone in a fresh process; a process that dies gives a failed result."""
    t0 = time.perf_counter()
    try:
        with worker_pool(1) as ex:
            status, summary, message, wall = ex.submit(_child, cell, run).result()
        return CellResult(cell, status, summary, message, wall)
    except BrokenProcessPool:
        return CellResult(cell, "failed", None, "the cell's process died before it finished, also when it ran alone "
                          "(killed, or out of memory?); run the same command again to retry it",
                          time.perf_counter() - t0)
    except Exception as e:  # a bug in one cell: recorded, the other cells go on
        return CellResult(cell, "failed", None, f"{type(e).__name__}: {e}", time.perf_counter() - t0)


def local_events(cells: Sequence[Cell], todo: Sequence[int], jobs: int,
                 run: Callable[[Cell], CellResult]) -> Iterator[Event]:
    """Run ``cells[i]`` for ``i`` in ``todo`` on ``jobs`` spawned processes (reused from cell to
    cell: torch is imported once per process); yields ``("start", i)`` and ``("end", i, result)``.

    A process that dies takes its pool down: the cells that were running then run again one at a
    time, each alone in a fresh process (the one whose process dies again is reported failed, the
    others finish), and the remaining cells go on in a new pool. Closed early (``close()``, or an
    exception where it waits), it terminates and joins its processes (:func:`worker_pool`).
    """
    left = deque(todo)
    while left:
        suspects: list[int] = []
        with worker_pool(jobs) as pool:
            running: dict[Future, int] = {}
            while left or running:
                while left and len(running) < jobs and not suspects:
                    i = left.popleft()
                    running[pool.submit(_child, cells[i], run)] = i
                    yield ("start", i)
                if not running:
                    break
                finished_now, _ = wait(running, return_when=FIRST_COMPLETED)
                for f in finished_now:
                    i = running.pop(f)
                    try:
                        status, summary, message, wall = f.result()
                        yield ("end", i, CellResult(cells[i], status, summary, message, wall))
                    except BrokenProcessPool:
                        suspects.append(i)
                    except Exception as e:  # a bug in one cell: recorded, the other cells go on
                        yield ("end", i, CellResult(cells[i], "failed", None, f"{type(e).__name__}: {e}"))
        for i in sorted(suspects):
            log.warning("a process died while %s ran; running it again alone", cells[i].name)
            yield ("end", i, _in_own_process(cells[i], run))


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

