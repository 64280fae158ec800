"""Tuning your own federation (:func:`fedproto.tune` with ``clients=make_clients``): each
client's training data split per class into train and validation, its test data never passed
to a trial; the final runs :func:`fedproto.federation.federate` the clients as they are.

``make_clients(seed)`` returns the clients anew (fresh models, the split the seed gives), as the
use-case examples' ``make_clients`` do; for ``jobs > 1`` it must be a module-level function (it
is sent to the worker processes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedproto.errors import DataError
from fedproto.tuning.split import validation_split


def _take(x: Any, rows: np.ndarray) -> Any:
    """The ``rows`` of in-memory inputs (a tensor, an array, a dict/tuple/list of them) or of a
    map-style Dataset (a ``Subset``)."""
    if isinstance(x, torch.utils.data.Dataset) and not isinstance(x, torch.Tensor):
        return torch.utils.data.Subset(x, [int(i) for i in rows])
    if isinstance(x, dict):
        return {k: _take(v, rows) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_take(v, rows) for v in x)
    if isinstance(x, torch.Tensor):
        return x[torch.as_tensor(rows, dtype=torch.long)]
    return np.asarray(x)[rows]


def _labels(split: Any, cid: int) -> np.ndarray:
    if isinstance(split, torch.utils.data.Dataset):
        from fedproto.federation.own_data import dataset_labels

        return np.asarray(dataset_labels(split)).astype(np.int64)
    if not (isinstance(split, (tuple, list)) and len(split) == 2):
        raise DataError(f"client {cid}: its train data is neither an (x, y) pair nor a Dataset; give one of them")
    y = split[1]
    return (y.cpu().numpy() if isinstance(y, torch.Tensor) else np.asarray(y)).astype(np.int64).reshape(-1)


def validation_clients(clients: Sequence[Any], fraction: float, seed: int) -> list[Any]:
    """The clients with ``train`` = their training data less the validation share and ``test`` =
    that share (:func:`~fedproto.tuning.split.validation_split`; their own test data left out).

    Raises:
        DataError: a client's training data is neither an ``(x, y)`` pair nor a Dataset.
        ConfigError, PartitionError: :func:`validation_split`'s.
    """
    from fedproto.federation import Client

    labels = [_labels(c.train, i) for i, c in enumerate(clients)]
    offsets = np.cumsum([0, *[len(y) for y in labels]])
    fit, val = validation_split([np.arange(offsets[i], offsets[i + 1]) for i in range(len(clients))],
                                np.concatenate(labels) if labels else np.zeros(0, np.int64), fraction, seed)
    out = []
    for i, c in enumerate(clients):
        f, v = fit[i] - offsets[i], val[i] - offsets[i]
        if isinstance(c.train, torch.utils.data.Dataset):
            train, valid = _take(c.train, f), _take(c.train, v)
        else:
            x, y = c.train
            train, valid = (_take(x, f), _take(y, f)), (_take(x, v), _take(y, v))
        out.append(Client(c.model, train, valid, head=c.head, embedding_dim=c.embedding_dim, collate=c.collate))
    return out


def own_simulation(make_clients: Callable[[int], Sequence[Any]], num_classes: int | None, options: dict,
                   fraction: float, seed: int, on_round: Callable[[dict], None] | None = None):
    """A trial's :class:`~fedproto.simulation.Simulation` of your clients (validation as test; writes nothing)."""
    from fedproto.federation import federate

    sim = federate(validation_clients(make_clients(seed), fraction, seed), num_classes, out=False, **options)
    sim.on_round = on_round
    return sim


def own_final(make_clients: Callable[[int], Sequence[Any]], num_classes: int | None, options: dict, seeds: list[int],
              runs: Path, method: str) -> list[Any]:
    """The final runs of your clients at the best settings, one per seed, each in ``runs/<method>-s<seed>``;
    results with ``.summary`` (``reproduce``'s :class:`~fedproto.reproduce.grid.CellResult`)."""
    from fedproto.federation import federate
    from fedproto.reproduce.grid import Cell, CellResult

    results = []
    for s in seeds:
        sim = federate(make_clients(s), num_classes, out=Path(runs) / f"{method}-s{s}", **{**options, "seed": s})
        results.append(CellResult(Cell("custom", 0, method, s, sim.cfg, f"{method}-s{s}"), "done", sim.run()))
    return results


__all__ = ["own_final", "own_simulation", "validation_clients"]
