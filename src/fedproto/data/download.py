"""Downloading dataset files: mirrors, checksums, atomic writes.

A download is written to a hidden temporary file in the destination folder and moved into
place with :func:`os.replace` only after its checksum verifies, so an interrupted, failed or
corrupt download never leaves a file at the destination (nor a stray temporary file).
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import secrets
import urllib.error
import urllib.request
import zlib
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from fedproto.errors import DataError

__all__ = ["default_cache_dir", "download_file", "md5_of"]

_CHUNK = 1 << 20  # 1 MiB
_USER_AGENT = "fedproto-downloader/0.1 (+python-urllib)"


def default_cache_dir() -> Path:
    """Return the per-user cache folder for fedproto data.

    ``$XDG_CACHE_HOME/fedproto`` when ``XDG_CACHE_HOME`` is set and non-empty, else
    ``~/.cache/fedproto``. The folder is not created.
    """
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "fedproto"


def md5_of(path: str | Path, decompress_gz: bool) -> str:
    """Return the hex MD5 digest of a file, read in 1 MiB chunks.

    Args:
        path: the file to hash.
        decompress_gz: hash the gzip-decompressed content instead of the raw bytes.

    Raises:
        OSError: the file cannot be read, or (``decompress_gz``) is not valid gzip data
            (:class:`gzip.BadGzipFile`, a subclass of ``OSError``).
        EOFError, zlib.error: (``decompress_gz``) the gzip stream is truncated or corrupt.
    """
    digest = hashlib.md5(usedforsecurity=False)
    opener = gzip.open if decompress_gz else open
    with opener(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class _ChecksumMismatch(Exception):
    """A downloaded file's content does not match the expected MD5."""


def _progress_bar(enabled: bool) -> Progress:
    console = Console(stderr=True)
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not (enabled and console.is_terminal),
    )


def _fetch(url: str, tmp: Path, timeout: float, progress: Progress, label: str) -> None:
    """Stream ``url`` into ``tmp``; raise on HTTP errors and truncated bodies."""
    request = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        length = response.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
        task = progress.add_task(label, total=total)
        received = 0
        try:
            with open(tmp, "wb") as out:
                while chunk := response.read(_CHUNK):
                    out.write(chunk)
                    received += len(chunk)
                    progress.update(task, advance=len(chunk))
        finally:
            progress.remove_task(task)
    if total is not None and received != total:
        raise http.client.IncompleteRead(b"", total - received)


def _verify(tmp: Path, md5: str, decompress: bool) -> None:
    what = "MD5 of the decompressed content" if decompress else "MD5"
    try:
        actual = md5_of(tmp, decompress_gz=decompress)
    except (OSError, EOFError, zlib.error) as exc:
        raise _ChecksumMismatch(
            f"checksum could not be verified: not a valid gzip file ({exc})"
        ) from exc
    if actual.lower() != md5.lower():
        raise _ChecksumMismatch(f"checksum mismatch: expected {what} {md5}, got {actual}")


def download_file(
    urls: list[str],
    dest: Path,
    md5: str | None,
    decompressed_md5: bool = True,
    progress: bool = True,
    timeout: float = 30,
) -> Path:
    """Download one file, trying each mirror URL in order, and verify its checksum.

    The file is streamed into a hidden temporary file in ``dest``'s folder (created if
    needed) and moved to ``dest`` only once its checksum matches. On any failure, including
    ``KeyboardInterrupt``, the temporary file is removed and ``dest`` is left untouched.
    A mirror whose file fails the checksum counts as failed and the next one is tried.

    Args:
        urls: full URLs of the same file, tried in order.
        dest: where the verified file is placed.
        md5: expected hex MD5, or ``None`` to skip verification.
        decompressed_md5: when ``dest`` ends in ``.gz``, ``md5`` is of the decompressed
            content (as for MNIST); set False to check the raw bytes (e.g. a ``.tar.gz``
            archive whose published checksum is of the archive itself).
        progress: show a rich progress bar on stderr (only when stderr is a terminal).
        timeout: socket timeout in seconds for connecting and for each read.

    Returns:
        ``dest``.

    Raises:
        DataError: every mirror failed (the message lists each URL with its error and
            where to place the file by hand), or ``dest``'s folder cannot be written. The
            folders the call created are removed again when nothing landed in them.
    """
    dest = Path(dest)
    if not urls:
        raise DataError(f"No download URL given for {dest.name}; place the file at {dest} by hand.")
    from fedproto.outputs.atomic import outermost_new, remove_empty_folders

    new = None if dest.parent.exists() else outermost_new(dest.parent)  # removed again if nothing lands in it
    try:
        return _download(urls, dest, md5, decompressed_md5, progress, timeout)
    except BaseException:
        if new is not None:
            remove_empty_folders(dest.parent, new)
        raise


def _download(urls: list[str], dest: Path, md5: str | None, decompressed_md5: bool, progress: bool,
              timeout: float) -> Path:
    """:func:`download_file` after its checks (the folder it creates is its caller's to remove)."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(
            f"Cannot create the folder {dest.parent} to download {dest.name} into ({exc}). "
            f"Choose a writable data folder (root=... or FEDPROTO_DATA) or download the file "
            f"by hand from {urls[0]} and place it at {dest}."
        ) from exc
    decompress = decompressed_md5 and dest.name.endswith(".gz")
    failures: list[tuple[str, str]] = []

    with _progress_bar(progress) as bar:
        for url in urls:
            # A unique hidden name; touch() (unlike mkstemp) keeps the usual umask permissions.
            tmp = dest.parent / f".{dest.name}.{secrets.token_hex(6)}.part"
            try:
                tmp.touch(exist_ok=False)
            except OSError as exc:
                raise DataError(
                    f"Cannot write a temporary file in {dest.parent} to download {dest.name} "
                    f"({exc}). Choose a writable data folder (root=... or FEDPROTO_DATA) or "
                    f"download the file by hand from {url} and place it at {dest}."
                ) from exc
            try:
                _fetch(url, tmp, timeout, bar, dest.name)
                if md5 is not None:
                    _verify(tmp, md5, decompress)
                os.replace(tmp, dest)
                return dest
            except (
                urllib.error.URLError,
                http.client.HTTPException,
                OSError,  # includes TimeoutError, ConnectionError
                ValueError,  # malformed URL
                _ChecksumMismatch,
            ) as exc:
                failures.append((url, _describe(exc)))
            finally:
                # Reached on success (already moved: no-op), on the failures above, and on
                # anything else (KeyboardInterrupt, ...) which then propagates.
                tmp.unlink(missing_ok=True)

    tried = "\n".join(f"  - {url}: {err}" for url, err in failures)
    raise DataError(
        f"Could not download {dest.name}; every mirror failed:\n{tried}\n"
        f"To fix it: download the file by other means (one of the URLs above) and place it "
        f"at {dest}, or point the library at a folder that already holds it."
    )


def _describe(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return f"connection failed ({exc.reason})"
    if isinstance(exc, http.client.IncompleteRead):
        return f"connection closed early ({exc.expected} bytes missing)"
    return str(exc) or type(exc).__name__
