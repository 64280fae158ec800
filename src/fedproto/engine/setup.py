"""The one set-up every front end builds a run with (``fedproto run``, :func:`fedproto.federation.federate`,
the Flower nodes, onboarding, ``reproduce``): data, partition, client models, the algorithm, and
every check of the clients against the options, before round 1 (config errors are caught
before any training starts; docs/architecture.md).

:func:`prepare` builds a run of a named dataset from a :class:`~fedproto.config.run_config.RunConfig`;
:func:`build_setup` finishes any set-up (your own clients included) and is where a check added
once holds everywhere.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from pydantic import ValidationError

from fedproto.algorithms import get_algorithm
from fedproto.algorithms.algorithm import Algorithm, ClientData, ClientState, SharedInputs
from fedproto.algorithms.method_options import owners
from fedproto.algorithms.requirements import ONE_ARCHITECTURE, check_architectures, check_model_needs, model_needs
from fedproto.config.common_options import CommonConfig
from fedproto.config.fixes import bound_fix
from fedproto.data.datasets import Dataset, load_dataset
from fedproto.data.partition import Partition, dirichlet_partition, fewshot_partition, natural_partition
from fedproto.errors import ConfigError, PartitionError, opt
from fedproto.models.zoo import build_client_models
from fedproto.plugins import method_options
from fedproto.training import has_batchnorm
from fedproto.training.devices import resolve_device, resolve_precision

if TYPE_CHECKING:
    from fedproto.engine.client_store import ClientStore
    from fedproto.models.proto_model import ProtoModel

log = logging.getLogger(__name__)


def build_algorithm(cfg: CommonConfig, embedding_dim: int) -> Algorithm:
    """The configured algorithm (:func:`fedproto.algorithms.get_algorithm`; raises
    :class:`ConfigError` for an unknown name)."""
    cls: type[Algorithm] = get_algorithm(cfg.algorithm)  # the registry's classes are Algorithm subclasses
    alg = cls.from_run(cfg, embedding_dim)  # from_config, freeze_after and seed passed in (Algorithm.from_run)
    options = method_options(cls)
    if options is not None and (getattr(alg, "options", None) is None or not isinstance(alg.options, options)):
        # a plug-in built by its parent's from_config (e.g. a FedProto subclass): every option it reads
        try:
            alg.options = options(**{k: getattr(cfg, k) for k in options.model_fields})
        except ValidationError as e:  # a plug-in whose Options narrow an inherited option's bounds
            err = e.errors()[0]
            k = str(err["loc"][0]) if err.get("loc") else "?"
            fix = bound_fix(k, dict(err)) or f"; give {opt(k)} a value algorithm {cfg.algorithm!r} accepts"
            raise ConfigError(f"{opt(k, err.get('input'))}: algorithm {cfg.algorithm!r} (its Options narrow {k!r}) "
                              f"refuses it: {err['msg']}{fix}", option=k, value=err.get("input")) from None
    return alg


def check_batches(cfg: CommonConfig, models: Sequence[torch.nn.Module], train_sizes: list[int]) -> None:
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

    dataset: Dataset | None  # None for your own clients (fedproto.federation.federate, a Flower node)
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
        self._each_model(lambda m: m.to(self.device), lambda st: st.to(device=self.device))
        shared: dict[int, SharedInputs] = {}
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
        that distance of a tie, and SGD then carries the difference on. Messages stay
        float32 (prototypes) or take the models' dtype (weights).
        """
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype {dtype}: use torch.float32 (training) or torch.float64 (checks)")
        self._each_model(lambda m: m.to(dtype), lambda st: st.to(dtype=dtype))
        for d in self.data:
            d.to(dtype=dtype)  # an index view casts the rows it gathers, not the whole shared split
        return self


    def _each_model(self, on_model: Callable[[ProtoModel], object], on_store: Callable[[ClientStore], object]) -> None:
        """Apply ``on_model`` to every client module and ``on_store`` once to each
        :class:`~fedproto.engine.client_store.ClientStore` (its clients' own modules bound to
        their rows again afterwards), without building a module per stored client."""
        from fedproto.engine.client_store import StoredClientState

        stores: dict[int, ClientStore] = {}
        for s in self.states:
            if isinstance(s, StoredClientState):
                stores[id(s.row_store)] = s.row_store
            else:
                on_model(s.model)
        for st in stores.values():
            on_store(st)
        for s in self.states:
            if isinstance(s, StoredClientState):
                s.rebind()


def partition_run(cfg: CommonConfig, ds: Dataset) -> Partition:
    """The run's seeded partition of ``ds`` into ``cfg.clients`` clients (``cfg.partition``: few-shot,
    Dirichlet or natural), as :func:`prepare` makes it; labels only, so a process that holds one
    client (a Flower simulation actor) makes the same partition without reading any input.

    Raises:
        ConfigError: ``natural`` for a dataset without writer ids. PartitionError: a client without
            training or test samples (and the partitions' own errors).
    """
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
    return part


def prepare(cfg: CommonConfig, dataset: Dataset | None = None, progress: bool = True,
            client_store: bool | str | os.PathLike[str] | None = None) -> Setup:
    """Load data, partition, build client models and the algorithm; raises FedprotoError subclasses.

    ``cfg.partition``: ``fewshot`` (the paper's n-way k-shot protocol, any dataset) or ``natural``
    (one client per writer; needs writer ids, i.e. FEMNIST; ``ways``, ``shots``, ``stdev`` and
    ``test_shots`` are then unused). ``cfg.pretrained``: resnet18 weights for ResNet18 clients.
    ``cfg.augment`` acts in training (see :class:`fedproto.training.OptimConfig`).
    ``client_store``: keep the clients' weights in one flat
    :class:`~fedproto.engine.client_store.ClientStore` (rows per client, no module per client:
    about 87 KB a PaperCNN client instead of 105 KB; the same numbers) where every client has one
    storable architecture (:func:`client_states`); a folder: the same store in a file there (the
    process keeps a few thousand rows resident, the page cache the rest); None: the
    ``FEDPROTO_CLIENT_STORE`` environment variable (``1``: in memory, a folder: in a file there),
    else off.
    """
    if cfg.dataset == "custom":
        raise ConfigError("dataset 'custom' holds your own clients: build the run with fedproto.federation.federate("
                          "clients, num_classes, ...) from Python; the command line runs mnist, femnist, cifar10, "
                          "digits")
    # mapped: decoded once per machine into a cache beside the files (or the user cache when that
    # folder is read-only) and memory-mapped from there on (fedproto.data.decoded): bit for bit the
    # decoded arrays, without decoding them again at every start (MNIST: about 1 s)
    ds = dataset or load_dataset(cfg.dataset, cfg.data_dir, download=cfg.download, progress=progress, mapped=True)
    part = partition_run(cfg, ds)
    if cfg.augment and ds.input_shape[0] != 3:
        log.warning("augment is on for %s: horizontal flips suit natural images (CIFAR-10), not "
                    "digits or letters", cfg.dataset)
    if client_store is None:
        client_store = client_store_from_env(os.environ.get("FEDPROTO_CLIENT_STORE", "0"))
    states = client_states(cfg, part, ds, client_store)
    return build_setup(cfg, states, client_views(ds, part.train_idx, part.test_idx), part, ds)


def client_store_from_env(value: str) -> bool | str:
    """``FEDPROTO_CLIENT_STORE``'s value as :func:`prepare`'s ``client_store``: ``1``/``true``/``yes``/``on``:
    in memory; ``0``/``false``/``no``/``off``/empty: off; else a folder for the store's file (``~`` expanded).

    Raises:
        ConfigError: a number other than 0 and 1, or a path that exists and is not a folder.
    """
    v = value.strip()
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("", "0", "false", "no", "off"):
        return False
    hint = ("FEDPROTO_CLIENT_STORE is 1 (the clients' weights in one store in memory), 0 (off) or a folder for "
            "the store's file, e.g. FEDPROTO_CLIENT_STORE=/tmp/fedproto-store")
    if v.lstrip("+-").replace(".", "", 1).isdigit():
        raise ConfigError(f"FEDPROTO_CLIENT_STORE={value!r} is a number but not 0 or 1", hint=hint)
    folder = os.path.expanduser(v)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(f"FEDPROTO_CLIENT_STORE={value!r} is a file, not a folder", hint=hint)
    return folder


def client_states(cfg: CommonConfig, part: Partition, ds: Dataset,
                  store: bool | str | os.PathLike[str] = False) -> list[ClientState]:
    """One :class:`ClientState` per client with its model (:func:`~fedproto.models.zoo.build_client_models`).

    With ``store``, where one model spec builds every client (no ``-mh`` spec, no list, no
    ``pretrained``) and its model is :func:`~fedproto.engine.client_store.storable`, the models
    are built one at a time exactly as there (same seeds, same order), copied into one
    :class:`~fedproto.engine.client_store.ClientStore` and dropped: the states are
    :class:`~fedproto.engine.client_store.StoredClientState` (peak memory: the store, (N, P)
    float32, and one module). ``store`` a folder: the rows in a file there
    (:class:`~fedproto.engine.client_store.ClientStore`'s ``path``; removed when the store goes).
    Otherwise, or when the first model is not storable, modules.
    """
    from fedproto.engine.client_store import ClientStore, StoredClientState, storable
    from fedproto.models.zoo import build_client_model

    C, H, _ = ds.input_shape
    n = part.num_clients
    spec = cfg.model.strip()
    if store and n > 0 and "," not in spec and not spec.endswith("-mh") and cfg.pretrained is None:
        def one(i: int) -> torch.nn.Module:
            return build_client_model(spec, i, n, C, ds.num_classes, H, cfg.embedding_dim, cfg.dropout, cfg.seed,
                                      shared_init=cfg.shared_init)

        first = one(0)
        if storable(first):
            path = None
            if not isinstance(store, bool):
                import uuid

                path = Path(store) / f"fedproto-client-store-{os.getpid()}-{uuid.uuid4().hex[:8]}.f32"
            st = ClientStore(first, n, path)
            st.put(0, first)
            for i in range(1, n):
                st.put(i, one(i))
            return [StoredClientState.of(i, st, part.classes[i]) for i in range(n)]
        log.info("client_store: %s models cannot live in a ClientStore (no batched forward, buffers or mixed "
                 "dtypes): one module per client", type(first).__name__)
    models = build_client_models(cfg.model, n, C, ds.num_classes, H, cfg.embedding_dim,
                                 cfg.dropout, cfg.seed, pretrained=cfg.pretrained, shared_init=cfg.shared_init)
    return [ClientState(i, m, part.classes[i]) for i, m in enumerate(models)]


def client_views(ds: Dataset, train_idx: Sequence[np.ndarray], test_idx: Sequence[np.ndarray]) -> list[ClientData]:
    """Each client's data as an index view into ``ds`` (:meth:`ClientData.view`): one copy of each
    split's inputs for all clients, each client's rows gathered when read (at 10,000
    clients the per-client copies of the test images were 3.8 GB).

    Args:
        ds: the dataset. train_idx, test_idx: per client, its (n_i,) rows of the train and the test split.
    Returns:
        One :class:`ClientData` per client, with its labels gathered (int64) and its inputs a view.
    """
    train, test = SharedInputs(ds.train_x), SharedInputs(ds.test_x)
    out = []
    for tr_rows, te_rows in zip(train_idx, test_idx):
        tr, te = torch.as_tensor(tr_rows, dtype=torch.long), torch.as_tensor(te_rows, dtype=torch.long)
        out.append(ClientData.view(train, tr, ds.train_y[tr], test, te, ds.test_y[te]))
    return out


def build_setup(cfg: CommonConfig, states: list[ClientState], data: list[ClientData], partition: Partition,
                dataset: Dataset | None = None, place: bool = True, whole: bool = True,
                fix: str | None = None) -> Setup:
    """The one set-up every front end finishes with (``fedproto run`` through :func:`prepare`,
    :func:`fedproto.federation.federate`, the Flower nodes, onboarding): the checks of the clients
    against the options, the algorithm, and the options resolved against the data, so a check
    added here holds everywhere.

    In order: the models meet what the method needs of them (its ``model_needs``:
    :func:`~fedproto.algorithms.requirements.check_model_needs`; one embedding size, one
    architecture, only the label space, or nothing), the
    batch size suits the clients (:func:`check_batches`), a warning for options the algorithm
    ignores, the algorithm built and its own checks (``check_setup``, ``check_models``), a
    warning naming the clients whose test sets hold classes absent from their training sets,
    and ``batch_size`` capped at the largest client's training samples (a wider batch only adds
    padding; the cap is ``Setup.algorithm.opt.batch_size``, and ``config.json``'s
    ``batch_size_in_force``), and the precision the clients train in
    (:func:`fedproto.training.devices.resolve_precision`: ``Setup.algorithm.opt.precision``).

    Args:
        cfg: the validated run configuration.
        states: one per client, in client order (``states[i].cid`` names the client in messages).
        data: one per client, in the order of ``states``; ``data[i].y`` and ``data[i].test_y`` are
            (n,) int64 label tensors.
        partition: the clients' sample indices and classes (``config.json``'s
            ``partition_summary``).
        dataset: the loaded dataset (None for your own clients).
        place: move the models and in-memory data to ``cfg.device`` (False: leave them where they are).
        fix: how this front end's user gives the models one embedding size (the refusal's advice;
            None: the general one).
        whole: the clients are the whole federation; False for some clients of one (a Flower
            node's own client, onboarding's new clients): the algorithm's federation-wide checks
            (``check_setup``: enough holders of a class for ``min_contributors``...) are skipped.
    Returns:
        The :class:`Setup`.
    Raises:
        ModelError: embedding sizes differ where the method needs one (names the clients and the
            methods that run these models). ConfigError: architectures differ where the method
            averages weights (names the methods that run these models), the batch size leaves a
            client without a batch, the algorithm refuses the clients' models or labels, or
            ``precision`` is fp16 on a device other than a CUDA GPU.
    """
    from fedproto.engine.client_store import arch_model

    models = [arch_model(s) for s in states]  # a stored client's template: no module built per client
    needs = model_needs(get_algorithm(cfg.algorithm))  # what the method needs of the models, checked as stated
    d = check_model_needs(cfg.algorithm, needs, models, fix)
    check_batches(cfg, models, [len(x.y) for x in data])
    fields = type(cfg).model_fields
    users = {k: owners(k) for k in fields if k not in CommonConfig.model_fields}  # the algorithms' own options
    unused = [k for k, algs in users.items() if cfg.algorithm not in algs and getattr(cfg, k) != fields[k].default]
    if unused:
        log.warning("%s ignores %s: %s", cfg.algorithm, ", ".join(unused), "; ".join(
            f"{k} acts on {', '.join(users[k])} only" for k in unused))
    alg = build_algorithm(cfg, d)
    for warning in alg.setup_warnings(cfg):  # the method's words about its options (FedProto: the DP noise's seed)
        log.warning("%s", warning)
    if whole:
        alg.check_setup(cfg, [x.y.cpu().numpy() for x in data])
    if needs == ONE_ARCHITECTURE:
        own = ("give every client a model of one architecture (the same class and layer sizes)"
               if cfg.dataset == "custom" else None)  # your own models: no zoo name to suggest
        check_architectures(cfg.algorithm, models, alg.include(models[0]), own)
    alg.check_models(models)
    warn_unseen_test_classes(states, data)
    # a batch wider than the largest client only adds padding (and memory for its dropout masks);
    # every step would hold the same samples, so cap it there
    largest = max((len(x.y) for x in data), default=1)
    if alg.opt.batch_size > largest > 0:
        alg.opt = replace(alg.opt, batch_size=largest)
    # the precision the clients train in on this run's device (bf16 on a CPU without it: a warning, fp32;
    # fp16 off a GPU: refused); alg.opt carries it to every training path, worker processes and Flower nodes
    device = resolve_device(cfg.device)
    alg.opt = replace(alg.opt, precision=resolve_precision(getattr(cfg, "precision", "fp32"), device))
    setup = Setup(dataset, partition, states, data, alg, d)
    return setup.to_device(device) if place else setup


def warn_unseen_test_classes(states: list[ClientState], data: list[ClientData]) -> dict[int, list[int]]:
    """Warn, naming the clients and the classes, where a client's test set holds classes its
    training set lacks: the client never learns them, so its accuracy counts every such test
    sample as an error (and nearest-prototype inference among its own classes cannot name them).

    Returns:
        client id -> the sorted classes seen in its test set only (clients without any left out).
    """
    unseen: dict[int, list[int]] = {}
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


