"""``summary.json`` of a finished run: what was run, the accuracy over clients, communication, time.

Accuracy is per client on that client's own test set, reported as the mean and population
standard deviation over clients, each client counted once (DESIGN.md "Conventions").
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from fedproto.algorithms.base import Algorithm
from fedproto.config import RunConfig

log = logging.getLogger(__name__)


def summarize(values: list[float]) -> tuple[float, float]:
    """Mean and population standard deviation over clients (each counted once), NaNs dropped."""
    v = np.asarray([x for x in values if x == x], dtype=np.float64)
    if len(v) == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std())


def trained_in(row: dict, num_clients: int):
    """The clients that trained and replied in a metrics row: ``replied`` where the row has it (Flower:
    ``sampled`` also lists clients that did not answer), else ``sampled`` (in-process, the rounds where
    not every client took part), else all ``num_clients``."""
    return row.get("replied", row.get("sampled", range(num_clients)))


def rounds_trained(history: list[dict], num_clients: int) -> list[int]:
    """Per client: the rounds of ``history`` in which it trained and replied (:func:`trained_in`)."""
    counts = [0] * num_clients
    for row in history:
        for i in trained_in(row, num_clients):
            counts[int(i)] += 1
    return counts


def describe_test_set(cfg: RunConfig) -> str:
    """Which test set the accuracies are on, in words."""
    if cfg.dataset == "custom":
        return "per client: its own test data"
    return {"fewshot": f"per client: {cfg.test_shots} test-split samples of each own class",
            "natural": "per client: the writer's own test samples",
            "dirichlet": f"per client: {cfg.test_shots} x (own classes) test-split samples in the client's training "
                         "class proportions"}[cfg.partition]


def build_summary(cfg: RunConfig, alg: Algorithm, executor: Any, history: list[dict], per_client: list[dict],
                  totals: dict, wall: float, train_time: float) -> dict:
    """The summary of a run from its metrics rows and final per-client metrics.

    Args:
        cfg: the run's options. alg: its algorithm (``eval_protocols``, ``summary_entries``).
        executor: its executor (``execution``, ``processes``, ``client_rows``, ``num_clients``).
        history: the metrics rows; the last one holds the final accuracies.
        per_client: the final per-client metrics (indexed by client id).
        totals: communication summed over rounds. wall, train_time: seconds.
    Returns:
        The ``summary.json`` dict (observers add their entries: attack, full test split).
    """
    last = history[-1]
    S = executor.num_clients
    fewshot = cfg.partition == "fewshot" and cfg.dataset != "custom"  # natural, dirichlet, custom: per client
    summary: dict[str, Any] = {
        "algorithm": cfg.algorithm,
        "dataset": cfg.dataset,
        "model": cfg.model,
        "clients": S,
        "rounds": cfg.rounds,
        "ways": cfg.ways if fewshot else None,
        "shots": cfg.shots if fewshot else None,
        "seed": cfg.seed,
        "test_set": describe_test_set(cfg),
        "accuracy": {k.removesuffix("_mean"): {"mean": last[k], "std": last[k.replace("_mean", "_std")]}
                     for k in last if k.endswith("_mean")},
        "evaluation": alg.eval_protocols(),  # which protocol each accuracy key is
        "params_per_round": {"up": totals["up_params"] / cfg.rounds, "down": totals["down_params"] / cfg.rounds},
        "bytes_total": {"up": totals["up_bytes"], "down": totals["down_bytes"]},
        "model_params": [r["params"] for r in executor.client_rows()],
        "wall_time_s": wall,
        "train_time_s": train_time,
        "execution": cfg.execution,
        "processes": executor.processes,
    }
    trained = rounds_trained(history, S)
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
        log.warning("%d of %d clients never trained (participation=%g over %d rounds): clients %s%s are scored at "
                    "their initial weights and counted in the accuracy over all clients; the mean over the %d clients "
                    "that trained is summary.json's accuracy_trained (clients.csv: rounds_trained)", len(never), S,
                    cfg.participation, cfg.rounds, never[:10], " ..." if len(never) > 10 else "", len(did))
    scored = sum(1 for m in per_client if isinstance(m.get("acc"), float) and m["acc"] == m["acc"])
    if scored < len(per_client) and any("acc" in m for m in per_client):  # a node did not answer (Flower)
        summary["clients_evaluated"] = scored
    left = executor.left_out(history, cfg.rounds) if hasattr(executor, "left_out") else {}
    if left:
        # the headline is over the clients that kept (or rebuilt) their state; all clients stand beside it
        kept = [m for i, m in enumerate(per_client) if i not in left]
        summary["accuracy_all_clients"] = summary["accuracy"]
        summary["accuracy"] = {k: dict(zip(("mean", "std"), summarize([m[k] for m in kept])))
                               for k in summary["accuracy"] if k in per_client[0]}
        summary["left_out"] = {str(i): why for i, why in left.items()}
        log.warning("the accuracy leaves out clients %s (their node lost their state and they trained too little "
                    "since); accuracy_all_clients in summary.json counts them", sorted(left))
    summary.update(alg.summary_entries(cfg, per_client))
    return summary
