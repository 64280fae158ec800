"""Onboarding new clients after training (paper §Discussion: "a new client can start from a
pretrained representation with random decision layers, download the global prototypes of its
classes and fine-tune on the local objective").

:func:`onboard` takes a finished FedProto run directory, draws ``clients`` new clients with the
run's n-way k-shot protocol from the training samples no member used (the members' partition
is rebuilt from the stored config and seed), and trains each one twice from the same
initialisation:

* ``prototypes``: cross-entropy + λ · distance to the run's global prototypes (eq. 7, the run's
  ``distance`` and λ), the prototypes fixed (the server is not asked again);
* ``local``: cross-entropy only (λ = 0), the same data, epochs and randomness.

Each epoch is one call of the run's FedProto client step (a fresh SGD optimizer each epoch, as in
a round). Both arms are evaluated like the members: classifier accuracy and nearest-global-
prototype accuracy (eq. 4) on each new client's own test set, so the gap between the arms is
what the global prototypes give a newcomer. Results go to ``RUN_DIR/onboard/`` (``summary.json``
and ``clients.csv``, written atomically).
"""

from __future__ import annotations

import copy
import csv
import io
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedproto.algorithms.base import ClientData, ClientState
from fedproto.algorithms.fedproto import FedProto
from fedproto.config import RunConfig
from fedproto.data.datasets import load_dataset
from fedproto.data.partition import fewshot_partition
from fedproto.errors import ConfigError, DataError, ModelError
from fedproto.models.base import check_embedding_dims
from fedproto.models.zoo import build_client_models
from fedproto.results import atomic_write_bytes, atomic_write_json
from fedproto.simulation import client_rng, summarize

log = logging.getLogger(__name__)

SEED_TAG = 0x0B0A
"""Mixed into the seed so new clients never repeat the members' draws."""


def _read_run(run_dir: Path) -> tuple[RunConfig, dict[str, np.ndarray]]:
    fix = "pass the folder of a finished `fedproto run --algorithm fedproto` run"
    for name in ("config.json", "summary.json"):
        if not (run_dir / name).is_file():
            raise DataError(f"{str(run_dir)!r} has no {name}; {fix}")
    try:
        stored = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {str(run_dir / 'config.json')!r} ({type(e).__name__}: {e}); {fix}") from None
    if not isinstance(stored, dict):
        raise DataError(f"{str(run_dir / 'config.json')!r} is not a run configuration; {fix}")
    try:
        cfg = RunConfig(**{k: v for k, v in stored.items() if k in RunConfig.model_fields})
    except Exception as e:
        raise DataError(f"{str(run_dir / 'config.json')!r} does not validate ({str(e).splitlines()[0]}); {fix}") from None
    if cfg.algorithm != "fedproto":
        raise ConfigError(f"the run in {str(run_dir)!r} used algorithm={cfg.algorithm!r}; onboarding downloads "
                          "global prototypes, which only a fedproto run has")
    if cfg.partition != "fewshot":
        raise ConfigError(f"the run in {str(run_dir)!r} used partition={cfg.partition!r}; onboarding draws new "
                          "n-way k-shot clients, so it needs a partition='fewshot' run")
    try:
        with np.load(run_dir / "prototypes.npz") as z:
            protos = {"classes": np.asarray(z["classes"], np.int64), "protos": np.asarray(z["protos"], np.float32)}
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"cannot read {str(run_dir / 'prototypes.npz')!r} ({type(e).__name__}: {e}); {fix}") from None
    if len(protos["classes"]) == 0:
        raise DataError(f"{str(run_dir / 'prototypes.npz')!r} holds no global prototypes; {fix}")
    return cfg, protos


def onboard(run_dir: str | Path, clients: int = 5, epochs: int | None = None, seed: int | None = None,
            data_dir: str | None = None, write: bool = True) -> dict[str, Any]:
    """Onboard ``clients`` new clients onto a finished FedProto run (module docstring).

    Args:
        run_dir: the run directory (config.json, summary.json, prototypes.npz).
        clients: number of new clients (>= 1). epochs: local epochs each (default: the run's
            rounds x local_epochs, the budget each member had). seed: new clients' seed (default:
            the run's). data_dir: where the dataset is (default: the run's look-up order).
        write: write ``RUN_DIR/onboard/summary.json`` and ``clients.csv``.
    Returns:
        ``{"arms": {"prototypes"|"local": {"acc": {"mean", "std"}, "acc_proto": {...}}},
        "clients_detail": [per-client rows], "train_idx": [per new client (n_i,) train-split
        indices], ...}``; accuracies in [0, 1].
    Raises:
        DataError: not a finished FedProto run; ConfigError: bad counts or a non-fewshot run;
        PartitionError: the samples the members left cannot supply the new clients (names the
        class); ModelError: the run's model gives another embedding size than its prototypes.
    """
    if not 1 <= clients <= 100_000:
        raise ConfigError(f"clients={clients}: onboard between 1 and 100000 new clients")
    if epochs is not None and not 1 <= epochs <= 1_000_000:
        raise ConfigError(f"epochs={epochs}: use 1 to 1000000 local epochs")
    run_dir = Path(run_dir)
    cfg, message = _read_run(run_dir)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    epochs = epochs or cfg.rounds * cfg.local_epochs
    base_seed = cfg.seed if seed is None else int(seed)
    pseed = int(np.random.SeedSequence([base_seed, SEED_TAG]).generate_state(1)[0])
    ds = load_dataset(cfg.dataset, data_dir if data_dir is not None else cfg.data_dir, download=cfg.download)
    train_y, test_y = ds.train_y.numpy(), ds.test_y.numpy()
    members = fewshot_partition(train_y, test_y, ds.num_classes, cfg.clients, cfg.ways, cfg.shots, cfg.stdev,
                                cfg.test_shots, cfg.noise, cfg.seed, cfg.dataset)
    free = np.setdiff1d(np.arange(len(train_y)), np.concatenate(members.train_idx))
    part = fewshot_partition(train_y[free], test_y, ds.num_classes, clients, cfg.ways, cfg.shots, cfg.stdev,
                             cfg.test_shots, cfg.noise, pseed, cfg.dataset)
    C, H, _ = ds.input_shape
    models = build_client_models(cfg.model, clients, C, ds.num_classes, H, cfg.embedding_dim, cfg.dropout, pseed,
                                 pretrained=cfg.pretrained)
    d = check_embedding_dims(models)
    if d != message["protos"].shape[1]:
        raise ModelError(f"model {cfg.model!r} gives {d}-d embeddings but the run's prototypes are "
                         f"{message['protos'].shape[1]}-d")
    data = [ClientData(ds.train_x[torch.as_tensor(free[tr])], ds.train_y[torch.as_tensor(free[tr])],
                       ds.test_x[torch.as_tensor(te)], ds.test_y[torch.as_tensor(te)])
            for tr, te in zip(part.train_idx, part.test_idx)]
    rows = [{"client": i, "ways": len(c), "classes": " ".join(map(str, c)),
             "classes_without_prototype": " ".join(str(j) for j in c if j not in set(message["classes"].tolist())),
             "train_samples": len(data[i].x), "test_samples": len(data[i].test_y)} for i, c in enumerate(part.classes)]
    arms = {}
    for arm in ("prototypes", "local"):
        alg = FedProto.from_config(cfg, d)
        if arm == "local":
            alg.lambda_proto = 0.0
        for i, model in enumerate(models):
            state = ClientState(i, copy.deepcopy(model), part.classes[i])
            for e in range(1, epochs + 1):
                torch.manual_seed(int(np.random.SeedSequence([pseed, e, i]).generate_state(1)[0]))
                alg.client_update(state, message, data[i], e, client_rng(pseed, e, i))
            res = alg.evaluate(state, message, data[i])
            rows[i].update({f"{arm}_acc": res["acc"], f"{arm}_acc_proto": res["acc_proto"]})
        arms[arm] = {k: dict(zip(("mean", "std"), summarize([r[f"{arm}_{k}"] for r in rows])))
                     for k in ("acc", "acc_proto")}
    summary = {"run": str(run_dir), "clients": clients, "epochs": epochs, "seed": base_seed,
               "lambda_proto": cfg.lam, "arms": arms, "clients_detail": rows,
               "test_set": f"per new client: {cfg.test_shots} test-split samples of each own class"}
    if write:
        out = run_dir / "onboard"
        try:
            atomic_write_json(out / "summary.json", summary)
            buf = io.StringIO()
            w = csv.DictWriter(buf, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
            atomic_write_bytes(out / "clients.csv", buf.getvalue().encode())
        except OSError as e:
            raise ConfigError(f"cannot write {str(e.filename or out)!r}: {e.strerror or e}; make the run "
                              "directory writable or pass write=False") from None
    summary["train_idx"] = [free[tr] for tr in part.train_idx]  # returned, not written: train-split indices
    return summary


__all__ = ["onboard"]
