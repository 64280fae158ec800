import os
import sys
from pathlib import Path

import pytest

DATA = os.environ.get("FEDPROTO_DATA")


def allowed_threads() -> int:
    """The threads a test may give one process: ``OMP_NUM_THREADS`` when set (CI, a shared machine),
    else at most 2. No test sets more than this: on a busy 2-core machine, 2 threads where the
    environment allows 1 ran the suite many times slower (issue #20)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return max(1, int(env)) if env.isdigit() else min(2, os.cpu_count() or 1)


SLOW_ENV = "FEDPROTO_SLOW"


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help=f"also run the tests marked slow (long end-to-end checks; or set {SLOW_ENV}=1)")


def pytest_collection_modifyitems(config, items):
    """``slow`` is opt-in: the README's ``python -m pytest -q`` skips those tests, ``--slow`` (or
    ``FEDPROTO_SLOW=1``) runs them; CI runs them in its extras step."""
    if config.getoption("--slow") or os.environ.get(SLOW_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"slow end-to-end check: run with --slow (or {SLOW_ENV}=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
if DATA:  # absolute, so that tests which change the working folder still find the data
    DATA = str(Path(DATA).resolve())
    os.environ["FEDPROTO_DATA"] = DATA


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    """``threads=1`` sets torch's process-wide thread count; each test module gives it back."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _work_in_tmp(tmp_path, monkeypatch):
    """Every test runs in its own empty folder: nothing a test writes (for example a default
    ``runs/`` folder) can touch the checkout or a user's earlier results."""
    monkeypatch.chdir(tmp_path)


def mnist_available() -> bool:
    return bool(DATA) and (Path(DATA) / "mnist" / "train-images-idx3-ubyte.gz").exists()


needs_mnist = pytest.mark.skipif(not mnist_available(), reason="set FEDPROTO_DATA to a folder with mnist/")


def float64_sim(cfg, **kw):
    """A :class:`~fedproto.simulation.Simulation` of ``cfg`` whose models and data are float64.

    Two execution paths are compared in float64 (rounding near 1e-15), so a bound like 1e-9 tells
    a logic difference from rounding on any CPU; in float32 a rounding difference can flip a ReLU
    or max-pool decision that sits within ~1e-7 of a tie, and SGD carries it on (issue #10).
    """
    import torch

    from fedproto.engine.setup import prepare
    from fedproto.simulation import Simulation

    return Simulation(cfg, setup=prepare(cfg, progress=False).to_dtype(torch.float64), out=False, **kw)


def flat_weights(sim):
    """Per client, all parameters as one flat vector."""
    import torch

    return [torch.cat([p.detach().flatten() for p in s.model.parameters()]) for s in sim.setup.states]


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


def digits_fewshot(stdev: int, seed: int = 5):
    """scikit-learn's digits with 4 few-shot clients (3 ways, 25 shots, 10 test shots): (dataset, partition)."""
    from fedproto.data.datasets import load_dataset
    from fedproto.data.partition import fewshot_partition

    ds = load_dataset("digits")
    return ds, fewshot_partition(ds.train_y.numpy(), ds.test_y.numpy(), 10, 4, 3, 25, stdev, 10, seed=seed)


def client_splits(ds, part):
    """Per client of ``part``: ((train x, train y), (test x, test y)) tensors of ``ds``."""
    import torch

    for tr, te in zip(part.train_idx, part.test_idx):
        tr, te = torch.as_tensor(tr), torch.as_tensor(te)
        yield (ds.train_x[tr], ds.train_y[tr]), (ds.test_x[te], ds.test_y[te])
