"""The clients' models at rest as one flat store (:class:`ClientStore`), for federations of
many clients (docs/benchmarks.md, "100,000 clients").

A :class:`~torch.nn.Module` per client costs its weights plus about 18 KB of Python objects and
allocations (PaperCNN: 87,360 bytes of float32 weights, about 105 KB in all); at 100,000 clients
that is 10.5 GB. The store keeps each client's weights as one row of a single ``(N, P)`` tensor
and no module per client: a client's module is built only when something asks for it.

* :class:`StoredClientState` is a :class:`~fedproto.algorithms.algorithm.ClientState` whose ``model``
  is read from the store. Reading ``state.model`` outside the engine gives a module of its own
  whose parameters are *views* of the client's row: what training writes to the row, the module
  holds, and what is written into the module (``load_state_dict``, an optimizer step) lands in
  the row; the module is kept for the next read (the objects :attr:`Simulation.models` returns
  stay the trained ones).
* The engine reads a client's model inside :meth:`StoredClientState.borrowed`: one scratch module
  per store is bound to the row (its parameters' ``.data`` set to views of it, ~45 µs) and let go
  afterwards, so no module is kept per client. The batched executor stacks a group's weights from
  the rows (:meth:`ClientStore.stacked`) and writes them back (:meth:`ClientStore.write`).

Every number is the one the per-client modules give: the rows hold the same float32 (or, after
:meth:`fedproto.engine.setup.Setup.to_dtype`, float64) values, and each client's module mode
(train/eval: the batched forward reads the first client's flag) is kept per client
(tests/engine/test_client_store.py).
"""

from __future__ import annotations

import copy
import mmap
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard, TypeVar, cast

import numpy as np
import torch
from torch import nn

from fedproto.algorithms.algorithm import ClientState
from fedproto.models.proto_model import ProtoModel

_M = TypeVar("_M", bound=nn.Module)


def _drop_file(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def storable(model: nn.Module) -> TypeGuard[ProtoModel]:
    """True when ``model`` can live in a :class:`ClientStore`: it has a hand-written batched forward
    (:attr:`ProtoModel.batch_params`), no buffers, and its state dict is exactly its parameters,
    all of one floating-point dtype."""
    if not isinstance(model, ProtoModel) or not model.batch_params or any(True for _ in model.buffers()):
        return False
    params = list(model.named_parameters())
    dtypes = {p.dtype for _, p in params}
    return (bool(params) and len(dtypes) == 1 and next(iter(dtypes)).is_floating_point
            and list(model.state_dict()) == [n for n, _ in params])


class ClientStore:
    """The weights of N clients of one architecture, one row per client.

    Args:
        template: a model of the architecture (its weights are not used; a copy is kept as the
            store's template and scratch module). Must be :func:`storable`.
        n: rows (clients).
        path: a file to hold the rows instead of memory (created, ``n x P x itemsize`` bytes; removed
            by :meth:`close` or when the store is collected). The rows are then a shared mapping of
            the file whose pages are handed back to the kernel every ``release_every`` rows read or
            written (``madvise(MADV_DONTNEED)``: written pages stay in the page cache and the file,
            so nothing is lost): the process's resident memory holds about ``release_every`` rows,
            the page cache the rest (it can write them out and drop them under memory pressure).
            The numbers are those of the memory store: the same values go through the same rows.

    Attributes:
        rows: (n, P) tensor of the template's dtype (float32 by default): row i is client i's
            parameters, flattened in ``named_parameters`` order (``names``, ``shapes``,
            ``offsets``); P = :attr:`params_per_client`.
        training: (n,) bool, each client's module mode (``nn.Module.training``) as last left.
        filled: (n,) bool, rows written by :meth:`put` (a store is complete when all are).
    """

    def __init__(self, template: nn.Module, n: int, path: str | os.PathLike[str] | None = None,
                 release_every: int = 4096):
        if not storable(template):
            raise ValueError(f"{type(template).__name__} cannot live in a ClientStore (it needs batch_params, no "
                             "buffers, and parameters of one floating-point dtype)")
        self.template: ProtoModel = copy.deepcopy(template)
        named = list(self.template.named_parameters())
        self.names = [k for k, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        sizes = [p.numel() for _, p in named]
        self.offsets = [int(o) for o in np.cumsum([0] + sizes)]
        self.params_per_client = self.offsets[-1]
        self.key = template.arch_key()
        dtype = named[0][1].dtype
        self.path: Path | None = None
        self._map: mmap.mmap | None = None
        self.release_every, self._touched = int(release_every), 0
        if path is None:
            self.rows = torch.zeros(n, self.params_per_client, dtype=dtype)
        else:
            self.path = Path(path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            nbytes = n * self.params_per_client * torch.empty(0, dtype=dtype).element_size()
            with open(self.path, "wb") as f:
                f.truncate(nbytes)  # sparse: zeros until written
            with open(self.path, "r+b") as f:
                self._map = mmap.mmap(f.fileno(), nbytes) if nbytes else None
            buf = self._map if self._map is not None else bytearray(0)
            self.rows = torch.frombuffer(buf, dtype=dtype).view(n, self.params_per_client)
            self._finalizer = weakref.finalize(self, _drop_file, self.path)
        self.training = torch.ones(n, dtype=torch.bool)
        self.filled = torch.zeros(n, dtype=torch.bool)
        self._scratch: ProtoModel | None = copy.deepcopy(self.template)
        self._scratch_params = list(self._scratch.parameters())

    def __len__(self) -> int:
        return self.rows.shape[0]

    def _touch(self, rows: int) -> None:
        """Count rows read or written; a file-backed store hands its pages back every ``release_every``."""
        if self._map is None:
            return
        self._touched += rows
        if self._touched >= self.release_every:
            self.release()

    def release(self) -> None:
        """Hand a file-backed store's resident pages back to the kernel (their data stays in the page
        cache and the file); nothing for a memory store."""
        self._touched = 0
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Remove a file-backed store's file (the rows are then unreadable); nothing for a memory store."""
        if self._map is not None:
            self.rows = torch.zeros(0, self.params_per_client, dtype=self.rows.dtype)
            self._finalizer()

    @property
    def nbytes(self) -> int:
        """Bytes the store holds: the rows (N x P x itemsize) and the per-row flags."""
        return (self.rows.numel() * self.rows.element_size() + self.training.numel() * self.training.element_size()
                + self.filled.numel() * self.filled.element_size())

    def fits(self, model: nn.Module) -> bool:
        """True when ``model`` has this store's architecture and parameter layout."""
        named = list(model.named_parameters())
        return (storable(model) and model.arch_key() == self.key and [k for k, _ in named] == self.names
                and [tuple(p.shape) for _, p in named] == self.shapes and named[0][1].dtype == self.rows.dtype)

    @torch.no_grad()
    def put(self, i: int, model: nn.Module) -> None:
        """Copy ``model``'s parameters (and mode) into row ``i`` (exact: a copy of the same dtype)."""
        if not self.fits(model):
            raise ValueError(f"client {i}'s {type(model).__name__} does not fit this store (another architecture "
                             "or parameter layout)")
        row = self.rows[i]
        for (_, p), a, b in zip(model.named_parameters(), self.offsets, self.offsets[1:]):
            row[a:b].copy_(p.detach().reshape(-1))
        self.training[i] = model.training
        self.filled[i] = True
        self._touch(1)

    def views(self, i: int) -> dict[str, torch.Tensor]:
        """Name -> client ``i``'s parameter as a view of its row (writing into it writes the row)."""
        row = self.rows[i]
        return {k: row[a:b].view(s) for k, s, a, b in zip(self.names, self.shapes, self.offsets, self.offsets[1:])}

    def stacked(self, ids: Sequence[int]) -> dict[str, torch.Tensor]:
        """Name -> (G, *shape) copy of the parameters of clients ``ids`` (what ``train_group`` stacks)."""
        block = self.rows[torch.as_tensor(list(ids), dtype=torch.long)]
        self._touch(len(ids))
        return {k: block[:, a:b].reshape(len(ids), *s).clone()
                for k, s, a, b in zip(self.names, self.shapes, self.offsets, self.offsets[1:])}

    @torch.no_grad()
    def write(self, ids: Sequence[int], P: Mapping[str, torch.Tensor]) -> None:
        """Write stacked parameters ``P`` (name -> (G, *shape)) back into the rows of clients ``ids``."""
        idx = torch.as_tensor(list(ids), dtype=torch.long)
        block = torch.cat([P[k].detach().reshape(len(idx), -1) for k in self.names], dim=1)
        self.rows[idx] = block.to(self.rows.dtype)
        self._touch(len(idx))

    def bind(self, module: _M, i: int) -> _M:
        """Set ``module``'s parameters to views of row ``i`` and its mode to the client's; returns it."""
        for p, v in zip(module.parameters(), self.views(i).values()):
            p.data = v
        module.train(bool(self.training[i]))
        self._touch(1)
        return module

    def module(self, i: int) -> ProtoModel:
        """A module of its own for client ``i`` (a copy of the template bound to row ``i``)."""
        return self.bind(copy.deepcopy(self.template), i)

    @contextmanager
    def scratch(self, i: int) -> Iterator[ProtoModel]:
        """The store's scratch module bound to row ``i`` for the duration of the block (a copy of
        the template when the scratch is in use); the client's mode is recorded when it ends."""
        m, own = self._scratch, self._scratch is not None
        if m is not None:
            self._scratch = None
            self.bind(m, i)
        else:  # nested borrow (two clients' models at once)
            m = self.module(i)
        try:
            yield m
        finally:
            self.training[i] = m.training
            if own:
                self._scratch = m

    def state_dict(self, i: int) -> dict[str, torch.Tensor]:
        """Client ``i``'s state dict (copies of its parameters, as ``model.state_dict()`` names them)."""
        return {k: v.clone() for k, v in self.views(i).items()}

    @torch.no_grad()
    def load_state_dict(self, i: int, sd: Mapping[str, torch.Tensor]) -> None:
        """Load a state dict into row ``i``. Raises ``RuntimeError`` (as ``nn.Module.load_state_dict``)
        for missing or unexpected keys or a shape that does not fit."""
        missing = [k for k in self.names if k not in sd]
        extra = [k for k in sd if k not in self.names]
        if missing or extra:
            raise RuntimeError(f"Error(s) in loading state_dict for client {i}: missing keys {missing}, "
                               f"unexpected keys {extra}")
        for k, v in self.views(i).items():
            if tuple(sd[k].shape) != tuple(v.shape):
                raise RuntimeError(f"size mismatch for {k}: copying a param with shape {tuple(sd[k].shape)}, the "
                                   f"client's model has {tuple(v.shape)}")
            v.copy_(sd[k])

    def to(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> ClientStore:
        """Move or cast the rows (and the template) in place; modules bound to rows must be bound again
        (:meth:`StoredClientState.rebind`). Returns self. A file-backed store that changes dtype or
        device is held in memory from then on."""
        rows = self.rows.to(device=device, dtype=dtype)
        if self._map is not None and rows.data_ptr() != self.rows.data_ptr():  # a copy in memory now
            self._map, self.path = None, None
            self._finalizer()
        self.rows = rows
        for m in (self.template, self._scratch):
            if m is not None:
                m.to(device=device, dtype=dtype)
        return self


@dataclass(eq=False)
class StoredClientState(ClientState):
    """A client whose weights live in row ``cid`` of a :class:`ClientStore` (see module docstring).

    Build with :meth:`of` (``model`` as a dataclass field is then the store's template: the
    property below replaces it).
    """

    store: ClientStore | None = None

    @classmethod
    def of(cls, cid: int, store: ClientStore, classes: np.ndarray) -> StoredClientState:
        """Client ``cid`` of ``store`` (its row must be filled: :meth:`ClientStore.put`)."""
        # model None: the dataclass __init__ passes it to the setter below, which sets nothing
        s = cls(cid, cast(ProtoModel, None), classes, store=store)
        return s

    def __post_init__(self) -> None:
        self.__dict__.setdefault("_module", None)
        self.__dict__.setdefault("_borrowed", None)

    @property
    def row_store(self) -> ClientStore:
        """The :class:`ClientStore` holding the client's row (``store``; None only while the dataclass
        ``__init__`` runs, before :meth:`of` has set it)."""
        return cast(ClientStore, self.store)  # set by the constructor of every built state (of)

    @property
    def _own(self) -> ProtoModel | None:
        """The client's module of its own (None until someone reads ``model``)."""
        own: ProtoModel | None = self.__dict__.get("_module")
        return own

    # mypy refuses a property in place of a dataclass field (ClientState.model): here it is one on purpose, the
    # dataclass __init__ setting it through the setter
    @property  # type: ignore[misc]
    def model(self) -> ProtoModel:
        """The client's model: the one borrowed by the engine (:meth:`borrowed`), else a module of its
        own bound to the row (built at the first read and kept)."""
        d = self.__dict__
        lent: ProtoModel | None = d.get("_borrowed")
        if lent is not None:
            return lent
        own: ProtoModel | None = d.get("_module")
        if own is None:
            store: ClientStore | None = d.get("store")
            if store is None:  # during the dataclass __init__
                return cast(ProtoModel, None)  # a state half built has no model yet
            own = d["_module"] = store.module(self.cid)
        return own

    @model.setter
    def model(self, value: ProtoModel | None) -> None:
        d = self.__dict__
        if value is None:
            return
        if d.get("store") is not None and d["store"].fits(value):  # a new module of the same layout: into the row
            d["store"].put(self.cid, value)
            d["_module"] = d["store"].bind(value, self.cid)
        else:
            kind = type(d["store"].template).__name__
            raise TypeError(f"client {self.cid}'s model lives in a ClientStore: give it a {kind} of the same layout")

    @property
    def materialized(self) -> bool:
        """True when the client has a module of its own (someone read ``model``)."""
        return self.__dict__.get("_module") is not None

    @property
    def arch_model(self) -> ProtoModel:
        """A model of the client's architecture and frozen parameters, without building one: its own
        module where it has one, else the store's template (for checks and batching keys)."""
        own = self._own
        return own if own is not None else self.row_store.template

    @contextmanager
    def borrowed(self) -> Iterator[ProtoModel]:
        """The client's model for the block: its own module where it has one, else the store's scratch
        module bound to the row (nothing kept afterwards)."""
        if self.materialized or self.__dict__.get("_borrowed") is not None:
            yield self.model
            return
        with self.row_store.scratch(self.cid) as m:
            self.__dict__["_borrowed"] = m
            try:
                yield m
            finally:
                self.__dict__["_borrowed"] = None

    def rebind(self) -> None:
        """Bind the client's own module (if any) to its row again (after :meth:`ClientStore.to`)."""
        own = self._own
        if own is not None:
            self.row_store.bind(own, self.cid)


@contextmanager
def borrowed(state: ClientState) -> Iterator[ProtoModel]:
    """``state.model`` for the block: :meth:`StoredClientState.borrowed` for a stored client, the
    model itself for any other."""
    if isinstance(state, StoredClientState):
        with state.borrowed() as m:
            yield m
    else:
        yield state.model


def arch_model(state: ClientState) -> ProtoModel:
    """A model standing for ``state``'s architecture without building one (:attr:`StoredClientState.arch_model`)."""
    return state.arch_model if isinstance(state, StoredClientState) else state.model


def stored_group(states: Sequence[ClientState]) -> ClientStore | None:
    """The store of a batched group when every member lives in it and none has a module of its own
    (the group then trains from the rows); None otherwise."""
    store = getattr(states[0], "store", None)
    if store is None:
        return None
    ok = all(isinstance(s, StoredClientState) and s.store is store and not s.materialized for s in states)
    return store if ok else None



@contextmanager
def transient_modules(states: Sequence[ClientState]) -> Iterator[None]:
    """For a call that reads many clients' ``state.model`` at once (a weight-sharing method's
    ``initial_message`` checks every client's shapes): the modules stored clients build during the
    block are let go after it (their parameters were views of the rows: nothing is lost)."""
    before = {id(s) for s in states if isinstance(s, StoredClientState) and s.materialized}
    try:
        yield
    finally:
        for s in states:
            if isinstance(s, StoredClientState) and s.materialized and id(s) not in before:
                s.__dict__["_module"] = None
