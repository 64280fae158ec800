"""The class check on clean runs: it may leave out an honest prototype now and then, but not
most clients, and a clean run keeps its accuracy within the spread over seeds."""

from __future__ import annotations

import numpy as np
from conftest import build_config

from fedproto.simulation import Simulation

SEEDS = (1, 2, 3)


def _run(seed: int, **kw) -> tuple[float, list[dict]]:
    cfg = build_config(overrides=dict(dataset="digits", clients=20, rounds=15, lr=0.05, aggregation="median",
                                      eval_every=0, seed=seed, threads=1, **kw))
    sim = Simulation(cfg, out=False)
    res = sim.run()
    return 100 * res["accuracy"]["acc_proto"]["mean"], sim.history


def test_class_check_keeps_clean_runs_within_the_seed_spread():
    """digits, 20 honest clients, the median, 15 rounds (the embeddings align around round 13,
    when a check that took every row nearer another class for a flipped one flagged 15-17 of the
    20): with class_check=3 no round flags more than a third of the clients (nor sets
    flagged_many), and the mean nearest-prototype accuracy over 3 seeds is within one standard
    deviation over seeds of the unchecked runs'."""
    plain, checked = [], []
    for seed in SEEDS:
        acc, history = _run(seed)
        plain.append(acc)
        assert all("flagged" not in h for h in history)  # the unchecked run has no check
        acc, history = _run(seed, class_check=3.0)
        checked.append(acc)
        flagged = [len(h["flagged"]) for h in history]
        assert len(flagged) == 15 and max(flagged) <= 20 // 3, flagged
        assert [h["flagged_many"] for h in history] == [0] * 15
    spread = float(np.std(plain, ddof=1))
    assert spread > 0
    assert abs(np.mean(checked) - np.mean(plain)) <= spread, (plain, checked)
