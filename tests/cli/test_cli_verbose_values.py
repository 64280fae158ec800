"""``-v``/``--verbose`` is moved to the front of the command line only where it is a flag: as the value of an
option (``--name -v``, ``--label-column -v``) or after ``--`` it stays where it is."""

from __future__ import annotations

import logging

import numpy as np
from conftest import run_cli

from fedproto.cli.app import _hoist_verbose, command


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


def test_verbose_among_short_switches_given_together():
    """``-qv``: ``-q`` is run's, ``-v`` the root's; taken apart only where every other letter is the
    command's own switch, and never as an option's value."""
    group = command()
    assert _hoist_verbose(["run", "-qv", "--rounds", "1"], group) == ["-v", "run", "-q", "--rounds", "1"]
    assert _hoist_verbose(["run", "-vq"], group) == ["-v", "run", "-q"]
    assert _hoist_verbose(["run", "--name", "-qv"], group) == ["run", "--name", "-qv"]
    assert _hoist_verbose(["run", "-xv"], group) == ["run", "-xv"]  # not run's switch: click refuses it


def test_quiet_and_verbose_together_reach_their_commands(capsys, monkeypatch):
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", logging.WARNING)  # restored after the test
    code, text = run_cli(["run", "-qv", "--dataset", "imagenet"], capsys, monkeypatch)
    assert code == 2 and "unknown dataset 'imagenet'" in text and "No such option" not in text, text
    assert root.level == logging.INFO


def test_verbose_prints_each_round_line_once(tmp_path):
    """Under ``-v`` the engine's logger writes the round line, and the command wrote it again."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    for flags in (["-v"], []):
        p = subprocess.run([sys.executable, "-m", "fedproto", *flags, "run", "--dataset", "digits", "--rounds", "2",
                            "--eval-every", "1", "--threads", "1", "--out-dir", str(tmp_path)],
                           env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        text = p.stdout + p.stderr
        assert text.count("round 1/2: loss ce") == 1 and text.count("round 2/2: loss ce") == 1, text[-3000:]
