"""``-v``/``--verbose`` is moved to the front of the command line only where it is a flag: as the value of an
option (``--name -v``, ``--label-column -v``) or after ``--`` it stays where it is."""

from __future__ import annotations

import numpy as np
from conftest import run_cli

from fedproto.cli import _hoist_verbose, command


def test_verbose_as_an_options_value_stays_the_value():
    group = command()
    assert _hoist_verbose(["run", "--name", "-v", "--rounds", "1"], group) == ["run", "--name", "-v", "--rounds", "1"]
    assert _hoist_verbose(["run", "--name", "x", "-v"], group) == ["-v", "run", "--name", "x"]
    assert _hoist_verbose(["run", "-q", "--verbose", "--rounds", "2"], group) == ["--verbose", "run", "-q", "--rounds",
                                                                                 "2"]
    assert _hoist_verbose(["site-data", "o", "--label-column", "--verbose"], group) == [
        "site-data", "o", "--label-column", "--verbose"]
    assert _hoist_verbose(["-v", "run", "--", "-v"], group) == ["-v", "run", "--", "-v"]


def test_a_csv_label_column_named_like_the_verbose_flag(tmp_path, capsys, monkeypatch):
    (tmp_path / "d.csv").write_text("-v,a\n0,1\n0,2\n1,3\n1,4\n")
    code, text = run_cli(["site-data", str(tmp_path / "s"), "--from", str(tmp_path / "d.csv"), "--label-column", "-v",
                          "--test-fraction", "0.5"], capsys, monkeypatch)
    assert code == 0, text
    with np.load(tmp_path / "s" / "train.npz") as z:
        assert sorted(z["y"].tolist()) == [0, 1]
