"""``summary.json`` of a finished run: what was run, the accuracy over clients, communication, time.

Accuracy is per client on that client's own test set, reported as the mean and population
standard deviation over clients, each client counted once (docs/architecture.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, TypeAlias

import numpy as np

from fedproto.algorithms.algorithm import Algorithm
from fedproto.config.common_options import CommonConfig
from fedproto.engine.executors.executor import Executor

log = logging.getLogger(__name__)

Row: TypeAlias = dict[str, Any]
"""A metrics row (one line of ``metrics.jsonl``): the round, losses, communication, delivery status,
the method's own metrics and, on evaluation rounds, ``<key>_mean`` and ``<key>_std``; its keys vary
with the method and the front end."""

ClientMetrics: TypeAlias = dict[str, Any]
"""One client's metrics (a row of ``clients.csv``): the executor's evaluation (numbers), then what
observers add (``left_out`` reasons, ``attacker``, ``full_*`` scores)."""

Summary: TypeAlias = dict[str, Any]
"""``summary.json``: :func:`build_summary`'s entries plus what observers and the method add."""


def summarize(values: list[float]) -> tuple[float, float]:
    """Mean and population standard deviation over clients (each counted once), NaNs dropped."""
    v = np.asarray([x for x in values if x == x], dtype=np.float64)
    if len(v) == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std())


def trained_in(row: Row, num_clients: int) -> Iterable[int]:
    """The clients that trained and replied in a metrics row: ``replied`` where the row has it (Flower:
    ``sampled`` also lists clients that did not answer), else ``sampled`` (in-process, the rounds where
    not every client took part), else all ``num_clients``."""
    for key in ("replied", "sampled"):
        if key in row:
            clients: Iterable[int] = row[key]
            return clients
    return range(num_clients)


def rounds_trained(history: list[Row], num_clients: int) -> list[int]:
    """Per client: the rounds of ``history`` in which it trained and replied (:func:`trained_in`)."""
    counts = [0] * num_clients
    for row in history:
        for i in trained_in(row, num_clients):
            counts[int(i)] += 1
    return counts


def _measured(v: object) -> bool:
    """An accuracy was measured: a number, not NaN (a node that did not answer reports NaN)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def over_clients(summary: Summary) -> str:
    """How many clients the headline accuracy is over, in words: ``"3"``, or ``"2 of 3"`` when some are
    left out (summary.json ``left_out``)."""
    n, k = summary["clients"], summary.get("clients_in_accuracy", summary["clients"])
    return f"{k} of {n}" if k != n else f"{n}"


def describe_test_set(cfg: CommonConfig) -> str:
    """Which test set the accuracies are on, in words."""
    if cfg.dataset == "custom":
        return "per client: its own test data"
    return {"fewshot": f"per client: {cfg.test_shots} test-split samples of each own class",
            "natural": "per client: the writer's own test samples",
            "dirichlet": f"per client: {cfg.test_shots} x (own classes) test-split samples in the client's training "
                         "class proportions"}[cfg.partition]


def _evaluated(per_client: list[ClientMetrics], last: Row) -> list[str]:
    """The keys the final evaluation measured (a ``_mean``/``_std`` pair in the last metrics row), in
    the order the clients report them."""
    keys = dict.fromkeys(k for m in per_client for k in m)
    return [k for k in keys if f"{k}_mean" in last and f"{k}_std" in last]


def _precision_used(cfg: CommonConfig, executor: Executor) -> str:
    """The precision the clients trained in (:func:`fedproto.training.devices.resolve_precision`: the option's
    bf16 is fp32 on a CPU without bf16): the simulator's executors know it
    (``precision_in_use``); on Flower each node resolves it on its own device (a node that falls
    back to fp32 says so in its log), so the server names the request."""
    used = getattr(executor, "precision_in_use", None)
    if used is not None:
        return str(used)
    asked = str(getattr(cfg, "precision", "fp32"))
    return asked if asked == "fp32" else f"{asked} as requested, resolved on each node (see the nodes' logs)"


def build_summary(cfg: CommonConfig, alg: Algorithm, executor: Executor, history: list[Row],
                  per_client: list[ClientMetrics], totals: dict[str, int], wall: float, train_time: float) -> Summary:
    """The summary of a run from its metrics rows and final per-client metrics.

    Args:
        cfg: the run's options. alg: its algorithm (``eval_protocols``, ``summary_entries``).
        executor: its executor (``execution``, ``processes``, ``client_rows``, ``num_clients``, and
            ``left_out`` where it has one).
        history: the metrics rows; the last one holds the final accuracies.
        per_client: the final per-client metrics (indexed by client id).
        totals: communication summed over rounds. wall, train_time: seconds.
    Returns:
        The ``summary.json`` dict (observers add their entries: attack, full test split). Its keys are the
        same whatever happened: ``accuracy`` is over the ``clients_in_accuracy`` clients not in ``left_out``
        (client id -> why: a node that lost its state and trained too little since, or that did not answer
        the final evaluation); ``accuracy_all_clients`` over every client evaluated (``clients_evaluated``).
        ``per_client`` rows get ``left_out`` (the reason, or ``""``) in place, for ``clients.csv``.
    """
    S = executor.num_clients
    summary = _run_entries(cfg, alg, executor, history[-1], per_client, totals, wall, train_time)
    trained = rounds_trained(history, S)
    never = [i for i, n in enumerate(trained) if n == 0]
    measured = [i for i, m in enumerate(per_client) if _measured(m.get("acc"))]
    left: dict[int, str] = dict(executor.left_out(history, cfg.rounds)) if hasattr(executor, "left_out") else {}
    scored = [i for i in never if i not in left and (i in measured or "acc" not in per_client[i])]
    if never:
        _add_accuracy_trained(summary, cfg, per_client, trained, scored)
    _add_headline_clients(summary, per_client, measured, left)
    summary.update(alg.summary_entries(cfg, per_client))
    return summary


def _run_entries(cfg: CommonConfig, alg: Algorithm, executor: Executor, last: Row, per_client: list[ClientMetrics],
                 totals: dict[str, int], wall: float, train_time: float) -> Summary:
    """What was run, the accuracy over every client evaluated (the ``_mean``/``_std`` pairs of the last
    metrics row), communication, times and how the clients ran: the first entries of ``summary.json``."""
    fewshot = cfg.partition == "fewshot" and cfg.dataset != "custom"  # natural, dirichlet, custom: per client
    return {
        "algorithm": cfg.algorithm,
        "dataset": cfg.dataset,
        "model": cfg.model,
        "clients": executor.num_clients,
        "rounds": cfg.rounds,
        "ways": cfg.ways if fewshot else None,
        "shots": cfg.shots if fewshot else None,
        "seed": cfg.seed,
        "test_set": describe_test_set(cfg),
        # the evaluated keys only: a method's own round metric may end in "_mean" too
        "accuracy": {k: {"mean": last[f"{k}_mean"], "std": last[f"{k}_std"]} for k in _evaluated(per_client, last)},
        "evaluation": alg.eval_protocols(),  # which protocol each accuracy key is
        "params_per_round": {"up": totals["up_params"] / cfg.rounds, "down": totals["down_params"] / cfg.rounds},
        "bytes_total": {"up": totals["up_bytes"], "down": totals["down_bytes"]},
        "model_params": [r["params"] for r in executor.client_rows()],
        "wall_time_s": wall,
        "train_time_s": train_time,
        "execution": cfg.execution,
        "processes": executor.processes,
        "precision": alg.opt.precision,  # the precision used (the option's bf16 is fp32 on a CPU without bf16)
        "client_store": _client_store_used(executor),
    }


def _client_store_used(executor: Executor) -> str | None:
    """Where the clients' weights were kept between rounds, when not as one module per client:
    ``"memory"`` or ``"file"`` (a :class:`~fedproto.engine.client_store.ClientStore`, the
    ``FEDPROTO_CLIENT_STORE`` environment variable or ``prepare(client_store=...)``); None: modules."""
    from fedproto.engine.client_store import StoredClientState

    setup = getattr(executor, "setup", None)
    states = getattr(setup, "states", None) or []
    if not states or not isinstance(states[0], StoredClientState):
        return None
    return "memory" if states[0].row_store.path is None else "file"


def _add_accuracy_trained(summary: Summary, cfg: CommonConfig, per_client: list[ClientMetrics], trained: list[int],
                          scored: list[int]) -> None:
    """``clients_trained`` and ``accuracy_trained``: the mean over the clients that trained in at least
    one round, beside the mean over all (some never trained); warns about the ``scored`` ones (never
    trained, yet in the accuracy over all clients)."""
    # clients never sampled (participation < 1) are scored at their initial weights: the mean over all
    # clients mixes them in, so the mean over the clients that trained stands beside it
    did = [m for i, m in enumerate(per_client) if trained[i] > 0]
    summary["clients_trained"] = len(did)
    summary["accuracy_trained"] = {
        "test_set": summary["test_set"] + f"; the {len(did)} clients that trained in at least one round",
        **{k: dict(zip(("mean", "std"), summarize([m[k] for m in did]))) for k in summary["accuracy"]
           if k in per_client[0]}}
    if scored:  # (a client left out, e.g. its node refused at join, is not scored: left_out says why)
        log.warning("%d of %d clients never trained (participation=%g over %d rounds): clients %s%s are scored at "
                    "their initial weights and counted in the accuracy over all clients; the mean over the %d "
                    "clients that trained is summary.json's accuracy_trained (clients.csv: rounds_trained)",
                    len(scored), len(trained), cfg.participation, cfg.rounds, scored[:10],
                    " ..." if len(scored) > 10 else "", len(did))


def _add_headline_clients(summary: Summary, per_client: list[ClientMetrics], measured: list[int],
                          left: dict[int, str]) -> None:
    """The headline accuracy over the clients it names: ``left`` (client id -> why, the executor's) gains
    the clients not evaluated at the end; ``accuracy`` is then over the others (``accuracy_all_clients``
    over every client evaluated), with ``clients_evaluated``, ``clients_in_accuracy`` and ``left_out``;
    each per-client row gets its ``left_out`` reason (or ``""``)."""
    # clients.csv and summary.json keep their keys whatever happened
    summary["clients_evaluated"] = len(measured)
    if any("acc" in m for m in per_client):  # (a DP node keeps its accuracy: nothing to leave out then)
        for i in range(len(per_client)):
            if i not in left and i not in measured:
                left[i] = "not evaluated at the end: its node did not answer the final evaluation"
    kept = [m for i, m in enumerate(per_client) if i not in left]
    summary["accuracy_all_clients"] = summary["accuracy"]
    if left:
        summary["accuracy"] = {k: dict(zip(("mean", "std"), summarize([m[k] for m in kept])))
                               for k in summary["accuracy"] if k in per_client[0]}
        log.warning("the accuracy is over %d of %d clients: it leaves out %s (summary.json left_out says why); "
                    "accuracy_all_clients in summary.json counts every client evaluated", len(kept), summary["clients"],
                    ", ".join(f"client {i} ({why})" for i, why in sorted(left.items())))
    summary["clients_in_accuracy"] = len(kept)
    summary["left_out"] = {str(i): why for i, why in sorted(left.items())}
    for i, m in enumerate(per_client):  # clients.csv: the same column in every run
        m["left_out"] = left.get(i, "")
