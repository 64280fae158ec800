"""Atomic file writes: a same-folder temp file, fsynced, renamed over the target; an interrupted
write never leaves a half-written file. A leaf module: it imports nothing of fedproto."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` atomically: ``write(f)`` fills a same-folder temp file, which is fsynced,
    given the usual permissions and renamed over ``path``; on any error it is removed.

    Raises whatever ``write`` raises, and ``OSError`` when the folder cannot be written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_write`)."""
    atomic_write(path, lambda f: f.write(data))


def outermost_new(path: str | Path) -> Path:
    """The outermost folder that creating ``path`` would create (``path`` itself when its parent
    exists), absolute, with ``..`` resolved by name (``os.path.abspath``: ``new/../run`` is ``run``)."""
    top = Path(os.path.abspath(path))
    while not top.parent.exists():
        top = top.parent
    return top


def remove_empty_folders(path: str | Path, top: Path) -> None:
    """Remove ``path`` and its parents up to ``top`` (from :func:`outermost_new`), as far as they are
    empty: a set-up that failed leaves no folder it created, and never removes a file."""
    d = Path(os.path.abspath(path))
    while True:
        try:
            d.rmdir()  # only when empty
        except OSError:
            return
        if d == top or d.parent == d:
            return
        d = d.parent
