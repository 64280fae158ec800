"""Tests of dataset loading and downloading (fedproto.data).

Real-data tests read the folder named by FEDPROTO_DATA and are skipped without it. Download
tests use a throw-away HTTP server on 127.0.0.1; nothing here touches the internet.
"""

from __future__ import annotations

import gzip
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import leftovers

from fedproto.data import Dataset, femnist, load_dataset, mnist
from fedproto.data import datasets as ds
from fedproto.data import download as dl
from fedproto.errors import DataError

pytestmark = pytest.mark.usefixtures("private_cache")


_ENV_DATA = os.environ.get("FEDPROTO_DATA", "").strip()


SHARED = Path(_ENV_DATA) if _ENV_DATA else None


MNIST_NAMES = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
]


def _shared(*parts: str) -> Path:
    """A path under FEDPROTO_DATA, or skip the test when it is unset or missing."""
    if SHARED is None:
        pytest.skip("FEDPROTO_DATA is not set")
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not found")
    return path


def _shared_mnist_dir() -> Path:
    folder = _shared("mnist")
    for name in MNIST_NAMES:
        if not (folder / f"{name}.gz").is_file():
            pytest.skip(f"{folder / name}.gz not found")
    return folder


def _regzip_corrupted(src_gz: Path, dest_gz: Path) -> None:
    """Write a valid gzip whose decompressed content differs from src's in a few bytes."""
    data = bytearray(gzip.decompress(src_gz.read_bytes()))
    for i in range(100, len(data), max(1, len(data) // 7)):
        data[i] ^= 0xFF
    dest_gz.write_bytes(gzip.compress(bytes(data), compresslevel=1))


def _flip_raw_bytes(src: Path, dest: Path) -> None:
    data = bytearray(src.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0xFF
    dest.write_bytes(bytes(data))


def _serve_mnist(www: Path, folder: str) -> Path:
    target = www / folder
    target.mkdir()
    for name in MNIST_NAMES:
        shutil.copyfile(_shared_mnist_dir() / f"{name}.gz", target / f"{name}.gz")
    return target


def test_mnist_download_with_mirror_fallback(isolated: Path, http_root, monkeypatch) -> None:
    www, base = http_root
    _serve_mnist(www, "good")
    monkeypatch.setenv(mnist.MNIST_MIRRORS_ENV, f"{base}/missing/,{base}/good")
    root = isolated / "root"

    data = load_dataset("mnist", root=root, progress=False)
    assert (len(data.train_y), len(data.test_y)) == (60000, 10000)
    assert leftovers(root / "mnist", {f"{n}.gz" for n in MNIST_NAMES}) == []
    assert all((root / "mnist" / f"{n}.gz").is_file() for n in MNIST_NAMES)


@pytest.mark.parametrize("corruption", ["content", "gzip-bytes"])
def test_mnist_download_corrupt_file(
    isolated: Path, http_root, monkeypatch: pytest.MonkeyPatch, corruption: str
) -> None:
    www, base = http_root
    served = _serve_mnist(www, "bad")
    bad = served / "train-labels-idx1-ubyte.gz"
    if corruption == "content":
        _regzip_corrupted(bad, bad)
    else:
        _flip_raw_bytes(bad, bad)
    monkeypatch.setenv(mnist.MNIST_MIRRORS_ENV, f"{base}/bad/")
    root = isolated / "root"

    with pytest.raises(DataError) as info:
        load_dataset("mnist", root=root, progress=False)
    msg = str(info.value)
    assert "checksum" in msg
    assert "train-labels-idx1-ubyte.gz" in msg
    target = root / "mnist"
    assert not (target / "train-labels-idx1-ubyte.gz").exists()
    # Files verified before the failure may stay; nothing else (no temporary files).
    assert leftovers(target, {"train-images-idx3-ubyte.gz"}) == []


def test_mnist_download_missing_file(isolated: Path, http_root, monkeypatch) -> None:
    www, base = http_root
    served = _serve_mnist(www, "partial")
    (served / "t10k-labels-idx1-ubyte.gz").unlink()
    monkeypatch.setenv(mnist.MNIST_MIRRORS_ENV, f"{base}/partial/")
    root = isolated / "root"

    with pytest.raises(DataError) as info:
        load_dataset("mnist", root=root, progress=False)
    msg = str(info.value)
    assert "t10k-labels-idx1-ubyte.gz" in msg and "404" in msg
    target = root / "mnist"
    assert not (target / "t10k-labels-idx1-ubyte.gz").exists()
    expected = {f"{n}.gz" for n in MNIST_NAMES if n != "t10k-labels-idx1-ubyte"}
    assert leftovers(target, expected) == []


def test_mnist_offline_without_files(isolated: Path) -> None:
    root = isolated / "empty"
    root.mkdir()
    with pytest.raises(DataError) as info:
        load_dataset("mnist", root=root, download=False)
    msg = str(info.value)
    for name in MNIST_NAMES:
        assert name in msg
    for folder in (root / "mnist", root, dl.default_cache_dir() / "mnist", dl.default_cache_dir()):
        assert str(folder) in msg
    assert list(root.iterdir()) == []  # nothing created when not downloading


def _local_mnist_copy(root: Path) -> Path:
    folder = root / "mnist"
    folder.mkdir(parents=True)
    for name in MNIST_NAMES:
        shutil.copyfile(_shared_mnist_dir() / f"{name}.gz", folder / f"{name}.gz")
    return folder


def test_mnist_corrupt_local_file(isolated: Path) -> None:
    folder = _local_mnist_copy(isolated / "root")
    bad = folder / "t10k-images-idx3-ubyte.gz"
    _regzip_corrupted(bad, bad)
    with pytest.raises(DataError) as info:
        load_dataset("mnist", root=isolated / "root", download=False)
    msg = str(info.value)
    assert str(bad) in msg and "corrupt" in msg and "Delete it" in msg


def test_mnist_truncated_raw_local_file(isolated: Path) -> None:
    folder = _local_mnist_copy(isolated / "root")
    labels = gzip.decompress((folder / "train-labels-idx1-ubyte.gz").read_bytes())
    raw = folder / "train-labels-idx1-ubyte"  # an uncompressed file is preferred over .gz
    raw.write_bytes(labels[:-10])
    with pytest.raises(DataError) as info:
        load_dataset("mnist", root=isolated / "root", download=False)
    assert str(raw) in str(info.value) and "truncated" in str(info.value)

    raw.write_bytes(b"\x00\x00\x0d\x01" + labels[4:])  # wrong IDX type code
    with pytest.raises(DataError, match="not an unsigned-byte IDX file"):
        load_dataset("mnist", root=isolated / "root", download=False)


def test_mnist_from_shared_data() -> None:
    _shared_mnist_dir()
    data = load_dataset("mnist", download=False)
    assert isinstance(data, Dataset)
    assert data.train_x.shape == (60000, 1, 28, 28) and data.train_x.dtype == torch.float32
    assert data.test_x.shape == (10000, 1, 28, 28)
    assert data.train_y.dtype == torch.int64 and data.input_shape == (1, 28, 28)
    assert data.num_classes == 10 and data.class_names == [str(i) for i in range(10)]
    assert set(data.train_y.unique().tolist()) == set(range(10))
    counts = torch.bincount(data.train_y, minlength=10)
    assert counts.sum() == 60000
    assert counts.tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert torch.bincount(data.test_y, minlength=10).sum() == 10000
    # (x/255 - 0.1307) / 0.3081: the constants are MNIST's own mean/std.
    assert abs(data.train_x.mean().item()) < 1e-3
    assert abs(data.train_x.std().item() - 1.0) < 1e-3
    assert data.train_x.min().item() == pytest.approx(-0.1307 / 0.3081, abs=1e-5)
    assert data.train_x.max().item() == pytest.approx((1 - 0.1307) / 0.3081, abs=1e-5)
    assert data.train_groups is None and data.test_groups is None
    assert load_dataset("mnist", download=False) is data  # in-process cache


def test_digits_shapes_and_determinism() -> None:
    data = load_dataset("digits")
    assert data.train_x.shape == (1257, 1, 8, 8) and data.test_x.shape == (540, 1, 8, 8)
    assert data.num_classes == 10 and data.input_shape == (1, 8, 8)
    assert set(data.train_y.tolist()) == set(range(10)) == set(data.test_y.tolist())
    assert abs(data.train_x.mean().item()) < 1e-4
    assert data.train_x.std().item() == pytest.approx(1.0, abs=1e-3)
    ds.clear_dataset_cache()
    again = load_dataset("DIGITS")
    assert again is not data
    assert torch.equal(again.train_x, data.train_x) and torch.equal(again.test_y, data.test_y)


def test_unknown_dataset_lists_known_names() -> None:
    with pytest.raises(DataError) as info:
        load_dataset("imagenet")
    for name in ("mnist", "digits", "femnist", "cifar10"):
        assert name in str(info.value)


def test_femnist_from_shared_data() -> None:
    _shared("femnist")
    data = load_dataset("femnist", download=False)
    assert data.train_x.shape == (14640, 1, 28, 28) and data.test_x.shape == (1677, 1, 28, 28)
    assert data.num_classes == 62 and len(data.class_names) == 62
    assert data.class_names[:11] == [*"0123456789", "A"] and data.class_names[-1] == "z"
    assert int(data.train_y.max()) < 62 and int(data.train_y.min()) >= 0
    assert abs(data.train_x.mean().item()) < 1e-3
    assert data.train_x.std().item() == pytest.approx(1.0, abs=1e-3)
    assert data.train_groups is not None and data.test_groups is not None
    assert data.train_groups.shape == (14640,) and data.test_groups.shape == (1677,)
    assert len(np.unique(data.train_groups)) == 105 and len(data.group_names or []) == 105
    assert set(np.unique(data.test_groups)) <= set(np.unique(data.train_groups))

    unpaired = femnist.load_femnist_unpaired()
    assert len(unpaired.train_y) == 0 and unpaired.test_x.shape == (2493, 1, 28, 28)
    assert len(unpaired.group_names or []) == 85
    assert not set(unpaired.group_names or []) & set(data.group_names or [])


def test_femnist_archive_extraction_location(isolated: Path) -> None:
    archive = _shared("femnist", "femnist-leaf-niid-sf0.05.tar.gz")
    writable = isolated / "w" / "femnist"
    writable.mkdir(parents=True)
    shutil.copyfile(archive, writable / archive.name)
    folder = femnist.find_femnist(isolated / "w")
    assert folder.is_relative_to(writable) and (folder / "train").is_dir()
    assert leftovers(writable, {archive.name, "femnist-leaf-niid-sf0.05"}) == []

    readonly = isolated / "r" / "femnist"
    readonly.mkdir(parents=True)
    shutil.copyfile(archive, readonly / archive.name)
    readonly.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)
    try:
        folder = femnist.find_femnist(isolated / "r")
        assert folder.is_relative_to(dl.default_cache_dir())
        assert sorted(os.listdir(readonly)) == [archive.name]
    finally:
        readonly.chmod(stat.S_IRWXU)


def test_femnist_missing_explains_leaf(isolated: Path) -> None:
    (isolated / "nothing").mkdir()
    with pytest.raises(DataError) as info:
        load_dataset("femnist", root=isolated / "nothing")
    msg = str(info.value)
    assert "./preprocess.sh -s niid --sf 0.05 -k 0 -t sample" in msg
    assert str(isolated / "nothing" / "femnist") in msg


def test_cifar10_from_shared_data() -> None:
    _shared("cifar10")
    data = load_dataset("cifar10", download=False)
    assert data.train_x.shape == (50000, 3, 32, 32) and data.test_x.shape == (10000, 3, 32, 32)
    assert data.train_x.dtype == torch.float32 and data.input_shape == (3, 32, 32)
    assert data.class_names[0] == "airplane" and data.class_names[-1] == "truck"
    assert torch.bincount(data.train_y, minlength=10).tolist() == [5000] * 10
    channel_means = data.train_x.mean(dim=(0, 2, 3))
    assert torch.all(channel_means.abs() < 0.01), channel_means


def test_cifar10_offline_without_files(isolated: Path) -> None:
    (isolated / "empty").mkdir()
    with pytest.raises(DataError) as info:
        load_dataset("cifar10", root=isolated / "empty", download=False)
    msg = str(info.value)
    assert "cifar-10-python.tar.gz" in msg and str(isolated / "empty" / "cifar10") in msg


def test_explicit_data_folder_that_is_missing_or_a_file(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # reported fault: a mistyped --data-dir fell through to $FEDPROTO_DATA without a word
    monkeypatch.setenv("FEDPROTO_DATA", str(isolated))
    with pytest.raises(DataError, match=r"data folder '.*typo' does not exist; pass an existing folder"):
        load_dataset("mnist", root=isolated / "typo", download=False)
    with pytest.raises(DataError, match="does not exist"):
        load_dataset("femnist", root=isolated / "typo")
    afile = isolated / "afile"
    afile.write_text("x")
    with pytest.raises(DataError, match=r"is a file, not a folder"):
        load_dataset("cifar10", root=afile)


def test_kept_client_folders_are_decoded_once_and_again_when_a_file_changes(tmp_path):
    """fedproto.data.folder.keep_decoded (the Flower executor's data cache): off by
    default (every call reads the files); on, a folder is decoded once and the same tensors come
    back until a file changes (size or mtime), labels are still checked against each call's class
    count, and a folder decoded before the class count is known (preload) is checked on use."""
    import numpy as np
    import pytest
    import torch
    from PIL import Image

    from fedproto.data import folder as fo
    from fedproto.errors import DataError

    rng = np.random.default_rng(0)
    npz = tmp_path / "npz"
    npz.mkdir()
    for split, n in (("train", 6), ("test", 3)):
        np.savez(npz / f"{split}.npz", x=rng.random((n, 1, 4, 4), dtype=np.float32), y=np.arange(n) % 3)
    img = tmp_path / "img"
    for split in ("train", "test"):
        for c in ("0", "2"):
            (img / split / c).mkdir(parents=True)
            Image.fromarray(np.full((4, 4), 40 * int(c), np.uint8)).save(img / split / c / "a.png")
    try:
        (a, _), _ = fo.load_client_folder(npz, 3)
        (b, _), _ = fo.load_client_folder(npz, 3)
        assert a is not b and torch.equal(a, b)  # off: read again
        fo.keep_decoded()
        assert fo.preload_client_folder(img) == 4
        (a, _), _ = fo.load_client_folder(npz, 3)
        (b, _), (tx, ty) = fo.load_client_folder(npz, 3)
        assert a is b and tx.shape == (3, 1, 4, 4) and ty.tolist() == [0, 1, 2]
        (xi, yi), _ = fo.load_client_folder(img, 3)
        assert sorted(yi.tolist()) == [0, 2] and float(xi.max()) == pytest.approx(80 / 255)
        with pytest.raises(DataError, match="label 2 is outside the run's classes 0..1"):
            fo.load_client_folder(img, 2)  # the preloaded arrays are still checked
        np.savez(npz / "train.npz", x=np.zeros((2, 1, 4, 4), np.float32), y=np.array([0, 1]))
        (c, _), _ = fo.load_client_folder(npz, 3)
        assert c is not a and c.shape == (2, 1, 4, 4) and float(c.abs().sum()) == 0.0
        with pytest.raises(ValueError, match="size=0: keep at least 1 folder"):
            fo.keep_decoded(size=0)
        fo.keep_decoded(size=1)
        fo.load_client_folder(img, 3)
        assert fo.kept_folders() == 1  # the least recently used folder went
    finally:
        fo.keep_decoded(False)
    assert fo.kept_folders() is None


def test_a_missing_data_folder_while_downloading_is_said_and_left_uncreated(tmp_path, monkeypatch, caplog):
    """From a new user: ``--data-dir /typo`` with ``FEDPROTO_DATA`` set trained on that copy without a
    word (downloading allowed, the folder is where a download would go)."""
    import logging

    monkeypatch.setenv("FEDPROTO_DATA", str(_shared("mnist").parent))
    with caplog.at_level(logging.WARNING, logger="fedproto.data.datasets"):
        ds = load_dataset("mnist", root=tmp_path / "typo", download=True, progress=False)
    assert len(ds.train_y) == 60000
    assert f"data folder '{tmp_path / 'typo'}' does not exist: mnist is read from $FEDPROTO_DATA" in caplog.text
    assert not (tmp_path / "typo").exists()
