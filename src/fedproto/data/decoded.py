"""A disk cache of decoded datasets that every process on a machine memory-maps.

Decoding a dataset (MNIST's gzipped IDX files, CIFAR-10's pickles, FEMNIST's JSON) into normalised
``float32`` tensors costs seconds and, per process, the whole decoded size in memory (211 MB for
MNIST). :func:`load_or_decode` decodes a dataset once per machine into a cache entry of ``.npy``
files and returns a :class:`~fedproto.data.datasets.Dataset` whose tensors are memory maps of those
files: the operating system keeps one copy of the pages for every process that maps them (Flower's
simulation actors, worker processes), and a process pays in memory only for the rows it reads.

``load_dataset(name, mapped=True)`` (:func:`fedproto.data.datasets.load_dataset`) goes through
here; every file-based loader is covered, since the cache hooks into the loaders' shared in-process
cache (:func:`fedproto.data.datasets.cached`). The arrays are those the loader decodes, written with
:func:`numpy.save` and read back bit for bit (same dtype, shape and values).

**Where.** An entry is a folder ``<name>-<key>/`` (``key``: the first 16 hex digits of a SHA-256 of
the format version, the dataset name and the source files' signature) in the first of:

1. the folder named by the environment variable ``FEDPROTO_DECODED_CACHE`` (``off``: no cache;
   the loader's arrays are returned as decoded);
2. ``.fedproto-decoded/`` next to the source files (in the folder holding them all), when that
   folder is writable (its permission
   bits grant a write and this user may write there: a folder made read-only stays untouched, even
   for root);
3. ``<user cache>/decoded/`` (:func:`fedproto.data.download.default_cache_dir`:
   ``$XDG_CACHE_HOME/fedproto`` or ``~/.cache/fedproto``).

**Validity.** An entry belongs to the source files it was decoded from: their resolved paths,
sizes and modification times (ns) are part of its key and repeated in its ``meta.json``, which is
compared on every load; a changed source file gives a new key (a new entry). An entry whose files
cannot be read or do not match ``meta.json`` (shape, dtype, and each file's size and modification
time as written: a file rewritten in place, even at the same size, counts as damaged) is decoded
again and replaced, with one warning.

**Concurrency.** Writers serialise on an exclusive lock file (``fcntl.flock``, where the platform
has it) so that processes starting together decode once; the entry is written into a temporary
folder beside it and renamed into place (atomic on one file system), so a reader never sees a
partial entry. Arrays are mapped copy-on-write (``mmap_mode="c"``): a process that writes into a
tensor changes its own copy of the page, never the file or another process's view.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

Dataset = Any
"""A :class:`fedproto.data.datasets.Dataset` (not imported: :mod:`fedproto.data.datasets` imports this module)."""

log = logging.getLogger(__name__)

DECODED_ENV = "FEDPROTO_DECODED_CACHE"
"""Environment variable: the cache folder to use, or ``off`` to decode without a cache."""
FORMAT = 1
"""Version of the entry layout; part of every key."""
NEXT_TO_DATA = ".fedproto-decoded"
"""The cache folder's name beside the source files."""
ARRAYS = ("train_x", "train_y", "test_x", "test_y", "train_groups", "test_groups")


def entry_key(name: str, sources: Sequence[tuple]) -> str:
    """The first 16 hex digits of the SHA-256 of (:data:`FORMAT`, ``name``, ``sources``).

    Args:
        name: the dataset's cache name (e.g. ``"mnist"``).
        sources: the source files' signature, ``(resolved path, size in bytes, mtime in ns)`` per
            file (:func:`fedproto.data.datasets.signature`).
    """
    blob = json.dumps([FORMAT, name, [list(s) for s in sources]])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def writable(folder: Path) -> bool:
    """True when ``folder`` exists, this process may write there, and its permission bits grant a
    write to someone (a folder made read-only, e.g. a shared data folder, counts as not writable
    even for root, who may write anywhere)."""
    try:
        mode = folder.stat().st_mode
    except OSError:
        return False
    return stat.S_ISDIR(mode) and bool(mode & 0o222) and os.access(folder, os.W_OK | os.X_OK)


def cache_root(sources: Sequence[tuple]) -> Path | None:
    """The folder holding the entries for these ``sources`` (module docstring, "Where"); None when
    ``FEDPROTO_DECODED_CACHE=off``."""
    env = os.environ.get(DECODED_ENV, "").strip()
    if env.lower() == "off":
        return None
    if env:
        try:  # absolute: read_rows reads the files by path, also after a chdir
            return Path(env).expanduser().absolute()
        except RuntimeError as e:  # "~user" of a user that does not exist
            from fedproto.errors import DataError

            raise DataError(f"{DECODED_ENV}={env!r}: {e}; give a folder without '~', e.g. an absolute path, "
                            "or off") from None
    try:  # the folder holding every source file (FEMNIST's train/ and test/: the femnist/ folder)
        folder = Path(os.path.commonpath([str(Path(str(s[0])).parent) for s in sources]))
    except ValueError:  # files on different drives
        folder = None
    if folder is not None and writable(folder):
        return folder / NEXT_TO_DATA
    from fedproto.data.download import default_cache_dir

    return default_cache_dir() / "decoded"


def load_or_decode(name: str, sources: Sequence[tuple], decode: Callable[[], Dataset], make: Callable[..., Dataset],
                   child: tuple | None = None) -> Dataset:
    """The dataset decoded by ``decode``, memory-mapped from its cache entry (decoded and written
    first when there is no valid entry).

    Args:
        name: the dataset's cache name.
        sources: the source files' signature (:func:`entry_key`); empty: no files to validate
            against, so no cache (``decode()`` is returned).
        decode: decodes the dataset from its files (the loader's own code).
        make: the dataset type (:class:`~fedproto.data.datasets.Dataset`), built from the mapped arrays.
        child: ``(dataset name, root, download)`` of the :func:`~fedproto.data.datasets.load_dataset`
            call: decode in a child process (``python -m fedproto.data.precache``) when there is no
            entry yet, so that this process never holds the decoded arrays; None: decode here.
    Returns:
        The :class:`~fedproto.data.datasets.Dataset`; its tensors are read-only memory maps (copy
        on write) of the entry's ``.npy`` files, equal bit for bit to ``decode()``'s. When the
        entry cannot be written (no writable cache folder, a full disk), the decoded dataset itself,
        after a warning naming the folder and :data:`DECODED_ENV`.
    Raises:
        Whatever ``decode`` raises (e.g. :class:`~fedproto.errors.DataError` for a corrupt file).
    """
    root = cache_root(sources) if sources else None
    if root is None:
        return decode()
    entry = root / f"{name}-{entry_key(name, sources)}"
    found = _read(entry, sources, make)
    if found is not None:
        return found
    if child is not None:
        found = _decode_in_child(child, entry, sources, make)
        if found is not None:
            return found
    with contextlib.ExitStack() as stack:
        try:
            root.mkdir(parents=True, exist_ok=True)
            stack.enter_context(_locked(root / f".{entry.name}.lock"))
        except OSError as e:
            return _uncached(name, root, e, decode)
        # another process wrote it while this one waited for the lock (the damage, if any, was reported above)
        found = _read(entry, sources, make, warn=False)
        if found is not None:
            return found
        ds = decode()
        try:
            _write(entry, ds, sources)
        except OSError as e:
            return _uncached(name, root, e, lambda: ds)
    found = _read(entry, sources, make)
    return found if found is not None else ds


_FILES: dict[int, tuple[str, int, np.ndarray]] = {}
"""data pointer of a mapped tensor -> (its .npy file, the offset of its data, the memory map)."""


def read_rows(x: torch.Tensor, idx: np.ndarray | torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Rows ``idx`` of ``x`` as a new tensor: ``x[idx]``, equal bit for bit. For a tensor mapped from
    the cache (:func:`load_or_decode`) the rows are read from its file (``os.pread``, one call per run
    of consecutive rows) instead of through the memory map: the operating system's page cache holds
    the file once for every process, and this process holds only the rows it asked for (a gather
    through a memory map would also map the pages around each row, 64 KiB per fault on Linux, into the
    process).

    Args:
        x: (N, ...) tensor, e.g. a dataset's ``train_x`` (N, C, H, W) float32.
        idx: (n,) integer row indices in ``0..N-1`` (numpy or torch).
    Returns:
        (n, ...) tensor of ``x``'s dtype, in the order of ``idx``.
    Raises:
        IndexError: an index outside ``0..N-1``.
    """
    idx = np.asarray(torch.as_tensor(idx, dtype=torch.long).cpu())
    src = _FILES.get(x.data_ptr()) if x.device.type == "cpu" and x.is_contiguous() else None
    if src is None or src[2].shape != tuple(x.shape):
        return x[torch.as_tensor(idx)]
    if len(idx) and (idx.min() < 0 or idx.max() >= len(x)):
        raise IndexError(f"row indices {int(idx.min())}..{int(idx.max())} outside 0..{len(x) - 1}")
    path, offset, _ = src
    row = int(np.prod(x.shape[1:], dtype=np.int64)) * x.element_size()
    order = np.unique(idx)
    out = np.empty((len(order), *x.shape[1:]), dtype=src[2].dtype)
    flat = out.reshape(len(order), row // x.element_size()).view(np.uint8)
    starts = np.flatnonzero(np.diff(order, prepend=-2) != 1)  # the first row of each run of consecutive rows
    ends = np.append(starts[1:], len(order))
    fd = os.open(path, os.O_RDONLY)
    try:
        for a, b in zip(starts, ends):
            want = (b - a) * row
            buf = os.pread(fd, want, offset + int(order[a]) * row)
            if len(buf) != want:
                raise OSError(f"{path} is shorter than its header says; delete its folder to decode it again")
            flat[a:b] = np.frombuffer(buf, dtype=np.uint8).reshape(b - a, row)
    finally:
        os.close(fd)
    return torch.from_numpy(out[np.searchsorted(order, idx)])


def _decode_in_child(call: tuple, entry: Path, sources: Sequence[tuple],
                     make: Callable[..., Dataset]) -> Dataset | None:
    """Run ``python -m fedproto.data.precache`` for ``call`` (name, root, download); the entry it wrote,
    or None when it failed (the caller decodes itself, raising the loader's own error)."""
    import subprocess

    name, root, download = call
    args = [sys.executable, "-m", "fedproto.data.precache", name, *(["--root", root] if root else []),
            *([] if download else ["--no-download"])]
    res = subprocess.run(args, capture_output=True, text=True)
    if res.returncode != 0:
        log.warning("fedproto: decoding %s in a child process failed (%s); decoding it here", name,
                    (res.stderr or res.stdout).strip()[-500:])
        return None
    return _read(entry, sources, make)


def _uncached(name: str, root: Path, error: OSError, decode: Callable[[], Dataset]) -> Dataset:
    log.warning("fedproto: cannot write the decoded %s into %s (%s); using it decoded in this process only (set "
                "%s to a writable folder to share one copy between processes)", name, root, error, DECODED_ENV)
    return decode()


def _stamp(path: Path) -> list[int]:
    """``[size in bytes, modification time in ns]`` of a file."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _read(entry: Path, sources: Sequence[tuple], make: Callable[..., Dataset], warn: bool = True) -> Dataset | None:
    """The mapped dataset of ``entry`` if it is complete, unchanged since it was written, and
    belongs to ``sources``, else None (with a warning naming why, unless ``warn`` is False)."""
    meta_path = entry / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("arrays"), dict):
            raise ValueError("meta.json is not an object with an 'arrays' object")
        if meta.get("format") != FORMAT or meta.get("sources") != [list(s) for s in sources]:
            if warn:
                log.warning("fedproto: ignoring the decoded-dataset cache entry %s: it belongs to other source files",
                            entry)
            return None
        arrays = {}
        stamps = meta.get("files", {})  # entries written before the stamps were kept have none
        for k, (shape, dtype) in meta["arrays"].items():
            now = _stamp(entry / f"{k}.npy") if k in stamps else None
            if now is not None and now != stamps[k]:
                raise ValueError(f"{k}.npy was changed after it was written (size, modification time: "
                                 f"{now}, meta.json says {stamps[k]})")
            a = np.load(entry / f"{k}.npy", mmap_mode="c", allow_pickle=False)
            if list(a.shape) != shape or str(a.dtype) != dtype:
                raise ValueError(f"{k}.npy holds {a.dtype} {a.shape}, meta.json says {dtype} {shape}")
            arrays[k] = a
        tensors = {k: torch.from_numpy(arrays[k]) for k in ARRAYS[:4]}
        for k, t in tensors.items():
            if t.numel():
                _FILES[t.data_ptr()] = (str(entry / f"{k}.npy"), int(arrays[k].offset), arrays[k])
        return make(name=meta["name"], num_classes=int(meta["num_classes"]), class_names=list(meta["class_names"]),
                       train_groups=arrays.get("train_groups"), test_groups=arrays.get("test_groups"),
                       group_names=meta.get("group_names"), **tensors)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        if warn:
            log.warning("fedproto: the decoded-dataset cache entry %s cannot be read (%s: %s); decoding again",
                        entry, type(e).__name__, str(e)[:200])
        return None


def _write(entry: Path, ds: Dataset, sources: Sequence[tuple]) -> None:
    """Write ``ds`` as ``entry`` (a temporary folder renamed into place; an old entry is replaced)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
    try:
        arrays: dict[str, list] = {}
        stamps: dict[str, list[int]] = {}
        for k in ARRAYS:
            v = getattr(ds, k)
            if v is None:
                continue
            a = v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
            with open(tmp / f"{k}.npy", "wb") as f:
                np.save(f, np.ascontiguousarray(a), allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
            arrays[k] = [list(a.shape), str(a.dtype)]
            stamps[k] = _stamp(tmp / f"{k}.npy")  # a rename keeps both
        meta = {"format": FORMAT, "name": ds.name, "num_classes": ds.num_classes, "class_names": list(ds.class_names),
                "group_names": ds.group_names, "arrays": arrays, "sources": [list(s) for s in sources], "files": stamps}
        (tmp / "meta.json").write_text(json.dumps(meta))
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700: other users of a shared cache folder read it too
        if entry.exists():  # an unreadable or foreign entry: move it aside, then drop it
            old = Path(tempfile.mkdtemp(prefix=f".{entry.name}.old-", dir=entry.parent))
            os.replace(entry, old / "entry")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` (``fcntl.flock``; none where the platform lacks it)."""
    try:
        import fcntl
    except ImportError:  # Windows: the atomic rename alone keeps readers safe
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


__all__ = ["DECODED_ENV", "FORMAT", "NEXT_TO_DATA", "cache_root", "entry_key", "load_or_decode", "read_rows",
           "writable"]
