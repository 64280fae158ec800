"""The worker side of :mod:`fedproto.engine.executors.worker_pool` and the shared memory both sides use: a worker is
``python -m fedproto.engine.executors.worker ADDRESS THREADS``, connected to the main process's
:class:`fedproto.engine.executors.worker_pool.WorkerPool` over an authenticated local socket; it attaches the shared
blocks (:class:`SharedSpec`) of the clients' inputs and stacked weights, then trains the parts it
is sent with :func:`fedproto.training.train_stacked` in place until it is told to stop. One
protocol: change this module and :mod:`fedproto.engine.executors.worker_pool` together.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.connection import Client, Connection
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import torch

from fedproto.training import train_stacked

if TYPE_CHECKING:
    from fedproto.models.proto_model import ProtoModel
    from fedproto.training import Objective, OptimConfig, StackedPhase, TrainResult

# ----------------------------------------------------------------------------------------------
# Shared arrays


@dataclass(frozen=True)
class SharedSpec:
    """Name, shape and dtype of an array in a :class:`SharedMemory` block."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def _attach(spec: SharedSpec) -> tuple[shared_memory.SharedMemory, torch.Tensor]:
    shm = shared_memory.SharedMemory(name=spec.name)
    # the creating process owns the block; do not let this process's tracker unlink it at exit
    # (Python < 3.13 registers attached blocks too)
    try:
        # _name: the name the tracker registered (the stub lists only the public name, without its "/")
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # noqa: SLF001
    except Exception:  # pragma: no cover - tracker internals differ across versions
        pass
    arr = np.ndarray(spec.shape, dtype=np.dtype(spec.dtype), buffer=shm.buf)
    return shm, torch.from_numpy(arr)


class _Blocks:
    """Shared blocks created by the main process (freed by :meth:`free`)."""

    def __init__(self) -> None:
        self._blocks: list[shared_memory.SharedMemory] = []
        self._tensors: list[torch.Tensor] = []

    def new(self, t: torch.Tensor) -> tuple[SharedSpec, torch.Tensor]:
        """A block holding a copy of ``t``."""
        t = t.detach().cpu().contiguous()
        spec, tv = self.empty(tuple(t.shape), t.dtype)
        tv.copy_(t)
        return spec, tv

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[SharedSpec, torch.Tensor]:
        """A block for an array of ``shape`` and ``dtype``, left for the caller to fill."""
        dt = torch.empty(0, dtype=dtype).numpy().dtype
        shm = shared_memory.SharedMemory(create=True, size=max(int(np.prod(shape)) * dt.itemsize, 1))
        view = np.ndarray(shape, dtype=dt, buffer=shm.buf)
        self._blocks.append(shm)
        tv = torch.from_numpy(view)
        self._tensors.append(tv)
        return SharedSpec(shm.name, tuple(shape), dt.str), tv

    def free(self) -> None:
        self._tensors.clear()
        for shm in self._blocks:
            try:
                shm.close()
            except BufferError:  # a view is still referenced: the mapping goes with it
                pass
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        self._blocks.clear()


# ----------------------------------------------------------------------------------------------
# The messages (pickled): the pool's first message, then a round's task per part, None to stop; the worker
# answers each task with a list of TrainResult lists (one per group) or WorkerError


class StoreInit(TypedDict):
    """One architecture's stacked weights in shared blocks."""

    m0: ProtoModel  # a model of the architecture (its grouped forward)
    names: tuple[str, ...]  # its batch_params
    specs: dict[str, SharedSpec]  # name -> the (N, *shape) block


class PoolInit(TypedDict):
    """The pool's first message: the shared inputs, labels and stores."""

    X: SharedSpec
    Y: SharedSpec
    stores: list[StoreInit]


class GroupTask(TypedDict):
    """One group of a task: rows of one store to train."""

    store: int
    rows: np.ndarray  # the clients' rows in that store
    phases: Sequence[StackedPhase]
    obj: Objective
    ref: dict[str, torch.Tensor] | None


class PartTask(TypedDict):
    """A round's part for one worker."""

    groups: list[GroupTask]
    opt: OptimConfig


class WorkerError(TypedDict):
    """A worker's answer when its task raised."""

    error: str  # the traceback


def _send(conn: Connection, obj: object) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    """The next message, unpickled: any of the module's messages (the caller knows which)."""
    return pickle.loads(conn.recv_bytes())


# ----------------------------------------------------------------------------------------------
# Worker side


def _serve(address: str, key: bytes, threads: int) -> None:
    torch.set_num_threads(threads)
    conn = Client(address, family="AF_UNIX", authkey=key)
    init: PoolInit = _recv(conn)
    shm_x, X = _attach(init["X"])
    shm_y, Y = _attach(init["Y"])
    keep = [shm_x, shm_y]  # the mappings must outlive the tensors viewing them
    stores: list[tuple[ProtoModel, tuple[str, ...], dict[str, torch.Tensor]]] = []
    for s in init["stores"]:
        P: dict[str, torch.Tensor] = {}
        for k, spec in s["specs"].items():
            shm, P[k] = _attach(spec)
            keep.append(shm)
        stores.append((s["m0"], s["names"], P))
    while True:
        try:
            task: PartTask | None = _recv(conn)
        except (EOFError, OSError):
            return
        if task is None:
            return
        try:
            replies: list[list[TrainResult]] = []
            for g in task["groups"]:
                m0, names, P_all = stores[g["store"]]
                rows = torch.from_numpy(g["rows"])
                P = {k: P_all[k][rows].clone() for k in names}
                replies.append(train_stacked(m0, P, X, Y, g["phases"], g["obj"], task["opt"], g["ref"]))
                with torch.no_grad():
                    for k in names:
                        P_all[k][rows] = P[k]
            _send(conn, replies)
        except Exception:
            _send(conn, WorkerError(error=traceback.format_exc()))


if __name__ == "__main__":
    _serve(sys.argv[1], bytes.fromhex(os.environ.pop("FEDPROTO_POOL_KEY")), int(sys.argv[2]))
