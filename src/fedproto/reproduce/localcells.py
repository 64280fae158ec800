"""``fedproto reproduce --jobs N``: the cells in N local processes (:func:`local_events`, the
counterpart of :func:`fedproto.reproduce.raycells.ray_events`), started and stopped so that none is
left behind (:func:`worker_pool`). Part of :mod:`fedproto.reproduce`; the thread budget and the
progress lines are :mod:`fedproto.reproduce.side_by_side`'s, which re-exports the names here.

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

from fedproto.reproduce.grid import Cell, CellResult

log = logging.getLogger("fedproto.reproduce")  # one logger for the package

Event = tuple  # ("start", index) or ("end", index, CellResult)


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
