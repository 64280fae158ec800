"""fedproto.data.decoded: the decoded-dataset cache on disk (load_dataset(..., mapped=True)) and
fedproto.data.precache."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedproto.data import decoded
from fedproto.data.datasets import clear_dataset_cache, load_dataset
from fedproto.errors import DataError

FIELDS = ("train_x", "train_y", "test_x", "test_y")


def write_leaf(root: Path, users: int = 3, per_user: int = 4, seed: int = 0) -> Path:
    """A small FEMNIST in LEAF's layout under ``root/femnist`` (train/ and test/ JSON); returns that folder."""
    rng = np.random.default_rng(seed)
    folder = root / "femnist"
    for split in ("train", "test"):
        (folder / split).mkdir(parents=True, exist_ok=True)
        names = [f"f{u:04d}" for u in range(users)]
        data = {u: {"x": rng.random((per_user, 784)).round(3).tolist(), "y": rng.integers(0, 62, per_user).tolist()}
                for u in names}
        blob = {"users": names, "num_samples": [per_user] * users, "user_data": data}
        (folder / split / "all.json").write_text(json.dumps(blob))
    return folder


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    """No data folder or user cache but the test's own; no in-process cache carried between tests."""
    monkeypatch.delenv("FEDPROTO_DATA", raising=False)
    monkeypatch.delenv(decoded.DECODED_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    clear_dataset_cache()
    yield
    clear_dataset_cache()


def _same(a, b) -> None:
    for k in FIELDS:
        x, y = getattr(a, k), getattr(b, k)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), k
    for k in ("train_groups", "test_groups"):
        assert np.array_equal(getattr(a, k), getattr(b, k)), k
    for k in ("name", "num_classes", "class_names", "group_names"):
        assert getattr(a, k) == getattr(b, k), k


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.exists() else []


def test_a_mapped_dataset_equals_the_decoded_one_bit_for_bit_and_is_cached_next_to_its_files(tmp_path):
    folder = write_leaf(tmp_path)
    plain = load_dataset("femnist", tmp_path)
    mapped = load_dataset("femnist", tmp_path, mapped=True)
    _same(plain, mapped)
    assert mapped.train_x is not plain.train_x
    (entry,) = _entries(folder / decoded.NEXT_TO_DATA)
    assert entry.startswith("femnist-")
    clear_dataset_cache()  # a new process: read from the entry, not decoded
    again = load_dataset("femnist", tmp_path, mapped=True)
    _same(plain, again)
    files = {line.split()[-1] for line in open("/proc/self/maps") if ".npy" in line} if Path("/proc").exists() else None
    if files is not None:
        assert str(folder / decoded.NEXT_TO_DATA / entry / "train_x.npy") in files  # a memory map of the entry
    # a write into a mapped tensor stays in this process (copy on write), the file keeps the decoded values
    again.train_x[0, 0, 0, 0] = 1e6
    clear_dataset_cache()
    _same(plain, load_dataset("femnist", tmp_path, mapped=True))


def test_a_read_only_data_folder_is_left_alone_and_the_user_cache_holds_the_entry(tmp_path, monkeypatch):
    folder = write_leaf(tmp_path)
    os.chmod(folder, 0o555)  # read-only for everyone, root included by intent
    try:
        mapped = load_dataset("femnist", tmp_path, mapped=True)
    finally:
        os.chmod(folder, 0o755)
    assert not (folder / decoded.NEXT_TO_DATA).exists()
    assert len(_entries(tmp_path / "xdg" / "fedproto" / "decoded")) == 1
    clear_dataset_cache()
    _same(load_dataset("femnist", tmp_path), mapped)
    # FEDPROTO_DECODED_CACHE names the folder; "off": no cache at all
    clear_dataset_cache()
    monkeypatch.setenv(decoded.DECODED_ENV, str(tmp_path / "mine"))
    load_dataset("femnist", tmp_path, mapped=True)
    assert len(_entries(tmp_path / "mine")) == 1
    clear_dataset_cache()
    monkeypatch.setenv(decoded.DECODED_ENV, "off")
    _same(load_dataset("femnist", tmp_path, mapped=True), mapped)
    assert len(_entries(tmp_path / "mine")) == 1 and len(_entries(folder / decoded.NEXT_TO_DATA)) == 0


def test_a_changed_source_file_gets_a_new_entry_and_a_damaged_entry_is_decoded_again(tmp_path, caplog):
    folder = write_leaf(tmp_path)
    first = load_dataset("femnist", tmp_path, mapped=True)
    first_x = first.train_x.clone()
    write_leaf(tmp_path, seed=1)  # new pixels, same file names
    clear_dataset_cache()
    second = load_dataset("femnist", tmp_path, mapped=True)
    assert not torch.equal(second.train_x, first_x)
    clear_dataset_cache()
    plain = load_dataset("femnist", tmp_path)
    _same(plain, second)
    del second  # its memory maps: a file truncated under a map must not be read through it (SIGBUS)
    cache = folder / decoded.NEXT_TO_DATA
    assert len(_entries(cache)) == 2  # the old entry stays until deleted; it is never read for the new files
    # a truncated array file: a warning, then decoded again
    newest = max((cache / e for e in _entries(cache)), key=lambda p: p.stat().st_mtime_ns)
    with open(newest / "train_x.npy", "r+b") as f:
        f.truncate(200)
    clear_dataset_cache()
    with caplog.at_level(logging.WARNING, logger="fedproto.data.decoded"):
        third = load_dataset("femnist", tmp_path, mapped=True)
    assert caplog.text.count("cannot be read") == 1, caplog.text  # one warning (it came twice)
    _same(third, plain)
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    # a file rewritten in place at the same size (flipped bytes): not read as data, decoded again
    del third
    newest = _newest(cache)
    size = (newest / "train_x.npy").stat().st_size
    with open(newest / "train_x.npy", "r+b") as f:
        f.seek(size - 8)
        f.write(b"\xff" * 8)
    os.utime(newest / "train_x.npy", ns=(time.time_ns(), time.time_ns() + 10**9))  # a write a second later
    assert (newest / "train_x.npy").stat().st_size == size
    fourth = _load_again(tmp_path, caplog)
    assert caplog.text.count("train_x.npy was changed after it was written") == 1, caplog.text
    _same(fourth, plain)
    # a meta.json that is not an object (it crashed every later load with an AttributeError)
    del fourth
    for bad in ("null", "[]", '{"format": 1, "arrays": []}'):
        (_newest(cache) / "meta.json").write_text(bad)
        again = _load_again(tmp_path, caplog)
        assert caplog.text.count("cannot be read") == 1, caplog.text
        _same(again, plain)
        del again


def _newest(cache: Path) -> Path:
    """The cache entry written last."""
    return max((cache / e for e in _entries(cache)), key=lambda p: p.stat().st_mtime_ns)


def _load_again(root: Path, caplog):
    """FEMNIST from ``root`` through the disk cache, as a new process would (the in-process cache
    and the captured log cleared first; the cache's warnings captured)."""
    clear_dataset_cache()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedproto.data.decoded"):
        return load_dataset("femnist", root, mapped=True)


def test_a_relative_cache_folder_is_made_absolute_and_an_unknown_home_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(decoded.DECODED_ENV, "relcache")
    assert decoded.cache_root([("/x/a", 1, 1)]) == tmp_path / "relcache"
    monkeypatch.setenv(decoded.DECODED_ENV, "~nosuchuser_fedproto/x")
    with pytest.raises(DataError, match=r"FEDPROTO_DECODED_CACHE='~nosuchuser_fedproto/x': .*give a folder without"):
        decoded.cache_root([("/x/a", 1, 1)])


def test_processes_loading_at_once_decode_once_and_agree(tmp_path):
    """Three processes load the same dataset at once: one entry, no temporary folder left, and
    every process gets the decoded arrays."""
    write_leaf(tmp_path, users=8, per_user=20)
    code = ("import sys, hashlib; from fedproto.data.datasets import load_dataset; "
            "d = load_dataset('femnist', sys.argv[1], mapped=True); "
            "print(hashlib.sha256(d.train_x.numpy().tobytes() + d.test_x.numpy().tobytes()).hexdigest())")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    plain = load_dataset("femnist", tmp_path)
    import hashlib

    want = hashlib.sha256(plain.train_x.numpy().tobytes() + plain.test_x.numpy().tobytes()).hexdigest()
    assert outs == [want] * 3
    cache = tmp_path / "femnist" / decoded.NEXT_TO_DATA
    assert len(_entries(cache)) == 1
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]


def test_decoding_in_a_child_process_and_its_failure(tmp_path):
    folder = write_leaf(tmp_path)
    mapped = load_dataset("femnist", tmp_path, mapped=True, decode_in_child=True)
    _same(mapped, load_dataset("femnist", tmp_path))
    assert len(_entries(folder / decoded.NEXT_TO_DATA)) == 1
    # a corrupt file: the child fails, this process decodes and raises the loader's own error
    (folder / "train" / "all.json").write_text("{not json")
    clear_dataset_cache()
    with pytest.raises(DataError, match="not a valid LEAF FEMNIST JSON"):
        load_dataset("femnist", tmp_path, mapped=True, decode_in_child=True)
    assert subprocess.run([sys.executable, "-m", "fedproto.data.precache", "femnist", "--root", str(tmp_path)],
                          capture_output=True, text=True).returncode == 1


def test_read_rows_equals_indexing_in_the_order_asked(tmp_path):
    write_leaf(tmp_path, users=5, per_user=10)
    mapped = load_dataset("femnist", tmp_path, mapped=True)
    for idx in ([3, 1, 2, 2, 49, 0], [7], [], list(range(10, 30))):
        got = decoded.read_rows(mapped.train_x, np.array(idx, dtype=np.int64))
        assert got.dtype == torch.float32 and torch.equal(got, mapped.train_x[torch.tensor(idx, dtype=torch.long)])
    plain = torch.arange(12.0).reshape(6, 2)  # not from the cache: plain indexing
    assert torch.equal(decoded.read_rows(plain, [5, 0]), plain[[5, 0]])
    with pytest.raises(IndexError):
        decoded.read_rows(mapped.train_x, [50])
