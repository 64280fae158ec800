"""fedproto.engine.observers.health: divergence, blown-up embeddings and prototype distance alerts."""

from __future__ import annotations

import csv

import pytest
import torch
from conftest import SMALL, digits_config

from fedproto.config.run_config import build_config
from fedproto.errors import TrainingError
from fedproto.simulation import Simulation


def test_divergence_under_an_attack_names_the_attack():
    cfg = build_config(overrides={**SMALL, "clients": 4, "rounds": 4, "algorithm": "fedavg", "attack": "scale",
                                  "attackers": 1, "attack_scale": 1e12})
    with pytest.raises(TrainingError) as e:
        Simulation(cfg, out=False).run()
    text = e.value.render()
    assert "1 simulated misbehaving client (attack='scale' x1e+12)" in text and "attack_scale" in text, text


def test_exploding_embeddings_under_dp_blame_the_dp_noise():
    sim = Simulation(build_config(overrides={**SMALL, "clients": 3, "rounds": 1, "dp": "prototypes",
                                             "dp_noise": 1000.0}), out=False)
    causes = sim.health.blowup_causes()
    assert causes.startswith("check the DP noise (dp_noise=1000, dp_clip=5") and "BatchNorm" in causes
    plain = Simulation(build_config(overrides={**SMALL, "clients": 3, "rounds": 1}), out=False).health.blowup_causes()
    assert "DP" not in plain and "lr (now 0.01)" in plain


def test_prototype_distance_warnings_are_not_repeated_without_end(caplog):
    """A misbehaving client is flagged by the distance monitor every round; the log names it
    ALERTS_PER_CLIENT times, the metrics every round."""
    from fedproto.engine.observers.health import ALERTS_PER_CLIENT

    sim = Simulation(digits_config(rounds=6, attack="scale", attackers=1, aggregation="median"), out=False)
    sim.run()
    (bad,) = sim.attackers
    lines = [r.getMessage() for r in caplog.records if f"client {bad}'s prototypes lie" in r.getMessage()]
    assert len(lines) == ALERTS_PER_CLIENT == 3 and "not repeated" in lines[-1]
    assert sum(h.get("proto_dist_argmax") == bad for h in sim.history) > ALERTS_PER_CLIENT  # flagged in more rounds


@pytest.mark.usefixtures("one_thread")
def test_exploding_and_nonfinite_embeddings_are_reported(tmp_path, caplog):
    """A blown-up client must not give a silent chance-level number: a warning names the
    client and round, and ``clients.csv`` flags it (``emb_norm``, ``nonfinite``)."""

    cfg = build_config(overrides=dict(dataset="digits", clients=3, ways=2, shots=10, test_shots=5, rounds=1,
                                      eval_every=1, lr=1e-12))  # the models stay about as set below
    sim = Simulation(cfg, out=tmp_path / "run")
    with torch.no_grad():
        sim.setup.states[1].model.fc1.weight.mul_(1e7)  # embeddings of norm ~1e7, finite
    tx = sim.setup.data[2].test_x  # a view gathers a new tensor: change it, then give it to the client
    tx[0] = float("inf")  # one of client 2's test embeddings is not finite
    sim.setup.data[2].test_x = tx
    with caplog.at_level("WARNING"):
        sim.run()
    text = caplog.text
    assert "round 1: client 1's training embeddings reached norm" in text
    assert "round 1: client 1's test embeddings have median norm" in text
    assert "round 1: client 2's test embeddings or scores are not finite" in text
    assert "client 0" not in text
    rows = list(csv.DictReader(open(tmp_path / "run" / "clients.csv")))
    assert [float(r["nonfinite"]) for r in rows] == [0.0, 0.0, 1.0]
    assert float(rows[0]["emb_norm"]) < 1e3 < 1e4 < float(rows[1]["emb_norm"])


@pytest.mark.usefixtures("one_thread")
def test_eval_mode_blow_up_below_the_norm_limit_is_reported(caplog):
    """A client at chance with test embeddings of norm ~700 against ~20 in training sits below the
    1e4 limit and would go unreported. Test embeddings 10x larger than any training embedding of
    the client's last round are reported."""
    sim = Simulation(build_config(overrides=dict(dataset="digits", clients=3, rounds=1)), out=False)
    sim.health.train_norm.update({0: 20.0, 1: 20.0, 2: 0.0})
    with caplog.at_level("WARNING"):
        sim.health.evaluated(sim.loop, 4, [{"emb_norm": 25.0, "nonfinite": 0.0}, {"emb_norm": 727.0, "nonfinite": 0.0},
                              {"emb_norm": 727.0, "nonfinite": 0.0}])
    assert "round 4: client 1's test embeddings (median norm 727) are 36x larger" in caplog.text
    assert "client 0" not in caplog.text and "client 2" not in caplog.text  # no training norm known: no claim
