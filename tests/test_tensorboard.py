"""fedproto.tensorboard: the per-round metrics as TensorBoard scalars (the tensorboard extra)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from fedproto.errors import ConfigError
from fedproto.tensorboard import TensorBoardObserver

HAS_TB = importlib.util.find_spec("tensorboard") is not None

ROWS = [
    {"round": 1, "loss_ce": 1.5, "loss_proto": None, "lr": 0.01, "up_bytes": 100, "sampled": [0, 2],
     "dropped_why": {"3": "nan"}, "flag": True, "proto_dist": float("nan")},
    {"round": 2, "loss_ce": 0.75, "loss_proto": 0.2, "lr": 0.005, "up_bytes": 100, "acc_mean": 0.9,
     "comm": {"up": 3.0}},
]


def test_scalars_are_the_numeric_entries():
    assert TensorBoardObserver.scalars(ROWS[0]) == {"loss_ce": 1.5, "lr": 0.01, "up_bytes": 100.0}
    assert TensorBoardObserver.scalars(ROWS[1]) == {"loss_ce": 0.75, "loss_proto": 0.2, "lr": 0.005,
                                                    "up_bytes": 100.0, "acc_mean": 0.9, "comm/up": 3.0}


@pytest.mark.skipif(not HAS_TB, reason="needs the tensorboard extra: pip install \"fedproto[tensorboard]\"")
def test_observer_writes_every_numeric_entry_at_its_round(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardObserver(tmp_path)
    for row in ROWS:
        tb.on_round(row)
    with pytest.raises(ValueError, match="round"):
        tb.on_round({"loss_ce": 1.0})
    tb.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss_ce", "loss_proto", "lr", "up_bytes", "acc_mean", "comm/up"}
    assert [(e.step, e.value) for e in acc.Scalars("loss_ce")] == [(1, 1.5), (2, 0.75)]
    assert [(e.step, pytest.approx(e.value)) for e in acc.Scalars("lr")] == [(1, 0.01), (2, 0.005)]
    assert [(e.step, pytest.approx(e.value)) for e in acc.Scalars("acc_mean")] == [(2, 0.9)]
    assert [e.step for e in acc.Scalars("loss_proto")] == [2]


def test_missing_tensorboard_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard raises ImportError
    with pytest.raises(ConfigError, match=r'pip install "fedproto\[tensorboard\]"'):
        TensorBoardObserver(tmp_path)
    assert not (tmp_path / "tensorboard").exists()


SMALL = dict(dataset="digits", clients=4, ways=3, shots=20, stdev=1, test_shots=10, rounds=1, eval_every=0, lr=0.05,
             threads=1, tensorboard=True)


def test_a_run_without_the_extra_stops_before_its_run_folder_exists(tmp_path, monkeypatch):
    """Left an empty run folder behind (the check ran after the folder was made)."""
    from fedproto.config import build_config
    from fedproto.simulation import Simulation

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match=r'tensorboard package, which is not installed.*fedproto\[tensorboard\]'):
        Simulation(build_config(overrides=SMALL), out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_tensorboard_without_a_run_folder_says_nothing_is_written(monkeypatch, caplog):
    """out=False with tensorboard on ran without a word and wrote no events."""
    from fedproto.config import build_config
    from fedproto.simulation import Simulation

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not needed when nothing is written
    with caplog.at_level("WARNING", logger="fedproto.simulation"):
        summary = Simulation(build_config(overrides=SMALL), out=False).run()
    assert "tensorboard is on but this run writes no run folder (out=False)" in caplog.text
    assert summary["rounds"] == 1
