import os
import sys
from pathlib import Path

import pytest

DATA = os.environ.get("FEDPROTO_DATA")


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
