import os
from pathlib import Path

import pytest

DATA = os.environ.get("FEDPROTO_DATA")


def mnist_available() -> bool:
    return bool(DATA) and (Path(DATA) / "mnist" / "train-images-idx3-ubyte.gz").exists()


needs_mnist = pytest.mark.skipif(not mnist_available(), reason="set FEDPROTO_DATA to a folder with mnist/")
