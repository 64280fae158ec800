"""A client's data as the engine holds them: a map-style ``Dataset`` read item by item
(:class:`LazyInputs`), its labels (:func:`dataset_labels`), and each split checked before round 1,
every error naming the client. Importable from :mod:`fedproto.federation`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fedproto.data.inputs import (
    Inputs,
    as_inputs,
    as_leaf,
    cast_floats,
    find_leaf,
    first_nonfinite,
    is_structure,
    leaves,
    tree_map,
    tree_zip,
)
from fedproto.errors import DataError, first_line


def _pair(item: Any, i: int) -> tuple[Any, Any]:
    """Item ``i`` of a Dataset as ``(x, y)``; raises DataError when it is not a pair."""
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    what = f"a {len(item)}-tuple" if isinstance(item, (tuple, list)) else f"a {type(item).__name__}"
    raise DataError(f"item {i} of the Dataset is {what}, not an (x, y) pair; make its __getitem__ return "
                    "(input, label)")


def _as_input(x: Any, i: int) -> Any:
    """Input ``x`` of item ``i`` as the model takes it: a tensor or array as a tensor (in its dtype:
    :func:`to_model_dtype` casts floating values to the model's), a dict, tuple or list of them with its structure kept
    (:func:`fedproto.data.inputs.as_inputs`); raises DataError naming its type and the fix."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return as_leaf(x)
    kind = f"{type(x).__module__}.{type(x).__qualname__}"
    if type(x).__module__.split(".")[0] == "PIL":
        raise DataError(f"item {i}'s input is a PIL image ({kind}), not a tensor; give the Dataset a tensor "
                        "transform, e.g. transform=torchvision.transforms.ToTensor() (then Normalize)")
    if is_structure(x):
        try:
            return tree_map(as_leaf, x)
        except TypeError as e:
            raise DataError(f"item {i}'s input is a {type(x).__name__} holding {e}; give the Dataset a transform "
                            "whose dicts, tuples or lists hold tensors or arrays only") from None
    raise DataError(f"item {i}'s input is a {kind}, not a tensor, an array, or a dict, tuple or list of them; give "
                    "the Dataset a transform that returns tensors")


log = logging.getLogger(__name__)

NAN_SCAN_ITEMS = 1000
"""Every item of a Dataset split is checked for NaN and inf before round 1, in the pass that reads its
labels (:func:`dataset_labels`); of a torchvision dataset whose labels are its ``targets`` (not read item
by item), every item when it has at most this many, else this many spread over it (:func:`scan_nonfinite`).
An item that holds NaN only when read later (a transform) stops the run when a training batch reads it
(naming the client, item and field); a test item leaves its client out of the headline (``left_out``)."""


def nonfinite_field(x: Any, path: str = "input") -> str | None:
    """Where an item's input ``x`` (a tensor, an array, or a dict, tuple or list of them) holds NaN
    or inf: ``"input"``, ``"input['pixels']"``, ``"input[1]"``; None when every floating value is finite."""
    found = find_leaf(x, _nonfinite_leaf, path)
    return None if found is None else found[0]


def _nonfinite_leaf(x: Any) -> bool | None:
    """True for a floating tensor, array or float holding NaN or inf, else None."""
    bad = ((isinstance(x, torch.Tensor) and x.is_floating_point() and not bool(torch.isfinite(x).all()))
           or (isinstance(x, np.ndarray) and x.dtype.kind in "fc" and not bool(np.isfinite(x).all()))
           or (isinstance(x, float) and not np.isfinite(x)))
    return True if bad else None


def nonfinite_message(cid: int | None, what: str, item: int, field: str, in_memory: bool = False) -> str:
    """The error for item ``item`` (a row of in-memory inputs) of client ``cid``'s ``what`` split
    whose ``field`` holds NaN or inf."""
    who = f"client {cid}: " if cid is not None else ""
    source = "row" if in_memory else "Dataset's __getitem__ or transform returns it"
    return f"{who}{what} item {item}: its {field} holds NaN or infinite values; clean or drop that item (its {source})"


def scan_nonfinite(x: LazyInputs) -> None:
    """Check the inputs of up to :data:`NAN_SCAN_ITEMS` items of ``x`` (all when it has no more): for a
    Dataset whose labels were not read item by item (:func:`dataset_labels`).

    Raises:
        DataError: the first item found with NaN or inf (names the client, the split, the item and the field).
    """
    n = len(x)
    idx = range(n) if n <= NAN_SCAN_ITEMS else np.unique(np.linspace(0, n - 1, NAN_SCAN_ITEMS).round().astype(int))
    for i in idx:
        field = nonfinite_field(_pair(x.dataset[int(i)], int(i))[0])
        if field is not None:
            raise DataError(nonfinite_message(x.cid, x.what, int(i), field))


def model_dtype(model: Any) -> torch.dtype:
    """The floating dtype of ``model``: that of its first floating parameter (else buffer);
    ``torch.float32`` for a model without any (or that is no ``nn.Module``)."""
    if isinstance(model, torch.nn.Module):
        for t in (*model.parameters(), *model.buffers()):
            if t.is_floating_point():
                return t.dtype
    return torch.float32


def floating_dtypes(x: Any) -> list[torch.dtype]:
    """The dtypes of the floating leaves of inputs ``x`` (a tensor, :class:`~fedproto.data.inputs.Inputs`,
    or :class:`LazyInputs`, of which the first item is read), each once, in order."""
    batch = x[0:1] if isinstance(x, LazyInputs) and len(x) else x
    tree = batch.tree if isinstance(batch, Inputs) else batch
    out: list[torch.dtype] = []
    for t in leaves(tree):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in out:
            out.append(t.dtype)
    return out


def to_model_dtype(x: Any, dtype: torch.dtype, cid: int, what: str) -> Any:
    """Inputs ``x`` of client ``cid``'s ``what`` split with their floating leaves in ``dtype``, its
    model's (:func:`model_dtype`), on every route alike: tensors and arrays (cast once here),
    dict/tuple/list structures, and Datasets with or without ``collate`` (cast on reading). A cast
    is logged once per client and split, naming both dtypes; integer leaves (token ids) keep theirs.
    So a float64 model trains on float64 inputs, and a float32 model on float64 arrays gets float32.

    Returns:
        ``x`` cast (a tensor, :class:`~fedproto.data.inputs.Inputs` or the same :class:`LazyInputs`).
    """
    before = [d for d in floating_dtypes(x) if d != dtype]
    if before:
        name = ", ".join(str(d).replace("torch.", "") for d in before)
        log.info("client %d: its %s inputs are %s, cast to %s, the dtype of its model (give inputs of the model's "
                 "dtype, or cast the model, e.g. model.double(), to train in another)", cid, what, name,
                 str(dtype).replace("torch.", ""))
    if isinstance(x, LazyInputs):
        return x.to(dtype)
    if isinstance(x, Inputs):
        return x.to(dtype=dtype) if before else x
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


class LazyInputs:
    """A map-style ``Dataset`` read as inputs ``x``: ``len()``, and ``x[LongTensor]``, ``x[i:j]``
    give the batch of those items' inputs, read item by item (the dataset's transforms run on every
    read): tensors stacked, dicts, tuples and lists of tensors stacked leaf by leaf (their structure
    and integer dtypes kept), or, with ``collate``, ``collate([inputs of the items])`` (e.g.
    :func:`fedproto.data.inputs.pad_collate` for variable-length sequences). The engine trains such
    clients on the sequential path.

    Raises (on reading):
        DataError: an item is not an ``(x, y)`` pair, its input is not a tensor, an array or a
            structure of them (a PIL image: the message says to add a tensor transform), or the
            items' inputs have different shapes and no ``collate`` is given.
    """

    def __init__(self, dataset: torch.utils.data.Dataset, collate: Any = None, cid: int | None = None,
                 what: str = "train", check: bool = True):
        self.dataset = dataset
        self.collate = collate
        self.dtype: torch.dtype | None = None  # floating leaves cast on reading (float64 checks)
        self.cid, self.what, self.check = cid, what, check
        self.bad: dict[int, str] = {}  # item -> the field that held NaN or inf (with check off: recorded, not raised)

    def __len__(self) -> int:
        return len(self.dataset)

    def to(self, dtype: torch.dtype | None = None) -> LazyInputs:
        """Cast the floating leaves of what is read to ``dtype`` (integer leaves keep theirs); returns self."""
        self.dtype = dtype
        return self

    def __getitem__(self, idx) -> Any:
        if isinstance(idx, slice):
            idx = range(*idx.indices(len(self)))
        elif isinstance(idx, torch.Tensor):
            idx = idx.tolist()
        raw = [_pair(self.dataset[int(i)], int(i))[0] for i in idx]
        for x, i in zip(raw, idx):
            field = nonfinite_field(x)
            if field is not None and self.check:
                raise DataError(nonfinite_message(self.cid, self.what, int(i), field))
            if field is not None:
                self.bad.setdefault(int(i), field)
        if self.collate is not None:
            batch = self.collate(raw)
        else:
            items = [_as_input(x, int(i)) for x, i in zip(raw, idx)]
            try:
                batch = tree_zip(torch.stack, items) if items else torch.zeros(0)
            except (RuntimeError, ValueError) as e:
                raise DataError(f"the items' inputs differ in shape or structure ({first_line(e)[:160]}); for "
                                "variable-length sequences give Client(..., collate=fedproto.data.inputs.pad_collate) "
                                "(pads them and adds an attention mask) or your own collate function") from None
        return batch if self.dtype is None else cast_floats(batch, self.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        first = self[0:1]
        return (len(self), *first.shape[1:]) if isinstance(first, torch.Tensor) else (len(self),)


PROBE_ITEMS = 8
"""Items of a Dataset batched once before round 1, so that inputs of different shapes (variable-length
sequences without a collate function) are refused before training, naming the fix."""

LABEL_CHECKS = 32
"""Items read to confirm a torchvision dataset's ``targets`` equal the labels it yields (see :func:`dataset_labels`)."""


def _yields_its_targets(ds: torch.utils.data.Dataset) -> bool:
    """True when ``ds`` is a torchvision dataset whose ``__getitem__`` is torchvision's own (its label
    is ``targets[i]`` passed through ``target_transform``) with no ``target_transform``."""
    get = getattr(type(ds), "__getitem__", None)
    return (str(getattr(get, "__module__", "")).startswith("torchvision.datasets")
            and getattr(ds, "target_transform", None) is None and getattr(ds, "targets", None) is not None)


def _label_value(y: Any, i: int) -> Any:
    if isinstance(y, (torch.Tensor, np.ndarray)):
        if (y.size if isinstance(y, np.ndarray) else y.numel()) == 1:
            return y.reshape(()).item()
        raise ValueError(f"item {i}'s label has shape {tuple(y.shape)}; give one integer class id per item")
    return y


def _label_array(values: Sequence[Any]) -> np.ndarray:
    """``values`` as an array; of dtype object when some are not numbers, so that the first of
    those can be named (numpy would turn the numbers into strings)."""
    if all(isinstance(v, (int, float, np.integer, np.floating)) for v in values):
        return np.asarray(values)
    return np.asarray(values, dtype=object)


def dataset_labels(ds: torch.utils.data.Dataset, on_input: Any = None) -> np.ndarray:
    """The labels a map-style Dataset yields, ``ds[i][1]`` for every i, as an array (n,).

    Every item is read (its transforms run once), except for a torchvision dataset read by
    torchvision's own ``__getitem__`` without a ``target_transform`` (MNIST, CIFAR10,
    ImageFolder...): its ``targets`` are used once they equal the labels of
    :data:`LABEL_CHECKS` items spread over the dataset. A ``targets`` attribute is never trusted
    otherwise: a ``target_transform`` or a ``__getitem__`` that changes the label decides.
    ``on_input(i, x)`` is called with each item's input read for its label (to check it).

    Raises:
        DataError: an item is not an ``(x, y)`` pair.
        ValueError: a label is a tensor of more than one value.
    """
    n = len(ds)
    if _yields_its_targets(ds) and len(ds.targets) == n:
        targets = _label_array([_label_value(t, i) for i, t in enumerate(ds.targets)])
        idx = np.unique(np.linspace(0, n - 1, min(n, LABEL_CHECKS)).round().astype(np.int64)) if n else []
        if all(_label_value(_pair(ds[int(i)], int(i))[1], int(i)) == targets[i] for i in idx):
            return targets
    out = []
    for i in range(n):
        x, y = _pair(ds[i], i)
        if on_input is not None:
            on_input(i, x)
        out.append(_label_value(y, i))
    return _label_array(out)


_ID_HINT = ("map each class to an id 0..C-1 (e.g. {name: i for i, name in enumerate(sorted(names))}, or "
            "torchvision's class_to_idx)")


def _labels(split: Any, on_input: Any = None) -> torch.Tensor:
    """Integer labels (n,) of a split (``on_input``: see :func:`dataset_labels`); raises
    ValueError/DataError with the offending value."""
    if isinstance(split, torch.utils.data.Dataset):
        raw = dataset_labels(split, on_input)
    else:
        y = split[1]
        raw = (np.asarray(y.cpu()) if isinstance(y, torch.Tensor) else
               _label_array([_label_value(v, i) for i, v in enumerate(y)]) if isinstance(y, (list, tuple)) else
               np.asarray(y))
    if raw.dtype.kind in "fuO" and raw.size:  # values int64 cannot hold (inf, 1e20, 2**70) would wrap around
        flat = raw.reshape(-1)
        num = [isinstance(v, (int, float, np.integer, np.floating)) for v in flat] if raw.dtype.kind == "O" else True
        with np.errstate(invalid="ignore"):
            fits = np.array([not n or -2**63 <= v < 2**63 for n, v in zip(num, flat)], bool) if raw.dtype.kind == "O" \
                else (flat >= -2**63) & (flat < 2**63)
        if not fits.all():
            j = int(np.flatnonzero(~fits)[0])
            v = flat[j].item() if isinstance(flat[j], np.generic) else flat[j]
            raise ValueError(f"label {v!r} (item {j}) is not a class id; give integer class ids 0..C-1")
    if raw.dtype.kind == "f" and raw.size and not np.array_equal(raw, np.round(raw)):
        bad = raw.reshape(-1)[np.flatnonzero(raw.reshape(-1) != np.round(raw.reshape(-1)))[0]]
        raise ValueError(f"labels with fractions (e.g. {bad:g}); give integer class ids")
    if raw.dtype.kind == "O" and raw.size:  # mixed kinds: find the first that is not a whole number
        flat = raw.reshape(-1)
        j = next((j for j, v in enumerate(flat) if not isinstance(v, (int, np.integer))
                  and not (isinstance(v, (float, np.floating)) and float(v).is_integer())), None)
        if j is not None:
            raise ValueError(f"label {flat[j]!r} (item {j}) is a {type(flat[j]).__name__}, not an integer class id; "
                             f"{_ID_HINT}")
        raw = flat.astype(np.int64).reshape(raw.shape)
    if raw.dtype.kind not in "iuf" and raw.size:
        v = raw.reshape(-1)[0]
        v = v.item() if isinstance(v, np.generic) else v
        raise ValueError(f"label {v!r} (item 0) is a {type(v).__name__}, not an integer class id; {_ID_HINT}")
    return torch.as_tensor(raw.astype(np.int64))


def _memory_inputs(x: Any, n_labels: int) -> Any:
    """In-memory inputs as the engine holds them: a dict, or a tuple/list of tensors or arrays that is
    not one row per label (e.g. ``(ids, mask)``), as :class:`~fedproto.data.inputs.Inputs`; anything
    else as one tensor (dtypes kept: :func:`to_model_dtype` casts floating values to the model's)."""
    arrays = isinstance(x, (tuple, list)) and x and all(isinstance(v, (torch.Tensor, np.ndarray, dict)) for v in x)
    if isinstance(x, dict) or (arrays and len(x) != n_labels):
        return as_inputs(x)
    return as_leaf(x if isinstance(x, (torch.Tensor, np.ndarray)) else np.asarray(x))


class ItemPairs(torch.utils.data.Dataset):
    """In-memory inputs given as a list of ``n`` items (e.g. token sequences of different lengths)
    with their ``n`` labels, read item by item as a Dataset is, so that ``collate`` batches them."""

    def __init__(self, items: list, labels: Any):
        self.items, self.labels = items, labels

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        return self.items[i], self.labels[i]


def _split(split: Any, cid: int, what: str, num_classes: int, collate: Any = None) -> tuple[Any, torch.Tensor]:
    """(inputs, labels) of one split, checked; raises DataError naming the client. With ``collate``, a
    list of ``n`` inputs with ``n`` labels (variable-length sequences held in memory) is read as a
    Dataset of those pairs (:class:`ItemPairs`)."""
    if (collate is not None and isinstance(split, (tuple, list)) and len(split) == 2 and isinstance(split[0], list)
            and hasattr(split[1], "__len__") and len(split[0]) == len(split[1])):
        split = ItemPairs(split[0], split[1])
    if isinstance(split, torch.utils.data.IterableDataset):
        raise DataError(f"client {cid}: {what} is an IterableDataset ({type(split).__name__}), read in order only; "
                        "fedproto reads items by index: give a map-style Dataset (__len__ and __getitem__), or "
                        "collect its items into (x, y) tensors")
    if isinstance(split, torch.utils.data.Dataset):
        if not hasattr(type(split), "__len__"):
            raise DataError(f"client {cid}: {what} is a {type(split).__name__} without __len__; give the Dataset a "
                            "__len__ (fedproto reads its items by index)")
        # the training split stops at the first batch that holds NaN; a test item leaves its client out of the headline
        x = LazyInputs(split, collate, cid, what, check=what == "train")
        try:  # a few items batched as training batches them: inputs of different shapes need a collate function
            x[0 : min(len(x), PROBE_ITEMS)]
        except DataError as e:
            raise (e if e.message.startswith(f"client {cid}:") else e.prefixed(f"client {cid}: {what}: ")) from None
    elif isinstance(split, (tuple, list)) and len(split) == 2:
        try:
            x = _memory_inputs(split[0], len(split[1]) if hasattr(split[1], "__len__") else -1)
        except (TypeError, ValueError) as e:
            raise DataError(f"client {cid}: cannot read its {what} inputs ({first_line(e)[:200]}); give a tensor or "
                            "array (n, ...), or a dict, tuple or list of them, each with one row per sample") from None
    else:
        raise DataError(f"client {cid}: {what} is a {type(split).__name__}; give (x, y) tensors or arrays, or a "
                        "map-style torch Dataset of (x, y) items")
    checked: list[int] = []  # the items whose inputs the label pass checked for NaN and inf

    def check(i: int, xi: Any) -> None:
        if (field := nonfinite_field(xi)) is not None:
            raise DataError(nonfinite_message(cid, what, i, field))
        checked.append(i)

    try:
        y = _labels(split, check)
    except DataError as e:
        raise (e if e.message.startswith(f"client {cid}:") else e.prefixed(f"client {cid}: {what}: ")) from None
    except ValueError as e:
        raise DataError(f"client {cid}: cannot read {what} labels as integers: {e}") from None
    except (TypeError, IndexError, KeyError, AttributeError, RuntimeError) as e:
        raise DataError(f"client {cid}: cannot read {what} labels ({type(e).__name__}: {str(e)[:160]}); its "
                        "items must be (x, y) pairs with integer labels") from None
    if len(y) == 0:
        raise DataError(f"client {cid}: its {what} data is empty; give every client at least one sample")
    if y.ndim != 1 or len(y) != len(x):
        raise DataError(f"client {cid}: {what} has {len(x)} inputs but labels of shape {tuple(y.shape)}; give one "
                        "integer label per input")
    bad = (y < 0) | (y >= num_classes)
    if bool(bad.any()):
        raise DataError(f"client {cid}: {what} label {int(y[bad][0])} is outside 0..{num_classes - 1} "
                        f"(num_classes={num_classes}); relabel, or raise num_classes")
    if isinstance(x, LazyInputs) and len(checked) < len(x):  # labels from a torchvision dataset's targets
        scan_nonfinite(x)
    if not isinstance(x, LazyInputs) and (found := first_nonfinite(x)) is not None:
        raise DataError(nonfinite_message(cid, what, found[1], found[0], in_memory=True))
    return x, y
