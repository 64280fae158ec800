"""MNIST (LeCun et al.): the four IDX files, checked against their canonical MD5, downloaded from
:data:`MNIST_MIRRORS` when missing; ``x/255`` then ``(x - 0.1307) / 0.3081`` (official code)."""

from __future__ import annotations

import gzip
import hashlib
import os
import zlib
from pathlib import Path

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
    to_images,
)
from fedproto.data.download import download_file
from fedproto.errors import DataError, opt

MNIST_MIRRORS: tuple[str, ...] = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
"""Base URLs tried in order for ``<base><canonical name>.gz``."""

MNIST_MIRRORS_ENV = "FEDPROTO_MNIST_MIRRORS"
"""Environment variable overriding :data:`MNIST_MIRRORS` (comma-separated base URLs)."""

# Canonical file name -> MD5 of its uncompressed content.
_MNIST_FILES: dict[str, str] = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}
_MNIST_MEAN, _MNIST_STD = 0.1307, 0.3081  # as in the official FedProto code


def load_mnist_files(root: str | Path | None, download: bool, progress: bool) -> Dataset:
    """The registry's loader of ``mnist`` (:data:`fedproto.data.registry.Loader`)."""
    return _load_mnist(root, download, progress)


def _mnist_mirrors() -> list[str]:
    env = os.environ.get(MNIST_MIRRORS_ENV, "").strip()
    bases = [b.strip() for b in env.split(",") if b.strip()] if env else list(MNIST_MIRRORS)
    return [b if b.endswith("/") else b + "/" for b in bases]


def _mnist_files_in(folder: Path) -> dict[str, Path] | None:
    """Map canonical name -> file (raw preferred over .gz), or None if any is missing."""
    found: dict[str, Path] = {}
    for name in _MNIST_FILES:
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                found[name] = candidate
                break
        else:
            return None
    return found


def _load_mnist(root: str | Path | None, download: bool, progress: bool) -> Dataset:
    searched: list[Path] = []
    files = None
    for r in candidate_roots(root):
        for folder in (r / "mnist", r):
            searched.append(folder)
            files = _mnist_files_in(folder)
            if files is not None:
                break
        if files is not None:
            break

    if files is None:
        missing = (
            "MNIST not found. Expected the 4 files "
            + ", ".join(_MNIST_FILES)
            + " (each raw or gzipped with .gz) together in one of these folders:\n"
            + bullets(searched)
        )
        target = download_root(root) / "mnist"
        if not download:
            raise DataError(
                f"{missing}\nTo fix it: {how_to_point('mnist')}, or allow downloading "
                f"({opt('download', True)}) on a machine with internet access (files go to {target})."
            )
        try:
            _download_mnist(target, progress)
        except DataError as exc:
            raise DataError(
                f"{missing}\nDownloading them into {target} failed:\n{exc}\n"
                f"Alternatively {how_to_point('mnist')}."
            ) from exc
        files = _mnist_files_in(target)
        assert files is not None  # all four were just downloaded

    return cached(("mnist", signature(files.values())), lambda: _read_mnist(files))


def _download_mnist(target: Path, progress: bool) -> None:
    mirrors = _mnist_mirrors()
    for name, md5 in _MNIST_FILES.items():
        if (target / name).is_file() or (target / f"{name}.gz").is_file():
            continue
        download_file(
            [base + f"{name}.gz" for base in mirrors],
            target / f"{name}.gz",
            md5=md5,
            decompressed_md5=True,
            progress=progress,
        )


def _read_mnist(files: dict[str, Path]) -> Dataset:
    def split(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        images_path = files[f"{prefix}-images-idx3-ubyte"]
        labels_path = files[f"{prefix}-labels-idx1-ubyte"]
        images = _read_idx(images_path, (None, 28, 28), _MNIST_FILES[f"{prefix}-images-idx3-ubyte"])
        labels = _read_idx(labels_path, (None,), _MNIST_FILES[f"{prefix}-labels-idx1-ubyte"])
        if len(images) != len(labels):
            raise DataError(
                f"{images_path} holds {len(images)} images but {labels_path} holds "
                f"{len(labels)} labels; replace them with a matching pair."
            )
        if labels.max(initial=0) > 9:
            raise DataError(f"{labels_path} holds labels above 9; replace it with a good copy.")
        x = images.astype(np.float32).reshape(len(images), -1)
        x /= 255.0
        x -= _MNIST_MEAN
        x /= _MNIST_STD
        return to_images(x, (1, 28, 28)), torch.from_numpy(labels.astype(np.int64))

    train_x, train_y = split("train")
    test_x, test_y = split("t10k")
    return Dataset(
        name="mnist",
        train_x=train_x,
        train_y=train_y,
        test_x=test_x,
        test_y=test_y,
        num_classes=10,
        class_names=[str(i) for i in range(10)],
    )


def _read_idx(path: Path, expected_dims: tuple[int | None, ...], md5: str) -> np.ndarray:
    """Parse an unsigned-byte IDX file (raw or .gz) after checking its header, size and MD5.

    Returns a read-only uint8 array of the header's dimensions.
    """
    fix = (
        f"Delete it and run again with downloading allowed ({opt('download', True)}) to "
        "re-download it, "
        "or replace it with a good copy."
    )
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = f.read()
        else:
            data = path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(
            f"Cannot read {path}: {exc}. The file is corrupt or not gzip data. {fix}"
        ) from exc

    ndim = len(expected_dims)
    header = 4 + 4 * ndim
    if len(data) < header or data[0] != 0 or data[1] != 0 or data[2] != 0x08 or data[3] != ndim:
        raise DataError(
            f"{path} is not an unsigned-byte IDX file with {ndim} dimension(s) "
            f"(bad header {data[:4].hex() or '<empty>'}; expected 000008{ndim:02x}). {fix}"
        )
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    if any(want is not None and got != want for got, want in zip(dims, expected_dims)):
        shape = "x".join("N" if d is None else str(d) for d in expected_dims)
        raise DataError(f"{path} has dimensions {dims}, expected {shape}. {fix}")
    expected_size = header + int(np.prod(dims))
    if len(data) != expected_size:
        raise DataError(
            f"{path} holds {len(data)} bytes of IDX data but its header {dims} requires "
            f"{expected_size}: the file is truncated or corrupt. {fix}"
        )
    actual = hashlib.md5(data, usedforsecurity=False).hexdigest()
    if actual != md5:
        what = "decompressed content" if path.name.endswith(".gz") else "content"
        raise DataError(
            f"{path} is corrupt: the MD5 of its {what} is {actual}, expected the canonical "
            f"{md5}. {fix}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)
