"""What a run does before it trains: its dataset memory-mapped from the decoded-dataset cache (decoded
once per machine, not at every start), and the partition's per-label indices from one sort. No
timing here (the start-up figures are in benchmarks/bench_startup.py)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import needs_mnist

from fedproto.config.run_config import build_config
from fedproto.data import decoded
from fedproto.data.assignment import indices_by_class
from fedproto.data.datasets import clear_dataset_cache, load_dataset


@pytest.mark.parametrize("n, labels", [(0, 3), (1, 1), (500, 7), (2000, 62)])
def test_indices_by_class_are_each_labels_samples_in_ascending_order(n, labels):
    y = np.random.default_rng(n).integers(0, labels, n)
    got = indices_by_class(y, labels + 2)  # two labels that no sample has
    assert len(got) == labels + 2
    for c, ix in enumerate(got):
        assert ix.dtype == np.int64
        assert np.array_equal(ix, [i for i in range(n) if y[i] == c]), c  # one pass per label, by hand


@needs_mnist
def test_the_run_maps_its_dataset_from_the_decoded_cache_bit_for_bit(tmp_path, monkeypatch):
    """``prepare`` (``fedproto run``) reads MNIST from a cache entry written on its first start: the
    tensors are memory maps of the entry's files and equal the decoded arrays bit for bit."""
    from fedproto.engine.setup import prepare

    monkeypatch.setenv(decoded.DECODED_ENV, str(tmp_path / "cache"))
    clear_dataset_cache()
    try:
        cfg = build_config(overrides={"dataset": "mnist", "clients": 2, "ways": 2, "shots": 5, "test_shots": 5,
                                      "rounds": 1, "threads": 1})
        setup = prepare(cfg, progress=False)
        (entry,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
        assert entry.name.startswith("mnist-") and (entry / "train_x.npy").is_file()
        ds = setup.dataset
        for k in ("train_x", "test_x"):  # mapped from the entry (fedproto.data.decoded keeps each map's file)
            assert decoded._FILES[getattr(ds, k).data_ptr()][0] == str(entry / f"{k}.npy")
        clear_dataset_cache()
        monkeypatch.setenv(decoded.DECODED_ENV, "off")
        plain = load_dataset("mnist", download=False)
        for k in ("train_x", "train_y", "test_x", "test_y"):
            a, b = getattr(ds, k), getattr(plain, k)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), k
    finally:
        clear_dataset_cache()
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)  # 211 MB of decoded MNIST
