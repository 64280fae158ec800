"""CIFAR-10 (Krizhevsky): the pickle batches or the archive (read in place), downloaded when
missing and checked against the published MD5; normalised per channel."""

from __future__ import annotations

import importlib
import pickle
import tarfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from fedproto.data.datasets import (
    Dataset,
    bullets,
    cached,
    candidate_roots,
    download_root,
    how_to_point,
    signature,
)
from fedproto.data.download import download_file
from fedproto.errors import DataError, opt

CIFAR10_URLS: tuple[str, ...] = ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",)
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
"""Published MD5 of the archive; checked only on freshly downloaded archives."""

_CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
_CIFAR10_DIR = "cifar-10-batches-py"
_CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR10_MEMBERS = (*_CIFAR10_TRAIN, "test_batch", "batches.meta")
_CIFAR10_MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)
_CIFAR10_STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)


def load_cifar10_files(root: str | Path | None, download: bool, progress: bool) -> Dataset:
    """The registry's loader of ``cifar10``."""
    return _load_cifar10(root, download, progress)


class _NumpyUnpickler(pickle.Unpickler):
    """Unpickler that only constructs numpy arrays (the CIFAR batches need nothing else)."""

    def find_class(self, module: str, name: str) -> Any:
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name in (
            "_reconstruct",
            "scalar",
        ):
            try:
                multiarray = importlib.import_module("numpy._core.multiarray")
            except ImportError:  # numpy < 2
                multiarray = importlib.import_module("numpy.core.multiarray")
            return getattr(multiarray, name)
        if module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a CIFAR-10 batch")


def _cifar10_source(folder_or_archive: Path) -> Path | None:
    if folder_or_archive.is_dir():
        ok = all((folder_or_archive / m).is_file() for m in _CIFAR10_MEMBERS)
        return folder_or_archive if ok else None
    return folder_or_archive if folder_or_archive.is_file() else None


def _load_cifar10(root: str | Path | None, download: bool, progress: bool) -> Dataset:
    searched: list[Path] = []
    source = None
    for r in candidate_roots(root):
        for candidate in (
            r / "cifar10" / _CIFAR10_DIR,
            r / _CIFAR10_DIR,
            r / "cifar10" / _CIFAR10_ARCHIVE,
            r / _CIFAR10_ARCHIVE,
        ):
            searched.append(candidate)
            source = _cifar10_source(candidate)
            if source is not None:
                break
        if source is not None:
            break

    if source is None:
        missing = (
            f"CIFAR-10 not found. Expected the folder {_CIFAR10_DIR}/ (with "
            f"{', '.join(_CIFAR10_MEMBERS)}) or the archive {_CIFAR10_ARCHIVE}; looked for:\n"
            + bullets(searched)
        )
        target = download_root(root) / "cifar10" / _CIFAR10_ARCHIVE
        if not download:
            raise DataError(
                f"{missing}\nTo fix it: {how_to_point('cifar10')}, or allow downloading "
                f"({opt('download', True)}) on a machine with internet access (the archive goes to {target})."
            )
        try:
            download_file(
                list(CIFAR10_URLS), target, CIFAR10_MD5, decompressed_md5=False, progress=progress
            )
        except DataError as exc:
            raise DataError(f"{missing}\nDownloading it failed:\n{exc}") from exc
        source = target

    files = [source / m for m in _CIFAR10_MEMBERS] if source.is_dir() else [source]
    return cached(("cifar10", signature(files)), lambda: _read_cifar10(source))


def _read_cifar10(source: Path) -> Dataset:
    batches: dict[str, dict[str, Any]] = {}

    def parse(member: str, f: IO[bytes], where: str) -> None:
        try:
            obj = _NumpyUnpickler(f, encoding="bytes").load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
            raise DataError(
                f"{where} is not a valid CIFAR-10 pickle ({exc}). Replace it with a good copy."
            ) from exc
        if not isinstance(obj, dict):
            raise DataError(
                f"{where} is not a CIFAR-10 batch (a dict). Replace it with a good copy."
            )
        batches[member] = {k.decode() if isinstance(k, bytes) else k: v for k, v in obj.items()}

    if source.is_dir():
        for member in _CIFAR10_MEMBERS:
            with open(source / member, "rb") as f:
                parse(member, f, str(source / member))
    else:
        try:
            with tarfile.open(source, "r:*") as tf:
                for info in tf:  # one sequential pass over the compressed stream
                    parent, _, base = info.name.rpartition("/")
                    if info.isfile() and base in _CIFAR10_MEMBERS and parent.endswith(_CIFAR10_DIR):
                        f = tf.extractfile(info)
                        assert f is not None
                        parse(base, f, f"{source}:{info.name}")
        except (OSError, EOFError, zlib.error, tarfile.TarError) as exc:
            raise DataError(
                f"Cannot read {source}: {exc}. Delete it and run again with downloading allowed "
                f"({opt('download', True)}), "
                "or replace it with a good copy."
            ) from exc
        absent = [m for m in _CIFAR10_MEMBERS if m not in batches]
        if absent:
            raise DataError(
                f"{source} lacks {', '.join(f'{_CIFAR10_DIR}/{m}' for m in absent)}. "
                "Replace it with the standard CIFAR-10 python archive."
            )

    def where(member: str) -> str:
        return str(source / member) if source.is_dir() else f"{source}:{_CIFAR10_DIR}/{member}"

    def split(members: Iterable[str]) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        for m in members:
            batch = batches[m]
            data, labels = batch.get("data"), batch.get("labels")
            ok = isinstance(data, np.ndarray) and data.shape == (10000, 3072)
            if not ok or data.dtype != np.uint8:
                got = getattr(data, "shape", type(data).__name__)
                raise DataError(f"{where(m)}: 'data' must be a 10000x3072 uint8 array, got {got}.")
            labels = np.asarray(labels, dtype=np.int64) if labels is not None else None
            if labels is None or labels.shape != (10000,) or labels.min() < 0 or labels.max() > 9:
                raise DataError(f"{where(m)}: 'labels' must be 10000 integers in 0..9.")
            xs.append(data)
            ys.append(labels)
        x = np.concatenate(xs).reshape(-1, 3, 32, 32).astype(np.float32)
        x /= 255.0
        x -= _CIFAR10_MEAN[:, None, None]
        x /= _CIFAR10_STD[:, None, None]
        return torch.from_numpy(x), torch.from_numpy(np.concatenate(ys))

    names = batches["batches.meta"].get("label_names")
    if not isinstance(names, list) or len(names) != 10:
        raise DataError(f"{where('batches.meta')}: 'label_names' must list 10 class names.")
    train_x, train_y = split(_CIFAR10_TRAIN)
    test_x, test_y = split(["test_batch"])
    return Dataset(
        name="cifar10",
        train_x=train_x,
        train_y=train_y,
        test_x=test_x,
        test_y=test_y,
        num_classes=10,
        class_names=[n.decode() if isinstance(n, bytes) else str(n) for n in names],
    )
