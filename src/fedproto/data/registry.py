"""The one registry of datasets: classes, input shape, the paper's defaults and the loader.

:class:`~fedproto.config.run_config.RunConfig` fills unset options from it, the CLI and the options page
print its defaults, ``fedproto reproduce`` takes each dataset's models from it, and
:func:`~fedproto.data.datasets.load_dataset` finds the loader here. Adding a dataset means one
:class:`DatasetInfo` entry (and its loader).

Sources of the defaults: rounds are tab. 1's FedProto rounds; the model is the paper's
(§Experiments: the CNN for MNIST and FEMNIST, ResNet18 for CIFAR-10); stdev is tab. 1's spread
of n (MNIST 2, FEMNIST and CIFAR-10 1); λ is app. A's (1 for MNIST and FEMNIST, 0.1 for CIFAR-10);
shots is the paper's k = 100; test shots are the official code's 40 (the shared FEMNIST copy, a
5% LEAF writer sample, holds as few as 3 test samples of some letters, so 3). ``digits``
(scikit-learn's 8x8 digits, about 125 training samples per class) is a small offline stand-in,
not in the paper.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

Loader = Callable[[Optional[str | Path], bool, bool], Any]
"""``loader(root, download, progress) -> Dataset``: the function that :attr:`DatasetInfo.loader`
names as ``"module:function"`` (by name, so the registry imports no loading code and the modules
form no import cycle)."""


@dataclass(frozen=True)
class DatasetInfo:
    """One dataset and the paper's settings for it.

    Attributes:
        name: the ``dataset`` option's value.
        title: how tables and docs name it.
        classes: number of classes C (0 for ``custom``: given by the ``classes`` option).
        input_shape: (channels, height, width) of one sample; None for ``custom``.
        rounds: default communication rounds (tab. 1's FedProto rounds).
        model: default model of every method but FedProto-mh.
        mh_model: FedProto-mh's heterogeneous models.
        stdev: default spread of n and k across clients (tab. 1).
        lambda_proto: default λ (app. A).
        shots: default training samples per class k.
        test_shots: default test samples per own class.
        in_paper: whether the paper reports results on it (tab. 1-4).
        loader: its :data:`Loader` as ``"module:function"`` (one module per dataset, e.g.
            ``"fedproto.data.mnist:load_mnist_files"``); None for ``custom``.
    """

    name: str
    title: str
    classes: int
    input_shape: tuple[int, int, int] | None
    rounds: int
    model: str
    mh_model: str
    stdev: int
    lambda_proto: float
    shots: int
    test_shots: int
    in_paper: bool
    loader: str | None = None

    def defaults(self) -> dict[str, object]:
        """The RunConfig fields this dataset fills when they are not given (:data:`FILLED`)."""
        return {k: getattr(self, k) for k in FILLED}


DATASETS: dict[str, DatasetInfo] = {d.name: d for d in (
    DatasetInfo("mnist", "MNIST", 10, (1, 28, 28), rounds=100, model="cnn", mh_model="cnn-mh", stdev=2,
                lambda_proto=1.0, shots=100, test_shots=40, in_paper=True,
                loader="fedproto.data.mnist:load_mnist_files"),
    DatasetInfo("femnist", "FEMNIST", 62, (1, 28, 28), rounds=120, model="cnn", mh_model="cnn-mh", stdev=1,
                lambda_proto=1.0, shots=100, test_shots=3, in_paper=True,
                loader="fedproto.data.femnist:load_femnist_files"),
    DatasetInfo("cifar10", "CIFAR-10", 10, (3, 32, 32), rounds=110, model="resnet18", mh_model="resnet18-mh",
                stdev=1, lambda_proto=0.1, shots=100, test_shots=40, in_paper=True,
                loader="fedproto.data.cifar10:load_cifar10_files"),
    DatasetInfo("digits", "digits (8x8, scikit-learn)", 10, (1, 8, 8), rounds=20, model="cnn", mh_model="cnn-mh",
                stdev=1, lambda_proto=1.0, shots=10, test_shots=10, in_paper=False,
                loader="fedproto.data.digits:load_digits_bundled"),
    # your own clients (fedproto.federation.federate): classes given by the `classes` option
    DatasetInfo("custom", "your own federation", 0, None, rounds=20, model="custom", mh_model="custom", stdev=0,
                lambda_proto=1.0, shots=1, test_shots=1, in_paper=False),
)}
"""Every dataset by name (``custom``: a federation of your own clients)."""

FILLED = ("stdev", "test_shots", "shots", "model", "rounds")
"""RunConfig fields that a dataset fills in when they are not given (``lambda_proto`` is
resolved by :attr:`RunConfig.lam` instead, so a stored config keeps ``null``)."""

PER_DATASET = (*FILLED, "lambda_proto")
"""RunConfig fields whose default depends on the dataset."""

LOADABLE = tuple(name for name, d in DATASETS.items() if d.loader is not None)
"""Datasets :func:`~fedproto.data.datasets.load_dataset` can load by name."""

PAPER_DATASETS = tuple(name for name, d in DATASETS.items() if d.in_paper)
"""Datasets of the paper's tables, in its order."""


def dataset_info(name: str) -> DatasetInfo:
    """The registry entry of ``name``.

    Raises:
        KeyError: ``name`` is not a registered dataset.
    """
    return DATASETS[name]


def per_dataset_default(field: str) -> str:
    """A per-dataset default as text for help and docs, e.g. ``mnist 100, femnist 120, ...``."""
    def text(v: object) -> str:
        return f"{v:g}" if isinstance(v, float) else str(v)

    return ", ".join(f"{n} {text(getattr(d, field))}" for n, d in DATASETS.items() if d.loader is not None)
