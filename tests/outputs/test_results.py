"""fedproto.outputs.run_folder: run folders, stored JSON, saved models, the progress line."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
from conftest import SMALL, csv_rows, digits_config

from fedproto.config.run_config import build_config
from fedproto.engine.attacks import attacker_ids
from fedproto.errors import DataError
from fedproto.outputs.run_folder import atomic_write_json
from fedproto.simulation import Simulation


def test_load_models_of_an_empty_or_foreign_file(tmp_path):
    # Before: an empty models.pt raised IndexError (its EOFError has no message line), and a format-1
    # dict whose clients are not state dicts was returned as is.
    from fedproto.outputs.run_folder import load_models

    (tmp_path / "models.pt").write_bytes(b"")
    with pytest.raises(DataError, match=r"cannot read '.*models.pt' \(EOFError: no message\); pass a models.pt"):
        load_models(tmp_path)
    torch.save({"format": 1, "clients": [1, 2]}, tmp_path / "other.pt")
    with pytest.raises(DataError, match=r"other.pt' is not a models.pt of fedproto \(format 1: one state_dict"):
        load_models(tmp_path / "other.pt")


def test_infinite_epsilon_has_one_spelling(tmp_path):
    atomic_write_json(tmp_path / "x.json", {"privacy": {"epsilon_max": math.inf, "delta": 1e-5},
                                            "loss": math.inf, "acc": {"dp_epsilon": {"mean": math.inf,
                                                                                      "std": math.nan}}})
    back = json.loads((tmp_path / "x.json").read_text())
    assert back == {"privacy": {"epsilon_max": "inf", "delta": 1e-5}, "loss": None,
                    "acc": {"dp_epsilon": {"mean": "inf", "std": None}}}
    cfg = build_config(overrides={**SMALL, "clients": 3, "rounds": 1, "dp": "prototypes", "dp_noise": 0.0})
    summary = Simulation(cfg, out=tmp_path / "run").run()
    assert summary["privacy"]["epsilon_max"] == math.inf
    stored = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert stored["privacy"]["epsilon_max"] == "inf" and stored["privacy"]["epsilon_mean"] == "inf"
    assert {r["dp_epsilon"] for r in csv_rows(tmp_path / "run" / "clients.csv")} == {"inf"}
    assert float(stored["privacy"]["epsilon_max"]) == math.inf  # Python reads the spelling back


def test_a_second_run_into_a_finished_run_folder_says_so(tmp_path, caplog):
    """Variants of an option share the derived run name: the second run warns that it replaces the
    finished one (found by a new user running the README's attack command after the default run)."""
    Simulation(digits_config(rounds=1), out=tmp_path / "run").run()
    assert "holds a finished run" not in caplog.text
    Simulation(digits_config(rounds=1, attack="nan", attackers=1), out=tmp_path / "run").run()
    assert f"{tmp_path / 'run'} holds a finished run" in caplog.text and "--name" in caplog.text

    rows = list(csv.DictReader(open(tmp_path / "run" / "clients.csv")))
    attackers = set(attacker_ids(1234, 6, 1))
    assert [int(r["attacker"]) for r in rows] == [int(i in attackers) for i in range(6)]


def test_progress_line_names_the_global_model_accuracy():
    """A weight-sharing run's progress line gives the global model's accuracy beside the personal one."""
    from fedproto.outputs.run_folder import round_line

    row = {"round": 3, "loss_ce": 0.5, "loss_proto": 0.0, "acc_mean": 0.9846, "acc_global_mean": 0.9739}
    assert round_line(row, 150, 1.0) == ("round 3/150: loss ce 0.5000; accuracy % classifier 98.46, global model "
                                         "97.39; elapsed 1.0 s")
