from __future__ import annotations

import csv
import functools
import os
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

# pytest hooks: which Flower tests ran or were skipped, and why (one skipped line per test without the extra)
from flower_report import pytest_pycollect_makemodule, pytest_terminal_summary  # noqa: F401
from torch import nn

from fedproto.config.run_config import build_config
from fedproto.data.partition import fewshot_partition
from fedproto.engine.setup import prepare
from fedproto.federation import Client
from fedproto.models.resnet import ResNet18
from fedproto.simulation import Simulation

# tests/flower/flower_helpers.py (the Flower tests' LocalGrid, node folders, ...) imports as ``from flower_helpers
# import ...`` in every test folder, also where a file of another folder (tests/engine/test_method_executors.py)
# is collected before tests/flower or runs alone: pytest puts a test file's own folder on sys.path, no other
sys.path.insert(0, str(Path(__file__).resolve().parent / "flower"))

DATA = os.environ.get("FEDPROTO_DATA")


def allowed_threads() -> int:
    """The threads a test may give one process: ``OMP_NUM_THREADS`` (1 unless set before the suite starts,
    see :func:`pytest_configure`). No test sets more than this: on a busy 2-core machine, 2 threads where the
    environment allows 1 ran the suite many times slower."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return max(1, int(env)) if env.isdigit() else min(2, os.cpu_count() or 1)


SLOW_ENV = "FEDPROTO_SLOW"


def pytest_configure(config):
    """The suite gives each process one thread unless ``OMP_NUM_THREADS`` says otherwise: torch's default
    (every core) made the README's ``python -m pytest -q`` many times slower on a machine other jobs share.
    The variable is set for the processes the tests start too."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(allowed_threads())


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


@pytest.fixture(autouse=True, scope="session")
def _library_registry():
    """The suite sees the library's methods and the plug-ins its tests register, never the
    plug-in packages installed on the machine (:func:`fedproto.plugins.scope`)."""
    from fedproto import plugins

    os.environ[plugins.NO_ENTRY_POINTS] = "1"  # the processes the tests start (CLI, Flower, workers) too
    with plugins.scope():
        yield


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
    or max-pool decision that sits within ~1e-7 of a tie, and SGD carries it on.
    """
    import torch


    return Simulation(cfg, setup=prepare(cfg, progress=False).to_dtype(torch.float64), **{"out": False, **kw})


def flat_weights(sim):
    """Per client, all parameters as one flat vector."""
    import torch

    return [torch.cat([p.detach().flatten() for p in s.model.parameters()]) for s in sim.setup.states]


def run_cli(args, capsys, monkeypatch):
    """Run ``fedproto ARGS`` in-process; returns (exit code, stdout + stderr)."""
    from fedproto.cli.app import main

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

    ds = load_dataset("digits")
    return ds, fewshot_partition(ds.train_y.numpy(), ds.test_y.numpy(), 10, 4, 3, 25, stdev, 10, seed=seed)


def client_splits(ds, part):
    """Per client of ``part``: ((train x, train y), (test x, test y)) tensors of ``ds``."""
    import torch

    for tr, te in zip(part.train_idx, part.test_idx):
        tr, te = torch.as_tensor(tr), torch.as_tensor(te)
        yield (ds.train_x[tr], ds.train_y[tr]), (ds.test_x[te], ds.test_y[te])


# -- functions shared by the tests of several modules -----------------------------------------------
class DigitsTwoOut(nn.Module):
    """A user's module returning (logits, 64-d embedding) for 8x8 digits."""

    def __init__(self, d=64):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, d), nn.ReLU())
        self.out = nn.Linear(d, 10)

    def forward(self, x):
        h = self.body(x)
        return self.out(h), h


def own_digits_clients(n=3, seed=0):
    """``n`` clients of your own (digits, Dirichlet-like skew by hand), 64-d models."""
    from fedproto.data.datasets import load_dataset

    ds = load_dataset("digits")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        classes = np.sort(rng.choice(10, size=4, replace=False))
        tr = np.flatnonzero(np.isin(ds.train_y.numpy(), classes))[i::n][:40]
        te = np.flatnonzero(np.isin(ds.test_y.numpy(), classes))[:20]
        torch.manual_seed(i)
        out.append(Client(DigitsTwoOut(), (ds.train_x[tr], ds.train_y[tr]), (ds.test_x[te], ds.test_y[te])))
    return out


# a small digits run: the options the tests of several modules start from
SMALL = {"dataset": "digits", "threads": 1, "eval_every": 0}


def csv_rows(path):
    """The rows of a CSV file (a run's clients.csv) as dicts of strings."""
    with open(path) as f:
        return list(csv.DictReader(f))


class Interrupted(Exception):
    """Raised by :func:`interrupt_at`'s callback: a run stopped from outside (a test's kill)."""


def interrupt_at(round_: int):
    """An ``on_round`` callback that stops a Simulation when round ``round_`` ends (raises
    :class:`Interrupted`), so that a test can resume it from its checkpoint."""

    def on_round(row):
        if row["round"] == round_:
            raise Interrupted

    return on_round


def digits_config(**kw):
    """A RunConfig of 6 digits clients (3 ways, 25 shots), 4 rounds, no evaluation, one thread; ``kw`` overrides."""
    base = dict(dataset="digits", clients=6, ways=3, shots=25, stdev=1, test_shots=10, rounds=4, eval_every=0,
                threads=1)
    return build_config(overrides={**base, **kw})


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors: one intra-op thread is as fast, and immune to the 10-50x slowdown of
    oversubscribed OpenMP threads when other processes share the CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def digits_eval_config(**kw):
    """A RunConfig of 6 digits clients (3 ways, 25 shots), 3 rounds evaluated every round; ``kw`` overrides."""
    base = dict(dataset="digits", clients=6, ways=3, shots=25, stdev=1, test_shots=10, rounds=3, eval_every=1)
    base.update(kw)
    return build_config(overrides=base)


def honest_replies(rng, refs, clients):
    """Honest replies near the references: per client (classes, protos (K, 2), counts)."""
    out = []
    for cls in clients:
        cls = np.array(cls)
        out.append((cls, refs[cls] + rng.normal(0, 0.3, (len(cls), 2)), np.full(len(cls), 5)))
    return out


REFS = np.array([[0.0, 4.0], [4.0, 0.0], [0.0, -4.0], [-4.0, 0.0]])  # global prototypes of 4 classes


def has_data(*parts: str) -> bool:
    """Whether FEDPROTO_DATA holds the path ``parts`` (for example ``"cifar10"``)."""
    return bool(DATA) and Path(DATA, *parts).exists()


needs_cifar = pytest.mark.skipif(not has_data("cifar10"), reason="set FEDPROTO_DATA to a folder with cifar10/")


def saved_resnet18_weights(tmp_path) -> tuple[Path, dict]:
    """A perturbed ResNet18 (1000 classes) state dict saved under ``tmp_path``: (its path, the state dict)."""
    torch.manual_seed(1)
    sd = ResNet18(num_classes=1000).state_dict()
    sd = {k: (v + 1.0 if v.is_floating_point() else v + 7) for k, v in sd.items()}  # perturbed
    path = tmp_path / "resnet18.pth"
    torch.save(sd, path)
    return path, sd


needs_femnist = pytest.mark.skipif(not has_data("femnist"), reason="set FEDPROTO_DATA to a folder with femnist/")


PNG = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    """``path`` is a PNG file of more than 1 KiB."""
    data = path.read_bytes()
    assert data[:8] == PNG, path
    assert len(data) > 1024, path


@pytest.fixture(scope="session")
def private_cache(tmp_path_factory: pytest.TempPathFactory):
    """Keep every test's cache writes (downloads, extractions) out of the user's home."""
    from fedproto.data import mnist

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        mp.delenv(mnist.MNIST_MIRRORS_ENV, raising=False)
        yield


class QuietHandler(SimpleHTTPRequestHandler):
    """The test HTTP server's handler, without a log line per request."""

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture
def http_root(tmp_path: Path):
    """Serve tmp_path/www on 127.0.0.1; yields (folder, base URL)."""
    www = tmp_path / "www"
    www.mkdir()
    handler = functools.partial(QuietHandler, directory=str(www))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield www, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def leftovers(folder: Path, expected: set[str]) -> list[str]:
    """The names in ``folder`` other than ``expected`` (temporary files a download left behind)."""
    if not folder.exists():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name not in expected)


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No FEDPROTO_DATA and an empty cache folder: only an explicit root can hold data."""
    monkeypatch.delenv("FEDPROTO_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


# the documentation folder of this checkout
DOCS = Path(__file__).resolve().parents[1] / "docs"


def digits_clients_partition():
    """The digits dataset and a 10-client few-shot partition of it (ways 4, shots 3, 25 test samples,
    seed 5): the own-federation tests' clients (``client_splits(*digits_clients_partition())``)."""
    from fedproto.data.datasets import load_dataset

    ds = load_dataset("digits")
    part = fewshot_partition(ds.train_y.numpy(), ds.test_y.numpy(), 10, 4, 3, 25, 0, 10, seed=5)
    return ds, part


class SmallCNN(nn.Module):
    """The guide's kind of user model: a classifier ending in ``fc`` on ``d`` features; clients
    whose d is not 16 are given ``embedding_dim=16``, so fedproto appends a projection and a new head."""

    def __init__(self, width=8, d=16):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                      nn.Linear(width * 16, d), nn.ReLU())
        self.fc = nn.Linear(d, 10)

    def forward(self, x):
        return self.fc(self.features(x))
