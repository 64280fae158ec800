"""The client part's data types (docs/architecture.md, "Algorithm"): a client's data
(:class:`ClientData`, optionally an index view into :class:`SharedInputs` held once for all clients),
what it keeps between rounds (:class:`ClientState`), and the messages it exchanges with the server
(:data:`Message`, ``dict[str, numpy.ndarray]``; :func:`message_size`, their communication cost).
Re-exported by :mod:`fedproto.algorithms.algorithm`, where the methods import them from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedproto.data.inputs import Inputs, place
from fedproto.models.proto_model import ProtoModel

Message = dict[str, np.ndarray]


def message_size(msg: Message) -> tuple[int, int]:
    """(number of elements, bytes) of a message: the communication cost of sending it once."""
    n = sum(int(np.asarray(v).size) for v in msg.values())
    b = sum(int(np.asarray(v).nbytes) for v in msg.values())
    return n, b


class SharedInputs:
    """One inputs tensor (N, C, H, W) that many clients' :class:`ClientData` views index into.

    :meth:`fedproto.engine.setup.Setup.to_device` moves it once for all clients (``tensor`` is
    replaced); the views read it whenever they gather their rows.
    """

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __len__(self) -> int:
        return len(self.tensor)


class ClientData:
    """A client's data: training inputs ``x`` (n, C, H, W) float, labels ``y`` (n,) int64, and the
    same for its test set (``test_x``, ``test_y``).

    ``ClientData(x, y, test_x, test_y)`` holds the given tensors (or :class:`~fedproto.federation.LazyInputs`
    for ``x``/``test_x``). :meth:`view` builds an index view instead: the client keeps only its
    sample indices into a dataset's inputs held once for all clients (:class:`SharedInputs`), and
    each read of ``x`` or ``test_x`` gathers its rows into a new tensor (so at 10,000 clients the
    simulator holds one copy of each split, not a copy per client). Read ``x`` once
    where it is needed and let it go afterwards; ``len(data.y)`` gives the sample count without a
    gather. Labels are small and always held. Assigning ``x`` or ``test_x`` replaces the view by
    the tensor assigned.
    """

    def __init__(self, x: Any, y: torch.Tensor, test_x: Any, test_y: torch.Tensor):
        self._x, self._test_x = x, test_x
        self.y, self.test_y = y, test_y
        self._src: SharedInputs | None = None
        self._test_src: SharedInputs | None = None
        self._idx: torch.Tensor | None = None
        self._test_idx: torch.Tensor | None = None
        self._dtype: torch.dtype | None = None

    @classmethod
    def view(cls, train: SharedInputs, train_idx: Any, train_y: torch.Tensor, test: SharedInputs, test_idx: Any,
             test_y: torch.Tensor) -> ClientData:
        """A client whose inputs are rows ``train_idx`` of ``train`` and ``test_idx`` of ``test``.

        Args:
            train: the shared inputs of the training split (N, C, H, W).
            train_idx: (n,) integer row indices into ``train`` (numpy or torch; kept without a copy
                where they already are int64).
            train_y: the client's (n,) int64 training labels (the dataset's labels at those rows).
            test: the shared inputs of the test split (N_test, C, H, W).
            test_idx: (n_test,) integer row indices into ``test``.
            test_y: the client's (n_test,) int64 test labels.
        Raises:
            ValueError: an index and its labels differ in length, or an index lies outside its split.
        """
        d = cls(None, train_y, None, test_y)
        d._src, d._test_src = train, test
        train_rows = torch.as_tensor(train_idx, dtype=torch.long)
        test_rows = torch.as_tensor(test_idx, dtype=torch.long)
        d._idx, d._test_idx = train_rows, test_rows
        for split, idx, y, src in (("train", train_rows, train_y, train), ("test", test_rows, test_y, test)):
            if len(idx) != len(y):
                raise ValueError(f"{split}: {len(idx)} indices but {len(y)} labels; give one label per index")
            if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= len(src)):
                raise ValueError(f"{split}: indices {int(idx.min())}..{int(idx.max())} outside the split's "
                                 f"{len(src)} rows; index rows 0..{len(src) - 1}")
        return d

    def _gather(self, src: SharedInputs, idx: torch.Tensor) -> torch.Tensor:
        x = src.tensor[idx.to(src.tensor.device)]
        return x if self._dtype is None else x.to(self._dtype)

    @property
    def x(self) -> Any:
        """Training inputs (n, C, H, W); for a view, gathered anew on every read."""
        return self._gather(self._src, self._idx) if self._src is not None and self._idx is not None else self._x

    @x.setter
    def x(self, value: Any) -> None:
        self._x, self._src, self._idx = value, None, None

    @property
    def test_x(self) -> Any:
        """Test inputs (n_test, C, H, W); for a view, gathered anew on every read."""
        if self._test_src is not None and self._test_idx is not None:  # a view (both set together)
            return self._gather(self._test_src, self._test_idx)
        return self._test_x

    @test_x.setter
    def test_x(self, value: Any) -> None:
        self._test_x, self._test_src, self._test_idx = value, None, None

    @property
    def is_view(self) -> bool:
        """True when the training inputs are an index view into :class:`SharedInputs`."""
        return self._src is not None

    @property
    def held_test_x(self) -> Any:
        """The test inputs as they are held, without gathering a view's rows (None for a view): e.g. the
        :class:`fedproto.federation.LazyInputs` of a Dataset, whose ``bad`` items the summary reports."""
        return self._test_x if self._test_src is None else None

    @property
    def in_memory(self) -> bool:
        """True when the training inputs are a tensor or a view of one (the batched engine can
        stack them); False for inputs read from a ``Dataset`` item by item."""
        return self._src is not None or isinstance(self._x, torch.Tensor) or isinstance(self._x, Inputs)

    def shared_inputs(self) -> list[SharedInputs]:
        """The shared inputs this client's views read (empty for a client holding its own tensors)."""
        return [s for s in (self._src, self._test_src) if s is not None]

    def to(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> ClientData:
        """Move the held tensors to ``device`` (labels always; inputs held as tensors) and/or cast
        the inputs to the float ``dtype``, in place; returns self. A view's shared inputs are not
        moved here (:meth:`fedproto.engine.setup.Setup.to_device` moves each once); its gathered rows
        are cast to ``dtype`` on every read."""
        if device is not None:
            self.y, self.test_y = self.y.to(device), self.test_y.to(device)
            self._x, self._test_x = place(self._x, device), place(self._test_x, device)  # token ids stay integers
        if dtype is not None:
            if self._src is not None or self._test_src is not None:
                self._dtype = dtype
            if self._src is None:
                self._x = place(self._x, dtype=dtype)
            if self._test_src is None:
                self._test_x = place(self._test_x, dtype=dtype)
        return self

    def __repr__(self) -> str:
        kind = "view" if self.is_view else "tensors"
        return f"ClientData({kind}, train={len(self.y)}, test={len(self.test_y)})"


@dataclass
class ClientState:
    """What a client keeps between rounds: its id, personal model, own classes (sorted (n_i,)
    int64) and algorithm-specific extras (e.g. a FeSEM cluster id)."""

    cid: int
    model: ProtoModel
    classes: np.ndarray
    extra: dict[str, Any] = field(default_factory=dict)
