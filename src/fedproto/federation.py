"""Your own federation: your client models and your data, through the simulator's engine.

    from fedproto.federation import Client, federate

    clients = [Client(model=MyNet(), train=(x0, y0), test=(tx0, ty0)),            # returns (logits, h)
               Client(model=resnet, head="fc", train=my_dataset, test=my_test_set)]  # split at its head
    sim = federate(clients, num_classes=10, algorithm="fedproto", rounds=20, out="runs/mine")
    summary = sim.run()

A client's model is either a module whose ``forward(x)`` returns ``(logits (B, C), embedding
(B, d))``, or any classifier plus the name of its final layer (``head``): the embedding is that
layer's input, flattened (torchvision- and timm-style heads ``fc``, ``classifier``, ``head``).
Data are tensors or arrays held in memory (the fast path), or a map-style
``torch.utils.data.Dataset`` whose items are ``(x, y)`` pairs, read batch by batch with its own
transforms (for data that does not fit in memory). Everything is checked before round 1, and
each error names the client. The engine, evaluation, metrics, run directory and checkpoints are
those of :class:`fedproto.simulation.Simulation`.

Size: about 620 lines: the adapters that make a user's module a ProtoModel (tuple, head split,
projection) and the data adapters, each short; one module is the one place a user reads.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedproto.algorithms.base import ClientData, ClientState
from fedproto.config import build_config
from fedproto.data.inputs import as_inputs, as_leaf, cast_floats, describe, finite, is_structure, tree_map, tree_zip
from fedproto.data.partition import Partition
from fedproto.errors import ConfigError, DataError, ModelError, first_line
from fedproto.models.base import ProtoModel
from fedproto.simulation import Simulation

ArrayLike = Any


class TupleModel(ProtoModel):
    """Adapter for a module whose ``forward(x)`` returns ``(logits (B, C), embedding (B, d))``.

    ``embed(x)`` runs the whole module and keeps the embedding. The module's own parameter names
    are kept under ``net.``; it has no known head, so FedPer/FedRep refuse it (give ``head``).
    """

    head_prefixes = ("net.\0",)  # matches no parameter: the head is unknown

    def __init__(self, net: nn.Module, embedding_dim: int, num_classes: int):
        super().__init__()
        self.net = net
        self.embedding_dim = int(embedding_dim)
        self.num_classes = int(num_classes)

    def forward(self, x, noise=None):
        out = self.net(x)
        tensor = (torch.Tensor, torch.fx.Proxy)  # a Proxy: the forward traced by fedproto.grouped
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, tensor) for t in out)):
            raise ModelError(f"the model's forward returned a {type(out).__name__}, not (logits, embedding); give "
                             "head='<final layer>' for a plain classifier")
        logits, h = out
        return logits, h.flatten(1)

    def embed(self, x, noise=None):
        return self.forward(x)[1]


class HeadSplitModel(ProtoModel):
    """Adapter for a classifier split at its final layer ``head`` (a submodule name, dotted for
    nested ones): the embedding is the flattened input of that layer, the logits its output.

    Parameters keep their names under ``net.``; FedPer/FedRep treat ``net.<head>.*`` as the head.
    """

    def __init__(self, net: nn.Module, head: str, embedding_dim: int, num_classes: int):
        super().__init__()
        self.net = net
        self.head_name = head
        self.head_prefixes = (f"net.{head}.",)
        self.embedding_dim = int(embedding_dim)
        self.num_classes = int(num_classes)
        self._seen: list[torch.Tensor] = []
        net.get_submodule(head).register_forward_pre_hook(self._keep)

    def _keep(self, module, args):
        self._seen.append(args[0])

    def forward(self, x, noise=None):
        self._seen.clear()
        logits = self.net(x)
        if not self._seen:
            raise ModelError(f"the model's forward never called its head {self.head_name!r}")
        h = self._seen[-1]
        self._seen.clear()
        return logits, h.flatten(1)

    def embed(self, x, noise=None):
        return self.forward(x)[1]

    def head(self, h, noise=None):
        return self.net.get_submodule(self.head_name)(h)


class Projected(ProtoModel):
    """``model`` with a linear projection of its embedding to size ``d`` and a new linear head
    (d -> C): the practitioner's guide's advice for clients whose embedding sizes differ
    (§3.2: "add a projection layer"). Parameters: ``inner.*``, ``proj.*``, ``fc.*`` (the head)."""

    head_prefixes = ("fc.",)

    def __init__(self, model: ProtoModel, d: int):
        super().__init__()
        self.inner = model
        self.proj = nn.Linear(model.embedding_dim, d)
        self.fc = nn.Linear(d, model.num_classes)
        self.embedding_dim, self.num_classes = int(d), model.num_classes

    def embed(self, x, noise=None):
        return self.proj(self.inner.embed(x))

    def head(self, h, noise=None):
        return self.fc(h)


def with_projection(model: ProtoModel, d: int) -> ProtoModel:
    """Append a linear projection to embedding size ``d`` (and a new d -> C head); see :class:`Projected`.

    Raises:
        ModelError: ``model`` is a plain module (its embedding size is unknown until it is adapted):
            give ``Client(..., embedding_dim=d)`` instead, or :func:`adapt` it first.
    """
    if not isinstance(model, ProtoModel):
        raise ModelError(f"with_projection needs an adapted model; for a plain {type(model).__name__} give "
                         f"Client(model, train, test, embedding_dim={d}) (or fedproto.federation.adapt it first)")
    return model if model.embedding_dim == d else Projected(model, d)


def _pair(item: Any, i: int) -> tuple[Any, Any]:
    """Item ``i`` of a Dataset as ``(x, y)``; raises DataError when it is not a pair."""
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    what = f"a {len(item)}-tuple" if isinstance(item, (tuple, list)) else f"a {type(item).__name__}"
    raise DataError(f"item {i} of the Dataset is {what}, not an (x, y) pair; make its __getitem__ return "
                    "(input, label)")


def _as_input(x: Any, i: int) -> Any:
    """Input ``x`` of item ``i`` as the model takes it: a tensor or array as a tensor (floating values
    as float32, integer token ids kept), a dict, tuple or list of them with its structure kept
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

    def __init__(self, dataset: torch.utils.data.Dataset, collate: Any = None):
        self.dataset = dataset
        self.collate = collate
        self.dtype: torch.dtype | None = None  # floating leaves cast on reading (float64 checks)

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


@dataclass
class Client:
    """One client of your federation.

    Attributes:
        model: an ``nn.Module`` returning ``(logits, embedding)``, or any classifier with ``head``.
        train, test: ``(x, y)`` tensors or arrays (x: (n, ...) float, y: (n,) int labels in
            0..C-1), or a map-style ``Dataset`` of ``(x, y)`` items.
        head: name of the final layer of a classifier (its input is the embedding); None when
            ``model`` returns ``(logits, embedding)`` itself.
        embedding_dim: when given and the model's embedding has another size, a linear projection
            to this size and a new linear head are appended (:func:`with_projection`), so clients
            whose architectures end in different widths share one prototype size.
        collate: for a ``Dataset``: a function from a list of items' inputs to the model's batch
            input (e.g. :func:`fedproto.data.inputs.pad_collate` for variable-length token
            sequences); None: inputs are stacked (leaf by leaf for dicts and tuples).

    Inputs reach the model as it takes them: integer token ids stay integers, a dict (``{"input_ids":
    ..., "attention_mask": ...}``) stays a dict, a tuple ``(ids, mask)`` a tuple; in-memory ``x`` may
    be such a dict, tuple or list of (n, ...) tensors or arrays (:class:`fedproto.data.inputs.Inputs`).
    """

    model: nn.Module
    train: Any
    test: Any
    head: str | None = None
    embedding_dim: int | None = None
    collate: Any = None


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


def dataset_labels(ds: torch.utils.data.Dataset) -> np.ndarray:
    """The labels a map-style Dataset yields, ``ds[i][1]`` for every i, as an array (n,).

    Every item is read (its transforms run once), except for a torchvision dataset read by
    torchvision's own ``__getitem__`` without a ``target_transform`` (MNIST, CIFAR10,
    ImageFolder...): its ``targets`` are used once they equal the labels of
    :data:`LABEL_CHECKS` items spread over the dataset. A ``targets`` attribute is never trusted
    otherwise: a ``target_transform`` or a ``__getitem__`` that changes the label decides.

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
    return _label_array([_label_value(_pair(ds[i], i)[1], i) for i in range(n)])


_ID_HINT = ("map each class to an id 0..C-1 (e.g. {name: i for i, name in enumerate(sorted(names))}, or "
            "torchvision's class_to_idx)")


def _labels(split: Any) -> torch.Tensor:
    """Integer labels (n,) of a split; raises ValueError/DataError with the offending value."""
    if isinstance(split, torch.utils.data.Dataset):
        raw = dataset_labels(split)
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
    else as one tensor (floating values float32, integer values kept)."""
    arrays = isinstance(x, (tuple, list)) and x and all(isinstance(v, (torch.Tensor, np.ndarray, dict)) for v in x)
    if isinstance(x, dict) or (arrays and len(x) != n_labels):
        return as_inputs(x)
    return as_leaf(x if isinstance(x, (torch.Tensor, np.ndarray)) else np.asarray(x))


def _split(split: Any, cid: int, what: str, num_classes: int, collate: Any = None) -> tuple[Any, torch.Tensor]:
    """(inputs, labels) of one split, checked; raises DataError naming the client."""
    if isinstance(split, torch.utils.data.IterableDataset):
        raise DataError(f"client {cid}: {what} is an IterableDataset ({type(split).__name__}), read in order only; "
                        "fedproto reads items by index: give a map-style Dataset (__len__ and __getitem__), or "
                        "collect its items into (x, y) tensors")
    if isinstance(split, torch.utils.data.Dataset):
        if not hasattr(type(split), "__len__"):
            raise DataError(f"client {cid}: {what} is a {type(split).__name__} without __len__; give the Dataset a "
                            "__len__ (fedproto reads its items by index)")
        x = LazyInputs(split, collate)
        try:  # a few items batched as training batches them: inputs of different shapes need a collate function
            x[0 : min(len(x), PROBE_ITEMS)]
        except DataError as e:
            raise e.prefixed(f"client {cid}: {what}: ") from None
    elif isinstance(split, (tuple, list)) and len(split) == 2:
        try:
            x = _memory_inputs(split[0], len(split[1]) if hasattr(split[1], "__len__") else -1)
        except (TypeError, ValueError) as e:
            raise DataError(f"client {cid}: cannot read its {what} inputs ({first_line(e)[:200]}); give a tensor or "
                            "array (n, ...), or a dict, tuple or list of them, each with one row per sample") from None
    else:
        raise DataError(f"client {cid}: {what} is a {type(split).__name__}; give (x, y) tensors or arrays, or a "
                        "map-style torch Dataset of (x, y) items")
    try:
        y = _labels(split)
    except DataError as e:
        raise e.prefixed(f"client {cid}: {what}: ") from None
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
    if isinstance(x, torch.Tensor) and x.is_floating_point() and not bool(torch.isfinite(x).all()):
        n = int((~torch.isfinite(x)).flatten(1).any(1).sum())
        raise DataError(f"client {cid}: {n} {what} input(s) hold NaN or infinite values; clean or drop them")
    if not isinstance(x, (torch.Tensor, LazyInputs)) and not finite(x):
        raise DataError(f"client {cid}: {what} inputs hold NaN or infinite values; clean or drop them")
    return x, y


def adapt(model: nn.Module, head: str | None, num_classes: int, sample: Any, cid: int = 0) -> ProtoModel:
    """Wrap ``model`` as a :class:`ProtoModel` and check it on ``sample`` (one input as the model
    takes it: a (1, ...) tensor, or a dict or tuple of them).

    Raises:
        ModelError: ``head`` is not a submodule (lists the candidates), the forward does not
            return what it must, or the logits are not (B, num_classes) (names client ``cid``).
    """
    if isinstance(model, ProtoModel):
        wrapped = model
    elif not isinstance(model, nn.Module):
        raise ModelError(f"client {cid}: model is a {type(model).__name__}, not a torch.nn.Module")
    elif head is not None:
        names = dict(model.named_modules())
        if head not in names or head == "":
            tail = [n for n in names if n][-5:]
            raise ModelError(f"client {cid}: the model has no layer {head!r}; its last layers are {tail}: name the "
                             "final (classifier) layer, e.g. head='fc'")
        wrapped = HeadSplitModel(model, head, 0, num_classes)
    else:
        wrapped = TupleModel(model, 0, num_classes)
    meta = [n for n, t in [*wrapped.named_parameters(), *wrapped.named_buffers()] if t.is_meta]
    if meta:
        raise ModelError(f"client {cid}: the model's weights are on the meta device (shapes only, no values; e.g. "
                         f"{meta[0]!r}); materialise it first: model.to_empty(device='cpu'), then load its weights "
                         "(load_state_dict), or build it without device='meta'")
    was = wrapped.training
    wrapped.eval()
    try:
        with torch.no_grad():
            out = wrapped(sample)
    except ModelError as e:
        raise e.prefixed(f"client {cid}: ") from None
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
        hint = ("its forward must return (logits, embedding), or give head='<final layer name>'" if head is None
                else "check the input shape")
        raise ModelError(f"client {cid}: the model failed on a training input of shape {describe(sample)} "
                         f"({type(e).__name__}: {str(e)[:160]}); {hint}") from None
    except RuntimeError as e:
        raise ModelError(f"client {cid}: the model failed on a training input of shape {describe(sample)} "
                         f"({type(e).__name__}: {first_line(e)[:200]})") from None
    finally:
        wrapped.train(was)
    logits, h = out
    if not isinstance(logits, torch.Tensor):
        raise ModelError(f"client {cid}: the model failed on a training input of shape {describe(sample)} (its "
                         f"forward returned a {type(logits).__name__}, not the logits tensor head={head!r} needs); if "
                         f"its forward returns (logits, embedding) itself, leave out head={head!r}")
    if not any(p.requires_grad for p in wrapped.parameters()):
        raise ModelError(f"client {cid}: the model has no trainable parameters")
    if logits.ndim != 2 or logits.shape != (1, num_classes):
        raise ModelError(f"client {cid}: the model's logits have shape {tuple(logits.shape)} for one input, "
                         f"expected (1, {num_classes}) (num_classes={num_classes})")
    if h.ndim != 2 or h.shape[0] != 1:
        raise ModelError(f"client {cid}: the embedding has shape {tuple(h.shape)} for one input, expected (1, d)")
    if head is not None:
        with torch.no_grad():
            again = wrapped.head(h)
        if again.shape != logits.shape or not torch.allclose(again, logits, rtol=1e-4, atol=1e-5):
            raise ModelError(f"client {cid}: layer {head!r} is not the model's final layer (its output is not the "
                             "logits); name the last layer, the one that outputs the class scores")
    if not isinstance(model, ProtoModel):
        wrapped.embedding_dim = int(h.shape[1])
    return wrapped


def share_initial_weights(models: Sequence[nn.Module]) -> list[list[int]]:
    """Give clients of one architecture identical initial weights (the ``shared_init`` option for your own models).

    Models whose state dicts hold the same names, shapes and dtypes (parameters and buffers) and that froze the
    same parameters (:func:`fedproto.training.frozen_params`) form a group; every model of a group gets the
    first one's (lowest client id's) trainable parameters and buffers, copied in place. What the user froze is
    left as it is: frozen parameters (``requires_grad=False``, e.g. a pretrained backbone) and the running
    statistics of BatchNorm layers whose parameters are all frozen (:func:`fedproto.training.frozen_batchnorms`)
    are not copied, and no ``requires_grad`` flag changes. Models of other architectures keep their weights.

    Args:
        models: the clients' models, in client order (changed in place).
    Returns:
        The groups of client indices (each sorted, in order of their first client), singletons included.
    """
    from fedproto.training import frozen_batchnorms, frozen_params

    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(models):
        key = (tuple((k, tuple(v.shape), v.dtype) for k, v in m.state_dict().items()), frozen_params(m))
        groups.setdefault(key, []).append(i)
    for members in groups.values():
        src = models[members[0]]
        frozen = frozen_params(src)
        fbn = {id(mod) for mod in frozen_batchnorms(src)}
        frozen_bn = {f"{n}.{b}" if n else b for n, mod in src.named_modules() if id(mod) in fbn
                     for b, _ in mod.named_buffers(recurse=False)}
        state = {k: v for k, v in src.state_dict().items() if k not in frozen and k not in frozen_bn}
        for i in members[1:]:
            with torch.no_grad():
                models[i].load_state_dict(state, strict=False)
    return list(groups.values())


def federate(clients: Sequence[Client], num_classes: int | None = None, out: Any = None, *,
             dataset: str | None = None, observers: Sequence[Any] = (), **options: Any):
    """Build a :class:`~fedproto.simulation.Simulation` of your own clients.

    Defaults: where ``dataset`` names the registry's dataset your data come from (``"mnist"``,
    ``"cifar10"``...), the options the paper sets per dataset take its values, as ``fedproto run
    --dataset`` does (``rounds``: mnist 100, femnist 120, cifar10 110; ``lambda_proto``: mnist 1,
    cifar10 0.1) and ``num_classes`` defaults to its classes; without ``dataset``: 20 rounds and
    λ = 1. Every other option has :class:`~fedproto.config.RunConfig`'s default (batch size 8, lr
    0.01, momentum 0.5, ...); any keyword overrides.

    Args:
        clients: one :class:`Client` per client (their order gives the client ids 0..m-1).
        num_classes: C; labels lie in 0..C-1 (default: the classes of ``dataset``; required
            without it).
        out: the run directory (None: ``out_dir/<algorithm>-custom-m<clients>-s<seed>``; False:
            write nothing).
        dataset: the name of a dataset of :data:`fedproto.data.registry.DATASETS` whose per-dataset
            defaults to use (None: the defaults above). It only sets defaults: the data are your
            clients'.
        observers: your own :class:`fedproto.engine.loop.Observer` s (:class:`~fedproto.simulation.Simulation`'s
            ``observers``).
        options: any run option of :class:`fedproto.config.RunConfig` (``algorithm``,
            ``rounds``, ``lambda_proto``, ``lr``, ``batch_size``, ``participation``...).
    Returns:
        A Simulation; ``.run()`` trains and returns the summary.
    Raises:
        ConfigError: a bad option, an unknown ``dataset``, or ``num_classes`` missing, not a whole
            number, or not the dataset's. DataError: bad data (names the client). ModelError: a model
            that does not fit (names the client), two clients sharing a model or layer object, or
            embedding sizes that differ (names the clients and the fix,
            ``Client(..., embedding_dim=d)``).
    """
    from fedproto.data.registry import DATASETS, LOADABLE
    from fedproto.engine.setup import build_setup

    if isinstance(clients, Client) or not isinstance(clients, Iterable):
        raise DataError(f"clients is a {type(clients).__name__}; pass a list of fedproto.federation.Client")
    clients = list(clients)
    if not clients:
        raise DataError("no clients given; pass a list of fedproto.federation.Client")
    if num_classes is not None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral):
            raise ConfigError(f"federate(num_classes={num_classes!r}): give the number of classes as a whole number "
                              "(your labels lie in 0..num_classes-1)")
        num_classes = int(num_classes)
    for k in ("classes", "clients", "model", "partition"):
        if k in options:
            raise ModelError(f"{k} is set by federate() from your clients; leave it out")
    if dataset is not None:
        if dataset not in LOADABLE:
            raise ConfigError(f"federate(dataset={dataset!r}): no such dataset; name one of {', '.join(LOADABLE)} "
                              "for its defaults, or leave dataset out")
        info = DATASETS[dataset]
        if num_classes is not None and num_classes != info.classes:
            raise ConfigError(f"federate(num_classes={num_classes}, dataset={dataset!r}): {dataset} has "
                              f"{info.classes} classes; give num_classes={info.classes} or leave it out")
        num_classes = info.classes
        from fedproto.algorithms.options import owners

        defaults = {"rounds": info.rounds}
        if options.get("algorithm", "fedproto") in owners("lambda_proto"):  # λ only where the algorithm has one
            defaults["lambda_proto"] = info.lambda_proto
        options = {**defaults, **options}
    if num_classes is None:
        raise ConfigError("federate() needs num_classes (your labels lie in 0..num_classes-1), or dataset='<name>' "
                          "of the dataset your data come from")
    cfg = build_config(overrides={**options, "dataset": "custom", "classes": int(num_classes),
                                  "clients": len(clients), "model": "custom"})
    states, data, part = [], [], Partition([], [], [])
    owner: dict[int, int] = {}  # id of a parameter -> its client: no two clients may share one
    for i, c in enumerate(clients):
        if not isinstance(c, Client):
            raise DataError(f"client {i} is a {type(c).__name__}; wrap it as fedproto.federation.Client(model, train, "
                            "test)")
        x, y = _split(c.train, i, "train", num_classes, c.collate)
        tx, ty = _split(c.test, i, "test", num_classes, c.collate)
        if c.embedding_dim is not None and (isinstance(c.embedding_dim, bool) or not (
                isinstance(c.embedding_dim, numbers.Integral) and c.embedding_dim >= 1)):
            raise ModelError(f"client {i}: embedding_dim={c.embedding_dim!r}; give a whole number >= 1 or None")
        try:
            sample = x[0:1]
        except DataError as e:
            raise e.prefixed(f"client {i}: train: ") from None
        except (TypeError, ValueError, IndexError, KeyError, AttributeError, RuntimeError) as e:
            raise DataError(f"client {i}: cannot read its first training input ({type(e).__name__}: {str(e)[:160]}); "
                            "its inputs must be tensors or arrays of one shape") from None
        mine = list(c.model.named_parameters()) if isinstance(c.model, nn.Module) else []
        shared = next(((owner[id(p)], n) for n, p in mine if id(p) in owner), None)
        if shared is not None:
            raise ModelError(f"clients {shared[0]} and {i} share parameters (e.g. {shared[1]!r}: the same model or "
                             "layer object), so they would train one set of weights; give each client its own model "
                             "(e.g. copy.deepcopy(model))")
        owner.update((id(p), i) for _, p in mine)
        model = adapt(c.model, c.head, num_classes, sample, i)
        if c.embedding_dim is not None:
            model = with_projection(model, int(c.embedding_dim))
        states.append(ClientState(i, model, np.unique(y.numpy())))
        data.append(ClientData(x, y, tx, ty))
        part.train_idx.append(np.arange(len(y)))
        part.test_idx.append(np.arange(len(ty)))
        part.classes.append(states[-1].classes)
        part.shots.append(np.bincount(y.numpy(), minlength=num_classes)[states[-1].classes])
    if cfg.augment:  # random crops and flips act on image batches (n, C, H, W) only
        other = [i for i, d in enumerate(data) if not (isinstance(b := d.x[0:1], torch.Tensor) and b.dim() == 4)]
        if other:
            raise ConfigError(f"augment=True crops and flips images (n, C, H, W), but the inputs of clients "
                              f"{other[:10]} are not image tensors (token ids, dicts, tables or signals); leave "
                              "augment off for them, or augment in your Dataset's transform")
    dims = [int(s.model.embedding_dim) for s in states]
    fix = (f"give every client Client(..., embedding_dim=d) with one d (e.g. embedding_dim={min(dims)}), which appends "
           "a projection to size d where a model's embedding differs")  # the check: build_setup's, worded for Python
    if cfg.shared_init:  # clients of one architecture start from the first one's weights
        share_initial_weights([st.model for st in states])
    setup = build_setup(cfg, states, data, part, fix=fix)  # the checks and the resolved options of `fedproto run`
    return Simulation(cfg, setup=setup, out=out, observers=observers)


FederationSimulation = Simulation
"""The run :func:`federate` builds: a :class:`~fedproto.simulation.Simulation` (which writes
``embeddings.npz`` for ``fedproto plot`` into its run directory, as every front end does)."""


__all__ = ["Client", "FederationSimulation", "HeadSplitModel", "LazyInputs", "Projected", "TupleModel", "adapt",
           "dataset_labels", "federate", "share_initial_weights", "with_projection"]
