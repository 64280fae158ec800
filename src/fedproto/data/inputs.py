"""Model inputs of any structure: a tensor, or a dict, tuple or list of tensors (nested).

A client's inputs reach its model as the model takes them: integer token ids stay integers, a
tokenizer's ``{"input_ids": ..., "attention_mask": ...}`` stays a dict, ``(ids, mask)`` stays a
tuple; only their device changes, and the dtype of floating leaves where it is not the model's
(cast to the model's floating dtype, logged once per client:
:func:`fedproto.federation.own_data.to_model_dtype`). Every leaf of one client's inputs holds one row
per sample along its first axis.

* :class:`Inputs` holds such a structure in memory for ``n`` samples: ``len()``, and
  ``inputs[idx]`` (a LongTensor of rows or a slice) gives the structure of those rows, which is what
  the model is called with.
* :func:`move`, :func:`cast_floats`, :func:`tree_map` act leaf by leaf on a batch (a tensor or a
  structure); :func:`concat` joins clients' inputs (the batched paths); :func:`describe` names a
  batch in messages.
* :func:`pad_collate` is the collate function for variable-length sequences: it pads a list of 1-D
  token tensors and returns ``{"input_ids": (B, L_max), "attention_mask": (B, L_max)}``.

Size: about 230 lines.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

Batch = Any
"""A tensor, or a dict / tuple / list of batches (the inputs of B samples, B along every leaf's first axis)."""


def is_structure(x: Any) -> bool:
    """True for a dict, tuple or list (a structure of leaves); False for a tensor or anything else."""
    return isinstance(x, (Mapping, tuple, list))


def tree_map(fn: Callable[[torch.Tensor], Any], x: Batch) -> Batch:
    """``fn`` applied to every tensor leaf of ``x``, the structure kept (a dict's keys and order, a
    tuple's or namedtuple's type, a list). A leaf that is not a tensor is passed to ``fn`` too."""
    if isinstance(x, Mapping):
        return {k: tree_map(fn, v) for k, v in x.items()}
    if isinstance(x, tuple):
        items = [tree_map(fn, v) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    if isinstance(x, list):
        return [tree_map(fn, v) for v in x]
    return fn(x)


def leaves(x: Batch) -> list[Any]:
    """The leaves of ``x`` in order (a dict in its key order)."""
    if isinstance(x, Mapping):
        return [leaf for v in x.values() for leaf in leaves(v)]
    if isinstance(x, (tuple, list)):
        return [leaf for v in x for leaf in leaves(v)]
    return [x]


def tree_zip(fn: Callable[[list[Any]], Any], xs: Sequence[Batch]) -> Batch:
    """``fn`` of the corresponding leaves of the batches ``xs`` (all of ``xs[0]``'s structure).

    Raises:
        ValueError: the batches' structures differ (names the first difference).
    """
    x0 = xs[0]
    if isinstance(x0, Mapping):
        keys = list(x0)
        for x in xs[1:]:
            if not isinstance(x, Mapping) or list(x) != keys:
                raise ValueError(f"inputs of different structure: keys {keys} and "
                                 f"{list(x) if isinstance(x, Mapping) else type(x).__name__}")
        return {k: tree_zip(fn, [x[k] for x in xs]) for k in keys}
    if isinstance(x0, (tuple, list)):
        for x in xs[1:]:
            if not isinstance(x, (tuple, list)) or len(x) != len(x0):
                raise ValueError(f"inputs of different structure: a {len(x0)}-{type(x0).__name__} and a "
                                 f"{type(x).__name__}")
        items = [tree_zip(fn, [x[j] for x in xs]) for j in range(len(x0))]
        return type(x0)(*items) if hasattr(x0, "_fields") else type(x0)(items)
    return fn(list(xs))


def move(x: Batch, device: torch.device | str, non_blocking: bool = False) -> Batch:
    """``x`` with every tensor leaf on ``device`` (dtypes kept)."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=non_blocking)
    return tree_map(lambda t: t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t, x)


def cast_floats(x: Batch, dtype: torch.dtype) -> Batch:
    """``x`` with its floating-point leaves cast to ``dtype``; integer and bool leaves (token ids,
    masks) keep their dtype."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, x)


def as_leaf(v: Any) -> torch.Tensor:
    """An array or tensor as a tensor, in its own dtype (floating values as given: the engine casts
    them to the client's model's dtype once, :func:`fedproto.federation.own_data.to_model_dtype`;
    integer and bool values kept, so token ids stay integers). Raises TypeError for anything else."""
    if isinstance(v, np.ndarray):
        v = torch.from_numpy(np.ascontiguousarray(v))
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"a {type(v).__module__}.{type(v).__qualname__}, not a tensor or array")
    return v


def as_inputs(x: Any) -> torch.Tensor | Inputs:
    """A client's inputs ``x`` (n, ...) as the engine holds them: a tensor (an array converted by
    :func:`as_leaf`), or :class:`Inputs` for a dict, tuple or list of tensors or arrays.

    Raises:
        TypeError: a leaf is not a tensor or array. ValueError: leaves hold different numbers of rows.
    """
    if is_structure(x):
        return Inputs(tree_map(as_leaf, x))
    return as_leaf(x)


class Inputs:
    """A structure (dict, tuple, list, nested) of tensors holding one row per sample along their
    first axis, in memory.

    ``len(inputs)`` is the sample count n; ``inputs[idx]`` (a LongTensor of rows, a list of ints or
    a slice) is the structure of those rows, what the model is called with; :meth:`to` moves it or
    casts its floating leaves.

    Raises:
        ValueError: the structure has no tensor leaf, or leaves differ in their first dimension.
    """

    def __init__(self, tree: Batch):
        found = leaves(tree)
        if not found or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in found):
            raise ValueError("inputs of a structure need tensor leaves of one row per sample (n, ...)")
        ns = {int(t.shape[0]) for t in found}
        if len(ns) > 1:
            raise ValueError(f"the inputs' leaves hold different numbers of rows {sorted(ns)}; give every leaf one "
                             "row per sample")
        self.tree = tree
        self.n = ns.pop()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: Any) -> Batch:
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)  # one row, kept as a batch of one
        if isinstance(idx, torch.Tensor):
            return tree_map(lambda t: t[idx.to(t.device)], self.tree)
        return tree_map(lambda t: t[idx], self.tree)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Inputs:
        """A copy on ``device`` and/or with its floating leaves cast to ``dtype``."""
        tree = self.tree
        if device is not None:
            tree = move(tree, device)
        if dtype is not None:
            tree = cast_floats(tree, dtype)
        return Inputs(tree)

    def __repr__(self) -> str:
        return f"Inputs({describe(self.tree)}, n={self.n})"


def concat(xs: Sequence[Any], device: torch.device | str | None = None) -> torch.Tensor | Inputs:
    """Clients' inputs joined along the sample axis (tensors: ``torch.cat``; :class:`Inputs`: leaf
    by leaf), moved to ``device``. Raises ValueError for structures that differ."""
    dev = (lambda t: t.to(device)) if device is not None else (lambda t: t)
    if all(isinstance(x, torch.Tensor) for x in xs):
        return torch.cat([dev(x) for x in xs])
    trees = [x.tree if isinstance(x, Inputs) else x for x in xs]
    return Inputs(tree_zip(lambda ls: torch.cat([dev(t) for t in ls]), trees))


def place(x: Any, device: torch.device | None = None, dtype: torch.dtype | None = None) -> Any:
    """A client's held inputs on ``device`` and/or with floating leaves cast to ``dtype``: a tensor
    (integer tensors keep their dtype), :class:`Inputs`, or an object with ``to(device=, dtype=)``
    (inputs read from a Dataset: the cast applies on reading). Anything else is returned as it is."""
    if isinstance(x, torch.Tensor):
        x = x.to(device) if device is not None else x
        return x.to(dtype) if dtype is not None and x.is_floating_point() else x
    if isinstance(x, Inputs):
        return x.to(device, dtype)
    if device is None and dtype is not None and callable(getattr(x, "to", None)):
        return x.to(dtype=dtype)
    return x


def finite(x: Any) -> bool:
    """True when no floating leaf of ``x`` (a tensor, :class:`Inputs` or a structure) holds NaN or inf."""
    tree = x.tree if isinstance(x, Inputs) else x
    return all(bool(torch.isfinite(t).all()) for t in leaves(tree) if isinstance(t, torch.Tensor)
               and t.is_floating_point())


def first_nonfinite(x: Any, path: str = "input") -> tuple[str, int] | None:
    """Where in-memory inputs ``x`` (a tensor or array (n, ...), :class:`Inputs`, or a dict, tuple
    or list of them, one row per item) first hold NaN or inf: (the field, as
    ``"input['a']['b']"``, and the item, its row); None when every floating value is finite."""
    return find_leaf(x.tree if isinstance(x, Inputs) else x, _first_bad_row, path)


def _first_bad_row(x: Any) -> int | None:
    """The first row of a floating (n, ...) tensor or array holding NaN or inf, else None."""
    if isinstance(x, np.ndarray) and x.dtype.kind in "fc":
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()) or x.ndim == 0:
        return None
    bad = (~torch.isfinite(x)).reshape(len(x), -1).any(1)
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None


def find_leaf(x: Any, test: Any, path: str = "input") -> tuple[str, Any] | None:
    """Depth first over a nested dict, tuple or list ``x``, the first leaf where ``test(leaf)`` is
    not None: (its path, as ``"input['a'][1]"``, and what ``test`` returned); None when none is."""
    items = x.items() if isinstance(x, Mapping) else enumerate(x) if isinstance(x, (tuple, list)) else None
    if items is None:
        got = test(x)
        return None if got is None else (path, got)
    for k, v in items:
        found = find_leaf(v, test, f"{path}[{k!r}]")
        if found is not None:
            return found
    return None


def describe(x: Any) -> str:
    """A batch's shape for messages: ``(1, 3, 28, 28)``, ``{'input_ids': (1, 12) int64, ...}``."""
    if isinstance(x, Inputs):
        x = x.tree
    if isinstance(x, torch.Tensor):
        kind = "" if x.is_floating_point() else " " + str(x.dtype).replace("torch.", "")
        return f"{tuple(x.shape)}{kind}"
    if isinstance(x, Mapping):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (tuple, list)):
        inner = ", ".join(describe(v) for v in x)
        return f"({inner})" if isinstance(x, tuple) else f"[{inner}]"
    return type(x).__name__


def pad_collate(items: Sequence[Any], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Collate variable-length token sequences: ``items`` (B 1-D integer tensors or arrays of
    lengths L_i) -> ``{"input_ids": (B, L_max) int64 padded with pad_id, "attention_mask": (B, L_max)
    int64, 1 on tokens, 0 on padding}``. Give it as ``Client(collate=pad_collate)`` for a Dataset
    whose items' inputs are sequences of different lengths.

    Raises:
        ValueError: an item is not one-dimensional.
    """
    seqs = [torch.as_tensor(np.asarray(s) if not isinstance(s, torch.Tensor) else s).long() for s in items]
    bad = next((i for i, s in enumerate(seqs) if s.dim() != 1), None)
    if bad is not None:
        raise ValueError(f"pad_collate pads 1-D token sequences; item {bad} has shape {tuple(seqs[bad].shape)}")
    L = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), L), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask}


__all__ = ["Batch", "Inputs", "as_inputs", "as_leaf", "cast_floats", "concat", "describe", "finite", "is_structure",
           "leaves", "move", "pad_collate", "place", "tree_map", "tree_zip"]
