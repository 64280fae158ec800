"""The batched executor: clients of one architecture trained as one batched computation.

Each round's clients are grouped by architecture (:meth:`BatchedExecutor.groups`). A group whose
models have a hand-written batched forward (:attr:`~fedproto.models.proto_model.ProtoModel.batch_params`,
the paper's CNN) trains with :func:`~fedproto.training.train_group`, split over worker processes
(:mod:`fedproto.engine.executors.worker_pool`) where the run has them; with ``execution="batched"`` other
architectures train with the generic path (:func:`~fedproto.training.train_group_generic`,
``torch.func.vmap``); with ``execution="auto"`` only those it runs as grouped operations (CNNs of
standard layers on images, :mod:`fedproto.training.grouped_forward`), the others one by one. Singletons, data read
item by item and models neither path can batch train one by one
(:func:`~fedproto.engine.executors.in_process.client_step`). Every path takes the same
``prepare``/``local_objective``/``plan``/``finish`` calls of the algorithm, so it matches the
sequential executor in float64 (tests/engine/test_parallel.py, tests/engine/test_batched_generic.py).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Hashable, Iterator, Mapping
from typing import TYPE_CHECKING, Literal, cast

import numpy as np
import torch

from fedproto.algorithms.algorithm import ClientData, Message
from fedproto.engine.client_store import ClientStore, StoredClientState, arch_model, borrowed, stored_group
from fedproto.engine.executors.in_process import LocalExecutor, client_step, custom_step
from fedproto.engine.executors.paths import explain_paths
from fedproto.engine.seeding import client_rng, client_seed
from fedproto.engine.setup import Setup
from fedproto.training import (
    Objective,
    OptimConfig,
    Plan,
    TrainResult,
    batch_key,
    can_batch,
    frozen_params,
    generic_batch_problem,
    generic_key,
    portable_objective,
    respect_frozen,
    stack_plans,
    stacked_refs,
    train_group,
    train_group_generic,
    train_stacked,
)

if TYPE_CHECKING:
    from fedproto.engine.executors.worker_pool import GroupItem, WorkerPool

log = logging.getLogger(__name__)


class _TrainInputs(Mapping[int, torch.Tensor]):
    """Client id -> its training inputs ``data[i].x``, read (for an index view: gathered) on access:
    the worker pool copies the clients one at a time into its shared block."""

    def __init__(self, data: list[ClientData], ids: list[int]):
        self._data, self._ids, self._known = data, ids, set(ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in self._known:
            raise KeyError(i)
        # the pool's clients have in-memory tensor inputs (BatchedExecutor._executors: in_memory, can_batch)
        return cast(torch.Tensor, self._data[i].x)

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


def balanced_parts(members: list[int], sizes: list[int], parts: int) -> list[list[int]]:
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


class BatchedExecutor(LocalExecutor):
    """Clients of one architecture as one batched computation, optionally on worker processes.

    Args:
        setup: the run's set-up (as :class:`~fedproto.engine.executors.in_process.LocalExecutor`).
        seed: the run's seed.
        mode: ``auto`` (the hand-written batched path where a model has one, the generic path's grouped
            operations for CNNs of standard layers, :mod:`fedproto.training.grouped_forward`) or ``batched`` (the
            generic path for every other model it can batch too: ``torch.func.vmap``).
        group_size: most clients in one batched computation.
        workers: worker processes (:func:`fedproto.engine.executors.worker_pool.plan_workers`; 0: auto).
        threads: the run's thread budget (0: torch's default).
        rounds: the run's rounds (auto mode starts workers only for long runs).
    """

    execution = "batched"

    def __init__(self, setup: Setup, seed: int, mode: str = "auto", group_size: int = 128, workers: int = 0,
                 threads: int = 0, rounds: int = 1):
        super().__init__(setup, seed)
        self.mode, self.group_size, self.workers, self.threads, self.rounds = mode, group_size, workers, threads, rounds
        self.processes = 1
        # fedproto.engine.executors.worker_pool.WorkerPool; False: one process; None: not decided yet (or closed)
        self._pool: WorkerPool | Literal[False] | None = None
        self._worker_threads = 1
        self._generic_checked: dict[Hashable, bool] = {}
        self._grouped_checked: dict[Hashable, bool] = {}
        self._said_custom = False  # the client_update override's log line was written

    @property
    def pool(self) -> WorkerPool | Literal[False] | None:
        """The :class:`~fedproto.engine.executors.worker_pool.WorkerPool` training this run's batched groups; False when
        they train in this process; None before the first batched round and after :meth:`close`."""
        return self._pool

    def groups(self, ids: list[int]) -> list[tuple[list[int], int]]:
        """This round's training groups, each with its executor: 0 the main process, w > 0 worker
        process w (:mod:`fedproto.engine.executors.worker_pool`). Singletons train on the sequential path."""
        mode = self.mode
        alg = self.setup.algorithm
        if mode == "sequential" or alg.sequential_only:
            explain_paths(self, [([i], 0) for i in ids])
            return [([i], 0) for i in ids]
        if custom_step(alg):  # the method replaced the whole client step: only client_step runs it
            if not self._said_custom:
                self._said_custom = True
                log.info("%s overrides client_update, which the batched paths cannot run: its clients train one "
                         "after another (client_step)", type(alg).__name__)
            return [([i], 0) for i in ids]
        by_arch: dict[Hashable, list[int]] = defaultdict(list)
        for i in ids:  # data read from a Dataset (fedproto.federation.LazyInputs) trains sequentially
            by_arch[self._group_key(i)].append(i)
        S = self.setup.states
        batched = [m for m in by_arch.values() if len(m) > 1 and can_batch([arch_model(S[i]) for i in m])]
        # the generic path: with execution="batched" for every model it can batch; with "auto" only for CNNs of standard
        # layers on images (the grouped operations of fedproto.training.grouped_forward), measured 1.3-2x faster than
        # the sequential
        # path on this project's 2-core CPU; vmap (BatchNorm, dropout: ResNet18 0.44x) was slower (docs/benchmarks.md)
        generic = [m for m in by_arch.values() if len(m) > 1 and (mode == "batched" or self._grouped_ok(m))
                   and self._generic_ok(m)]
        W = self._executors(max((len(m) for m in batched), default=0))
        groups: list[tuple[list[int], int]] = []
        for members in by_arch.values():
            if any(members is m for m in generic):  # the generic path trains in the main process
                n = self.group_size
                groups.extend((members[j : j + n], 0) for j in range(0, len(members), n))
                continue
            if not any(members is m for m in batched):
                groups.extend(([i], 0) for i in members)
                continue
            # W parts of about equal sample counts, then chunks: a very wide stack (thousands of
            # clients) outgrows the caches; clients are independent, so neither changes a number
            sizes = {i: len(self.setup.data[i].y) for i in members}
            parts = balanced_parts(members, [sizes[i] for i in members], W)
            # the main process, which also prepares, sends and aggregates, takes the lightest part
            parts.sort(key=lambda p: sum(sizes[i] for i in p))
            n = self.group_size
            for w, part in enumerate(parts):
                groups.extend((part[j : j + n], w) for j in range(0, len(part), n))
        explain_paths(self, groups)  # token ids, dicts, Dataset items: each client's path, logged once
        return groups

    def _group_key(self, i: int) -> tuple[object, ...] | None:
        """Client ``i``'s batching key: the hand-written batched path's (:func:`batch_key`) where its
        model has one, else the generic path's (:func:`generic_key`); None: it trains sequentially
        (data read from a Dataset, :class:`fedproto.federation.LazyInputs`, always does)."""
        model = arch_model(self.setup.states[i])  # a stored client's template: no module built (store.py)
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
        model = arch_model(self.setup.states[members[0]])
        if model.batch_params:
            return False
        key = self._group_key(members[0])
        if key is None:
            return False
        cache = self._generic_checked
        if key not in cache:
            problem = generic_batch_problem(model, self.setup.data[members[0]].x)
            if problem is not None:  # named by the user's class, not the library's adapter around it
                inner = getattr(model, "net", None)
                user = inner if isinstance(inner, torch.nn.Module) else model
                log.info("%s models train one client after another: torch.func.vmap cannot batch them (%s)",
                         type(user).__name__, problem)
            cache[key] = problem is None
        return cache[key]

    def _grouped_ok(self, members: list[int]) -> bool:
        """True if the clients ``members`` (equal :meth:`_group_key`) would train on the generic path's grouped
        operations (:func:`fedproto.training.grouped_forward.grouped_graph` traces their model; image inputs), which
        ``execution="auto"`` uses; checked once per architecture and run."""
        from fedproto.training.grouped_forward import grouped_graph

        model = arch_model(self.setup.states[members[0]])
        key = self._group_key(members[0])
        if key is None or model.batch_params:
            return False
        cache = self._grouped_checked
        if key not in cache:
            x = self.setup.data[members[0]].x
            cache[key] = isinstance(x, torch.Tensor) and x.dim() == 4 and grouped_graph(model)[0] is not None
        return cache[key]

    def _executors(self, batched_clients: int) -> int:
        """Processes that train this run's batched groups (fixed at the first round that has
        any): 1, or W with a :class:`~fedproto.engine.executors.worker_pool.WorkerPool` of W - 1 workers."""
        if self._pool is None and batched_clients >= 2:
            from fedproto.engine.executors.worker_pool import WorkerPool, available_cores, plan_workers

            W, threads = plan_workers(self.workers, self.threads, batched_clients, str(self.setup.device),
                                      self.rounds)
            if W > 1 and any(isinstance(s, StoredClientState) for s in self.setup.states):
                log.info("the clients' weights live in a ClientStore: training in one process (worker processes "
                         "would need a module per client)")
                W, threads = 1, self.threads or torch.get_num_threads()
            self._worker_threads = threads
            self.processes = W
            if self.workers > 1 and W == 1:
                log.warning("workers=%d: training in one process (worker processes need the CPU, 2 or more "
                            "batched clients in a round and a system other than Windows; this run: device %s, %d "
                            "batched clients)", self.workers, self.setup.device, batched_clients)
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

    def _group_inputs(self, round: int, group: list[int],
                      msgs: dict[int, Message]) -> tuple[list[Objective], list[Plan]]:
        """Prepare the clients of a batched group; their objectives and batch plans."""
        alg, S, D = self.setup.algorithm, self.setup.states, self.setup.data
        objs: list[Objective] = []
        plans: list[Plan] = []
        for i in group:
            with borrowed(S[i]):  # a stored client's model is bound for these calls only (store.py)
                alg.prepare(S[i], msgs[i])
                objs.append(alg.local_objective(S[i], msgs[i]))
                plans.append(alg.plan(S[i], objs[-1], len(D[i].y), client_rng(self.seed, round, i)))
        return objs, plans

    def _train_stored(self, store: ClientStore, group: list[int], plans: list[Plan], obj: Objective,
                      opt: OptimConfig, objs: list[Objective]) -> list[TrainResult]:
        """:func:`~fedproto.training.train_group` of a group whose clients live in ``store``, from and
        back into their rows (:meth:`ClientStore.stacked`, :meth:`ClientStore.write`): the same stacked
        weights, the same :func:`~fedproto.training.train_stacked` call, with the first client's model
        mode (the batched forward reads it) as its module would have it."""
        S, D = self.setup.states, self.setup.data
        with borrowed(S[group[0]]) as m0:
            names = m0.batch_params
            frozen = frozen_params(m0)  # a stored client without a module of its own has the template's
            obj = respect_frozen(obj, frozen)
            objs = [respect_frozen(o, frozen) for o in objs]
            P = store.stacked(group)
            ref = stacked_refs(obj, objs, names, len(group))
            xs = [D[i].x for i in group]
            offsets = np.cumsum([0] + [len(x) for x in xs])[:-1]
            X = torch.cat(xs).contiguous()
            Y = torch.cat([D[i].y for i in group])
            del xs
            phases = [stack_plans(plans, pi, offsets, opt.batch_size) for pi in range(len(obj.phases))]
            out = train_stacked(m0, P, X, Y, phases, obj, opt, ref)
        store.write(group, P)
        return out

    def train_clients(self, round: int, msgs: dict[int, Message]) -> dict[int, tuple[Message, TrainResult]]:
        """Client id -> (message, TrainResult) of one round: batched groups (in worker processes where
        there are any), the rest one by one (:func:`client_step`)."""
        alg, S, D = self.setup.algorithm, self.setup.states, self.setup.data
        opt = alg.opt.at_round(round)  # the round's lr (lr_schedule), passed to every path
        out: dict[int, tuple[Message, TrainResult]] = {}
        groups = self.groups(sorted(msgs))
        pool = self._pool or None
        # read only for groups of a worker w > 0, which exist only where _executors started a pool
        workers = cast("WorkerPool", pool)
        tasks: dict[int, list[GroupItem]] = defaultdict(list)
        for group, w in groups:  # the workers' parts first: they train while the main process trains its own
            if w == 0:
                continue
            objs, plans = self._group_inputs(round, group, msgs)
            names = arch_model(S[group[0]]).batch_params
            ref = stacked_refs(objs[0], objs, names, len(group))
            obj = portable_objective(objs[0], names)
            phases = [stack_plans(plans, pi, workers.offsets(group), opt.batch_size) for pi in range(len(obj.phases))]
            tasks[w].append((group, phases, obj, ref))
        models = {w: [[S[i].model for i in g] for g, *_ in items] for w, items in tasks.items()}
        for w, items in tasks.items():
            workers.submit(w - 1, items, models[w], opt)
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
                    with borrowed(S[i]):
                        out[i] = client_step(alg, S[i], msgs[i], D[i], self.seed, round)
                    continue
                objs, plans = self._group_inputs(round, group, msgs)
                store = stored_group([S[i] for i in group])
                if store is not None and store.template.batch_params:
                    results = self._train_stored(store, group, plans, objs[0], opt, objs)
                    for i, res in zip(group, results):
                        with borrowed(S[i]):
                            out[i] = (alg.finish(S[i], msgs[i], D[i], res), res)
                    continue
                ms = [S[i].model for i in group]
                if ms[0].batch_params:
                    results = train_group(ms, [D[i].x for i in group], [D[i].y for i in group], plans, objs[0],
                                          opt, objs)
                else:
                    results = train_group_generic(ms, [D[i].x for i in group], [D[i].y for i in group], plans,
                                                  objs[0], opt, objs,
                                                  [client_seed(self.seed, round, i) for i in group])
                for i, res in zip(group, results):
                    out[i] = (alg.finish(S[i], msgs[i], D[i], res), res)
            trained = True
        finally:
            torch.set_num_threads(threads)
            if not trained and tasks:  # the main part raised or was interrupted (Ctrl-C): that is the error to
                self.close()           # report, not the workers'; they stop without their results awaited
        done = {w: workers.collect(w - 1, models[w]) for w in tasks}
        for w, items in tasks.items():
            for (ids, *_), results in zip(items, done[w]):
                for i, res in zip(ids, results):
                    out[i] = (alg.finish(S[i], msgs[i], D[i], res), res)
        return out

