"""FEMNIST (LEAF): the writers' JSON files (or the shared 5% sample's archive, extracted once);
standardised with the train split's mean and std; ``train_groups``/``test_groups`` give the writer."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import string
import tarfile
import zlib
from pathlib import Path

import numpy as np
import torch

from fedproto.data.datasets import (
    CLEAR_HOOKS,
    Dataset,
    bullets,
    cached,
    candidate_roots,
    how_to_point,
    signature,
    to_images,
)
from fedproto.data.download import default_cache_dir
from fedproto.errors import DataError

_FEMNIST_ARCHIVE = "femnist-leaf-niid-sf0.05.tar.gz"
_FEMNIST_CLASSES = list(string.digits + string.ascii_uppercase + string.ascii_lowercase)
_FEMNIST_PIXELS = 28 * 28


def load_femnist_files(root: str | Path | None, download: bool, progress: bool) -> Dataset:
    """The registry's loader of ``femnist`` (never downloaded: LEAF's files are built by its scripts)."""
    return _load_femnist(root)


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
            test_x=to_images((x - mean) / std, (1, 28, 28)),
            test_y=torch.from_numpy(y),
            num_classes=len(_FEMNIST_CLASSES),
            class_names=list(_FEMNIST_CLASSES),
            train_groups=np.empty(0, dtype=np.int64),
            test_groups=groups,
            group_names=names,
        )

    return cached(("femnist_unpaired", signature(files)), build)


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
    for r in candidate_roots(root):
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
        f"{_FEMNIST_ARCHIVE}, at:\n{bullets(searched)}\n"
        "FEMNIST has no single canonical download; produce it with LEAF:\n"
        "  git clone https://github.com/TalwalkarLab/leaf && cd leaf/data/femnist\n"
        "  ./preprocess.sh -s niid --sf 0.05 -k 0 -t sample\n"
        "then copy leaf/data/femnist/data/train and .../data/test to <folder>/femnist/train "
        f"and <folder>/femnist/test, and {how_to_point('femnist')}."
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
        f"Cannot extract {archive}: no writable folder.\n{bullets(failures)}\n"
        f"Extract it by hand into <folder>/femnist/ and {how_to_point('femnist')}."
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
            train_x=to_images((train_x - mean) / std, (1, 28, 28)),
            train_y=torch.from_numpy(train_y),
            test_x=to_images((test_x - mean) / std, (1, 28, 28)),
            test_y=torch.from_numpy(test_y),
            num_classes=len(_FEMNIST_CLASSES),
            class_names=list(_FEMNIST_CLASSES),
            train_groups=groups(train_users, train_counts),
            test_groups=groups(test_users, test_counts),
            group_names=names,
        )

    return cached(("femnist", signature(files)), build)


CLEAR_HOOKS.append(_FEMNIST_STATS.clear)
