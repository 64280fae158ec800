"""Dataset loading: the :class:`Dataset` type, :func:`load_dataset` and what the per-dataset
loaders share (one module per dataset: :mod:`fedproto.data.mnist`, :mod:`fedproto.data.femnist`,
:mod:`fedproto.data.cifar10`, :mod:`fedproto.data.digits`; the registry,
:mod:`fedproto.data.registry`, names each one's loader).

Every loader returns a :class:`Dataset` of normalized ``float32`` image tensors shaped
``(N, C, H, W)`` and ``int64`` labels. File-based datasets are looked for, in order, in:

1. the explicit ``root`` argument of :func:`load_dataset`,
2. the folder named by the environment variable ``FEDPROTO_DATA``,
3. :func:`~fedproto.data.download.default_cache_dir` (``~/.cache/fedproto``).

Within each of these a dataset lives in its own sub-folder (``mnist/``, ``femnist/``,
``cifar10/``); see :func:`load_dataset` for the exact layouts accepted. MNIST and CIFAR-10
are downloaded when missing (into ``<root>/<name>/`` when ``root`` is given, else into the
cache folder); FEMNIST has no canonical download and must be produced with LEAF.

Loaded datasets are kept in a small in-process cache keyed by the dataset name and the
files read (path, size, modification time), so repeated loads in one process are cheap.
Cached datasets are shared: do not modify their tensors in place.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedproto.data.download import default_cache_dir
from fedproto.data.registry import DATASETS, LOADABLE
from fedproto.errors import DataError, opt

__all__ = ["DATA_ENV", "KNOWN_DATASETS", "Dataset", "clear_dataset_cache", "load_dataset"]

DATA_ENV = "FEDPROTO_DATA"
"""Environment variable naming a data folder, searched after the explicit ``root``."""

KNOWN_DATASETS = LOADABLE
"""Names :func:`load_dataset` accepts (from :mod:`fedproto.data.registry`)."""


@dataclass(eq=False, repr=False)
class Dataset:
    """A train/test image-classification dataset held in memory.

    Attributes:
        name: dataset name (``"mnist"``, ``"digits"``, ``"femnist"``, ``"cifar10"``,
            ``"femnist_unpaired"``).
        train_x: ``(N, C, H, W)`` float32, normalized (roughly zero mean, unit variance).
        train_y: ``(N,)`` int64 class indices in ``[0, num_classes)``.
        test_x: ``(M, C, H, W)`` float32, normalized with the same constants as train.
        test_y: ``(M,)`` int64.
        num_classes: number of classes.
        class_names: ``num_classes`` human-readable names, indexed by label.
        train_groups: ``(N,)`` int64 writer index per train sample (FEMNIST), else None.
        test_groups: ``(M,)`` int64 writer index per test sample; a writer has the same
            index in train and test.
        group_names: writer ids (LEAF user names) indexed by group index, or None.
    """

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    class_names: list[str]
    train_groups: np.ndarray | None = None
    test_groups: np.ndarray | None = None
    group_names: list[str] | None = None

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x, y = getattr(self, f"{split}_x"), getattr(self, f"{split}_y")
            groups = getattr(self, f"{split}_groups")
            if x.ndim != 4 or y.ndim != 1 or len(x) != len(y):
                raise ValueError(
                    f"{split}_x must be (N, C, H, W) and {split}_y (N,); got "
                    f"{tuple(x.shape)} and {tuple(y.shape)}"
                )
            if groups is not None and groups.shape != (len(y),):
                raise ValueError(f"{split}_groups must be ({len(y)},); got {groups.shape}")
        if len(self.class_names) != self.num_classes:
            raise ValueError(f"{len(self.class_names)} class names for {self.num_classes} classes")

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one sample."""
        c, h, w = (int(d) for d in self.train_x.shape[1:])
        return c, h, w

    def __repr__(self) -> str:
        groups = "" if self.group_names is None else f", groups={len(self.group_names)}"
        return (
            f"Dataset(name={self.name!r}, train={len(self.train_y)}, test={len(self.test_y)}, "
            f"input_shape={self.input_shape}, num_classes={self.num_classes}{groups})"
        )


def load_dataset(
    name: str,
    root: str | Path | None = None,
    download: bool = True,
    progress: bool = True,
    mapped: bool = False,
    decode_in_child: bool = False,
) -> Dataset:
    """Load a dataset by name, from disk (downloading if allowed) or from the in-process cache.

    Args:
        name: ``"mnist"``, ``"digits"``, ``"femnist"`` or ``"cifar10"`` (case-insensitive).
        root: data folder searched first; also where MNIST/CIFAR-10 are downloaded to (into
            ``<root>/mnist/`` or ``<root>/cifar10/``). Then ``$FEDPROTO_DATA`` and the cache
            folder are searched.
        download: download MNIST/CIFAR-10 when no searched folder holds them.
        progress: show a progress bar while downloading (only on a terminal).
        mapped: return tensors memory-mapped from the decoded-dataset cache on disk
            (:mod:`fedproto.data.decoded`): decoded once per machine, one copy in memory for every
            process that maps it; equal bit for bit to the decoded arrays (digits, which has no
            files, is decoded as usual).
        decode_in_child: with ``mapped``, when the cache has no entry yet, decode in a child process
            (``python -m fedproto.data.precache``) so that this process never holds the decoded
            arrays (a long-lived process such as a Flower simulation actor keeps its memory low);
            if the child fails, this process decodes itself (and raises the loader's error).

    Layouts accepted in each searched folder ``R``:

    * mnist: the 4 canonical IDX files (``train-images-idx3-ubyte`` etc., raw or ``.gz``)
      in ``R/mnist/`` or ``R/``. Their decompressed MD5 is verified against the canonical
      checksums. ``x/255`` then ``(x - 0.1307) / 0.3081``; ``(N, 1, 28, 28)``, 60,000/10,000.
    * digits: scikit-learn's 8x8 digits, no files; ``x/16`` then standardized with the train
      mean/std; deterministic stratified 70/30 split; ``(N, 1, 8, 8)``, 1,257/540.
    * femnist: LEAF JSON in ``R/femnist/{train,test}/*.json`` or
      ``R/femnist/femnist/{train,test}/*.json``, or the archive
      ``R/femnist/femnist-leaf-niid-sf0.05.tar.gz`` (extracted once next to it, or into the
      cache folder when that is read-only; delete the extracted ``femnist-leaf-niid-sf0.05/``
      folder to re-extract). Standardized with the train mean/std;
      ``(N, 1, 28, 28)``, 62 classes, ``train_groups``/``test_groups`` give the writer.
    * cifar10: the pickle batches in ``R/cifar10/cifar-10-batches-py/`` or
      ``R/cifar-10-batches-py/``, or the archive ``cifar-10-python.tar.gz`` in ``R/cifar10/``
      or ``R/`` (read in place). Per-channel normalized; ``(N, 3, 32, 32)``, 50,000/10,000.

    Returns:
        The :class:`Dataset`, possibly shared with earlier calls (do not modify in place).

    Raises:
        DataError: unknown name; files missing (the message names the expected files and
            every folder looked in, and how to obtain them); a file corrupt or malformed (the
            message names it); the download failed; or ``root`` is a file, or does not exist
            while downloading is off (a typo would otherwise fall through to ``$FEDPROTO_DATA``
            silently).
    """
    key = name.strip().lower()
    if root is not None and key != "digits":
        r = Path(root).expanduser()
        if r.exists() and not r.is_dir():
            raise DataError(f"data folder {str(r)!r} is a file, not a folder; pass the folder that holds "
                            f"{key}/ (or its files) to {opt('data_dir')}")
        if not r.exists() and (not download or key == "femnist"):
            raise DataError(f"data folder {str(r)!r} does not exist; pass an existing folder to {opt('data_dir')}, "
                            "or leave it out to search $FEDPROTO_DATA and the user cache")
        if not r.exists():  # a typo would otherwise fall through to another copy without a word
            logging.getLogger(__name__).warning(
                "data folder %r does not exist: %s is read from $%s or the user cache if one holds it, else "
                "downloaded into %r", str(r), key, DATA_ENV, str(r))
    if key in LOADABLE:
        module, _, function = DATASETS[key].loader.partition(":")
        token = _MAPPED.set((name, None if root is None else str(root), download, decode_in_child) if mapped else None)
        try:
            return getattr(importlib.import_module(module), function)(root, download, progress)
        finally:
            _MAPPED.reset(token)
    raise DataError(f"Unknown dataset {name!r}. Known datasets: {', '.join(KNOWN_DATASETS)}.")


def clear_dataset_cache() -> None:
    """Forget all datasets kept by the in-process cache."""
    _CACHE.clear()
    for forget in CLEAR_HOOKS:  # caches of the loaders (FEMNIST's pixel statistics)
        forget()


CLEAR_HOOKS: list[Callable[[], None]] = []
"""Functions :func:`clear_dataset_cache` calls as well (a loader module registers its own caches)."""


_CACHE: OrderedDict[tuple, Dataset] = OrderedDict()
_CACHE_SIZE = 8


_MAPPED: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("fedproto_mapped", default=None)
"""Set by :func:`load_dataset` while its loader runs: None, or (name, root, download, decode_in_child)
of a ``mapped=True`` call (:func:`cached` then maps the decoded-dataset cache)."""


def cached(key: tuple, build: Callable[[], Dataset]) -> Dataset:
    """The in-process cache every loader goes through: ``key`` is ``(name, signature(files))``
    (:func:`signature`), ``build`` decodes the files. Under ``load_dataset(..., mapped=True)`` the
    dataset comes memory-mapped from the disk cache (:func:`fedproto.data.decoded.load_or_decode`)."""
    call = _MAPPED.get()
    if call is not None and len(key) == 2 and key[1]:
        from fedproto.data.decoded import load_or_decode

        name, sources = key
        child = call[:3] if call[3] else None
        key, build = (*key, "mapped"), functools.partial(load_or_decode, name, sources, build, Dataset, child)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    dataset = build()
    _CACHE[key] = dataset
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return dataset


def signature(paths: Iterable[Path]) -> tuple:
    """Identify a set of files by resolved path, size and mtime (for the cache key)."""
    out = []
    for p in paths:
        st = p.stat()
        out.append((str(p.resolve()), st.st_size, st.st_mtime_ns))
    return tuple(out)


def candidate_roots(root: str | Path | None) -> list[Path]:
    """Explicit root, then $FEDPROTO_DATA, then the cache folder (duplicates dropped)."""
    roots: list[Path] = []
    if root is not None:
        roots.append(Path(root).expanduser())
    env = os.environ.get(DATA_ENV, "").strip()
    if env:
        roots.append(Path(env).expanduser())
    roots.append(default_cache_dir())
    unique: list[Path] = []
    seen: set[Path] = set()
    for r in roots:
        resolved = r.resolve()
        if resolved not in seen:
            seen.add(resolved)
            unique.append(r)
    return unique


def download_root(root: str | Path | None) -> Path:
    return Path(root).expanduser() if root is not None else default_cache_dir()


def bullets(paths: Iterable[Path | str]) -> str:
    return "\n".join(f"  - {p}" for p in paths)


def to_images(x: np.ndarray, shape: tuple[int, int, int]) -> torch.Tensor:
    """Flat float array ``(N, C*H*W)`` -> contiguous float32 tensor ``(N, C, H, W)``."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, *shape)
    return torch.from_numpy(x)


def how_to_point(name: str) -> str:
    return (
        f"pass {opt('data_dir', '<folder>')} (load_dataset: root=<folder>; files in <folder>/{name}/) "
        f"or set {DATA_ENV}=<folder>"
    )
