"""The data of a tuning trial: each client's training data split into train and validation, the
test split out of reach.

A trial's set-up is built from :func:`training_only`, a copy of the dataset whose "test" split
*is* its training split, so nothing a trial runs can read a test sample. The clients' training
samples are those of the real run (:func:`fedproto.engine.setup.partition_run`; for the few-shot
partition without ``overlap`` they do not depend on the test split at all), and each client's are
then split per class (:func:`validation_split`, seeded): the trial trains on the first part and is
scored on the second, which the engine evaluates as the clients' "test" sets.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from fedproto.algorithms.algorithm import ClientState
from fedproto.config.run_config import RunConfig
from fedproto.data.datasets import Dataset, load_dataset
from fedproto.engine.setup import Setup, build_setup, client_views, partition_run
from fedproto.errors import ConfigError, PartitionError
from fedproto.models.zoo import build_client_models

SPLIT_STREAM = 0x7A1E
"""The seed stream of the validation split (beside the partition's own)."""


def training_only(ds: Dataset) -> Dataset:
    """``ds`` with its test split replaced by its training split (same tensors, nothing copied):
    what a tuning trial sees. The real test split is not referenced by the result."""
    return replace(ds, test_x=ds.train_x, test_y=ds.train_y, test_groups=ds.train_groups)


def validation_split(train_idx: list[np.ndarray], labels: np.ndarray, fraction: float,
                     seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each client's training rows split per class into (train, validation).

    Of each class a client holds, ``round(n * fraction)`` rows go to validation (at least 1 when
    the client holds 2 or more of the class, never all of them), drawn with a generator seeded by
    ``(seed, client)``; the same arguments give the same split.

    Args:
        train_idx: per client, its (n_i,) int64 rows of the train split.
        labels: (N,) labels of the whole train split.
        fraction: the share of each class held out, 0 < fraction < 1.
        seed: the split's seed.
    Returns:
        (train rows, validation rows) per client, each sorted (n,) int64.
    Raises:
        ConfigError: ``fraction`` outside (0, 1). PartitionError: a client is left without
            validation rows (it holds one sample per class).
    """
    if not 0 < fraction < 1:
        raise ConfigError(f"--val-fraction {fraction!r}: give the share of each client's training data held out "
                          "for validation, between 0 and 1 (e.g. 0.2)")
    fit, val = [], []
    for cid, rows in enumerate(train_idx):
        rows = np.asarray(rows, dtype=np.int64)
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), SPLIT_STREAM, cid]))
        keep, held = [], []
        y = labels[rows]
        for c in np.unique(y):
            mine = rng.permutation(rows[y == c])
            k = min(len(mine) - 1, max(1, int(round(len(mine) * fraction)))) if len(mine) > 1 else 0
            held.append(mine[:k])
            keep.append(mine[k:])
        v = np.sort(np.concatenate(held)) if held else np.zeros(0, np.int64)
        if len(v) == 0:
            raise PartitionError(f"client {cid} holds {len(rows)} training samples, one per class: none can be held "
                                 "out for validation; give the clients more samples (shots) to tune")
        fit.append(np.sort(np.concatenate(keep)).astype(np.int64))
        val.append(v.astype(np.int64))
    return fit, val


def tuning_setup(cfg: RunConfig, fraction: float, split_seed: int, dataset: Dataset | None = None) -> Setup:
    """The set-up of one trial: the run's clients (:func:`fedproto.engine.setup.prepare`'s
    partition and models) trained on their training rows minus the validation rows and
    evaluated on those (the :class:`Setup`'s clients' test sets are validation sets).

    Raises:
        FedprotoError: what :func:`~fedproto.engine.setup.prepare` raises, and
            :func:`validation_split`'s errors.
    """
    if cfg.dataset == "custom":
        raise ConfigError("fedproto tune runs the named datasets (mnist, femnist, cifar10, digits), not custom")
    ds = training_only(dataset or load_dataset(cfg.dataset, cfg.data_dir, download=cfg.download, progress=False,
                                               mapped=True))
    part = partition_run(cfg, ds)
    fit, val = validation_split(part.train_idx, ds.train_y.numpy(), fraction, split_seed)
    part = replace(part, train_idx=fit, test_idx=val)
    C, H, _ = ds.input_shape
    models = build_client_models(cfg.model, part.num_clients, C, ds.num_classes, H, cfg.embedding_dim,
                                 cfg.dropout, cfg.seed, pretrained=cfg.pretrained, shared_init=cfg.shared_init)
    states = [ClientState(i, m, part.classes[i]) for i, m in enumerate(models)]
    return build_setup(cfg, states, client_views(ds, fit, val), part, ds)


__all__ = ["SPLIT_STREAM", "training_only", "tuning_setup", "validation_split"]
