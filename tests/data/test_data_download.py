"""fedproto.data.download: downloading with mirrors, checksums and clean-up."""

from __future__ import annotations

import gzip
import hashlib
import os
import socket
import stat
from pathlib import Path

import pytest
from conftest import leftovers

from fedproto.data import download as dl
from fedproto.errors import DataError

pytestmark = pytest.mark.usefixtures("private_cache")


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/nothing-listens-here"


def test_default_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert dl.default_cache_dir() == tmp_path / "fedproto"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert dl.default_cache_dir() == Path.home() / ".cache" / "fedproto"


def test_download_file_falls_back_to_next_mirror(http_root, tmp_path: Path) -> None:
    www, base = http_root
    payload = os.urandom(50_000)
    (www / "good").mkdir()
    (www / "good" / "blob.bin").write_bytes(payload)
    dest = tmp_path / "out" / "blob.bin"

    got = dl.download_file(
        [_closed_port_url(), f"{base}/missing/blob.bin", f"{base}/good/blob.bin"],
        dest,
        md5=hashlib.md5(payload).hexdigest(),
        progress=False,
        timeout=5,
    )
    assert got == dest
    assert dest.read_bytes() == payload
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600
    assert leftovers(dest.parent, {"blob.bin"}) == []
    assert dl.md5_of(dest, decompress_gz=False) == hashlib.md5(payload).hexdigest()


def test_download_file_md5_of_decompressed_or_raw(http_root, tmp_path: Path) -> None:
    www, base = http_root
    content = b"fedproto " * 1000
    (www / "f.gz").write_bytes(gzip.compress(content))
    raw_md5 = hashlib.md5((www / "f.gz").read_bytes()).hexdigest()

    url = [f"{base}/f.gz"]
    a = dl.download_file(url, tmp_path / "a" / "f.gz", hashlib.md5(content).hexdigest(), progress=False)
    b = dl.download_file(url, tmp_path / "b" / "f.gz", raw_md5, decompressed_md5=False, progress=False)
    assert gzip.decompress(a.read_bytes()) == content
    assert b.read_bytes() == (www / "f.gz").read_bytes()
    assert dl.md5_of(a, decompress_gz=True) == hashlib.md5(content).hexdigest()


def test_download_file_all_mirrors_fail(http_root, tmp_path: Path) -> None:
    www, base = http_root
    (www / "blob.bin").write_bytes(b"not what was expected")
    dest = tmp_path / "out" / "blob.bin"
    urls = [f"{base}/missing/blob.bin", f"{base}/blob.bin"]

    with pytest.raises(DataError) as info:
        dl.download_file(urls, dest, md5="0" * 32, progress=False)
    msg = str(info.value)
    assert all(u in msg for u in urls)
    assert "404" in msg and "checksum mismatch" in msg
    assert str(dest) in msg  # where to put the file by hand
    assert not dest.exists()
    assert leftovers(dest.parent, set()) == []
    # the folders it made for the file are gone again (an offline run left an empty data/mnist/)
    deep = tmp_path / "new" / "data" / "mnist" / "blob.bin"
    with pytest.raises(DataError):
        dl.download_file(urls, deep, md5="0" * 32, progress=False)
    assert not (tmp_path / "new").exists()


def test_download_file_cleans_up_on_keyboard_interrupt(
    http_root, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    www, base = http_root
    (www / "blob.bin").write_bytes(b"x" * 1000)

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(dl, "md5_of", interrupted)  # the check of the finished download
    dest = tmp_path / "out" / "blob.bin"
    with pytest.raises(KeyboardInterrupt):
        dl.download_file([f"{base}/blob.bin"], dest, md5="0" * 32, progress=False)
    assert not dest.exists()
    assert leftovers(dest.parent, set()) == []
