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
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedproto.algorithms.algorithm import ClientState
from fedproto.algorithms.fedproto import FedProto
from fedproto.config.run_config import RunConfig
from fedproto.data.datasets import load_dataset
from fedproto.data.partition import fewshot_partition
from fedproto.engine.executors.in_process import client_step
from fedproto.engine.setup import build_setup, client_views
from fedproto.engine.summary import summarize
from fedproto.errors import ConfigError, DataError, ModelError, PartitionError, TrainingError, first_line, opt
from fedproto.models.proto_model import check_embedding_dims
from fedproto.models.zoo import build_client_models
from fedproto.outputs.run_folder import PREVIOUS, atomic_write_bytes, atomic_write_json

log = logging.getLogger(__name__)

SEED_TAG = 0x0B0A
"""Mixed into the seed so new clients never repeat the members' draws."""


def _read_run(run_dir: Path) -> tuple[RunConfig, dict[str, np.ndarray], dict | None]:
    fix = "pass the folder of a finished `fedproto run --algorithm fedproto` run"
    if not run_dir.exists():
        raise DataError(f"{str(run_dir)!r} does not exist; {fix}")
    if not run_dir.is_dir():
        raise DataError(f"{str(run_dir)!r} is a file, not a run directory; {fix}")
    for name in ("config.json", "summary.json"):
        if not (run_dir / name).is_file():
            prev = run_dir / PREVIOUS / "summary.json"
            if prev.is_file():
                fix = (f"its earlier finished run waits in {str(prev.parent)!r} while a newer run is unfinished "
                       f"(resume that one with {opt('resume')}, or pass the .previous folder)")
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
        raise DataError(f"{str(run_dir / 'config.json')!r} does not validate ({first_line(e)}); "
                        f"{fix}") from None
    if cfg.algorithm != "fedproto":
        raise ConfigError(f"the run in {str(run_dir)!r} used algorithm={cfg.algorithm!r}; onboarding downloads "
                          "global prototypes, which only a fedproto run has")
    if cfg.partition != "fewshot":
        raise ConfigError(f"the run in {str(run_dir)!r} used partition={cfg.partition!r}; onboarding draws new "
                          "n-way k-shot clients, so it needs a partition='fewshot' run")
    where = str(run_dir / "prototypes.npz")
    if not (run_dir / "prototypes.npz").is_file():
        raise DataError(f"{str(run_dir)!r} has no prototypes.npz; {fix}")
    try:
        with np.load(run_dir / "prototypes.npz") as z:
            classes, protos = np.asarray(z["classes"]), np.asarray(z["protos"])
    except Exception as e:  # damaged zip, empty file, missing arrays: numpy raises many kinds
        raise DataError(f"cannot read {where!r} ({type(e).__name__}); it is damaged: rerun the run") from None
    C = cfg.num_classes
    if len(classes) == 0:
        raise DataError(f"{where!r} holds no global prototypes (no client sent one, e.g. every local prototype "
                        f"was below min_proto_samples={cfg.min_proto_samples}); nothing to onboard onto")
    bad = ""
    if classes.ndim != 1 or classes.dtype.kind not in "iu":
        bad = f"classes of shape {classes.shape} and type {classes.dtype}, not a 1-d integer array"
    elif protos.ndim != 2 or len(protos) != len(classes):
        bad = f"prototypes of shape {protos.shape} for {len(classes)} classes"
    elif classes.min() < 0 or classes.max() >= C or len(np.unique(classes)) != len(classes):
        bad = f"class ids {classes.tolist()[:12]} (need distinct ids in 0..{C - 1})"
    elif not np.isfinite(protos).all():
        bad = "non-finite values in the prototypes"
    if bad:
        raise DataError(f"{where!r} holds {bad}; it is damaged: rerun the run")
    part = stored.get("partition_summary")
    return cfg, {"classes": classes.astype(np.int64), "protos": protos.astype(np.float32)}, (
        part if isinstance(part, dict) else None)


def _fits(train_y: np.ndarray, test_y: np.ndarray, num_classes: int, clients: int, cfg: RunConfig, seed: int) -> bool:
    """True if the unused samples ``train_y`` can supply ``clients`` new clients with this seed."""
    try:
        fewshot_partition(train_y, test_y, num_classes, clients, cfg.ways, cfg.shots, cfg.stdev, cfg.test_shots,
                          cfg.noise, seed, cfg.dataset)
    except PartitionError:
        return False
    return True


def onboard(run_dir: str | Path, clients: int = 5, epochs: int | None = None, seed: int | None = None,
            data_dir: str | None = None, write: bool = True, threads: int | None = None) -> dict[str, Any]:
    """Onboard ``clients`` new clients onto a finished FedProto run (module docstring).

    Args:
        run_dir: the run directory (config.json, summary.json, prototypes.npz).
        clients: number of new clients (>= 1). epochs: local epochs each (default: the run's
            rounds x local_epochs, the budget each member had). seed: new clients' seed (default:
            the run's). data_dir: where the dataset is (default: the run's look-up order).
        write: write ``RUN_DIR/onboard/summary.json`` and ``clients.csv`` (an earlier onboarding's
            files there are replaced). threads: torch threads (default: the run's setting).
    Returns:
        ``{"arms": {"prototypes"|"local": {"acc": {"mean", "std"}, "acc_proto": {...}}},
        "clients_detail": [per-client rows], "train_idx": [per new client (n_i,) train-split
        indices], ...}``; accuracies in [0, 1].
    Raises:
        DataError: not a finished FedProto run, damaged files, or other data than the run's;
        ConfigError: bad counts, a non-fewshot run, an unwritable run directory, or a drop_last run
        whose batch exceeds a new client; TrainingError: a new client's loss is not finite;
        PartitionError: the samples the members left cannot supply the new clients (names the
        class); ModelError: the run's model gives another embedding size than its prototypes.
    """
    if not 1 <= clients <= 100_000:
        raise ConfigError(f"clients={clients}: onboard between 1 and 100000 new clients")
    if epochs is not None and not 1 <= epochs <= 1_000_000:
        raise ConfigError(f"epochs={epochs}: use 1 to 1000000 local epochs")
    if seed is not None and not 0 <= seed < 2**32:
        raise ConfigError(f"seed={seed}: use a seed in 0..{2**32 - 1}")
    if threads is not None and not 0 <= threads <= 1024:
        raise ConfigError(f"threads={threads}: use 0 (torch's default) to 1024")
    run_dir = Path(run_dir)
    cfg, message, stored_partition = _read_run(run_dir)
    if threads or (threads is None and cfg.threads):
        torch.set_num_threads(threads or cfg.threads)
    out = run_dir / "onboard"
    if write:  # fail before training, not after it
        try:
            out.mkdir(exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=out, prefix=".write-check-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise ConfigError(f"cannot write {str(out)!r}: {e.strerror or e}; "
                              "make the run directory writable") from None
    epochs = epochs or cfg.rounds * cfg.local_epochs
    base_seed = cfg.seed if seed is None else int(seed)
    pseed = int(np.random.SeedSequence([base_seed, SEED_TAG]).generate_state(1)[0])
    ds = load_dataset(cfg.dataset, data_dir if data_dir is not None else cfg.data_dir, download=cfg.download)
    train_y, test_y = ds.train_y.numpy(), ds.test_y.numpy()
    members = fewshot_partition(train_y, test_y, ds.num_classes, cfg.clients, cfg.ways, cfg.shots, cfg.stdev,
                                cfg.test_shots, cfg.noise, cfg.seed, cfg.dataset, overlap=cfg.overlap)
    stored = (stored_partition or {}).get("train_samples_total")
    if stored is not None and stored != members.summary()["train_samples_total"]:
        raise DataError(f"the {cfg.dataset} data read now gives the members {members.summary()['train_samples_total']} "
                        f"training samples, the run had {stored}: it is not the data the run used; pass its "
                        f"folder with {opt('data_dir')}")
    free = np.setdiff1d(np.arange(len(train_y)), np.concatenate(members.train_idx))
    try:
        part = fewshot_partition(train_y[free], test_y, ds.num_classes, clients, cfg.ways, cfg.shots, cfg.stdev,
                                 cfg.test_shots, cfg.noise, pseed, cfg.dataset)
    except PartitionError as e:
        if e.short_class is None:
            raise
        # the largest count that fits, by bisection (fitting is close to monotone in the count; the
        # answer is checked, so the advice never names a count that fails)
        lo, hi = 0, clients - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if _fits(train_y[free], test_y, ds.num_classes, mid, cfg, pseed) else (lo, mid - 1)
        advice = (f"{opt('clients', lo)} fits with this {opt('seed')} (or try another {opt('seed')})" if lo >= 1
                  else f"no smaller {opt('clients')} fits with this {opt('seed')}: try another {opt('seed')}")
        raise PartitionError(
            f"the {len(free)} training samples the run's clients left unused cannot supply {clients} new clients: "
            f"class {e.short_class} runs short ({e.needed} samples needed, {e.available} unused; "
            f"{e.short_classes} class(es) short in all). New clients draw their classes and shots as the run's "
            f"clients did (ways {cfg.ways}, shots {cfg.shots}, stdev {cfg.stdev}); {advice}",
            short_class=e.short_class, needed=e.needed, available=e.available, short_classes=e.short_classes,
        ) from None
    if cfg.drop_last:
        small = [i for i, tr in enumerate(part.train_idx) if len(tr) < cfg.batch_size]
        if small:
            raise ConfigError(f"the run used drop_last with batch_size={cfg.batch_size}, so new clients {small[:10]} "
                              f"(client {small[0]}: {len(part.train_idx[small[0]])} samples) would get no batch; "
                              f"onboard other clients ({opt('seed')}) or onboard a run without drop_last")
    C, H, _ = ds.input_shape
    models = build_client_models(cfg.model, clients, C, ds.num_classes, H, cfg.embedding_dim, cfg.dropout, pseed,
                                 pretrained=cfg.pretrained, shared_init=cfg.shared_init)
    d = check_embedding_dims(models)
    if d != message["protos"].shape[1]:
        raise ModelError(f"model {cfg.model!r} gives {d}-d embeddings but the run's prototypes are "
                         f"{message['protos'].shape[1]}-d")
    data = client_views(ds, [free[tr] for tr in part.train_idx], part.test_idx)
    # the checks and resolved options of every front end (batch size capped to the new clients' data)
    setup = build_setup(cfg, [ClientState(i, m, part.classes[i]) for i, m in enumerate(models)], data, part, ds,
                        place=False, whole=False)
    rows = [{"client": i, "ways": len(c), "classes": " ".join(map(str, c)),
             "classes_without_prototype": " ".join(str(j) for j in c if j not in set(message["classes"].tolist())),
             "train_samples": len(data[i].y), "test_samples": len(data[i].test_y)} for i, c in enumerate(part.classes)]
    arms = {}
    for arm in ("prototypes", "local"):
        alg = FedProto.from_config(cfg, d)
        alg.opt = setup.algorithm.opt
        alg.local_epochs = 1  # one client step = one epoch, so ``epochs`` counts real epochs
        if arm == "local":
            alg.lambda_proto = 0.0
        for i, model in enumerate(models):
            state = ClientState(i, copy.deepcopy(model), part.classes[i])
            for e in range(1, epochs + 1):
                _, res = client_step(alg, state, message, data[i], pseed, e)  # epoch e as round e
                if not np.isfinite([res.loss_ce, res.loss_proto]).all():
                    raise TrainingError(f"new client {i} diverged in epoch {e} ({arm}): the loss is not finite; "
                                        f"the run's lr={cfg.lr} and λ={cfg.lam} do not suit it")
            res = alg.evaluate(state, message, data[i])
            rows[i].update({f"{arm}_acc": res["acc"], f"{arm}_acc_proto": res["acc_proto"]})
        arms[arm] = {k: dict(zip(("mean", "std"), summarize([r[f"{arm}_{k}"] for r in rows])))
                     for k in ("acc", "acc_proto")}
    summary = {"run": str(run_dir), "clients": clients, "epochs": epochs, "seed": base_seed,
               "lambda_proto": cfg.lam, "arms": arms, "clients_detail": rows,
               "test_set": f"per new client: {cfg.test_shots} test-split samples of each own class"}
    if write:
        try:
            atomic_write_json(out / "summary.json", summary)
            buf = io.StringIO()
            w = csv.DictWriter(buf, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
            atomic_write_bytes(out / "clients.csv", buf.getvalue().encode())
        except OSError as e:
            raise ConfigError(f"cannot write {str(e.filename or out)!r}: {e.strerror or e}; make the run "
                              "directory writable") from None
    summary["train_idx"] = [free[tr] for tr in part.train_idx]  # returned, not written: train-split indices
    return summary


__all__ = ["onboard"]
