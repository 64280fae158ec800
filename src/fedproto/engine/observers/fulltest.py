"""Evaluation beyond the personalized test sets (practitioner's guide §4.3, option ``eval_full_test``):
every client's model and the ensemble of all client models on the dataset's full test split."""

from __future__ import annotations

import logging
from typing import Any, TypedDict

import torch

from fedproto.algorithms.algorithm import Message
from fedproto.engine.loop import Observer, RoundLoop
from fedproto.engine.setup import Setup
from fedproto.engine.summary import ClientMetrics, Summary, summarize
from fedproto.training import predict

log = logging.getLogger(__name__)


class FullTestResult(TypedDict):
    """What :func:`full_test_evaluation` returns."""

    summary: dict[str, Any]
    """``summary.json``'s ``accuracy_full_test``: ``test_set`` (in words), per key the mean and std over
    clients, ``ensemble_softmax`` and ``ensemble_vote``."""
    clients: list[dict[str, float]]
    """Per client (by id): :meth:`Algorithm.full_test_metrics`."""


def full_test_evaluation(setup: Setup, message: Message, num_classes: int) -> FullTestResult | None:
    """Every client's model on the dataset's full test split (all classes;
    :meth:`Algorithm.full_test_metrics`, both inference rules where the algorithm has prototypes)
    and the ensemble of all client models on it: the mean of their softmax outputs
    (``ensemble_softmax``) and a majority vote of their predictions (``ensemble_vote``; ties to the
    lowest class). None (with a warning) when the run has no dataset test split (your own clients).

    Args:
        setup: the run's set-up. message: the final server message. num_classes: C.
    Returns:
        ``{"summary": {...}, "clients": [per-client dict]}``; accuracies in [0, 1].
    """
    ds = setup.dataset  # None for your own clients
    if ds is None:
        log.warning("eval_full_test: your own clients have no shared test split; only the per-client test sets "
                    "are evaluated")
        return None
    alg, S = setup.algorithm, setup.states
    x, y = ds.test_x, ds.test_y
    C = num_classes
    probs = torch.zeros(len(y), C, dtype=torch.float64)
    votes = torch.zeros(len(y), C, dtype=torch.float64)
    per: list[dict[str, float]] = []
    for i, s in enumerate(S):
        logits, h = predict(s.model, x)
        logits, h = logits.cpu(), h.cpu()
        per.append(alg.full_test_metrics(s, alg.downlink(message, i), logits, h, y))
        probs += torch.softmax(logits.to(torch.float64), 1)
        votes[torch.arange(len(y)), logits.argmax(1)] += 1.0
    out: dict[str, Any] = {"test_set": f"the full test split: {len(y)} samples of all {C} classes (each client's "
                                       f"model, and the ensemble of all {len(S)})"}
    for k in per[0]:
        out[k] = dict(zip(("mean", "std"), summarize([m[k] for m in per])))
    out["ensemble_softmax"] = float((probs.argmax(1) == y).to(torch.float64).mean())
    out["ensemble_vote"] = float((votes.argmax(1) == y).to(torch.float64).mean())
    return {"summary": out, "clients": per}


class FullTest(Observer):
    """Adds ``accuracy_full_test`` to the summary and ``full_*`` columns to ``clients.csv``."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup

    def summary(self, loop: RoundLoop, summary: Summary, per_client: list[ClientMetrics]) -> None:
        full = full_test_evaluation(self.setup, loop.message, loop.cfg.num_classes)
        if full is not None:
            summary["accuracy_full_test"] = full["summary"]
            for i, m in enumerate(full["clients"]):
                per_client[i].update({f"full_{k}": v for k, v in m.items()})
