"""The in-process round engine (DESIGN.md "Engines").

Owns rounds, seeding, client batching, timing, progress, metrics and the run directory. It never
knows which algorithm it runs beyond the :class:`~fedproto.algorithms.base.Algorithm` hooks.

Seeding: the partition, each client's model initialisation and each client's per-round
randomness (batch order, dropout masks) come from ``numpy.random.SeedSequence([seed, round,
client])``-style streams, so results do not depend on execution mode or client order.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from fedproto.algorithms import ALGORITHMS
from fedproto.algorithms.base import (
    HEALTH_KEYS,
    Algorithm,
    ClientData,
    ClientState,
    Message,
    SharedInputs,
    message_size,
)
from fedproto.attacks import attacker_ids, corrupt_message
from fedproto.checkpoint import load_checkpoint, save_checkpoint
from fedproto.config import ADDED_FIELDS, RESULT_ONLY_FOR, RunConfig, result_fields
from fedproto.data.datasets import Dataset, load_dataset
from fedproto.data.partition import Partition, dirichlet_partition, fewshot_partition, natural_partition
from fedproto.devices import resolve_device
from fedproto.errors import (
    CheckpointError,
    CheckpointMismatch,
    ConfigError,
    PartitionError,
    TrainingError,
    first_line,
    opt,
)
from fedproto.models.base import ProtoModel, check_embedding_dims, count_parameters
from fedproto.models.zoo import build_client_models
from fedproto.results import PREVIOUS, RunDir, round_line
from fedproto.training import (
    EMBED_NORM_LIMIT,
    EVAL_TRAIN_NORM_RATIO,
    Objective,
    batch_key,
    can_batch,
    generic_batch_problem,
    generic_key,
    has_batchnorm,
    portable_objective,
    predict,
    stack_plans,
    stacked_refs,
    train_group,
    train_group_generic,
)

log = logging.getLogger(__name__)

ALERTS_PER_CLIENT = 3
"""Prototype-distance warnings (``proto_dist_alert``) logged per client in a run; later rounds are
only in the metrics."""


def build_algorithm(cfg: RunConfig, embedding_dim: int) -> Algorithm:
    """The configured algorithm (raises :class:`ConfigError` for an unknown name)."""
    if cfg.algorithm not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {cfg.algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    alg = ALGORITHMS[cfg.algorithm].from_config(cfg, embedding_dim)
    alg.freeze_after = cfg.freeze_after
    return alg


def client_rng(seed: int, round: int, cid: int) -> np.random.Generator:
    """The generator of client ``cid`` in ``round`` (independent of order and execution mode)."""
    return np.random.default_rng(np.random.SeedSequence([seed, round, cid, 0xC1]))


def client_seed(seed: int, round: int, cid: int) -> int:
    """The torch seed set before client ``cid``'s step in ``round`` on the sequential path (weight
    noise of heterogeneous layers, anything drawn from torch's global generator)."""
    return int(np.random.SeedSequence([seed, round, cid]).generate_state(1)[0])


def sample_clients(seed: int, round: int, num_clients: int, participation: float) -> list[int]:
    """The clients that take part in ``round``: all when ``participation`` is 1 (paper); for a
    fraction in (0, 1), ``max(1, round(participation * num_clients))`` of them; for a whole number
    above 1, that many. They are drawn without replacement from a generator of (seed, round)
    alone, so the draw is the same in every engine and on resume.

    Returns:
        Sorted client ids.
    Raises:
        ValueError: ``participation`` <= 0, or above 1 and not a whole number <= ``num_clients``.
    """
    if not participation > 0 or (participation > 1 and (participation != int(participation)
                                                          or participation > num_clients)):
        if participation > num_clients and participation == int(participation):
            raise ValueError(f"participation={participation:g} is more than the {num_clients} clients")
        raise ValueError(f"participation={participation} is neither a fraction in (0, 1] nor a whole number of "
                         f"clients up to {num_clients}")
    if participation == 1.0 or participation == num_clients:
        return list(range(num_clients))
    k = int(participation) if participation > 1 else max(1, int(np.rint(participation * num_clients)))
    rng = np.random.default_rng(np.random.SeedSequence([seed, round, 0x5A4D]))
    return sorted(int(i) for i in rng.choice(num_clients, size=k, replace=False))


class _TrainInputs(Mapping):
    """Client id -> its training inputs ``data[i].x``, read (for an index view: gathered) on access:
    the worker pool copies the clients one at a time into its shared block."""

    def __init__(self, data: list[ClientData], ids: list[int]):
        self._data, self._ids, self._known = data, ids, set(ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in self._known:
            raise KeyError(i)
        return self._data[i].x

    def __iter__(self):
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


def _balanced_parts(members: list[int], sizes: list[int], parts: int) -> list[list[int]]:
    """``members`` split into at most ``parts`` parts of about equal total ``sizes`` (training
    samples), none empty, each in the order of ``members``: the largest first, each to the part
    with the least so far (longest-processing-time-first)."""
    if parts <= 1 or len(members) <= 1:
        return [list(members)]
    k = min(parts, len(members))
    load = [0] * k
    pos: list[list[int]] = [[] for _ in range(k)]
    for j in sorted(range(len(members)), key=lambda j: (-sizes[j], j)):
        p = min(range(k), key=lambda q: (load[q], q))
        load[p] += sizes[j]
        pos[p].append(j)
    return [[members[j] for j in sorted(p)] for p in pos]


def client_step(alg: Algorithm, state: ClientState, message: Message, data: ClientData, seed: int,
                round: int) -> tuple[Message, object]:
    """One client's step in ``round``, as every engine runs it (the simulator's sequential path,
    the Flower ClientApp, onboarding): torch's generator seeded by :func:`client_seed` and the
    client's numpy generator :func:`client_rng`, then :meth:`Algorithm.client_update`. Returns the
    client's message and its :class:`~fedproto.training.TrainResult`."""
    torch.manual_seed(client_seed(seed, round, state.cid))
    alg.opt = alg.opt.at_round(round)  # issue #24: the round's lr (lr_schedule), on every engine
    return alg.client_update(state, message, data, round, client_rng(seed, round, state.cid))


def reply_problem(alg: Algorithm, reply, sent: Message, embedding_dim: int) -> str:
    """What is wrong with a client's reply ('' if nothing): it must be a dict of numeric numpy
    arrays, then pass the algorithm's own check (:meth:`Algorithm.reply_problem`: shapes, finite
    values, class ids, counts). Every engine checks replies with this before aggregating."""
    if not isinstance(reply, dict):
        return f"is a {type(reply).__name__}, not a dict of arrays"
    for k, v in reply.items():
        if not isinstance(v, np.ndarray):
            return f"entry {k!r} is a {type(v).__name__}, not an array"
        if v.dtype.kind not in "biuf":
            return f"entry {k!r} has dtype {v.dtype}, not a number type"
    return alg.reply_problem(reply, sent, embedding_dim)


def summarize(values: list[float]) -> tuple[float, float]:
    """Mean and population standard deviation over clients (each counted once), NaNs dropped."""
    v = np.asarray([x for x in values if x == x], dtype=np.float64)
    if len(v) == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std())


def check_batches(cfg: RunConfig, models: list, train_sizes: list[int]) -> None:
    """Checks of the batch size against the clients, shared by :func:`prepare` and
    :func:`fedproto.federation.federate`: a warning for BatchNorm models with batch size < 4
    (see :func:`fedproto.training.min_batch`); ConfigError when ``drop_last`` leaves a client with
    no batch (names the clients)."""
    if cfg.batch_size < 4 and any(has_batchnorm(m) for m in models):
        log.warning("batch_size=%d with BatchNorm models (%s): each step normalises with the statistics of %d "
                    "sample(s), too few where maps are 1x1 (ResNet18's layer4); use batch_size 4 or more",
                    cfg.batch_size, cfg.model, cfg.batch_size)
    if cfg.drop_last:
        small = [i for i, n in enumerate(train_sizes) if n < cfg.batch_size]
        if small:
            raise ConfigError(
                f"{opt('batch_size', cfg.batch_size)} with {opt('drop_last', True)} leaves clients {small[:10]} with "
                f"no batch (client {small[0]} holds {train_sizes[small[0]]} samples)", option="batch_size",
                value=cfg.batch_size, hint=f"lower {opt('batch_size')} or use {opt('drop_last', False)}")


@dataclass
class Setup:
    """Everything built before round 1 (all config errors surface while building it)."""

    dataset: Dataset
    partition: Partition
    states: list[ClientState]
    data: list[ClientData]
    algorithm: Algorithm
    embedding_dim: int
    device: torch.device = torch.device("cpu")

    def to_device(self, device: torch.device) -> Setup:
        """Move every client model and every client's in-memory data (labels always) to ``device``
        in place; returns self. Inputs that clients' index views share (:class:`SharedInputs`) move
        once for all of them. Data read from a ``Dataset`` stays where it is read, batch by batch."""
        self.device = torch.device(device)
        for s in self.states:
            s.model.to(self.device)
        shared = {}
        for d in self.data:
            d.to(self.device)
            shared.update((id(src), src) for src in d.shared_inputs())
        for src in shared.values():
            src.tensor = src.tensor.to(self.device)
        return self

    def to_dtype(self, dtype: torch.dtype) -> Setup:
        """Cast every client model and every client's data to ``dtype`` in place; returns self.

        ``torch.float64`` is for checks: rounding then sits near 1e-15, so two execution paths that
        agree there agree in logic. In float32 they may not agree on this machine or across CPUs:
        a rounding difference of ~1e-7 can flip a ReLU or max-pool decision whose input is within
        that distance of a tie, and SGD then carries the difference on (issue #10). Messages stay
        float32 (prototypes) or take the models' dtype (weights).
        """
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype {dtype}: use torch.float32 (training) or torch.float64 (checks)")
        for s in self.states:
            s.model.to(dtype)
        for d in self.data:
            d.to(dtype=dtype)  # an index view casts the rows it gathers, not the whole shared split
        return self


def prepare(cfg: RunConfig, dataset: Dataset | None = None, progress: bool = True) -> Setup:
    """Load data, partition, build client models and the algorithm; raises FedprotoError subclasses.

    ``cfg.partition``: ``fewshot`` (the paper's n-way k-shot protocol, any dataset) or ``natural``
    (one client per writer; needs writer ids, i.e. FEMNIST; ``ways``, ``shots``, ``stdev`` and
    ``test_shots`` are then unused). ``cfg.pretrained``: resnet18 weights for ResNet18 clients.
    ``cfg.augment`` acts in training (see :class:`fedproto.training.OptimConfig`).
    """
    if cfg.dataset == "custom":
        raise ConfigError("dataset 'custom' holds your own clients: build the run with fedproto.federation.federate("
                          "clients, num_classes, ...) from Python; the command line runs mnist, femnist, cifar10, "
                          "digits")
    ds = dataset or load_dataset(cfg.dataset, cfg.data_dir, download=cfg.download, progress=progress)
    if cfg.partition == "natural":
        if ds.train_groups is None or ds.test_groups is None:
            raise ConfigError(
                f"partition='natural' needs a dataset with writer ids (femnist); {cfg.dataset!r} has "
                "none: use partition='fewshot'"
            )
        part = natural_partition(ds.train_groups, ds.test_groups, ds.train_y.numpy(), ds.test_y.numpy(),
                                 cfg.clients, cfg.seed)
    elif cfg.partition == "dirichlet":
        part = dirichlet_partition(ds.train_y.numpy(), ds.test_y.numpy(), ds.num_classes, cfg.clients, cfg.alpha,
                                   cfg.min_client_samples, cfg.test_shots, cfg.seed)
    else:
        part = fewshot_partition(
            ds.train_y.numpy(), ds.test_y.numpy(), ds.num_classes, cfg.clients, cfg.ways, cfg.shots,
            cfg.stdev, cfg.test_shots, cfg.noise, cfg.seed, cfg.dataset, overlap=cfg.overlap,
        )
    empty = [i for i, (tr, te) in enumerate(zip(part.train_idx, part.test_idx)) if len(tr) == 0 or len(te) == 0]
    if empty:
        raise PartitionError(f"clients {empty[:10]} hold no training or no test samples; give every client data "
                             f"(for {opt('partition', 'dirichlet')}: raise {opt('min_client_samples')} or "
                             f"{opt('alpha')}, or use fewer {opt('clients')})")
    if cfg.augment and ds.input_shape[0] != 3:
        log.warning("augment is on for %s: horizontal flips suit natural images (CIFAR-10), not "
                    "digits or letters", cfg.dataset)
    C, H, _ = ds.input_shape
    models = build_client_models(cfg.model, part.num_clients, C, ds.num_classes, H, cfg.embedding_dim,
                                 cfg.dropout, cfg.seed, pretrained=cfg.pretrained,
                                 shared_init=cfg.shared_init)  # issue #24
    states = [ClientState(i, m, part.classes[i]) for i, m in enumerate(models)]
    return build_setup(cfg, states, client_views(ds, part.train_idx, part.test_idx), part, ds)


def client_views(ds: Dataset, train_idx: list, test_idx: list) -> list[ClientData]:
    """Each client's data as an index view into ``ds`` (:meth:`ClientData.view`): one copy of each
    split's inputs for all clients, each client's rows gathered when read (issue #25: at 10,000
    clients the per-client copies of the test images were 3.8 GB).

    Args:
        ds: the dataset. train_idx, test_idx: per client, its (n_i,) rows of the train and the test split.
    Returns:
        One :class:`ClientData` per client, with its labels gathered (int64) and its inputs a view.
    """
    train, test = SharedInputs(ds.train_x), SharedInputs(ds.test_x)
    out = []
    for tr, te in zip(train_idx, test_idx):
        tr, te = torch.as_tensor(tr, dtype=torch.long), torch.as_tensor(te, dtype=torch.long)
        out.append(ClientData.view(train, tr, ds.train_y[tr], test, te, ds.test_y[te]))
    return out


def build_setup(cfg: RunConfig, states: list[ClientState], data: list[ClientData], partition: Partition,
                dataset: Dataset | None = None, place: bool = True, whole: bool = True) -> Setup:
    """The one set-up every front end finishes with (``fedproto run`` through :func:`prepare`,
    :func:`fedproto.federation.federate`, the Flower nodes, onboarding): the checks of the clients
    against the options, the algorithm, and the options resolved against the data, so a check
    added here holds everywhere.

    In order: the embedding sizes agree (:func:`~fedproto.models.base.check_embedding_dims`), the
    batch size suits the clients (:func:`check_batches`), a warning for options the algorithm
    ignores, the algorithm built and its own checks (``check_setup``, ``check_models``), a
    warning naming the clients whose test sets hold classes absent from their training sets,
    and ``batch_size`` capped at the largest client's training samples (a wider batch only adds
    padding; the cap is ``Setup.algorithm.opt.batch_size``, and ``config.json``'s
    ``batch_size_in_force``).

    Args:
        cfg: the validated run configuration.
        states: one per client, in client order (``states[i].cid`` names the client in messages).
        data: one per client, in the order of ``states``; ``data[i].y`` and ``data[i].test_y`` are
            (n,) int64 label tensors.
        partition: the clients' sample indices and classes (``config.json``'s
            ``partition_summary``).
        dataset: the loaded dataset (None for your own clients).
        place: move the models and in-memory data to ``cfg.device`` (False: leave them where they are).
        whole: the clients are the whole federation; False for some clients of one (a Flower
            node's own client, onboarding's new clients): the algorithm's federation-wide checks
            (``check_setup``: enough holders of a class for ``min_contributors``...) are skipped.
    Returns:
        The :class:`Setup`.
    Raises:
        ModelError: embedding sizes differ (names the clients). ConfigError: the batch size leaves a
            client without a batch, or the algorithm refuses the clients' models or labels.
    """
    models = [s.model for s in states]
    d = check_embedding_dims(models)
    check_batches(cfg, models, [len(x.y) for x in data])
    unused = [k for k, algs in RESULT_ONLY_FOR.items() if cfg.algorithm not in algs
              and getattr(cfg, k) != RunConfig.model_fields[k].default]
    if unused:
        log.warning("%s ignores %s: %s", cfg.algorithm, ", ".join(unused), "; ".join(
            f"{k} acts on {', '.join(RESULT_ONLY_FOR[k])} only" for k in unused))
    if cfg.dp_reproducible_noise:
        log.warning("dp_reproducible_noise: %s", "ignored, it acts with dp prototypes or full only" if cfg.dp == "off"
                    else "the DP noise is drawn from the run's seed, so the privacy guarantee does not hold against "
                         "anyone who knows the seed (use it for reproducible experiments only)")
    alg = build_algorithm(cfg, d)
    if whole:
        alg.check_setup(cfg, [x.y.cpu().numpy() for x in data])
    alg.check_models(models)
    warn_unseen_test_classes(states, data)
    # a batch wider than the largest client only adds padding (and memory for its dropout masks);
    # every step would hold the same samples, so cap it there
    largest = max((len(x.y) for x in data), default=1)
    if alg.opt.batch_size > largest > 0:
        alg.opt = replace(alg.opt, batch_size=largest)
    setup = Setup(dataset, partition, states, data, alg, d)
    return setup.to_device(resolve_device(cfg.device)) if place else setup


def warn_unseen_test_classes(states: list[ClientState], data: list[ClientData]) -> dict[int, list[int]]:
    """Warn, naming the clients and the classes, where a client's test set holds classes its
    training set lacks: the client never learns them, so its accuracy counts every such test
    sample as an error (and nearest-prototype inference among its own classes cannot name them).

    Returns:
        client id -> the sorted classes seen in its test set only (clients without any left out).
    """
    unseen = {}
    for s, x in zip(states, data):
        extra = np.setdiff1d(np.unique(x.test_y.cpu().numpy()), np.unique(x.y.cpu().numpy()))
        if len(extra):
            unseen[int(s.cid)] = [int(c) for c in extra]
    if unseen:
        shown = "; ".join(f"client {i}: {v[:10]}" for i, v in list(unseen.items())[:10])
        more = f" (and {len(unseen) - 10} more clients)" if len(unseen) > 10 else ""
        log.warning("%d client(s) have test classes absent from their training data (%s%s): they cannot learn "
                    "them, so those test samples count as errors; give them training samples of those classes or "
                    "drop those test samples", len(unseen), shown, more)
    return unseen


class Simulation:
    """Run a configured experiment in-process.

    Args:
        cfg: the validated :class:`RunConfig`.
        setup: a prebuilt :class:`Setup` (else built from cfg).
        out: run directory path (None: ``cfg.out_dir / cfg.run_name()``; False: write nothing).
        on_round: optional callback(row) after each round (used for the progress bar).
    """

    def __init__(self, cfg: RunConfig, setup: Setup | None = None, out: str | Path | None | bool = None,
                 on_round: Callable[[dict], None] | None = None, progress: bool = False):
        if not isinstance(cfg, RunConfig):
            raise ConfigError(f"Simulation needs a RunConfig (from fedproto.build_config), not a {type(cfg).__name__}")
        if out is True or not (out is None or out is False or isinstance(out, (str, Path, RunDir))) or out == "":
            raise ConfigError(f"out={out!r}: give a run directory path, None (out_dir/name) or False (write nothing)")
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.setup = setup or prepare(cfg, progress=progress)
        self.on_round = on_round
        if out is False:
            self.run_dir = None
        elif isinstance(out, RunDir):
            self.run_dir = out
        else:
            self.run_dir = RunDir(out if out is not None else Path(cfg.out_dir) / cfg.run_name())
        self.message: Message = {}
        self.history: list[dict] = []
        self.train_norm: dict[int, float] = {}  # client -> largest training embedding norm of its last round
        self.attackers = set(attacker_ids(cfg.seed, len(self.setup.states), cfg.attackers))
        self._alerts: dict[int, int] = {}  # client -> prototype-distance warnings logged
        self._ran = False

    @property
    def models(self) -> list[ProtoModel]:
        """The client models, indexed by client id: the objects training updates, so after :meth:`run`
        they hold the trained weights, and the objects the reported accuracies were measured on
        (``model(x)`` gives ``(logits (B, C), embedding (B, d))``; call ``.eval()`` first).

        With your own clients (:func:`fedproto.federation.federate`) each is the adapter around your
        module: your module is its ``net`` (:class:`~fedproto.federation.HeadSplitModel`,
        :class:`~fedproto.federation.TupleModel`) and is trained in place. Where ``embedding_dim`` added a
        projection the model is a :class:`~fedproto.federation.Projected`: your module (``.inner.net``)
        holds the trained body, but its own final layer is not used nor trained; predict with this
        object. ``save_models`` also writes them to ``models.pt`` (:func:`fedproto.results.load_models`).
        """
        return [s.model for s in self.setup.states]

    # -------------------------------------------------------------------------------------------
    _pool = None  # fedproto.parallel.WorkerPool; False: one process; None: not decided yet (or closed)
    _worker_threads = 1
    _processes = 1  # processes that trained the batched groups (summary.json: processes)

    def _groups(self, ids: list[int]) -> list[tuple[list[int], int]]:
        """This round's training groups, each with its executor: 0 the main process, w > 0 worker
        process w (:mod:`fedproto.parallel`). Singletons train on the sequential path."""
        mode = self.cfg.execution
        if mode == "sequential" or self.setup.algorithm.sequential_only:
            return [([i], 0) for i in ids]
        by_arch: dict = defaultdict(list)
        for i in ids:  # data read from a Dataset (fedproto.federation.LazyInputs) trains sequentially
            by_arch[self._group_key(i)].append(i)
        batched = [m for m in by_arch.values() if len(m) > 1 and can_batch([self.setup.states[i].model for i in m])]
        # the generic path only when asked for (execution="batched"): on this project's 2-core CPU it was measured
        # 1.0-1.2x the sequential path's speed for small CNNs and 0.44x for ResNet18 (docs/benchmarks.md)
        generic = [m for m in by_arch.values() if mode == "batched" and len(m) > 1 and self._generic_ok(m)]
        W = self._executors(max((len(m) for m in batched), default=0))
        groups = []
        for members in by_arch.values():
            if any(members is m for m in generic):  # the generic path trains in the main process
                n = self.cfg.group_size
                groups.extend((members[j : j + n], 0) for j in range(0, len(members), n))
                continue
            if not any(members is m for m in batched):
                groups.extend(([i], 0) for i in members)
                continue
            # W parts of about equal sample counts, then chunks: a very wide stack (thousands of
            # clients) outgrows the caches; clients are independent, so neither changes a number
            sizes = {i: len(self.setup.data[i].y) for i in members}
            parts = _balanced_parts(members, [sizes[i] for i in members], W)
            # the main process, which also prepares, sends and aggregates, takes the lightest part
            parts.sort(key=lambda p: sum(sizes[i] for i in p))
            n = self.cfg.group_size
            for w, part in enumerate(parts):
                groups.extend((part[j : j + n], w) for j in range(0, len(part), n))
        return groups

    def _group_key(self, i: int):
        """Client ``i``'s batching key: the hand-written batched path's (:func:`batch_key`) where its
        model has one, else the generic path's (:func:`generic_key`); None: it trains sequentially
        (data read from a Dataset, :class:`fedproto.federation.LazyInputs`, always does)."""
        model = self.setup.states[i].model
        if not self.setup.data[i].in_memory:
            return None
        if model.batch_params:
            return batch_key(model)
        return generic_key(model)

    def _generic_ok(self, members: list[int]) -> bool:
        """True if the clients ``members`` (equal :meth:`_group_key`) train on the generic batched path
        (:func:`~fedproto.training.train_group_generic`): their models have no hand-written batched
        forward and ``torch.func.vmap`` runs their training step (:func:`generic_batch_problem`,
        checked once per architecture and run; a model it cannot batch trains sequentially, logged)."""
        model = self.setup.states[members[0]].model
        if model.batch_params:
            return False
        key = self._group_key(members[0])
        if key is None:
            return False
        cache = self.__dict__.setdefault("_generic_checked", {})
        if key not in cache:
            problem = generic_batch_problem(model, self.setup.data[members[0]].x)
            if problem is not None:
                log.info("%s models train one client after another: torch.func.vmap cannot batch them (%s)",
                         type(model).__name__, problem)
            cache[key] = problem is None
        return cache[key]

    def _executors(self, batched_clients: int) -> int:
        """Processes that train this run's batched groups (fixed at the first round that has
        any): 1, or W with a :class:`~fedproto.parallel.WorkerPool` of W - 1 workers."""
        if self._pool is None and batched_clients >= 2:
            from fedproto.parallel import WorkerPool, available_cores, plan_workers

            W, threads = plan_workers(self.cfg.workers, self.cfg.threads, batched_clients, str(self.setup.device),
                                      self.cfg.rounds)
            self._worker_threads = threads
            self._processes = W
            if self.cfg.workers > 1 and W == 1:
                log.warning("workers=%d: training in one process (worker processes need the CPU, 2 or more "
                            "batched clients in a round and a system other than Windows; this run: device %s, %d "
                            "batched clients)", self.cfg.workers, self.setup.device, batched_clients)
            if W > 1:
                if W > available_cores():
                    log.warning("workers=%d starts more processes than the %d cores this run may use; they will "
                                "wait for each other (use workers=0 for the automatic choice)", W, available_cores())
                S, D = self.setup.states, self.setup.data
                ok = [i for i in range(len(S)) if D[i].in_memory and can_batch([S[i].model])]
                log.info("training on %d processes with %d thread%s each", W, threads, "s" if threads > 1 else "")
                self._pool = WorkerPool({i: S[i].model for i in ok}, _TrainInputs(D, ok), {i: D[i].y for i in ok},
                                        W - 1, threads)
            else:
                self._pool = False
        return self._pool.n_workers + 1 if self._pool else 1

    def close(self) -> None:
        """Stop this simulation's worker processes, if any (:meth:`run` does so when it ends);
        ``worker_peak_rss_mb`` keeps their largest peak resident memory."""
        if self._pool:
            self.worker_peak_rss_mb = self._pool.worker_peak_rss_mb()
            self._pool.close()
        self._pool = None

    def _group_inputs(self, round: int, group: list[int], msgs: dict[int, Message]):
        """Prepare the clients of a batched group; their objectives and batch plans."""
        alg, S, D = self.setup.algorithm, self.setup.states, self.setup.data
        objs: list[Objective] = []
        plans = []
        for i in group:
            alg.prepare(S[i], msgs[i])
            objs.append(alg.local_objective(S[i], msgs[i]))
            plans.append(alg.plan(S[i], objs[-1], len(D[i].y), client_rng(self.cfg.seed, round, i)))
        return objs, plans

    def _client_step(self, round: int, ids: list[int], msgs: dict[int, Message]) -> dict[int, tuple[Message, object]]:
        alg, S, D = self.setup.algorithm, self.setup.states, self.setup.data
        alg.opt = alg.opt.at_round(round)  # issue #24: the round's lr (lr_schedule) for the batched paths too
        out = {}
        groups = self._groups(ids)
        pool = self._pool or None
        tasks: dict[int, list] = defaultdict(list)
        for group, w in groups:  # the workers' parts first: they train while the main process trains its own
            if w == 0:
                continue
            objs, plans = self._group_inputs(round, group, msgs)
            names = S[group[0]].model.batch_params
            ref = stacked_refs(objs[0], objs, names, len(group))
            obj = portable_objective(objs[0], names)
            phases = [stack_plans(plans, pi, pool.offsets(group), alg.opt.batch_size) for pi in range(len(obj.phases))]
            tasks[w].append((group, phases, obj, ref))
        models = {w: [[S[i].model for i in g] for g, *_ in items] for w, items in tasks.items()}
        for w, items in tasks.items():
            pool.submit(w - 1, items, models[w], alg.opt)
        threads = torch.get_num_threads()
        if pool:
            torch.set_num_threads(self._worker_threads)
        trained = False
        try:
            for group, w in groups:
                if w:
                    continue
                if len(group) == 1:
                    i = group[0]
                    out[i] = client_step(alg, S[i], msgs[i], D[i], self.cfg.seed, round)
                    continue
                objs, plans = self._group_inputs(round, group, msgs)
                ms = [S[i].model for i in group]
                if ms[0].batch_params:
                    results = train_group(ms, [D[i].x for i in group], [D[i].y for i in group], plans, objs[0],
                                          alg.opt, objs)
                else:
                    results = train_group_generic(ms, [D[i].x for i in group], [D[i].y for i in group], plans,
                                                  objs[0], alg.opt, objs,
                                                  [client_seed(self.cfg.seed, round, i) for i in group])
                for i, res in zip(group, results):
                    out[i] = (alg.finish(S[i], msgs[i], D[i], res), res)
            trained = True
        finally:
            torch.set_num_threads(threads)
            if not trained and tasks:  # the main part raised or was interrupted (Ctrl-C): that is the error to
                self.close()           # report, not the workers'; they stop without their results awaited
        done = {w: pool.collect(w - 1, models[w]) for w in tasks}
        for w, items in tasks.items():
            for (group, *_), results in zip(items, done[w]):
                for i, res in zip(group, results):
                    out[i] = (alg.finish(S[i], msgs[i], D[i], res), res)
        return out

    def _check_health(self, r: int, per_client: list[dict]) -> None:
        """Warn, naming the client and round, where evaluation embeddings or scores were not finite,
        the median embedding norm exceeded :data:`EMBED_NORM_LIMIT`, or it exceeded
        :data:`EVAL_TRAIN_NORM_RATIO` times the client's largest training embedding norm (issue #10:
        a silent chance-level accuracy otherwise)."""
        for i, m in enumerate(per_client):
            seen = self.train_norm.get(i, 0.0)
            if (not m.get("nonfinite") and m.get("emb_norm", 0.0) <= EMBED_NORM_LIMIT
                    and 0 < seen < m.get("emb_norm", 0.0) / EVAL_TRAIN_NORM_RATIO):
                log.warning("round %d: client %d's test embeddings (median norm %.3g) are %.0fx larger than any of "
                            "its training embeddings (%.3g): evaluation mode changes its model, as BatchNorm "
                            "running statistics from too few values do; check its batch sizes", r, i,
                            m["emb_norm"], m["emb_norm"] / seen, seen)
            if m.get("nonfinite"):
                log.warning("round %d: client %d's test embeddings or scores are not finite (NaN or inf); its "
                            "accuracy is not meaningful (flagged in clients.csv: nonfinite = 1)", r, i)
            elif m.get("emb_norm", 0.0) > EMBED_NORM_LIMIT:
                log.warning("round %d: client %d's test embeddings have median norm %.3g (limit %.0e): the model "
                            "blew up; %s", r, i, m["emb_norm"], EMBED_NORM_LIMIT, self._blowup_causes())

    def _attack_hint(self) -> str:
        """The simulated attack's part of a divergence error ('' without one): the options through
        which misbehaving clients reach the honest ones."""
        cfg = self.cfg
        if not self.attackers:
            return ""
        what = f"{opt('attack', cfg.attack)}" + (f" x{cfg.attack_scale:g}" if cfg.attack == "scale" else "")
        if cfg.algorithm != "fedproto":
            fix = f"lower {opt('attack_scale')} or {opt('attackers')}, or run {opt('algorithm', 'fedproto')} with " \
                  f"{opt('aggregation', 'median')}"
        elif cfg.aggregation in ("mean", "weighted") and not cfg.exclude_outliers:
            fix = ""  # the algorithm's hint already names the robust aggregation rules
        else:
            rule = opt("aggregation", cfg.aggregation) + (f" with {opt('trim', cfg.trim)}" if cfg.aggregation ==
                                                           "trimmed" else "")
            fix = (f"{rule}" + (f" and {opt('exclude_outliers', cfg.exclude_outliers)}" if cfg.exclude_outliers
                                else "") + f" did not hold them off: raise {opt('trim')} (trimmed), add "
                   f"{opt('exclude_outliers')}, or lower {opt('attackers')}")
        n = len(self.attackers)
        return f"; {n} simulated misbehaving client{'s' if n > 1 else ''} ({what}) reach the others through " \
               f"aggregation" + (f": {fix}" if fix else "")

    def _blowup_causes(self) -> str:
        """What a warning about exploding embeddings asks to check, given this run's options: DP
        noise and the simulated attack where they are on, then the data, lr and BatchNorm batches."""
        cfg = self.cfg
        causes = []
        if cfg.dp != "off":
            causes.append(f"the DP noise (dp_noise={cfg.dp_noise:g}, dp_clip={cfg.dp_clip:g}: the noise added to "
                          "prototypes grows with both)")
        if self.attackers:
            causes.append(f"the simulated attack (attack={cfg.attack}, attackers={cfg.attackers}; a robust "
                          "aggregation holds it off)")
        causes.append(f"its data and lr (now {cfg.lr:g}), or for BatchNorm models its batch sizes")
        return "check " + "; ".join(causes)

    # -- hooks an engine over a transport replaces (fedproto.flower.server_app.FlowerEngine) ------
    def _initial_message(self) -> Message:
        """The server's first broadcast (:meth:`Algorithm.initial_message` of the clients' states)."""
        return self.setup.algorithm.initial_message(self.setup.states)

    def _sample(self, round: int) -> list[int]:
        """The clients of ``round`` (:func:`sample_clients`)."""
        return sample_clients(self.cfg.seed, round, len(self.setup.states), self.cfg.participation)

    def _round_status(self) -> dict:
        """Extra entries of the round's metrics row (which clients replied; none in-process)."""
        return {}

    def _client_report(self, cid: int) -> dict:
        """What client ``cid`` reports about itself for ``clients.csv`` (:meth:`Algorithm.client_report`)."""
        return self.setup.algorithm.client_report(self.setup.states[cid])

    def _who(self, cid: int) -> str:
        """How logs name client ``cid``."""
        return f"client {cid}"

    def _check_replies(self, r: int, sent: dict[int, Message], results: dict) -> tuple[dict[int, str], set[int]]:
        """Check every reply of round ``r`` before aggregation. A reply that is not what the
        algorithm sends (:func:`reply_problem`: types, keys, shapes) is dropped whole; then the
        algorithm drops its bad parts (:meth:`Algorithm.reply_problems`, e.g. a prototype row with
        NaN values), replacing the message in ``results``; a reply with no usable part left is
        dropped whole. Each is logged with the client and reason.

        Returns:
            (client id -> reason, for every reply dropped whole or in part; the ids dropped whole).
        """
        alg, d = self.setup.algorithm, self.setup.embedding_dim
        reasons: dict[int, str] = {}
        whole: set[int] = set()
        for i in sorted(results):
            msg, res = results[i]
            why = reply_problem(alg, msg, sent.get(i, {}), d)
            if why:
                whole.add(i)
            else:
                clean, parts = alg.reply_problems(i, msg)
                if parts:
                    why = "; ".join(parts[:3]) + (f" (and {len(parts) - 3} more)" if len(parts) > 3 else "")
                    if clean:
                        results[i] = (clean, res)
                    else:
                        whole.add(i)
            if why:
                reasons[i] = why
                if i in whole:
                    log.warning("round %d: dropped the reply of %s: %s", r, self._who(i), why)
                else:
                    log.warning("round %d: dropped part of the reply of %s: %s", r, self._who(i), why)
        return reasons, whole

    def _config_record(self) -> dict:
        """What ``config.json`` holds: the options, the λ, batch size and device in force, the
        partition. For your own clients (dataset ``custom``) the options the run did not use
        (:meth:`RunConfig.unused_fields`: the partition's, the zoo models') are ``null`` and
        ``embedding_dim`` is your models' embedding size."""
        record = self.cfg.model_dump()
        if self.cfg.dataset == "custom":
            record.update(dict.fromkeys(self.cfg.unused_fields()))
            record["embedding_dim"] = int(self.setup.embedding_dim)
        return {**record, "lambda_proto_in_force": self.cfg.lam,
                "batch_size_in_force": int(getattr(self.setup.algorithm.opt, "batch_size", self.cfg.batch_size)),
                "device_in_use": str(self.setup.device), "partition_summary": self.setup.partition.summary()}

    def rounds_trained(self) -> list[int]:
        """Per client: the rounds of this run (so far) in which it trained and replied, from the
        metrics rows (``sampled`` lists them in rounds where not every client did)."""
        counts = [0] * len(self.setup.states)
        for row in self.history:
            for i in row.get("sampled", range(len(counts))):
                counts[int(i)] += 1
        return counts

    def _model_params(self) -> list[int]:
        """Parameter count of each client's model (summary ``model_params``)."""
        return [count_parameters(s.model) for s in self.setup.states]

    def _client_rows(self, per_client: list[dict]) -> list[dict]:
        """The rows of ``clients.csv``: each client's classes, sample counts, parameters, metrics."""
        rows = []
        for i, s in enumerate(self.setup.states):
            row = {"client": i, "ways": len(s.classes), "classes": " ".join(map(str, s.classes)),
                   "train_samples": len(self.setup.data[i].y), "test_samples": len(self.setup.data[i].test_y),
                   "params": count_parameters(s.model)}
            row.update(per_client[i])
            rows.append(row)
        return rows

    def evaluate(self) -> list[dict]:
        """Per-client metrics on each client's own test set (list indexed by client id)."""
        alg, S, D = self.setup.algorithm, self.setup.states, self.setup.data
        return [alg.evaluate(S[i], alg.downlink(self.message, i), D[i]) for i in range(len(S))]

    def full_test_evaluation(self) -> dict | None:
        """Evaluation beyond the personalized test sets (practitioner's guide §4.3): every client's
        model on the dataset's full test split (all classes; :meth:`Algorithm.full_test_metrics`,
        both inference rules where the algorithm has prototypes) and the ensemble of all client
        models on it: the mean of their softmax outputs (``ensemble_softmax``) and a majority vote
        of their predictions (``ensemble_vote``; ties to the lowest class). None (with a warning)
        when the run has no dataset test split (your own clients).

        Returns:
            ``{"summary": {...}, "clients": [per-client dict]}``; accuracies in [0, 1].
        """
        ds = self.setup.dataset
        if ds is None:
            log.warning("eval_full_test: your own clients have no shared test split; only the per-client test sets "
                        "are evaluated")
            return None
        alg, S = self.setup.algorithm, self.setup.states
        x, y = ds.test_x, ds.test_y
        C = self.cfg.num_classes
        probs = torch.zeros(len(y), C, dtype=torch.float64)
        votes = torch.zeros(len(y), C, dtype=torch.float64)
        per = []
        for i, s in enumerate(S):
            logits, h = predict(s.model, x)
            logits, h = logits.cpu(), h.cpu()
            per.append(alg.full_test_metrics(s, alg.downlink(self.message, i), logits, h, y))
            probs += torch.softmax(logits.to(torch.float64), 1)
            votes[torch.arange(len(y)), logits.argmax(1)] += 1.0
        out = {"test_set": f"the full test split: {len(y)} samples of all {C} classes (each client's model, and "
                           f"the ensemble of all {len(S)})"}
        for k in per[0]:
            out[k] = dict(zip(("mean", "std"), summarize([m[k] for m in per])))
        out["ensemble_softmax"] = float((probs.argmax(1) == y).to(torch.float64).mean())
        out["ensemble_vote"] = float((votes.argmax(1) == y).to(torch.float64).mean())
        return {"summary": out, "clients": per}

    def _checkpoint_state(self, r: int, totals: dict, train_time: float, wall: float) -> dict:
        return {
            "round": r,
            "config": self.cfg.result_fields(),
            "message": self.message,
            "server_state": self.setup.algorithm.server_state(),
            "clients": [{"model": s.model.state_dict(), "extra": dict(s.extra)} for s in self.setup.states],
            "data": self._data_fingerprint(),
            "history": self.history,
            "totals": dict(totals),
            "train_time_s": train_time,
            "wall_time_s": wall,
        }

    def _data_fingerprint(self) -> list[list[int]]:
        """Per client: training and test sample counts and the sums of their labels (a resumed run must
        have the clients' data of the interrupted one; with your own clients the config cannot tell)."""
        return [[len(d.y), len(d.test_y), int(d.y.sum()), int(d.test_y.sum())] for d in self.setup.data]

    def _restore(self, ckpt: dict) -> None:
        """Load a checkpoint's state (see :mod:`fedproto.checkpoint`) into this simulation.

        Raises:
            CheckpointMismatch: the checkpoint belongs to another configuration (names the fields).
            CheckpointError: its content does not fit these clients' models.
        """
        mine = self.cfg.result_fields()
        theirs = result_fields({**ADDED_FIELDS, **ckpt["config"]}) if isinstance(ckpt["config"], dict) else {}
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        where = str(self.run_dir.checkpoint) if self.run_dir else "the checkpoint"
        if diff:
            shown = ", ".join(f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} now" for k in diff[:5])
            raise CheckpointMismatch(f"{where} was written by a run with other options ({shown}); resume with "
                                     "the same options, or delete it to start from round 1")
        S = self.setup.states
        if "data" in ckpt and ckpt["data"] != self._data_fingerprint():
            diff = [i for i, (a, b) in enumerate(zip(ckpt["data"], self._data_fingerprint())) if a != b]
            raise CheckpointMismatch(f"{where} was written for other client data (clients {diff[:10]} differ in sample "
                                     "counts or labels); resume with the same data, or delete it to start anew")
        if len(ckpt["clients"]) != len(S) or not 0 < int(ckpt["round"]) <= self.cfg.rounds:
            raise CheckpointError(f"{where} does not fit this run ({len(ckpt['clients'])} clients, round "
                            f"{ckpt['round']}); delete it to start anew")
        try:
            for s, c in zip(S, ckpt["clients"]):
                s.model.load_state_dict(c["model"])
                s.extra = dict(c["extra"])
            self.setup.algorithm.load_server_state(ckpt["server_state"])
        except (RuntimeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{where} does not fit this run's models ({type(e).__name__}: "
                            f"{first_line(e)[:200]}); delete it to start anew") from None
        bad = self._message_problem(ckpt["message"])
        if bad:
            raise CheckpointError(f"{where} is damaged: its server message {bad}; delete it to start from round 1")
        self.message = ckpt["message"]
        self.history = list(ckpt["history"])

    def _message_problem(self, msg) -> str:
        """What is wrong with a checkpoint's server message ('' if nothing): arrays only, finite,
        the shapes of the algorithm's first message, prototypes of the embedding size for classes
        in range."""
        if not isinstance(msg, dict):
            return f"is a {type(msg).__name__}, not a dict of arrays"
        ref = self.message  # the algorithm's initial message (run() builds it before restoring)
        for k, v in msg.items():
            if not isinstance(v, np.ndarray):
                return f"entry {k!r} is a {type(v).__name__}, not an array"
            if v.dtype.kind == "f" and not np.isfinite(v).all():
                return f"entry {k!r} holds non-finite values"
            if k in ref and np.shape(ref[k]) != v.shape:
                return f"entry {k!r} has shape {v.shape}, the model needs {np.shape(ref[k])}"
        return self.setup.algorithm.message_problem(msg, self.setup.embedding_dim)

    def run(self, resume: bool = False) -> dict:
        """Run all rounds; returns the summary dict (also written to ``summary.json``).

        Args:
            resume: continue from the run directory's checkpoint when there is one (else start at
                round 1). Checkpoints are written every ``cfg.checkpoint_every`` rounds and removed
                when the run finishes; see :mod:`fedproto.checkpoint`.
        Raises:
            CheckpointMismatch: the checkpoint was written under other options.
            CheckpointError: it is damaged or does not fit.
            TrainingError: the loss diverged.
        """
        if self._ran:
            raise ConfigError("this Simulation has run already (its models are trained); build a new Simulation "
                              "to run again")
        try:
            if not self.run_dir:
                return self._run(resume)
            self.run_dir.acquire()  # one process per run folder
            try:
                return self._run(resume)
            finally:
                self.run_dir.release()
        finally:
            self.close()

    def _run(self, resume: bool) -> dict:
        alg = self.setup.algorithm
        self._ran = True
        # may refuse the set-up (weight sharing across architectures)
        self.message = alg.broadcast(1, self._initial_message())
        totals = {"up_params": 0, "up_bytes": 0, "down_params": 0, "down_bytes": 0}
        train_time = wall_before = 0.0
        start = 1
        ckpt = None
        has_ckpt = bool(self.run_dir) and self.run_dir.checkpoint.is_file()
        if self.run_dir:
            ck = self.run_dir.checkpoint
            if ck.exists() and not ck.is_file():
                raise ConfigError(f"{str(ck)!r} is not a file; remove it (the checkpoint goes there)")
            if has_ckpt and not resume:
                prev = self.run_dir.path / PREVIOUS
                kept = (f" (an earlier finished run waits in {str(prev)!r} until the interrupted one finishes)"
                        if prev.is_dir() else "")
                raise ConfigError(f"{str(self.run_dir.path)!r} holds an interrupted run's checkpoint{kept}: add "
                                  f"{opt('resume')} to continue it, or delete {str(ck)!r} (or pick another "
                                  f"{opt('name')}) to start anew")
            if resume and not has_ckpt:
                if (self.run_dir.path / "summary.json").is_file():
                    raise ConfigError(f"the run in {str(self.run_dir.path)!r} has finished (summary.json) and has no "
                                      f"checkpoint: nothing to resume; drop {opt('resume')} to run it again")
                log.warning("no checkpoint in %s: starting at round 1", self.run_dir.path)
        if resume and has_ckpt:
            ckpt = load_checkpoint(self.run_dir.checkpoint)
            self._restore(ckpt)
            start = int(ckpt["round"]) + 1
            totals.update({k: int(v) for k, v in ckpt["totals"].items() if k in totals})
            train_time, wall_before = float(ckpt["train_time_s"]), float(ckpt["wall_time_s"])
            log.info("resuming %s after round %d", self.run_dir.path, start - 1)
        if self.run_dir:
            self.run_dir.begin(self.history if ckpt is not None else None)
        try:
            return self._rounds(start, totals, train_time, wall_before)
        except BaseException:
            if self.run_dir and self.run_dir.abort():
                log.warning("the earlier finished run in %s is back in place", self.run_dir.path)
            raise

    def _rounds(self, start: int, totals: dict, train_time: float, wall_before: float) -> dict:
        """Rounds ``start..rounds``, evaluation and the result files (the body of :meth:`run`)."""
        cfg, alg, S = self.cfg, self.setup.algorithm, self.setup.states
        if self.run_dir:
            self.run_dir.write_config(self._config_record())
        if self.on_round:
            for row in self.history:
                self.on_round(row)
        t_start = time.perf_counter() - wall_before
        per_client: list[dict] = []
        for r in range(start, cfg.rounds + 1):
            t0 = time.perf_counter()
            ids = self._sample(r)
            received = {i: alg.downlink(self.message, i) for i in ids}
            results = self._client_step(r, ids, received)  # may add to received (a retried round)
            for i in self.attackers.intersection(results):  # simulated misbehaving clients (fedproto.attacks)
                rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, r, i, 0xA77]))
                results[i] = (corrupt_message(results[i][0], cfg.attack, rng, self.cfg.num_classes,
                                              cfg.attack_scale), results[i][1])
            down = [message_size(m) for m in received.values()]
            ids = sorted(results)  # the clients that replied (all of them in-process)
            tr = [results[i][1] for i in ids]
            up = [message_size(results[i][0]) for i in ids]
            dropped, whole = self._check_replies(r, received, results)  # drops bad parts of results in place
            kept = {i: results[i][0] for i in ids if i not in whole}
            if kept:
                self.message = alg.broadcast(r + 1, alg.aggregate(r, kept))
            else:
                log.warning("round %d: no reply to aggregate; the server message stays that of the round before", r)
                self.message = alg.broadcast(r + 1, self.message)
            t_train = time.perf_counter() - t0
            monitor = alg.round_metrics()
            for cid, dist, med in alg.outliers():
                seen = self._alerts[cid] = self._alerts.get(cid, 0) + 1
                if seen <= ALERTS_PER_CLIENT:
                    log.warning("round %d: client %d's prototypes lie %.3g from the global ones, %.1fx the median "
                                "%.3g over clients; check its data (proto_dist_alert=%s)%s", r, cid, dist, dist / med,
                                med, cfg.proto_dist_alert, "; not repeated for this client (proto_dist_max in "
                                "metrics.jsonl)" if seen == ALERTS_PER_CLIENT else "")
            # a simulated misbehaving client may diverge (its messages go through the server's checks); the run
            # stops when an honest client does
            seen = [(i, x) for i, x in zip(ids, tr) if x.loss_ce is not None]  # a node under DP sends no losses
            bad = [i for i, x in seen if not np.isfinite([x.loss_ce, x.loss_proto]).all() and i not in self.attackers]
            if bad:
                lam = alg.divergence_hint(cfg)
                dirty = [i for i in bad if self.setup.data[i].in_memory
                         and not bool(torch.isfinite(self.setup.data[i].x).all())]
                if dirty:
                    raise TrainingError(f"training diverged in round {r}: the training inputs of clients {dirty[:10]} "
                                        "hold NaN or infinite values; clean or drop those samples")
                raise TrainingError(
                    f"training diverged in round {r}: the loss of clients {bad[:10]} is not finite; "
                    f"lower {opt('lr')} (now {cfg.lr}){lam}{self._attack_hint()}")
            for i, x in seen:
                self.train_norm[i] = x.emb_norm_max
                if not x.emb_norm_max <= EMBED_NORM_LIMIT:
                    log.warning("round %d: client %d's training embeddings reached norm %.3g (limit %.0e)%s; its "
                                "numbers may be meaningless: %s", r, i, x.emb_norm_max, EMBED_NORM_LIMIT,
                                "" if np.isfinite(x.emb_norm_max) else " (not finite)", self._blowup_causes())
            train_time += t_train
            row = {
                "round": r,
                "loss_ce": float(np.mean([x.loss_ce for _, x in seen])) if seen else None,
                "loss_proto": float(np.mean([x.loss_proto for _, x in seen])) if seen else None,
                "lr": alg.opt.lr_of_round(r),  # issue #24: the round's learning rate (lr_schedule)
                "up_params": sum(u[0] for u in up),
                "up_bytes": sum(u[1] for u in up),
                "down_params": sum(d[0] for d in down),
                "down_bytes": sum(d[1] for d in down),
                "train_time_s": t_train,
                **monitor,
            }
            if len(ids) < len(S):
                row["sampled"] = ids
            row.update(self._round_status())
            if dropped:  # replies dropped whole or in part, and why
                row["dropped"] = sorted(dropped)
                row["dropped_why"] = {str(i): why for i, why in dropped.items()}
            for k in totals:
                totals[k] += row[k]
            if r == cfg.rounds or (cfg.eval_every and r % cfg.eval_every == 0):
                t1 = time.perf_counter()
                per_client = self.evaluate()
                self._check_health(r, per_client)
                for key in per_client[0]:
                    if key not in HEALTH_KEYS:
                        row[f"{key}_mean"], row[f"{key}_std"] = summarize([m[key] for m in per_client])
                row["eval_time_s"] = time.perf_counter() - t1
            self.history.append(row)
            if self.run_dir:
                self.run_dir.log_round(row)
                if cfg.checkpoint_every and r % cfg.checkpoint_every == 0 and r < cfg.rounds:
                    self.run_dir.write_checkpoint(save_checkpoint,
                                                  self._checkpoint_state(r, totals, train_time,
                                                                         time.perf_counter() - t_start))
            if "acc_mean" in row:  # one line per evaluated round, for Python users who turn INFO logging on
                log.info("%s", round_line(row, cfg.rounds, time.perf_counter() - t_start))
            if self.on_round:
                self.on_round(row)
        if not per_client:  # resumed after the last round's checkpoint: evaluate the restored models
            per_client = self.evaluate()
        per_client = [{**m, **self._client_report(i)} for i, m in enumerate(per_client)]
        full = self.full_test_evaluation() if cfg.eval_full_test else None
        wall = time.perf_counter() - t_start
        last = self.history[-1]
        summary = {
            "algorithm": cfg.algorithm,
            "dataset": cfg.dataset,
            "model": cfg.model,
            "clients": len(S),
            "rounds": cfg.rounds,
            # natural, dirichlet, custom: per client (partition_summary, clients.csv)
            "ways": cfg.ways if cfg.partition == "fewshot" and cfg.dataset != "custom" else None,
            "shots": cfg.shots if cfg.partition == "fewshot" and cfg.dataset != "custom" else None,
            "seed": cfg.seed,
            "test_set": "per client: its own test data" if cfg.dataset == "custom" else {
                         "fewshot": f"per client: {cfg.test_shots} test-split samples of each own class",
                         "natural": "per client: the writer's own test samples",
                         "dirichlet": f"per client: {cfg.test_shots} x (own classes) test-split samples in the "
                                      "client's training class proportions"}[cfg.partition],
            "accuracy": {k.removesuffix("_mean"): {"mean": last[k], "std": last[k.replace("_mean", "_std")]}
                         for k in last if k.endswith("_mean")},
            "evaluation": alg.eval_protocols(),  # which protocol each accuracy key is (issue #24)
            "params_per_round": {"up": totals["up_params"] / cfg.rounds, "down": totals["down_params"] / cfg.rounds},
            "bytes_total": {"up": totals["up_bytes"], "down": totals["down_bytes"]},
            "model_params": self._model_params(),
            "wall_time_s": wall,
            "train_time_s": train_time,
            "execution": cfg.execution,
            "processes": self._processes,
        }
        trained = self.rounds_trained()
        never = [i for i, n in enumerate(trained) if n == 0]
        if never:
            # clients never sampled (participation < 1) are scored at their initial weights: the mean over all
            # clients mixes them in, so the mean over the clients that trained stands beside it
            did = [m for i, m in enumerate(per_client) if trained[i] > 0]
            summary["clients_trained"] = len(did)
            summary["accuracy_trained"] = {
                "test_set": summary["test_set"] + f"; the {len(did)} clients that trained in at least one round",
                **{k: dict(zip(("mean", "std"), summarize([m[k] for m in did]))) for k in summary["accuracy"]
                   if k in per_client[0]}}
            log.warning("%d of %d clients never trained (participation=%g over %d rounds): clients %s%s are scored "
                        "at their initial "
                        "weights and counted in the accuracy over all clients; the mean over the %d clients that "
                        "trained is summary.json's accuracy_trained (clients.csv: rounds_trained)", len(never),
                        len(S), cfg.participation, cfg.rounds, never[:10],
                        " ..." if len(never) > 10 else "", len(did))
        scored = sum(1 for m in per_client if isinstance(m.get("acc"), float) and m["acc"] == m["acc"])
        if scored < len(per_client) and any("acc" in m for m in per_client):  # a node did not answer (Flower)
            summary["clients_evaluated"] = scored
        if self.attackers:
            honest = [m for i, m in enumerate(per_client) if i not in self.attackers]
            summary["attack"] = {"kind": cfg.attack, "clients": sorted(self.attackers)}
            summary["accuracy_honest"] = {
                "test_set": summary["test_set"] + f"; the {len(honest)} clients that did not misbehave",
                **{k: dict(zip(("mean", "std"), summarize([m[k] for m in honest])))
                   for k in per_client[0] if k not in HEALTH_KEYS and k != "dp_epsilon"}}
        if full is not None:
            summary["accuracy_full_test"] = full["summary"]
            for i, m in enumerate(full["clients"]):
                per_client[i].update({f"full_{k}": v for k, v in m.items()})
        if cfg.dp != "off":
            # under Flower: NaN for a node that did not answer; none under dp=full (each node keeps its own)
            eps = [m["dp_epsilon"] for m in per_client if m.get("dp_epsilon", math.nan) == m.get("dp_epsilon")]
            summary["privacy"] = {
                "mode": cfg.dp, "noise_multiplier": cfg.dp_noise, "embedding_clip": cfg.dp_clip,
                "grad_clip": cfg.dp_grad_clip if cfg.dp == "full" else None, "delta": cfg.dp_delta,
                "epsilon_max": float(max(eps)) if eps else None, "epsilon_mean": float(np.mean(eps)) if eps else None,
                "accountant": "Opacus RDP (subsampled Gaussian per DP-SGD step, Gaussian per prototype release)",
                "neighbouring": "one training sample of a client added or removed, its label set unchanged (the "
                                "label set is public)" + (
                    "; for a fixed feature extractor (the extractor's training is not covered)"
                    if cfg.dp == "prototypes" else ""),
                "noise": "seeded by the run's seed (dp_reproducible_noise: no guarantee against whoever knows the "
                         "seed)" if cfg.dp_reproducible_noise else "the operating system's secure randomness",
            }
            if not eps:
                summary["privacy"]["epsilon_note"] = ("each node logs its own epsilon: under dp=full it depends on "
                                                      "the node's sample count, which the node does not send")
        if cfg.save_models and not self.run_dir:
            log.warning("save_models: this run writes no run directory (out=False); the trained models are in "
                        "Simulation.models")
        if self.run_dir:
            self.run_dir.write_summary(summary)
            rows = [{**r, "rounds_trained": n} for r, n in zip(self._client_rows(per_client), trained)]
            if self.attackers:  # which clients misbehaved (fedproto.attacks)
                rows = [{**r, 'attacker': int(int(r['client']) in self.attackers)} for r in rows]
            self.run_dir.write_clients(rows)
            if cfg.save_models:
                self.run_dir.write_models(self.models)
            if "protos" in self.message:
                self.run_dir.write_prototypes(self.message["classes"], self.message["protos"],
                                              getattr(alg, "last_contributors", None))
            self.run_dir.checkpoint.unlink(missing_ok=True)  # finished: nothing left to resume
            self.run_dir.finish()
        return summary
