"""fedproto.engine.observers.tensorboard_log: the per-round metrics as TensorBoard scalars (the tensorboard extra)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from conftest import Interrupted, interrupt_at

from fedproto.engine.observers.tensorboard_log import TensorBoardObserver
from fedproto.errors import ConfigError

HAS_TB = importlib.util.find_spec("tensorboard") is not None
pytestmark = pytest.mark.extras  # CI runs them where the tensorboard extra is installed

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
    from fedproto.config.run_config import build_config
    from fedproto.simulation import Simulation

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match=r'tensorboard package, which is not installed.*fedproto\[tensorboard\]'):
        Simulation(build_config(overrides=SMALL), out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_tensorboard_without_a_run_folder_says_nothing_is_written(monkeypatch, caplog):
    """out=False with tensorboard on ran without a word and wrote no events."""
    from fedproto.config.run_config import build_config
    from fedproto.simulation import Simulation

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not needed when nothing is written
    with caplog.at_level("WARNING", logger="fedproto.simulation"):
        summary = Simulation(build_config(overrides=SMALL), out=False).run()
    assert "tensorboard is on but this run writes no run folder (out=False)" in caplog.text
    assert summary["rounds"] == 1


def _events(folder):
    """(step, value) of every ``loss_ce`` event TensorBoard shows for ``folder`` (purged steps hidden)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("loss_ce")]


def _steps_per_file(folder, tag="loss_ce"):
    """{event file name: [step of every ``tag`` scalar event in it]}, read raw (nothing hidden, nothing purged)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out = {}
    for f in sorted(folder.iterdir()):
        if "tfevents" in f.name:
            out[f.name] = [ev.step for ev in EventFileLoader(str(f)).Load()
                           if ev.HasField("summary") and any(v.tag == tag for v in ev.summary.value)]
    return out


@pytest.mark.skipif(not HAS_TB, reason="needs the tensorboard extra: pip install \"fedproto[tensorboard]\"")
def test_tensorboard_resume_that_redoes_a_round_logs_it_once(tmp_path, caplog):
    """Checkpoint every 2 rounds, stopped after round 3, resumed: round 3 is run again from round 2's
    checkpoint. Was: step 3 stayed in the first event file too (TensorBoard warned and dropped 12 scalars).
    Now every step is in exactly one event file, with metrics.jsonl's values, and no plot of the old rows is left."""
    from fedproto.config.run_config import build_config
    from fedproto.outputs.run_folder import read_metrics
    from fedproto.simulation import Simulation

    cfg = build_config(overrides={**SMALL, "rounds": 4, "checkpoint_every": 2})

    run = tmp_path / "run"
    with pytest.raises(Interrupted):
        Simulation(cfg, out=run, on_round=interrupt_at(3)).run()
    before = _steps_per_file(run / "tensorboard")
    assert list(before.values()) == [[1, 2, 3]]  # round 3 was logged before the stop
    assert [r["round"] for r in read_metrics(run)] == [1, 2, 3]
    (run / "curves.png").write_bytes(b"a plot of rounds 1-3")  # `fedproto plot` drawn from the stopped run

    Simulation(cfg, out=run).run(resume=True)
    rows = read_metrics(run)
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    after = _steps_per_file(run / "tensorboard")
    assert len(after) == 2
    old, new = (after[name] for name in sorted(after))
    assert old == [1, 2] and new == [3, 4]
    assert sorted(s for steps in after.values() for s in steps) == [1, 2, 3, 4]
    assert not (run / "curves.png").exists()
    with caplog.at_level("WARNING"):
        got = _events(run / "tensorboard")
    assert "Purging" not in caplog.text  # nothing for TensorBoard to drop
    assert [s for s, _ in got] == [1, 2, 3, 4]
    assert [v for _, v in got] == [pytest.approx(r["loss_ce"], rel=1e-6) for r in rows]


@pytest.mark.skipif(not HAS_TB, reason="needs the tensorboard extra: pip install \"fedproto[tensorboard]\"")
def test_purge_events_keeps_the_steps_before_the_first_redone_one(tmp_path):
    from fedproto.engine.observers.tensorboard_log import purge_events

    tb = TensorBoardObserver(tmp_path)
    for r in range(1, 6):
        tb.on_round({"round": r, "loss_ce": float(r)})
    tb.close()
    assert purge_events(tmp_path / "tensorboard", 3) == 3
    assert list(_steps_per_file(tmp_path / "tensorboard").values()) == [[1, 2]]
    assert purge_events(tmp_path / "tensorboard", 1) == 2  # nothing left: the file goes
    assert _steps_per_file(tmp_path / "tensorboard") == {}
    assert purge_events(tmp_path / "missing", 1) == 0
    with pytest.raises(ValueError, match="first_step must be a round number >= 1, got 0"):
        purge_events(tmp_path / "tensorboard", 0)


@pytest.mark.skipif(not HAS_TB, reason="needs the tensorboard extra: pip install \"fedproto[tensorboard]\"")
def test_tensorboard_rerun_keeps_no_old_events(tmp_path):
    """A second run under the same folder (another lr, so other losses) shows only its own events; the
    first run's event files wait in .previous with the rest of that run until the new one finishes."""
    from fedproto.config.run_config import build_config
    from fedproto.outputs.run_folder import PREVIOUS, read_metrics
    from fedproto.simulation import Simulation

    run = tmp_path / "run"
    Simulation(build_config(overrides={**SMALL, "rounds": 2}), out=run).run()
    first = _events(run / "tensorboard")

    seen = {}

    def during(row):  # while the new run runs, the old events are aside, not beside the new ones
        seen[row["round"]] = (run / PREVIOUS / "tensorboard").is_dir()

    Simulation(build_config(overrides={**SMALL, "rounds": 2, "lr": 0.01}), out=run, on_round=during).run()
    assert seen == {1: True, 2: True}
    got = _events(run / "tensorboard")
    rows = read_metrics(run)
    assert [s for s, _ in got] == [1, 2]
    assert [v for _, v in got] == [pytest.approx(r["loss_ce"], rel=1e-6) for r in rows]
    assert [v for _, v in got] != [v for _, v in first]
    assert not (run / PREVIOUS).exists()  # the new run finished: the old one is gone


def test_a_refused_tensorboard_leaves_no_folder_from_the_command_line(tmp_path, capsys, monkeypatch):
    """The command line made the run folder and its new parent folders before the check refused the run."""
    from conftest import run_cli

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    out = tmp_path / "new" / "deeper"
    code, text = run_cli(["run", "--dataset", "digits", "--rounds", "1", "--threads", "1", "--tensorboard",
                          "--out-dir", str(out)], capsys, monkeypatch)
    assert code == 2 and "fedproto[tensorboard]" in text
    assert list(tmp_path.iterdir()) == []
