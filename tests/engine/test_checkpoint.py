"""Checkpoints: an interrupted run resumed from its checkpoint gives the numbers of a run that was
never interrupted; a damaged or foreign checkpoint is a clear error, never a silent restart."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import run_cli

from fedproto.config.run_config import build_config
from fedproto.errors import CheckpointError, CheckpointMismatch, ConfigError
from fedproto.outputs.run_folder import read_metrics
from fedproto.reproduce import Cell, run_cell
from fedproto.simulation import Simulation

BASE = dict(dataset="digits", clients=4, ways=3, shots=15, stdev=1, test_shots=8, rounds=4, eval_every=2,
            lr=0.05, threads=1)
TIMES = ("train_time_s", "eval_time_s")


def _cfg(**kw):
    return build_config(overrides={**BASE, **kw})


def _numbers(rows):
    return [{k: v for k, v in r.items() if k not in TIMES} for r in rows]


class _Stop(Exception):
    pass


def _interrupt_at(round_):
    def on_round(row):
        if row["round"] == round_:
            raise _Stop

    return on_round


@pytest.mark.parametrize("algorithm,execution", [("fedproto", "batched"), ("fedproto", "sequential"),
                                                 ("fesem", "auto"), ("fedavg", "auto")])
def test_resumed_run_equals_uninterrupted_run(tmp_path, algorithm, execution):
    cfg = _cfg(algorithm=algorithm, execution=execution, checkpoint_every=2)
    whole = Simulation(cfg, out=tmp_path / "whole")
    s_whole = whole.run()
    assert not (tmp_path / "whole" / "checkpoint.pt").exists()  # removed once finished

    part = tmp_path / "part"
    with pytest.raises(_Stop):
        Simulation(cfg, out=part, on_round=_interrupt_at(3)).run()
    assert (part / "checkpoint.pt").is_file() and len(read_metrics(part)) == 3  # checkpoint after round 2

    resumed = Simulation(cfg, out=part)
    s_res = resumed.run(resume=True)
    assert _numbers(resumed.history) == _numbers(whole.history)
    assert _numbers(read_metrics(part)) == _numbers(read_metrics(tmp_path / "whole"))  # round 3 logged once
    assert s_res["accuracy"] == s_whole["accuracy"] and s_res["params_per_round"] == s_whole["params_per_round"]
    assert s_res["bytes_total"] == s_whole["bytes_total"]
    for a, b in zip(whole.setup.states, resumed.setup.states):
        for (k, t), (_, u) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
            assert torch.equal(t, u), k
    assert not (part / "checkpoint.pt").exists()
    if algorithm == "fedproto":
        with np.load(part / "prototypes.npz") as p, np.load(tmp_path / "whole" / "prototypes.npz") as q:
            assert np.array_equal(p["protos"], q["protos"]) and np.array_equal(p["contributors"], q["contributors"])


def test_resume_without_checkpoint_starts_at_round_one(tmp_path):
    sim = Simulation(_cfg(rounds=2), out=tmp_path / "r")
    sim.run(resume=True)
    assert [r["round"] for r in read_metrics(tmp_path / "r")] == [1, 2]


def test_checkpoint_of_other_options_is_refused(tmp_path):
    d = tmp_path / "r"
    with pytest.raises(_Stop):
        Simulation(_cfg(checkpoint_every=1), out=d, on_round=_interrupt_at(2)).run()
    with pytest.raises(CheckpointMismatch, match=r"lr: 0.05 there, 0.02 now"):
        Simulation(_cfg(checkpoint_every=1, lr=0.02), out=d).run(resume=True)
    assert (d / "checkpoint.pt").is_file()  # nothing lost
    # checkpoint_every, threads and folders do not change numbers: resuming with others is fine
    # (threads 0: torch's default, which follows the environment; the run before had threads 1)
    Simulation(_cfg(checkpoint_every=3, threads=0), out=d).run(resume=True)
    assert [r["round"] for r in read_metrics(d)] == [1, 2, 3, 4]


def test_damaged_checkpoint_is_a_clear_error(tmp_path, capsys, monkeypatch):
    d = tmp_path / "runs" / "x"
    with pytest.raises(_Stop):
        Simulation(_cfg(checkpoint_every=1, out_dir=str(tmp_path / "runs"), name="x"), out=d,
                   on_round=_interrupt_at(2)).run()
    data = (d / "checkpoint.pt").read_bytes()
    (d / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="checkpoint.pt' is not a readable fedproto checkpoint"):
        Simulation(_cfg(checkpoint_every=1), out=d).run(resume=True)
    args = ["run", "--dataset", "digits", "--clients", "4", "--shots", "15", "--test-shots", "8", "--rounds", "4",
            "--lr", "0.05", "--out-dir", str(tmp_path / "runs"), "--name", "x", "--checkpoint-every", "1", "--resume"]
    code, text = run_cli(args, capsys, monkeypatch)
    assert code == 2 and "delete" in text and "Traceback" not in text, text
    (d / "checkpoint.pt").write_bytes(b"not a checkpoint")
    code, text = run_cli(args, capsys, monkeypatch)
    assert code == 2 and "is not a readable fedproto checkpoint" in text, text


def test_cli_resume_continues_and_reproduce_cell_resumes(tmp_path, capsys, monkeypatch):
    out = tmp_path / "runs"
    args = ["run", "--dataset", "digits", "--clients", "4", "--shots", "15", "--test-shots", "8", "--rounds", "4",
            "--lr", "0.05", "--out-dir", str(out), "--name", "c", "--checkpoint-every", "2", "--threads", "1"]
    code, text = run_cli(args, capsys, monkeypatch)
    assert code == 0, text
    whole = read_metrics(out / "c")
    cfg = build_config(overrides={"dataset": "digits", "clients": 4, "shots": 15, "test_shots": 8, "rounds": 4,
                                  "lr": 0.05, "out_dir": str(out), "name": "c", "checkpoint_every": 2, "threads": 1})
    with pytest.raises(_Stop):
        Simulation(cfg, out=out / "c", on_round=_interrupt_at(3)).run()
    code, text = run_cli([*args, "--resume"], capsys, monkeypatch)
    assert code == 0, text
    assert "resuming from the checkpoint in" in text
    assert _numbers(read_metrics(out / "c")) == _numbers(whole)
    # a reproduce cell with a checkpoint goes on from it; with a damaged one it starts anew
    with pytest.raises(_Stop):
        Simulation(cfg, out=out / "c", on_round=_interrupt_at(3)).run()
    (out / "c" / "checkpoint.pt").write_bytes(b"junk")
    res = run_cell(Cell("digits", 3, "fedproto", 1234, cfg, "c"))
    assert res.status == "done" and _numbers(read_metrics(out / "c")) == _numbers(whole)
    assert json.loads((out / "c" / "summary.json").read_text())["rounds"] == 4


def test_checkpoint_round_trip_keeps_arrays(tmp_path):
    from fedproto.outputs.checkpoint import load_checkpoint, save_checkpoint

    state = {"round": 1, "config": {"lr": 0.1}, "message": {"a": np.array(2.0), "b": np.arange(6).reshape(2, 3).T},
             "server_state": {"x": None}, "clients": [{"model": {"w": torch.ones(2)}, "extra": {"c": np.int64(3),
                                                                                                  "z": np.zeros(2)}}],
             "history": [{"round": 1, "loss_ce": 0.5}], "totals": {"up_params": 7}, "train_time_s": 0.1,
             "wall_time_s": 0.2}
    save_checkpoint(tmp_path / "c.pt", state)
    back = load_checkpoint(tmp_path / "c.pt")
    assert back["message"]["a"].shape == () and float(back["message"]["a"]) == 2.0
    assert np.array_equal(back["message"]["b"], np.arange(6).reshape(2, 3).T)
    assert isinstance(back["clients"][0]["extra"]["z"], np.ndarray) and back["clients"][0]["extra"]["c"] == 3
    assert isinstance(back["clients"][0]["model"]["w"], torch.Tensor)
    assert (tmp_path / "c.pt").stat().st_mode & 0o777 == 0o600  # models and prototypes: the owner's alone
    assert tmp_path.stat().st_mode & 0o777 == 0o700
    with pytest.raises(TypeError, match=r"server_state\['o'\]: a object cannot be checkpointed"):
        save_checkpoint(tmp_path / "d.pt", {**state, "server_state": {"o": object()}})
    assert not (tmp_path / "d.pt").exists() and not list(tmp_path.glob(".d.pt.*"))
    # structurally damaged checkpoints (hand edits) are refused with what is wrong
    for change, what in (({"train_time_s": None}, "'train_time_s' is a NoneType"),
                         ({"history": []}, "'history' does not hold rounds 1..1"),
                         ({"totals": {"up_params": "x"}}, "'totals' holds a non-number"),
                         ({"round": "1"}, "'round' is a str")):
        save_checkpoint(tmp_path / "e.pt", {**state, **change})
        with pytest.raises(CheckpointError, match=re.escape(what)):
            load_checkpoint(tmp_path / "e.pt")


def test_full_disk_while_checkpointing_is_a_clear_error(tmp_path, monkeypatch):
    import errno

    def full(obj, f):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos") from None

    d = tmp_path / "r"
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(ConfigError, match=r"cannot write .*No space left on device"):
        Simulation(_cfg(checkpoint_every=1), out=d).run()
    assert not list(d.glob(".checkpoint.pt.*")) and len(read_metrics(d)) == 1


def test_resume_ignores_options_that_change_no_number(tmp_path):
    d = tmp_path / "r"
    with pytest.raises(_Stop):
        Simulation(_cfg(checkpoint_every=1), out=d, on_round=_interrupt_at(2)).run()
    # group_size (batching width) and personal_layers (FedPer/FedRep only) do not touch FedProto's numbers
    Simulation(_cfg(checkpoint_every=1, group_size=2, personal_layers="head"), out=d).run(resume=True)
    assert [r["round"] for r in read_metrics(d)] == [1, 2, 3, 4]


def test_a_checkpoint_is_never_replaced_without_resume(tmp_path, capsys, monkeypatch):
    """Reported fault: the same command without --resume deleted an interrupted run's checkpoint."""
    d = tmp_path / "r"
    with pytest.raises(_Stop):
        Simulation(_cfg(checkpoint_every=1), out=d, on_round=_interrupt_at(3)).run()
    before = (d / "checkpoint.pt").read_bytes()
    with pytest.raises(ConfigError, match=r"holds an interrupted run's checkpoint: add resume=True"):
        Simulation(_cfg(checkpoint_every=1), out=d).run()
    assert (d / "checkpoint.pt").read_bytes() == before and len(read_metrics(d)) == 3
    args = ["run", "--dataset", "digits", "--clients", "4", "--shots", "15", "--test-shots", "8", "--rounds", "4",
            "--lr", "0.05", "--out-dir", str(tmp_path), "--name", "r", "--checkpoint-every", "1", "--threads", "1"]
    code, text = run_cli(args, capsys, monkeypatch)
    assert code == 2 and "add --resume" in text and (d / "checkpoint.pt").read_bytes() == before, text


def test_a_failed_rerun_puts_the_finished_run_back(tmp_path):
    """Reported fault: a rerun that failed (diverged, interrupted) had already deleted the finished
    run's summary, clients.csv and prototypes. Now they are kept aside and restored."""
    d = tmp_path / "r"
    Simulation(_cfg(), out=d).run()
    files = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    assert {"summary.json", "clients.csv", "prototypes.npz", "metrics.jsonl", "config.json"} <= set(files)
    with pytest.raises(_Stop):
        Simulation(_cfg(lr=0.02), out=d, on_round=_interrupt_at(2)).run()
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} == files
    assert not (d / ".previous").exists()
    with pytest.raises(ConfigError, match="has finished .* nothing to resume"):
        Simulation(_cfg(), out=d).run(resume=True)
    # with a checkpoint to resume from, the interrupted rerun stays; the old run waits in .previous
    with pytest.raises(_Stop):
        Simulation(_cfg(lr=0.02, checkpoint_every=1), out=d, on_round=_interrupt_at(2)).run()
    assert (d / "checkpoint.pt").is_file() and (d / ".previous" / "summary.json").read_bytes() == files["summary.json"]
    Simulation(_cfg(lr=0.02, checkpoint_every=1), out=d).run(resume=True)
    assert not (d / ".previous").exists() and json.loads((d / "summary.json").read_text())["rounds"] == 4
    assert (d / "summary.json").read_bytes() != files["summary.json"]


def test_a_reproduce_cell_that_fails_at_set_up_keeps_its_finished_run(tmp_path):
    """Reported fault: run_cell removed a finished cell's summary before the new options failed."""
    cfg = _cfg(out_dir=str(tmp_path), name="c")
    assert run_cell(Cell("digits", 3, "fedproto", 1234, cfg, "c")).status == "done"
    before = (tmp_path / "c" / "summary.json").read_bytes()
    bad = _cfg(out_dir=str(tmp_path), name="c", shots=100000)
    res = run_cell(Cell("digits", 3, "fedproto", 1234, bad, "c"))
    assert res.status == "failed" and "shots" in res.message
    assert (tmp_path / "c" / "summary.json").read_bytes() == before


@pytest.mark.parametrize("edit,expect", [
    (lambda m: {**m, "protos": m["protos"][:, :7]}, r"prototypes have shape \(\d+, 7\), expected \(\d+, 50\)"),
    (lambda m: {**m, "classes": m["classes"] + 99}, r"names classes outside 0..9"),
    (lambda m: {**m, "protos": np.full_like(m["protos"], np.nan)}, r"entry 'protos' holds non-finite values"),
    (lambda m: {**m, "protos": "x"}, r"entry 'protos' is a str, not an array"),
])
def test_a_checkpoint_with_a_bad_server_message_is_refused(tmp_path, edit, expect):
    """Reported fault: a well-formed checkpoint whose message had wrong shapes, classes or NaN
    crashed the resume with a traceback (or blamed the learning rate)."""
    from fedproto.outputs.checkpoint import load_checkpoint, save_checkpoint

    d = tmp_path / "r"
    with pytest.raises(_Stop):
        Simulation(_cfg(checkpoint_every=1), out=d, on_round=_interrupt_at(2)).run()
    ck = load_checkpoint(d / "checkpoint.pt")
    ck["message"] = edit(ck["message"])
    save_checkpoint(d / "checkpoint.pt", ck)
    with pytest.raises(CheckpointError, match="is damaged: its server message " + expect):
        Simulation(_cfg(checkpoint_every=1), out=d).run(resume=True)


def test_one_process_per_run_folder_and_one_run_per_simulation(tmp_path):
    """Reported: two runs in one folder mixed their metrics and deleted the finished run; a
    second Simulation.run() went on training the same models."""
    import os
    import subprocess
    import sys

    d = tmp_path / "r"
    sim = Simulation(_cfg(), out=d)
    sim.run()
    with pytest.raises(ConfigError, match="has run already"):
        sim.run()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (d / ".lock").write_text(str(other.pid))
        with pytest.raises(ConfigError, match=rf"another fedproto process \(pid {other.pid}\) is writing"):
            Simulation(_cfg(), out=d).run()
        assert json.loads((d / "summary.json").read_text())["rounds"] == 4  # untouched
    finally:
        other.kill()
        other.wait()
    Simulation(_cfg(rounds=2), out=d).run()  # the lock of a dead process is stale
    assert not (d / ".lock").exists() and json.loads((d / "summary.json").read_text())["rounds"] == 2
    assert os.listdir(d).count(".previous") == 0


def test_a_killed_rerun_leaves_the_finished_run_to_be_restored(tmp_path):
    """Reported: after SIGKILL/SIGTERM the finished run stayed hidden in .previous/ and the next
    finished run deleted it. Now the next writer of the folder puts it back first (nothing can
    resume the killed run: it left no checkpoint)."""
    from fedproto.outputs.run_folder import RunDir

    d = tmp_path / "r"
    Simulation(_cfg(), out=d).run()
    files = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    rd = RunDir(d)
    rd.begin()  # a rerun starts ...
    rd.log_round({"round": 1})  # ... and is killed (no abort, no finish)
    assert (d / ".previous" / "summary.json").is_file() and not (d / "summary.json").exists()
    RunDir(d)  # the next command that writes here
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} == files
    assert not (d / ".previous").exists()


def test_begin_puts_a_finished_run_back_when_it_fails(tmp_path, monkeypatch):
    """Reported: a rerun that failed while starting (a full disk on metrics.jsonl, a folder in
    place of a result file) left the finished run hidden in .previous/."""
    import errno

    import fedproto.outputs.run_folder as results

    d = tmp_path / "r"
    Simulation(_cfg(), out=d).run()
    files = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    rd = results.RunDir(d)

    def full(path, data, *args, **kwargs):  # atomic_write_bytes's signature, whatever its options
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(results, "atomic_write_bytes", full)
    with pytest.raises(ConfigError, match="cannot write .*metrics.jsonl.*No space left"):
        rd.begin()
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} == files
    assert not (d / ".previous").exists()


def test_reproduce_keeps_an_interrupted_cell_of_other_options(tmp_path):
    """Reported: a reproduce rerun with another --set silently deleted the interrupted cell's
    checkpoint; now the cell fails and names the options that differ."""
    cfg = _cfg(out_dir=str(tmp_path), name="c", checkpoint_every=1)
    with pytest.raises(_Stop):
        Simulation(cfg, out=tmp_path / "c", on_round=_interrupt_at(2)).run()
    before = (tmp_path / "c" / "checkpoint.pt").read_bytes()
    res = run_cell(Cell("digits", 3, "fedproto", 1234, _cfg(out_dir=str(tmp_path), name="c", checkpoint_every=1,
                                                            lr=0.02), "c"))
    assert res.status == "failed" and "lr: 0.05 there, 0.02 now" in res.message
    assert (tmp_path / "c" / "checkpoint.pt").read_bytes() == before
