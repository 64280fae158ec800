"""Atomic file writes: a same-folder temp file, fsynced, renamed over the target; an interrupted
write never leaves a half-written file. A leaf module: it imports nothing of fedproto."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

PRIVATE_FILE = 0o600
"""Mode of a file that holds a model, prototypes or embeddings (``private=True``): its owner's alone."""
PRIVATE_FOLDER = 0o700
"""Mode of the folder such a file is written into."""


def make_private_folder(folder: str | Path) -> Path:
    """Create ``folder`` (and its parents) if needed and make it ``0700`` (:data:`PRIVATE_FOLDER`): what
    a model or prototypes are written into is readable by its owner alone. Returns the folder.

    Raises:
        OSError: it cannot be created or its mode cannot be set (another user's folder).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=PRIVATE_FOLDER)
    if folder.stat().st_mode & 0o777 != PRIVATE_FOLDER:
        os.chmod(folder, PRIVATE_FOLDER)
    return folder


def make_private_tree(folder: str | Path) -> None:
    """``folder`` and every folder in it ``0700``, every file in it ``0600`` (a run folder that holds what
    nodes sent, also files other code wrote into it); symbolic links are left alone. Never raises."""
    for root, _dirs, files in os.walk(folder):
        for name, mode in [(root, PRIVATE_FOLDER), *((os.path.join(root, f), PRIVATE_FILE) for f in files)]:
            try:
                if not os.path.islink(name) and os.stat(name).st_mode & 0o777 != mode:
                    os.chmod(name, mode)
            except OSError:
                pass


def atomic_write(path: Path, write: Callable[[BinaryIO], object], private: bool = False) -> None:
    """Write ``path`` atomically: ``write(f)`` fills a same-folder temp file, which is fsynced,
    given the usual permissions and renamed over ``path``; on any error it is removed.

    Args:
        path: the file. write: fills the open binary file (what it returns is ignored).
        private: the file holds a model, prototypes or embeddings: it is ``0600`` (:data:`PRIVATE_FILE`)
            from its creation on, in a ``0700`` folder (:func:`make_private_folder`).
    Raises whatever ``write`` raises, and ``OSError`` when the folder cannot be written.
    """
    path = Path(path)
    if private:
        make_private_folder(path.parent)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if not private:  # mkstemp creates 0600: a private file keeps it, others get the usual permissions
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: Path, data: bytes, private: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_write`; ``private``: 0600 in a 0700 folder)."""
    atomic_write(path, lambda f: f.write(data), private)


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
