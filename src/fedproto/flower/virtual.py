"""Benchmark clients of Flower's simulation runtime: a process holds the clients it serves, not the run.

A benchmark node (node config ``partition-id``, what Flower's simulation runtime gives each virtual
SuperNode) is client ``partition-id`` of the seeded partition of the run's dataset
(:mod:`fedproto.flower.client_app`). Flower runs the virtual nodes' ClientApps in a few Ray actors
(processes), each serving whichever node's message comes next. An actor here holds:

* **the dataset once per machine**: ``load_dataset(..., mapped=True)`` decodes the dataset once
  into its disk cache (:mod:`fedproto.data.decoded`) and maps it, so every actor (and every run on
  the machine) shares one copy, and an actor reads only the labels and the rows of the clients it
  serves;
* **the run's partition and the algorithm**, built once per run: the partition from the labels
  alone (:func:`fedproto.engine.setup.partition_run`), every client's data as an index view
  (labels and row indices; :meth:`fedproto.algorithms.algorithm.ClientData.view`), and the algorithm
  through the same :func:`fedproto.engine.setup.build_setup` as an in-process run, over every
  client, so its options (``batch_size`` capped at the largest client) and checks are those of
  the in-process run. Its model checks see one model per entry of ``model``'s list, built for the
  first client of that entry and dropped afterwards;
* **the models and inputs of the last** :data:`KEEP` **clients it served**: each client's rows read
  from the cache file (:func:`fedproto.data.decoded.read_rows`: the page cache holds the file once
  per machine, the actor only its clients' rows), its model built alone
  (:func:`fedproto.models.zoo.build_client_model`, the in-process run's seed and architecture for
  that client). A client's trained weights live in its node's ``context.state`` (Flower keeps it
  between messages), so a client built again is loaded from there; a client without state there
  gets a freshly built model, i.e. its initial weights.

Memory so grows with the clients' labels and indices, not with their models or inputs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from fedproto.algorithms.algorithm import Algorithm, ClientData, ClientState
from fedproto.config.run_config import RunConfig
from fedproto.data.datasets import Dataset, load_dataset
from fedproto.data.decoded import read_rows
from fedproto.data.partition import Partition
from fedproto.engine.setup import build_setup, client_views, partition_run
from fedproto.models.zoo import build_client_model

KEEP = 4
"""How many clients' models an actor keeps built between messages (the most recently served)."""


@dataclass
class VirtualRun:
    """What an actor holds of one run: its config key, the mapped dataset, the partition, every
    client's index view and the algorithm (built once per run and process)."""

    key: str
    dataset: Dataset
    partition: Partition
    data: list[ClientData]
    algorithm: Algorithm
    device: torch.device

    @property
    def num_clients(self) -> int:
        """The run's number of clients (``clients``)."""
        return self.partition.num_clients


_LOCK = threading.Lock()
_RUN: VirtualRun | None = None
_CLIENTS: OrderedDict[int, tuple[ClientState, ClientData]] = OrderedDict()


def run_for(cfg: RunConfig) -> VirtualRun:
    """This process's :class:`VirtualRun` of ``cfg`` (built on first use; a new config replaces
    the previous run's, one run at a time per process).

    Raises:
        FedprotoError: as :func:`fedproto.engine.setup.prepare` (the dataset, the partition, the
            models, the algorithm's checks).
    """
    global _RUN
    key = cfg.model_dump_json()
    with _LOCK:
        if _RUN is not None and _RUN.key == key:
            return _RUN
        _RUN = None
        _CLIENTS.clear()
        ds = load_dataset(cfg.dataset, cfg.data_dir, download=cfg.download, progress=False, mapped=True,
                          decode_in_child=True)
        part = partition_run(cfg, ds)
        n = part.num_clients
        specs = max(1, len([s for s in cfg.model.split(",") if s.strip()]))
        models = {k: _model(cfg, ds, k, n) for k in range(min(specs, n))}  # one per entry of the list
        states = [ClientState(i, models[i % specs], part.classes[i]) for i in range(n)]
        setup = build_setup(cfg, states, client_views(ds, part.train_idx, part.test_idx), part, ds)
        _RUN = VirtualRun(key, ds, part, setup.data, setup.algorithm, setup.device)
        return _RUN


def virtual_client(cfg: RunConfig, cid: int, fresh: bool) -> tuple[ClientState, ClientData, Algorithm]:
    """Client ``cid`` of the run ``cfg``: its state (model, classes), its data (its own rows, read
    from the dataset's cache file) and the run's algorithm.

    Args:
        cfg: the run config.
        cid: the client id (``partition-id``), in ``0..clients-1``.
        fresh: give the client its initial weights (a freshly built model): its node's context
            holds no state yet. Otherwise the caller loads the state from the context into the
            returned model (a kept model is returned as it is).
    Raises:
        ConfigError: ``cid`` outside ``0..clients-1`` (the node's ``partition-id``); and as
            :func:`run_for`.
    """
    from fedproto.errors import ConfigError

    run = run_for(cfg)
    if not 0 <= cid < run.num_clients:
        raise ConfigError(f"node config partition-id={cid} is outside 0..{run.num_clients - 1} "
                          f"(the run has {run.num_clients} clients)")
    with _LOCK:
        kept = _CLIENTS.get(cid)
        if kept is None or fresh:
            model = _model(cfg, run.dataset, cid, run.num_clients).to(run.device)
            view = run.data[cid]
            data = kept[1] if kept is not None else ClientData(
                read_rows(run.dataset.train_x, run.partition.train_idx[cid]), view.y,
                read_rows(run.dataset.test_x, run.partition.test_idx[cid]), view.test_y).to(run.device)
            kept = (ClientState(cid, model, run.partition.classes[cid]), data)
        _CLIENTS[cid] = kept
        _CLIENTS.move_to_end(cid)
        while len(_CLIENTS) > KEEP:
            _CLIENTS.popitem(last=False)
    return kept[0], kept[1], run.algorithm


def kept_clients() -> list[int]:
    """The ids of the clients whose models this process keeps built, oldest first (at most :data:`KEEP`)."""
    return list(_CLIENTS)


def forget() -> None:
    """Drop the run and the clients this process holds (what a new process starts without)."""
    global _RUN
    with _LOCK:
        _RUN = None
        _CLIENTS.clear()


def _model(cfg: RunConfig, ds: Dataset, cid: int, num_clients: int):
    C, H, _ = ds.input_shape
    return build_client_model(cfg.model, cid, num_clients, C, ds.num_classes, H, cfg.embedding_dim, cfg.dropout,
                              cfg.seed, pretrained=cfg.pretrained, shared_init=cfg.shared_init)


__all__ = ["KEEP", "VirtualRun", "forget", "kept_clients", "run_for", "virtual_client"]
