"""Dataset loading: MNIST, scikit-learn digits, FEMNIST (LEAF) and CIFAR-10.

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

import gzip
import hashlib
import importlib
import json
import os
import pickle
import secrets
import shutil
import stat
import string
import tarfile
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from fedproto.data.download import default_cache_dir, download_file
from fedproto.data.registry import DATASETS, LOADABLE
from fedproto.errors import DataError, opt

__all__ = [
    "CIFAR10_MD5",
    "CIFAR10_URLS",
    "DATA_ENV",
    "KNOWN_DATASETS",
    "MNIST_MIRRORS",
    "MNIST_MIRRORS_ENV",
    "Dataset",
    "clear_dataset_cache",
    "load_dataset",
    "load_femnist_unpaired",
]

DATA_ENV = "FEDPROTO_DATA"
"""Environment variable naming a data folder, searched after the explicit ``root``."""

KNOWN_DATASETS = LOADABLE
"""Names :func:`load_dataset` accepts (from :mod:`fedproto.data.registry`)."""

# --- MNIST -------------------------------------------------------------------------------

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

# --- CIFAR-10 ----------------------------------------------------------------------------

CIFAR10_URLS: tuple[str, ...] = ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",)
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
"""Published MD5 of the archive; checked only on freshly downloaded archives."""

_CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
_CIFAR10_DIR = "cifar-10-batches-py"
_CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR10_MEMBERS = (*_CIFAR10_TRAIN, "test_batch", "batches.meta")
_CIFAR10_MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)
_CIFAR10_STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)

# --- FEMNIST -----------------------------------------------------------------------------

_FEMNIST_ARCHIVE = "femnist-leaf-niid-sf0.05.tar.gz"
_FEMNIST_CLASSES = list(string.digits + string.ascii_uppercase + string.ascii_lowercase)
_FEMNIST_PIXELS = 28 * 28


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


# --- public entry points -----------------------------------------------------------------


def load_dataset(
    name: str,
    root: str | Path | None = None,
    download: bool = True,
    progress: bool = True,
) -> Dataset:
    """Load a dataset by name, from disk (downloading if allowed) or from the in-process cache.

    Args:
        name: ``"mnist"``, ``"digits"``, ``"femnist"`` or ``"cifar10"`` (case-insensitive).
        root: data folder searched first; also where MNIST/CIFAR-10 are downloaded to (into
            ``<root>/mnist/`` or ``<root>/cifar10/``). Then ``$FEDPROTO_DATA`` and the cache
            folder are searched.
        download: download MNIST/CIFAR-10 when no searched folder holds them.
        progress: show a progress bar while downloading (only on a terminal).

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
    if key in LOADABLE:
        return globals()[DATASETS[key].loader](root, download, progress)
    raise DataError(f"Unknown dataset {name!r}. Known datasets: {', '.join(KNOWN_DATASETS)}.")


def load_mnist_files(root: str | Path | None, download: bool, progress: bool) -> Dataset:
    """The registry's loader of ``mnist`` (:data:`fedproto.data.registry.Loader`)."""
    return _load_mnist(root, download, progress)


def load_digits_bundled(root: str | Path | None, download: bool, progress: bool) -> Dataset:
    """The registry's loader of ``digits``: scikit-learn's bundled 8x8 digits (``root`` unused)."""
    return _cached(("digits",), _load_digits)


def load_femnist_files(root: str | Path | None, download: bool, progress: bool) -> Dataset:
    """The registry's loader of ``femnist`` (never downloaded: LEAF's files are built by its scripts)."""
    return _load_femnist(root)


def load_cifar10_files(root: str | Path | None, download: bool, progress: bool) -> Dataset:
    """The registry's loader of ``cifar10``."""
    return _load_cifar10(root, download, progress)


def load_femnist_unpaired(root: str | Path | None = None) -> Dataset:
    """Load FEMNIST's unpaired writers: test data only, for tests of new clients joining.

    Reads ``test_unpaired/*.json`` next to the ``train/`` and ``test/`` folders found as in
    :func:`load_dataset` ("femnist"). Normalized with the main train set's mean/std.

    Returns:
        A :class:`Dataset` named ``"femnist_unpaired"`` with empty ``train_x`` ``(0, 1, 28, 28)``
        / ``train_y``; ``test_groups`` index into ``group_names`` (these writers only).

    Raises:
        DataError: FEMNIST not found, has no ``test_unpaired/`` folder, or is malformed.
    """
    folder = find_femnist(root)
    unpaired = folder / "test_unpaired"
    files = sorted(unpaired.glob("*.json")) if unpaired.is_dir() else []
    if not files:
        raise DataError(
            f"No FEMNIST unpaired writers: expected {unpaired}/*.json next to {folder}/train "
            f"and {folder}/test. These are writers with test data only; put their LEAF JSON "
            f"files there (the shared copy's archive {_FEMNIST_ARCHIVE} includes them)."
        )

    def build() -> Dataset:
        mean, std = _femnist_stats(folder)
        x, y, users, counts = _read_leaf_split(unpaired)
        names = sorted(set(users))
        index = {u: i for i, u in enumerate(names)}
        groups = np.repeat(np.array([index[u] for u in users], dtype=np.int64), counts)
        return Dataset(
            name="femnist_unpaired",
            train_x=torch.empty((0, 1, 28, 28), dtype=torch.float32),
            train_y=torch.empty(0, dtype=torch.int64),
            test_x=_to_images((x - mean) / std, (1, 28, 28)),
            test_y=torch.from_numpy(y),
            num_classes=len(_FEMNIST_CLASSES),
            class_names=list(_FEMNIST_CLASSES),
            train_groups=np.empty(0, dtype=np.int64),
            test_groups=groups,
            group_names=names,
        )

    return _cached(("femnist_unpaired", _signature(files)), build)


def clear_dataset_cache() -> None:
    """Forget all datasets kept by the in-process cache."""
    _CACHE.clear()
    _FEMNIST_STATS.clear()


# --- shared helpers ----------------------------------------------------------------------

_CACHE: OrderedDict[tuple, Dataset] = OrderedDict()
_CACHE_SIZE = 8


def _cached(key: tuple, build: Callable[[], Dataset]) -> Dataset:
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    dataset = build()
    _CACHE[key] = dataset
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return dataset


def _signature(paths: Iterable[Path]) -> tuple:
    """Identify a set of files by resolved path, size and mtime (for the cache key)."""
    out = []
    for p in paths:
        st = p.stat()
        out.append((str(p.resolve()), st.st_size, st.st_mtime_ns))
    return tuple(out)


def _candidate_roots(root: str | Path | None) -> list[Path]:
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


def _download_root(root: str | Path | None) -> Path:
    return Path(root).expanduser() if root is not None else default_cache_dir()


def _bullets(paths: Iterable[Path | str]) -> str:
    return "\n".join(f"  - {p}" for p in paths)


def _to_images(x: np.ndarray, shape: tuple[int, int, int]) -> torch.Tensor:
    """Flat float array ``(N, C*H*W)`` -> contiguous float32 tensor ``(N, C, H, W)``."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, *shape)
    return torch.from_numpy(x)


def _how_to_point(name: str) -> str:
    return (
        f"pass {opt('data_dir', '<folder>')} (load_dataset: root=<folder>; files in <folder>/{name}/) "
        f"or set {DATA_ENV}=<folder>"
    )


# --- MNIST -------------------------------------------------------------------------------


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
    for r in _candidate_roots(root):
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
            + _bullets(searched)
        )
        target = _download_root(root) / "mnist"
        if not download:
            raise DataError(
                f"{missing}\nTo fix it: {_how_to_point('mnist')}, or allow downloading "
                f"({opt('download', True)}) on a machine with internet access (files go to {target})."
            )
        try:
            _download_mnist(target, progress)
        except DataError as exc:
            raise DataError(
                f"{missing}\nDownloading them into {target} failed:\n{exc}\n"
                f"Alternatively {_how_to_point('mnist')}."
            ) from exc
        files = _mnist_files_in(target)
        assert files is not None  # all four were just downloaded

    return _cached(("mnist", _signature(files.values())), lambda: _read_mnist(files))


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
        return _to_images(x, (1, 28, 28)), torch.from_numpy(labels.astype(np.int64))

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


# --- digits ------------------------------------------------------------------------------


def _load_digits() -> Dataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = x.astype(np.float32) / 16.0
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.3, stratify=y, random_state=0
    )
    mean, std = x_train.mean(), x_train.std()
    return Dataset(
        name="digits",
        train_x=_to_images((x_train - mean) / std, (1, 8, 8)),
        train_y=torch.from_numpy(y_train.astype(np.int64)),
        test_x=_to_images((x_test - mean) / std, (1, 8, 8)),
        test_y=torch.from_numpy(y_test.astype(np.int64)),
        num_classes=10,
        class_names=[str(i) for i in range(10)],
    )


# --- FEMNIST -----------------------------------------------------------------------------

_FEMNIST_STATS: dict[str, tuple[float, float]] = {}


def _leaf_dir(folder: Path) -> Path | None:
    """``folder`` if it holds ``train/*.json`` and ``test/*.json``, else None."""
    for split in ("train", "test"):
        d = folder / split
        if not d.is_dir() or next(d.glob("*.json"), None) is None:
            return None
    return folder


def find_femnist(root: str | Path | None) -> Path:
    """Return the folder holding FEMNIST's ``train/`` and ``test/`` JSON folders (LEAF's layout).

    Looks in ``root`` (else ``FEDPROTO_DATA``, else the cache folder) for ``femnist/`` or
    ``femnist/femnist/``, else for LEAF's archive in ``femnist/``, which it extracts once: next to
    the archive, or into the cache folder (:func:`fedproto.data.download.default_cache_dir`) when
    that folder is read-only.

    Args:
        root: the data folder, or None for the default places.

    Returns:
        The folder whose ``train/`` and ``test/`` hold the JSON files.

    Raises:
        DataError: no FEMNIST folder nor archive in any place searched (names each, and how to make it).
    """
    searched: list[Path] = []
    for r in _candidate_roots(root):
        base = r / "femnist"
        for folder in (base, base / "femnist"):
            searched.append(folder / "{train,test}/*.json")
            if _leaf_dir(folder) is not None:
                return folder
        archive = base / _FEMNIST_ARCHIVE
        searched.append(archive)
        if archive.is_file():
            return _extract_femnist(archive)
    raise DataError(
        "FEMNIST not found. Looked for LEAF JSON folders train/ and test/, or the archive "
        f"{_FEMNIST_ARCHIVE}, at:\n{_bullets(searched)}\n"
        "FEMNIST has no single canonical download; produce it with LEAF:\n"
        "  git clone https://github.com/TalwalkarLab/leaf && cd leaf/data/femnist\n"
        "  ./preprocess.sh -s niid --sf 0.05 -k 0 -t sample\n"
        "then copy leaf/data/femnist/data/train and .../data/test to <folder>/femnist/train "
        f"and <folder>/femnist/test, and {_how_to_point('femnist')}."
    )


def _extract_femnist(archive: Path) -> Path:
    """Extract the archive once (atomically) next to it, else into the cache folder."""
    name = archive.name.removesuffix(".tar.gz")
    bases = [archive.parent, default_cache_dir() / "femnist"]
    for base in bases:
        for folder in (base / name / "femnist", base / name):
            if _leaf_dir(folder) is not None:
                return folder

    failures: list[str] = []
    for base in bases:
        if base == archive.parent and not _looks_writable(base):
            failures.append(f"{base}: read-only")
            continue
        try:
            base.mkdir(parents=True, exist_ok=True)
            tmp = base / f".{name}.{secrets.token_hex(6)}.extracting"
            tmp.mkdir()  # not mkdtemp: keep the usual umask permissions on the final folder
        except OSError as exc:
            failures.append(f"{base}: {exc}")
            continue
        final = base / name
        try:
            _safe_extract(archive, tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():  # not a concurrent extraction winning the race
                    raise
        except (OSError, EOFError, zlib.error, tarfile.TarError) as exc:
            raise DataError(
                f"Cannot extract {archive} into {base}: {exc}. If the archive is corrupt, "
                f"replace it with a good copy (or the extracted train/ and test/ folders)."
            ) from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for folder in (final / "femnist", final):
            if _leaf_dir(folder) is not None:
                return folder
        raise DataError(
            f"{archive} does not hold FEMNIST's femnist/train/*.json and femnist/test/*.json "
            f"(extracted to {final}). Replace it with the LEAF archive or the JSON folders."
        )
    raise DataError(
        f"Cannot extract {archive}: no writable folder.\n{_bullets(failures)}\n"
        f"Extract it by hand into <folder>/femnist/ and {_how_to_point('femnist')}."
    )


def _looks_writable(folder: Path) -> bool:
    """Whether ``folder`` is writable *and* meant to be: a folder without any write
    permission bit counts as read-only even for root (who could write to it anyway)."""
    try:
        mode = folder.stat().st_mode
    except OSError:
        return False
    return bool(mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)) and os.access(
        folder, os.W_OK | os.X_OK
    )


def _safe_extract(archive: Path, dest: Path) -> None:
    with tarfile.open(archive, "r:*") as tf:
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, filter="data")
            return
        members = []  # Python without extraction filters: allow plain files/dirs inside dest
        for m in tf.getmembers():
            parts = Path(m.name).parts
            if Path(m.name).is_absolute() or ".." in parts or not (m.isfile() or m.isdir()):
                raise tarfile.TarError(f"unsafe archive member {m.name!r}")
            members.append(m)
        tf.extractall(dest, members=members)


def _read_leaf_split(folder: Path) -> tuple[np.ndarray, np.ndarray, list[str], list[int]]:
    """Read LEAF ``*.json`` files in ``folder``.

    Returns ``x`` (N, 784) float32, ``y`` (N,) int64, the users in order and their sample
    counts (so ``np.repeat(users, counts)`` gives the per-sample writer).
    """
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    users: list[str] = []
    counts: list[int] = []
    for path in sorted(folder.glob("*.json")):
        try:
            blob = json.loads(path.read_bytes())
            for user in blob["users"]:
                data = blob["user_data"][user]
                x = np.asarray(data["x"], dtype=np.float32)
                y = np.asarray(data["y"], dtype=np.int64)
                if x.ndim != 2 or x.shape[1] != _FEMNIST_PIXELS or y.shape != (len(x),):
                    raise ValueError(
                        f"user {user!r}: x must be (n, {_FEMNIST_PIXELS}) and y (n,), got "
                        f"{x.shape} and {y.shape}"
                    )
                if len(y) and (y.min() < 0 or y.max() >= len(_FEMNIST_CLASSES)):
                    last = len(_FEMNIST_CLASSES) - 1
                    raise ValueError(f"user {user!r}: labels outside 0..{last}")
                xs.append(x)
                ys.append(y)
                users.append(str(user))
                counts.append(len(y))
        except (OSError, ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
            raise DataError(
                f"{path} is not a valid LEAF FEMNIST JSON file ({exc}). Replace it with a "
                "good copy (regenerate with LEAF: "
                "./preprocess.sh -s niid --sf 0.05 -k 0 -t sample)."
            ) from exc
    if not xs:
        raise DataError(f"No samples in {folder}/*.json; replace the folder with LEAF's output.")
    x = np.concatenate(xs)
    if not np.isfinite(x).all():
        raise DataError(f"{folder}/*.json holds non-finite pixel values (NaN or inf); "
                        "replace the files with LEAF's output.")
    return x, np.concatenate(ys), users, counts


def _femnist_stats(folder: Path) -> tuple[float, float]:
    """Mean and std of all train pixels (computed once per folder)."""
    key = str(folder.resolve())
    if key not in _FEMNIST_STATS:
        x, _, _, _ = _read_leaf_split(folder / "train")
        _FEMNIST_STATS[key] = _pixel_stats(x)
    return _FEMNIST_STATS[key]


def _pixel_stats(x: np.ndarray) -> tuple[float, float]:
    return float(x.mean(dtype=np.float64)), float(x.std(dtype=np.float64))


def _load_femnist(root: str | Path | None) -> Dataset:
    folder = find_femnist(root)
    files = sorted(folder.glob("train/*.json")) + sorted(folder.glob("test/*.json"))

    def build() -> Dataset:
        train_x, train_y, train_users, train_counts = _read_leaf_split(folder / "train")
        test_x, test_y, test_users, test_counts = _read_leaf_split(folder / "test")
        mean, std = _pixel_stats(train_x)
        _FEMNIST_STATS[str(folder.resolve())] = (mean, std)
        names = sorted(set(train_users) | set(test_users))
        index = {u: i for i, u in enumerate(names)}

        def groups(users: list[str], counts: list[int]) -> np.ndarray:
            return np.repeat(np.array([index[u] for u in users], dtype=np.int64), counts)

        return Dataset(
            name="femnist",
            train_x=_to_images((train_x - mean) / std, (1, 28, 28)),
            train_y=torch.from_numpy(train_y),
            test_x=_to_images((test_x - mean) / std, (1, 28, 28)),
            test_y=torch.from_numpy(test_y),
            num_classes=len(_FEMNIST_CLASSES),
            class_names=list(_FEMNIST_CLASSES),
            train_groups=groups(train_users, train_counts),
            test_groups=groups(test_users, test_counts),
            group_names=names,
        )

    return _cached(("femnist", _signature(files)), build)


# --- CIFAR-10 ----------------------------------------------------------------------------


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
    for r in _candidate_roots(root):
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
            + _bullets(searched)
        )
        target = _download_root(root) / "cifar10" / _CIFAR10_ARCHIVE
        if not download:
            raise DataError(
                f"{missing}\nTo fix it: {_how_to_point('cifar10')}, or allow downloading "
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
    return _cached(("cifar10", _signature(files)), lambda: _read_cifar10(source))


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
