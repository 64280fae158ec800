"""``fedproto site-data --from`` on bad or unusual sources: one ``error:`` line naming the bad value and the fix,
exit code 2, nothing written; and every folder it writes is one a Flower node loads."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_cli

from fedproto.data.folder import load_client_folder
from fedproto.deploy.site_data import write_site_from
from fedproto.errors import ConfigError


def _npz(**arrays):
    return lambda p: np.savez(p, **arrays)


def _text(s):
    return lambda p: p.write_text(s)


def _objects(p):
    np.savez(p, x=np.array([object()] * 4, dtype=object), y=np.arange(4))


BAD = {
    "ragged.csv": (_text("label,a,b\n0,1\n1,2,3\n"), r"line 2 has 2 values but the header 3 columns"),
    "extra.csv": (_text("label,a\n0,1,9\n1,2\n"), r"line 2 has 3 values but the header 2 columns"),
    "nan.csv": (_text("label,a\n0,1\n0,nan\n1,2\n1,3\n"), r"1 sample\(s\) hold NaN or infinite values"),
    "inf.npz": (_npz(x=np.array([[1.0, np.inf], [2, 3], [4, 5], [6, 7]]), y=np.array([0, 0, 1, 1])),
                r"1 sample\(s\) hold NaN or infinite values"),
    "str.npz": (_npz(x=np.array([["a", "b"]] * 4), y=np.arange(4)), r"x has dtype <U1"),
    "object.npz": (_objects, r"cannot read"),
    "garbage.npz": (_text("not a zip"), r"cannot read"),
    "negative.npz": (_npz(x=np.ones((4, 2)), y=np.array([-1, 0, 1, 1])), r"label -1 is not a class id"),
    "empty.npz": (_npz(x=np.ones((0, 2)), y=np.zeros(0, dtype=int)), r"holds no samples"),
    "flat.npz": (_npz(x=np.ones(4), y=np.arange(4)), r"x has shape \(4,\)"),
    "nofeatures.csv": (_text("label\n0\n0\n1\n1\n"), r"no feature columns"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_source_is_one_error_with_exit_2_and_writes_nothing(name, tmp_path, capsys, monkeypatch):
    make, message = BAD[name]
    src = tmp_path / name
    make(src)
    out = tmp_path / "site"
    code, text = run_cli(["site-data", str(out), "--from", str(src)], capsys, monkeypatch)
    assert code == 2, text
    assert text.startswith("error: ") and text.count("error:") == 1 and "Traceback" not in text, text
    assert name in text
    import re

    assert re.search(message, text), text
    assert not out.exists()


def test_an_unreadable_image_is_named_as_an_image_error(tmp_path, capsys, monkeypatch):
    (tmp_path / "imgs" / "0").mkdir(parents=True)
    (tmp_path / "imgs" / "0" / "a.png").write_text("junk")
    code, text = run_cli(["site-data", str(tmp_path / "s"), "--from", str(tmp_path / "imgs")], capsys, monkeypatch)
    assert code == 2 and "cannot read image" in text and "a.png" in text and "free space" not in text, text


def test_class_names_twice_or_empty_are_refused(tmp_path):
    (tmp_path / "d.csv").write_text("label,a\ncat,1\ndog,2\ncat,3\ndog,4\n")
    with pytest.raises(ConfigError, match=r"class name 'cat' is given twice"):
        write_site_from(tmp_path / "d.csv", tmp_path / "s", class_names=["cat", "dog", "cat"])
    with pytest.raises(ConfigError, match=r"an empty class name \(position 1\)"):
        write_site_from(tmp_path / "d.csv", tmp_path / "s", class_names=["cat", "", "dog"])
    assert not (tmp_path / "s").exists()
    (tmp_path / "sp.csv").write_text("label,a\ncat ,1\n dog,2\ncat,3\ndog,4\n")  # spaces around labels: stripped
    got = write_site_from(tmp_path / "sp.csv", tmp_path / "s", class_names=["cat", "dog"], test_fraction=0.5)
    assert got["classes"] == [0, 1] and got["train_samples"] == 2


def test_every_class_keeps_a_train_sample_and_the_test_split_is_never_empty(tmp_path):
    """A huge test fraction leaves one train sample per class of two or more; a class of one sample stays in
    train; a split that would be empty (which a node refuses) is an error instead."""
    x = np.arange(7, dtype=np.float32)[:, None]
    np.savez(tmp_path / "d.npz", x=x, y=np.array([0, 0, 1, 1, 1, 2, 3]))
    got = write_site_from(tmp_path / "d.npz", tmp_path / "s", test_fraction=0.99, how="none")
    (tr_x, tr_y), (te_x, te_y) = load_client_folder(tmp_path / "s", 4)
    assert sorted(tr_y.tolist()) == [0, 1, 2, 3] and sorted(te_y.tolist()) == [0, 1, 1]
    assert got["train_samples"] == 4 and got["test_samples"] == 3
    with pytest.raises(ConfigError, match=r"the test split would be empty.*--test-fraction"):
        write_site_from(tmp_path / "d.npz", tmp_path / "s0", test_fraction=0)
    np.savez(tmp_path / "one.npz", x=x[:2], y=np.array([0, 1]))  # one sample per class: no test sample possible
    with pytest.raises(ConfigError, match=r"the test split would be empty"):
        write_site_from(tmp_path / "one.npz", tmp_path / "s1")
    assert not (tmp_path / "s0").exists() and not (tmp_path / "s1").exists()


def test_image_modes_are_read_as_a_node_reads_them(tmp_path):
    """16-bit grayscale stays one channel scaled by 65535; grayscale among RGB images becomes RGB (v, v, v)/255."""
    from PIL import Image

    for c in ("0", "1"):
        (tmp_path / "g16" / c).mkdir(parents=True)
        (tmp_path / "mix" / c).mkdir(parents=True)
        for k in range(2):
            Image.fromarray(np.full((4, 4), 65535 if c == "1" else 0, dtype=np.int32), mode="I").save(
                tmp_path / "g16" / c / f"{k}.tif")
        Image.new("L", (4, 4), 51).save(tmp_path / "mix" / c / "a.png")
        Image.new("RGB", (4, 4), (255, 0, 102)).save(tmp_path / "mix" / c / "b.png")
    write_site_from(tmp_path / "g16", tmp_path / "s16", test_fraction=0.5, how="none")
    (x, y), _ = load_client_folder(tmp_path / "s16", 2)
    assert x.shape == (2, 1, 4, 4)
    assert {int(c): float(v) for c, v in zip(y, x[:, 0, 0, 0])} == {0: 0.0, 1: 1.0}
    write_site_from(tmp_path / "mix", tmp_path / "smix", test_fraction=0.5, how="none", seed=3)
    (x, y), (tx, ty) = load_client_folder(tmp_path / "smix", 2)
    pixels = {tuple(np.round(v[:, 0, 0].numpy() * 255).astype(int).tolist()) for v in (*x, *tx)}
    assert x.shape[1:] == (3, 4, 4) and pixels == {(51, 51, 51), (255, 0, 102)}


def test_a_failed_write_keeps_the_sites_earlier_files(tmp_path, monkeypatch):
    """The two files are replaced together: a failure while writing leaves the earlier pair and the folder's
    other files as they were, and no temporary file behind."""
    np.savez(tmp_path / "d.npz", x=np.arange(8, dtype=np.float32)[:, None], y=np.array([0, 0, 0, 0, 1, 1, 1, 1]))
    site = tmp_path / "site"
    site.mkdir()
    (site / "notes.txt").write_text("mine")
    (site / "train.npz").write_bytes(b"old train")
    (site / "test.npz").write_bytes(b"old test")
    calls = []

    def failing_savez(path, **arrays):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_savez(path, **arrays)

    real_savez = np.savez
    monkeypatch.setattr(np, "savez", failing_savez)
    with pytest.raises(OSError):
        write_site_from(tmp_path / "d.npz", site)
    assert sorted(p.name for p in site.iterdir()) == ["notes.txt", "test.npz", "train.npz"]
    assert (site / "train.npz").read_bytes() == b"old train" and (site / "test.npz").read_bytes() == b"old test"


def test_an_output_path_that_is_a_file_is_refused_and_kept(tmp_path, capsys, monkeypatch):
    np.savez(tmp_path / "d.npz", x=np.ones((4, 2)), y=np.array([0, 0, 1, 1]))
    (tmp_path / "site").write_text("mine")
    code, text = run_cli(["site-data", str(tmp_path / "site"), "--from", str(tmp_path / "d.npz")], capsys, monkeypatch)
    assert code == 2 and "is a file; give a folder" in text and "site" in text, text
    assert (tmp_path / "site").read_text() == "mine"


def test_a_negative_seed_is_refused_on_the_command_line_and_in_python(tmp_path, capsys, monkeypatch):
    np.savez(tmp_path / "d.npz", x=np.ones((4, 2)), y=np.array([0, 0, 1, 1]))
    code, text = run_cli(["site-data", str(tmp_path / "site"), "--from", str(tmp_path / "d.npz"), "--seed", "-5"],
                         capsys, monkeypatch)
    assert code == 2 and "'--seed': -5 is not in the range x>=0" in text, text
    with pytest.raises(ConfigError, match=r"seed -5: give a whole number, 0 or more"):
        write_site_from(tmp_path / "d.npz", tmp_path / "site2", seed=-5)
    assert not (tmp_path / "site").exists() and not (tmp_path / "site2").exists()
