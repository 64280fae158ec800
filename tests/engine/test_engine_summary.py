"""fedproto.engine.summary: the run's summary (rounds trained, the means reported)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from conftest import SMALL, csv_rows

from fedproto.config.run_config import build_config
from fedproto.engine.seeding import sample_clients
from fedproto.simulation import Simulation


def test_sampled_clients_record_rounds_trained_and_the_mean_over_those_that_trained(tmp_path, caplog):
    cfg = build_config(overrides={**SMALL, "clients": 10, "participation": 0.1, "rounds": 3, "algorithm": "fedavg"})
    with caplog.at_level(logging.WARNING, logger="fedproto"):
        summary = Simulation(cfg, out=tmp_path / "run").run()
    expected = np.zeros(10, int)
    for r in (1, 2, 3):
        expected[sample_clients(cfg.seed, r, 10, 0.1)] += 1
    rows = csv_rows(tmp_path / "run" / "clients.csv")
    trained = [int(r["rounds_trained"]) for r in rows]
    assert trained == expected.tolist() and sum(trained) == 3
    never = [i for i, n in enumerate(trained) if n == 0]
    assert len(never) >= 7  # 1 client a round, 3 rounds
    did = [float(r["acc"]) for r in rows if int(r["rounds_trained"]) > 0]
    assert summary["clients_trained"] == 10 - len(never)
    assert summary["accuracy_trained"]["acc"]["mean"] == pytest.approx(np.mean(did), abs=1e-6)
    assert summary["accuracy"]["acc"]["mean"] == pytest.approx(np.mean([float(r["acc"]) for r in rows]), abs=1e-6)
    stored = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert stored["accuracy_trained"]["acc"]["mean"] == pytest.approx(np.mean(did), abs=1e-6)
    warned = [r.getMessage() for r in caplog.records if "never trained" in r.getMessage()]
    assert len(warned) == 1 and f"{len(never)} of 10 clients never trained" in warned[0]
    assert str(never[:10]) in warned[0]


def test_full_participation_reports_every_round_trained_and_no_second_mean(tmp_path, caplog):
    cfg = build_config(overrides={**SMALL, "clients": 3, "rounds": 2, "algorithm": "fedavg"})
    with caplog.at_level(logging.WARNING):
        summary = Simulation(cfg, out=tmp_path / "run").run()
    assert [int(r["rounds_trained"]) for r in csv_rows(tmp_path / "run" / "clients.csv")] == [2, 2, 2]
    assert "accuracy_trained" not in summary and "clients_trained" not in summary
    assert not any("never trained" in r.getMessage() for r in caplog.records)
