"""fedproto.engine.attacks: simulated misbehaving clients (corrupted messages, poisoning)."""

from __future__ import annotations

import numpy as np
import pytest

from fedproto.config.run_config import build_config
from fedproto.engine.attacks import attacker_ids, corrupt_message
from fedproto.errors import TrainingError
from fedproto.simulation import Simulation


# -- misbehaving clients -------------------------------------------------------------------------
def test_corrupt_message_kinds():
    msg = {"classes": np.array([0, 3, 9]), "protos": np.arange(6, dtype=np.float32).reshape(3, 2) + 1,
           "counts": np.array([5, 6, 7])}
    rng = np.random.default_rng(0)
    assert (corrupt_message(msg, "scale", rng, 10)["protos"] == msg["protos"] * 100).all()
    assert np.isnan(corrupt_message(msg, "nan", rng, 10)["protos"]).all()
    r = corrupt_message(msg, "random", rng, 10)["protos"]
    assert np.linalg.norm(r, axis=1) == pytest.approx(np.linalg.norm(msg["protos"], axis=1), rel=1e-6)
    assert not np.allclose(r, msg["protos"])
    f = corrupt_message(msg, "flip", rng, 10)
    assert f["classes"].tolist() == [0, 1, 4]  # 9 -> 0, 0 -> 1, 3 -> 4, kept sorted
    assert f["protos"].tolist() == [[5.0, 6.0], [1.0, 2.0], [3.0, 4.0]] and f["counts"].tolist() == [7, 5, 6]
    assert msg["protos"][0].tolist() == [1.0, 2.0]  # the honest message is untouched
    assert attacker_ids(1234, 20, 4) == attacker_ids(1234, 20, 4) and len(set(attacker_ids(1234, 20, 4))) == 4
    with pytest.raises(ValueError, match="attack 'loud'"):
        corrupt_message(msg, "loud", rng, 10)


DIGITS20 = dict(dataset="digits", clients=20, ways=3, shots=8, stdev=1, test_shots=10, rounds=20, eval_every=0,
                threads=1)


def _honest(sim, attackers=None):
    per = sim.evaluate()
    bad = sim.attackers if attackers is None else attackers
    return np.mean([m["acc_proto"] for i, m in enumerate(per) if i not in bad])


def test_poisoning_small_version():
    """2 of 20 digits clients send scaled or NaN prototypes (the README's MNIST table, small)."""
    clean = Simulation(build_config(overrides=DIGITS20), out=False)
    clean.run()
    ref = _honest(clean, set(attacker_ids(1234, 20, 2)))
    for rule in ("mean", "weighted", "median", "trimmed"):  # NaN never reaches a global prototype
        sim = Simulation(build_config(overrides={**DIGITS20, "attack": "nan", "attackers": 2, "aggregation": rule}),
                         out=False)
        sim.run()
        assert np.isfinite(sim.message["protos"]).all() and len(sim.message["classes"]) == 10
        assert sorted(sim.history[-1]["dropped"]) == sorted(sim.attackers)
    # the mean follows 100x prototypes until honest clients blow up
    with pytest.raises(TrainingError, match=r"diverged(.|\n)*class_check=3"):  # the hint names the class check
        Simulation(build_config(overrides={**DIGITS20, "attack": "scale", "attackers": 2}), out=False).run()
    for kw in ({"aggregation": "median"}, {"aggregation": "trimmed", "trim": 0.4}, {"exclude_outliers": 3.0}):
        sim = Simulation(build_config(overrides={**DIGITS20, "attack": "scale", "attackers": 2, **kw}), out=False)
        s = sim.run()
        assert abs(_honest(sim) - ref) < 0.03, kw
        assert s["attack"]["clients"] == sorted(sim.attackers)
        if "exclude_outliers" in kw:
            assert all(sim.attackers <= set(h["excluded"]) for h in sim.history)  # every round
            assert np.mean([len(h["excluded"]) for h in sim.history]) < 3  # few honest clients left out
