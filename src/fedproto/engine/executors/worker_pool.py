"""Worker processes for the client-batched engine: every core, not just the threads of one process.

A run with ``workers`` W > 1 splits each round's clients of one architecture into W parts of
about equal sample counts. The main process trains part 0 itself; parts 1..W-1 go to W - 1 worker
processes, each with ``threads_per_worker`` torch threads. Each part is trained by the same
:func:`fedproto.training.train_stacked` as in one process, so the numbers are the same: clients
are independent within a batched computation (per-client grouped convolutions and batched
matmuls), and this was checked bitwise in float32 on the development machine and within 1e-12 in
float64 by the tests (tests/engine/test_parallel.py).

Shared memory: the clients' training inputs and labels are copied once, when the pool starts,
into :class:`multiprocessing.shared_memory.SharedMemory` blocks; each architecture's stacked
weights ((N, \\*shape) per parameter, N its clients) live in shared blocks too. Per round the main
process writes the weights of a part's clients there, sends the part's stacked batch plan and
objective (pickled, a few MB at most), the worker trains in place and returns per-client results
(class sums and counts of embeddings, losses); the main process copies the new weights back into
the client models. Nothing else is shared.

Workers are separate interpreters started with ``python -m fedproto.engine.executors.worker`` (not
``multiprocessing``'s spawn, which re-runs the user's script in each worker when it lacks an
``if __name__ == "__main__"`` guard) and connected over an authenticated local socket
(:mod:`multiprocessing.connection`). A worker that dies or raises stops the run with its
traceback. The pool is closed, and its shared memory freed, when the run ends.

The shared blocks and the worker's side of the protocol are :mod:`fedproto.engine.executors.worker`
(one protocol: change both modules together).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener
from typing import IO, TYPE_CHECKING, cast

import numpy as np
import torch

from fedproto.engine.executors.worker import (
    GroupTask,
    PartTask,
    PoolInit,
    SharedSpec,
    StoreInit,
    _Blocks,
    _recv,
    _send,
)
from fedproto.training import Objective, OptimConfig, StackedPhase, TrainResult

if TYPE_CHECKING:
    from fedproto.models.proto_model import ProtoModel

GroupItem = tuple[Sequence[int], Sequence[StackedPhase], Objective, "dict[str, torch.Tensor] | None"]
"""A group :meth:`WorkerPool.submit` sends: ``(ids, phases, obj, ref)``."""

CLIENTS_PER_WORKER = 8
"""Auto mode gives each process at least this many clients of a round (fewer clients do not pay
for a worker's start-up and the per-round messages)."""

THREADS_PER_WORKER = 2
"""Auto mode gives each process this many threads: on the 2-core development machines two threads
of one process trained the grouped step 1.7x faster than one thread, and two one-thread processes
were no faster than one two-thread process (docs/benchmarks.md), so processes are for machines
with more cores than one process's threads use well (not measured: no such machine was at hand)."""

MIN_ROUNDS = 10
"""Auto mode starts workers only for runs of at least this many rounds (a worker takes about 1-2 s
to start: it imports torch)."""

START_TIMEOUT_S = 120.0
"""Seconds a worker may take to start (import torch and connect) before the run stops."""


def available_cores() -> int:
    """CPU cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` elsewhere)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def plan_workers(workers: int, threads: int, batched_clients: int, device: str = "cpu",
                 rounds: int = MIN_ROUNDS) -> tuple[int, int]:
    """Worker processes and torch threads per worker for a run.

    Args:
        workers: the ``workers`` option (0: auto). threads: the ``threads`` option, the run's CPU
            threads in all (0: every available core). batched_clients: the most clients of one
            architecture trained in a round (batched execution; 0 or 1 when nothing batches).
        device: the run's device; workers are CPU processes. rounds: the run's rounds.
    Returns:
        (W, threads per worker). Auto: W = min((threads or cores) // :data:`THREADS_PER_WORKER`,
        batched_clients // :data:`CLIENTS_PER_WORKER`), at least 1, and 1 for runs shorter than
        :data:`MIN_ROUNDS`;
        explicit W is kept (1 for a non-CPU device, fewer than 2 batched clients, or Windows). Threads per
        worker: (threads or cores) // W, at least 1.
    """
    total = threads or available_cores()
    if not str(device).startswith("cpu") or batched_clients < 2 or os.name == "nt":  # (no AF_UNIX sockets)
        return 1, total
    auto = min(total // THREADS_PER_WORKER, batched_clients // CLIENTS_PER_WORKER) if rounds >= MIN_ROUNDS else 1
    w = workers or auto
    w = max(1, min(w, batched_clients))
    return w, max(1, total // w)


# ----------------------------------------------------------------------------------------------
# Main side


@dataclass
class _Store:
    """One architecture's clients in shared memory: client id -> row, stacked weights."""

    m0: ProtoModel
    names: tuple[str, ...]
    row: dict[int, int]
    P: dict[str, torch.Tensor]
    specs: dict[str, SharedSpec]


class WorkerPool:
    """``n_workers`` worker processes (plus the main process) training parts of batched groups.

    Args:
        models: client id -> model of every client that may be trained batched (CPU).
        data_x: client id -> (n_i, Cin, H, W) training inputs: any mapping, read once per client,
            one client at a time, straight into the shared block (a mapping that gathers a
            client's rows on reading, as :class:`~fedproto.algorithms.algorithm.ClientData` views do,
            never holds all clients' inputs at once outside it).
        data_y: client id -> (n_i,) labels.
        n_workers: worker processes to start (the main process is not counted).
        threads: torch threads of each worker.
    Raises:
        RuntimeError: a worker failed to start (its error output is included).
    """

    def __init__(self, models: Mapping[int, ProtoModel], data_x: Mapping[int, torch.Tensor],
                 data_y: Mapping[int, torch.Tensor], n_workers: int, threads: int):
        self._blocks = _Blocks()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        self._pending: dict[int, list[Sequence[int]]] = {}
        self._dir = tempfile.mkdtemp(prefix="fedproto-pool-")
        try:
            self._setup(models, data_x, data_y, n_workers, threads)
        except BaseException:
            self.close()
            raise

    def _setup(self, models: Mapping[int, ProtoModel], data_x: Mapping[int, torch.Tensor],
               data_y: Mapping[int, torch.Tensor], n_workers: int, threads: int) -> None:
        ids = sorted(models)
        sizes = [len(data_y[i]) for i in ids]
        offsets = np.cumsum([0] + sizes)[:-1]
        self.offset = {i: int(o) for i, o in zip(ids, offsets)}
        x_spec, self.X = self._fill(data_x, ids, sizes)
        y_spec, self.Y = self._blocks.new(torch.cat([data_y[i] for i in ids]))
        by_arch: dict[Hashable, list[int]] = {}
        for i in ids:
            by_arch.setdefault(models[i].arch_key(), []).append(i)
        self.stores: list[_Store] = []
        self.store_of: dict[int, int] = {}
        for members in by_arch.values():
            m0 = models[members[0]]
            names = tuple(m0.batch_params)
            P: dict[str, torch.Tensor] = {}
            specs: dict[str, SharedSpec] = {}
            for k in names:
                specs[k], P[k] = self._blocks.new(
                    torch.stack([dict(models[i].named_parameters())[k].detach() for i in members]))
            for i in members:
                self.store_of[i] = len(self.stores)
            self.stores.append(_Store(m0, names, {i: r for r, i in enumerate(members)}, P, specs))
        key = secrets.token_bytes(32)
        address = os.path.join(self._dir, "pool.sock")
        listener = Listener(address, family="AF_UNIX", authkey=key)
        try:
            # the key goes in the environment, readable by this user only, not on the command line (ps)
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                       FEDPROTO_POOL_KEY=key.hex())
            self._logs: list[IO[str]] = []
            for _ in range(n_workers):
                log = tempfile.TemporaryFile("w+")  # no name on disk: nothing is left if this process is killed
                self._logs.append(log)
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "fedproto.engine.executors.worker", address, str(threads)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                    # a session of its own: Ctrl-C in a terminal (SIGINT to the foreground process group)
                    # reaches the main process only, which stops the run and closes the pool; a worker
                    # killed by it would turn the interruption into a "worker died" error
                    start_new_session=True))
            try:  # Listener.accept() has no timeout of its own: a worker that cannot start must not hang the run
                # private attributes the stub does not list (the listening socket)
                listener._listener._socket.settimeout(START_TIMEOUT_S)  # type: ignore[attr-defined]
            except AttributeError:  # pragma: no cover - another multiprocessing implementation
                pass
            for _ in range(n_workers):
                try:
                    self._conns.append(listener.accept())
                except OSError as e:
                    raise RuntimeError(f"a worker process did not start within {START_TIMEOUT_S:.0f} s: "
                                       f"{e}\n{self._worker_logs()}") from None
        finally:
            listener.close()  # removes the socket file: the pool's folder is empty and goes now
            try:
                os.rmdir(self._dir)
            except OSError:
                pass
        init = PoolInit(X=x_spec, Y=y_spec,
                        stores=[StoreInit(m0=s.m0, names=s.names, specs=s.specs) for s in self.stores])
        for c in self._conns:
            _send(c, init)

    def _fill(self, data_x: Mapping[int, torch.Tensor], ids: list[int],
              sizes: list[int]) -> tuple[SharedSpec, torch.Tensor]:
        """One shared block holding the inputs of clients ``ids`` one after another, read client by client."""
        first = data_x[ids[0]]
        spec, X = self._blocks.empty((sum(sizes), *first.shape[1:]), first.dtype)
        at = 0
        for k, i in enumerate(ids):
            x = first if k == 0 else data_x[i]
            if len(x) != sizes[k]:
                raise ValueError(f"client {i}: {len(x)} training inputs but {sizes[k]} labels; give one label per "
                                 "input")
            X[at : at + sizes[k]] = x.detach().cpu()
            at += sizes[k]
        return spec, X

    @property
    def processes(self) -> list[subprocess.Popen[bytes]]:
        """The worker processes (one per worker, in worker order; empty once closed)."""
        return list(self._procs)

    @property
    def n_workers(self) -> int:
        return len(self._conns)

    def submit(self, w: int, items: Sequence[GroupItem], models: Sequence[Sequence[torch.nn.Module]],
               opt: OptimConfig) -> None:
        """Send worker ``w`` groups to train, one after another.

        Args:
            items: per group ``(ids, phases, obj, ref)``: client ids (one architecture), the
                :class:`StackedPhase` list indexing rows of the shared inputs (:meth:`offsets`), the
                objective (:func:`fedproto.training.portable_objective`) and stacked FedProx
                references or None (:func:`fedproto.training.stacked_refs`).
            models: per group, the clients' models in the order of ``ids``.
        Collect the results with :meth:`collect` before submitting to ``w`` again.
        """
        sent: list[GroupTask] = []
        with torch.no_grad():
            for (ids, phases, obj, ref), ms in zip(items, models):
                s = self.store_of[ids[0]]
                st = self.stores[s]
                rows = torch.as_tensor([st.row[i] for i in ids])
                named = [dict(m.named_parameters()) for m in ms]
                for k in st.names:
                    st.P[k][rows] = torch.stack([n[k].detach() for n in named])
                sent.append(GroupTask(store=s, rows=rows.numpy(), phases=phases, obj=obj, ref=ref))
        self._pending[w] = [ids for ids, *_ in items]
        try:
            _send(self._conns[w], PartTask(groups=sent, opt=opt))
        except OSError as e:  # it died between rounds
            raise self._died(w, e) from None

    def collect(self, w: int, models: Sequence[Sequence[torch.nn.Module]]) -> list[list[TrainResult]]:
        """Wait for worker ``w``'s results (per group submitted, per client) and copy the trained
        weights into ``models`` (as given to :meth:`submit`).

        Raises:
            RuntimeError: the worker raised (with its traceback) or died.
        """
        try:
            reply = _recv(self._conns[w])
        except (EOFError, OSError) as e:
            raise self._died(w, e) from None
        if isinstance(reply, dict) and "error" in reply:
            raise RuntimeError(f"worker process {w + 1} failed:\n{reply['error']}")
        with torch.no_grad():
            for ids, ms in zip(self._pending.pop(w), models):
                st = self.stores[self.store_of[ids[0]]]
                for i, m in zip(ids, ms):
                    named = dict(m.named_parameters())
                    for k in st.names:
                        named[k].copy_(st.P[k][st.row[i]])
        return cast("list[list[TrainResult]]", reply)  # not an error: the worker's results, per group and client

    def _died(self, w: int, e: BaseException) -> RuntimeError:
        return RuntimeError(f"worker process {w + 1} died ({str(e) or type(e).__name__}; {self._exit(w)}); its "
                            f"output:\n{self._worker_logs()}")

    def _exit(self, w: int) -> str:
        """How worker ``w`` ended: its exit code or the signal that killed it."""
        if w >= len(self._procs):
            return "exit code unknown"
        try:
            code = self._procs[w].wait(timeout=5)  # its socket closes just before it is reaped
        except subprocess.TimeoutExpired:
            return "still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            hint = " (out of memory? the kernel's OOM killer sends it)" if -code == signal.SIGKILL else ""
            return f"killed by {name}{hint}"
        return f"exit code {code}"

    def offsets(self, ids: Sequence[int]) -> list[int]:
        """Rows of the shared inputs where each client's samples start."""
        return [self.offset[i] for i in ids]

    def _worker_logs(self) -> str:
        out = []
        for w, log in enumerate(getattr(self, "_logs", [])):
            try:
                log.flush()
                log.seek(0)
                text = log.read()[-4000:]
            except (OSError, ValueError):
                text = ""
            if text.strip():
                out.append(f"--- worker {w + 1} ---\n{text}")
        return "\n".join(out) or "(no output)"

    def worker_peak_rss_mb(self) -> float:
        """The largest peak resident memory of a worker so far (MB; Linux ``VmHWM``, counting the
        shared blocks it touched; 0 where unknown)."""
        peak = 0.0
        for p in self._procs:
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            peak = max(peak, int(line.split()[1]) / 1024)
            except (OSError, ValueError):
                pass
        return peak

    def close(self) -> None:
        """Stop the workers and free the shared memory (safe to call twice). Workers with results
        outstanding (the run stopped mid-round: an error or Ctrl-C) are killed, not waited for."""
        for w in self._pending:
            if w < len(self._procs):
                self._procs[w].kill()
        self._pending = {}
        for c in self._conns:
            try:
                _send(c, None)
                c.close()
            except (OSError, EOFError, BrokenPipeError):
                pass
        self._conns = []
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs = []
        for log in getattr(self, "_logs", []):
            log.close()
        self._logs = []
        self._blocks.free()
        try:
            if os.path.isdir(self._dir):
                for f in os.listdir(self._dir):
                    os.unlink(os.path.join(self._dir, f))
                os.rmdir(self._dir)
        except OSError:
            pass

    def __del__(self) -> None:  # a pool that was not closed (an exception in the run) still frees its memory
        try:
            self.close()
        except Exception:
            pass
