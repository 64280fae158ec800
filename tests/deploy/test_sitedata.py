"""fedproto.deploy.site_data (``fedproto site-data``): a site's train.npz/test.npz, from the simulator's partition
or from the site's own files, readable by a Flower node as written."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_cli

from fedproto.config.run_config import build_config
from fedproto.data.folder import load_client_folder
from fedproto.deploy.site_data import write_partition_sites, write_site_from
from fedproto.engine.setup import prepare
from fedproto.errors import ConfigError, DataError

SMALL = {"dataset": "digits", "clients": 3, "ways": 2, "shots": 10, "stdev": 0, "test_shots": 5, "threads": 1}


def test_partition_sites_hold_the_simulators_clients(tmp_path, capsys, monkeypatch):
    """site<i> holds exactly client i's normalised samples of the run ``fedproto run`` would train."""
    cfg = build_config(overrides=SMALL)
    folders = write_partition_sites(cfg, tmp_path / "sites")
    assert [f.name for f in folders] == ["site0", "site1", "site2"]
    setup = prepare(cfg, progress=False)
    for i, folder in enumerate(folders):
        (x, y), (tx, ty) = load_client_folder(folder, 10)  # what a node reads
        d = setup.data[i]
        assert np.array_equal(x.numpy(), d.x.numpy()) and np.array_equal(y.numpy(), d.y.numpy())
        assert np.array_equal(tx.numpy(), d.test_x.numpy()) and np.array_equal(ty.numpy(), d.test_y.numpy())
    code, text = run_cli(["site-data", str(tmp_path / "cli"), "--set", "dataset=digits", "--set", "clients=3",
                          "--set", "ways=2", "--set", "shots=10", "--set", "stdev=0", "--set", "test_shots=5",
                          "--client-ids", "1"], capsys, monkeypatch)
    assert code == 0, text
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == ["site1"]
    with np.load(tmp_path / "cli" / "site1" / "train.npz") as z, np.load(folders[1] / "train.npz") as w:
        assert np.array_equal(z["x"], w["x"]) and np.array_equal(z["y"], w["y"])
    with pytest.raises(ConfigError, match=r"client id\(s\) \[3\] are not among the run's 3 clients"):
        write_partition_sites(cfg, tmp_path / "x", [3])
    small = [a for k, v in (("dataset", "digits"), ("clients", 3), ("ways", 2), ("shots", 10), ("stdev", 0),
                            ("test_shots", 5)) for a in ("--set", f"{k}={v}")]
    code, text = run_cli(["site-data", str(tmp_path / "twice"), *small, "--client-ids", "1,1"], capsys, monkeypatch)
    assert code == 0 and text.count("site1") == 1, text  # written once
    code, text = run_cli(["site-data", str(tmp_path / "none"), *small, "--client-ids", ""], capsys, monkeypatch)
    assert code == 2 and "--client-ids '': give whole numbers" in text and not (tmp_path / "none").exists(), text


def test_a_csv_is_split_per_class_and_standardised_with_the_train_statistics(tmp_path):
    rng = np.random.default_rng(1)
    rows = [(c, rng.normal(10 * k, 2.0), rng.normal(-3, 0.5)) for k, c in enumerate(("ok", "fault")) for _ in range(10)]
    csv = tmp_path / "sensors.csv"
    csv.write_text("temp,status,vib\n" + "".join(f"{a},{s},{b}\n" for s, a, b in rows))
    got = write_site_from(csv, tmp_path / "site", test_fraction=0.3, label_column="status",
                          class_names=["ok", "fault"])
    assert got["train_samples"] == 14 and got["test_samples"] == 6 and got["classes"] == [0, 1]
    raw = np.array([[a, b] for _, a, b in rows], dtype=np.float32)
    with np.load(tmp_path / "site" / "train.npz") as z, np.load(tmp_path / "site" / "test.npz") as t:
        x, y, tx, ty = z["x"], z["y"], t["x"], t["y"]
    assert np.bincount(y).tolist() == [7, 7] and np.bincount(ty).tolist() == [3, 3]  # 30 % of each class
    np.testing.assert_allclose(x.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(x.std(0), 1, atol=1e-5)
    for f in range(2):  # train and test went through one affine map: the train split's mean and std
        z = np.concatenate([x[:, f], tx[:, f]])
        order = np.argsort(z)
        r = np.sort(raw[:, f])
        scale, shift = np.polyfit(z[order], r, 1)
        np.testing.assert_allclose(scale * z[order] + shift, r, atol=1e-3)
        train_raw = scale * x[:, f] + shift
        assert shift == pytest.approx(train_raw.mean(), abs=1e-3) and scale == pytest.approx(train_raw.std(), rel=1e-3)
    with pytest.raises(DataError, match=r"labels \['fault', 'ok'\] are names, not class ids; give the run's class"):
        write_site_from(csv, tmp_path / "s2", label_column="status")
    with pytest.raises(DataError, match="has no column 'label'"):
        write_site_from(csv, tmp_path / "s3")
    with pytest.raises(ConfigError, match=r"test-fraction 1: give a share of each class in \[0, 1\)"):
        write_site_from(csv, tmp_path / "s4", test_fraction=1, label_column="status", class_names=["ok", "fault"])


def test_an_image_folder_keeps_class_ids_and_takes_the_mnist_constants(tmp_path, capsys, monkeypatch):
    """Class folders ``3`` and ``7`` stay classes 3 and 7 (the label space is shared across sites), and
    ``--normalize mnist`` is ``(x/255 - 0.1307) / 0.3081``, as the MNIST loader normalises."""
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = {}
    for c in ("3", "7"):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        for k in range(5):
            a = rng.integers(0, 256, (6, 6), dtype=np.uint8)
            Image.fromarray(a, mode="L").save(tmp_path / "imgs" / c / f"{k}.png")
            pixels[a.tobytes()] = int(c)
    code, text = run_cli(["site-data", str(tmp_path / "site"), "--from", str(tmp_path / "imgs"), "--normalize",
                          "mnist", "--test-fraction", "0.4"], capsys, monkeypatch)
    assert code == 0 and "classes [3, 7]" in text, text
    (x, y), (tx, ty) = load_client_folder(tmp_path / "site", 10)
    assert x.shape == (6, 1, 6, 6) and tx.shape == (4, 1, 6, 6)
    for xs, ys in ((x, y), (tx, ty)):
        for img, label in zip(xs.numpy(), ys.numpy()):
            raw = np.rint((img[0] * 0.3081 + 0.1307) * 255).astype(np.uint8)
            assert pixels[raw.tobytes()] == label
    code, text = run_cli(["site-data", str(tmp_path / "s"), "--from", str(tmp_path / "imgs"), "--set", "clients=3"],
                         capsys, monkeypatch)
    assert code == 2 and "give one or the other" in text
