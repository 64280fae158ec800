import os
import sys
from pathlib import Path

import pytest

DATA = os.environ.get("FEDPROTO_DATA")
if DATA:  # absolute, so that tests which change the working folder still find the data
    DATA = str(Path(DATA).resolve())
    os.environ["FEDPROTO_DATA"] = DATA


@pytest.fixture(autouse=True)
def _work_in_tmp(tmp_path, monkeypatch):
    """Every test runs in its own empty folder: nothing a test writes (for example a default
    ``runs/`` folder) can touch the checkout or a user's earlier results."""
    monkeypatch.chdir(tmp_path)


def mnist_available() -> bool:
    return bool(DATA) and (Path(DATA) / "mnist" / "train-images-idx3-ubyte.gz").exists()


needs_mnist = pytest.mark.skipif(not mnist_available(), reason="set FEDPROTO_DATA to a folder with mnist/")


def run_cli(args, capsys, monkeypatch):
    """Run ``fedproto ARGS`` in-process; returns (exit code, stdout + stderr)."""
    from fedproto.cli import main

    monkeypatch.setattr(sys, "argv", ["fedproto", *args])
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out + out.err
