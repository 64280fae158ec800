"""A Flower run that stops and is resumed, in this process: ``resume-from`` needs the folder of an
interrupted run; a run stopped by a lost SuperLink writes failure.json and a checkpoint and
resumes on a new SuperLink with every round kept; a SuperLink that stops answering stops the run
within round-timeout, a signal to the ServerApp writes failure.json before Flower's handler; the
resume app and the resume command (and its fallback for the user's own app folder) hold every
option of the stopped run in the form Flower builds and parses. The same on real processes
(SuperLink killed and restarted) is in test_flower_deployment.py."""

from __future__ import annotations

import json
import shlex
import threading
import time

import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower

import tomllib  # noqa: E402  (flwr needs Python >= 3.11, which has it)
from flower_helpers import (  # noqa: E402  (the Flower tests' grid, configs and node folders)
    LocalGrid,
    PushPullGrid,
    _own_config,
    _user_config,
    flower_process,
    node_configs,
    write_node_folders,
)
from flwr.app import Context, RecordDict  # noqa: E402

from fedproto.errors import ConfigError, TrainingError  # noqa: E402
from fedproto.flower import client_app  # noqa: E402
from fedproto.flower.records import run_config  # noqa: E402
from fedproto.flower.server_app import FlowerEngine  # noqa: E402


@pytest.fixture(autouse=True)
def _flower_process(tmp_path, monkeypatch):
    """The ServerApp process's task identity and a node-state cache of this test's own
    (:func:`flower_helpers.flower_process`)."""
    yield from flower_process(tmp_path, monkeypatch)


def test_resume_needs_the_folder_of_an_interrupted_run(tmp_path):
    from fedproto.flower.records import FlowerOptions

    uc = _user_config()
    for where, why in ((tmp_path / "none", "is not a folder"), (tmp_path, "is not the config.json of a Flower run")):
        with pytest.raises(ConfigError, match=why):
            FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2, 3]), options=FlowerOptions(resume_from=str(where)))
    # a finished run (no checkpoint left): refused before any node is asked
    done = tmp_path / "done"
    FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2, 3]), out=done).run()
    grid = LocalGrid(uc, [0, 1, 2, 3])
    with pytest.raises(ConfigError, match="holds no checkpoint.pt: nothing to resume"):
        FlowerEngine(run_config(uc), grid, options=FlowerOptions(resume_from=str(done)))
    assert grid.sent == []


def test_a_run_stopped_by_a_lost_superlink_resumes_on_a_new_one_with_every_round_kept(tmp_path, caplog):
    """The SuperLink goes away in round 3 of 4. The server has written a checkpoint
    after every round and writes failure.json (the round, the error, the resume command). A new
    SuperLink (new Flower run id, new node contexts, nodes restarted: their state comes from their
    state files, keyed by the server's run key) continues the run with ``resume-from``: rounds 1-2
    kept, the numbers of a run that was never interrupted."""
    from fedproto.flower.records import FlowerOptions

    folders = write_node_folders(tmp_path)
    uc = _own_config(rounds=4)
    want = FlowerEngine(run_config(uc), LocalGrid(uc, node_configs=node_configs(folders)), out=False).run()
    client_app.forget_clients()

    def superlink_dies(grid, kind, group):
        if kind == "train" and group == "3":
            raise RuntimeError("StatusCode.UNAVAILABLE: the SuperLink went away")

    grid = LocalGrid(uc, node_configs=node_configs(folders))
    grid.on_send = superlink_dies
    run = tmp_path / "run"
    eng = FlowerEngine(run_config(uc), grid, out=run)
    eng.run_cfg = uc  # as the ServerApp's main sets it
    with pytest.raises(RuntimeError, match="SuperLink went away"):
        eng.run()
    failure = json.loads((run / "failure.json").read_text())
    assert (failure["round"], failure["rounds_completed"], failure["error"]) == (3, 2, "RuntimeError")
    app_dir = str(run.absolute() / "resume-app")
    assert failure["checkpoint"] and failure["resume"] == f"flwr run {shlex.quote(app_dir)} --stream"
    assert "flwr uses the default connection of FLWR_HOME/config.toml" in failure["resume_note"]
    app_cfg = tomllib.loads((run / "resume-app" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert app_cfg == {**uc, "resume-from": str(run.absolute()), "wait-nodes": 180.0}
    assert [r["round"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [1, 2]
    assert not (run / "summary.json").exists()

    client_app.forget_clients()  # new SuperNode processes
    grid = LocalGrid(uc, node_configs=node_configs(folders))
    for nid, c in grid.contexts.items():  # a new SuperLink: a new Flower run id
        grid.contexts[nid] = Context(run_id=2, node_id=nid, node_config=c.node_config, state=RecordDict(),
                                     run_config=c.run_config)
    resumed = {**uc, "resume-from": str(run)}
    with caplog.at_level("WARNING"):
        got = FlowerEngine(run_config(resumed), grid, options=FlowerOptions.from_user_config(resumed)).run()
    # the nodes join the resumed run before its first round (the drill saw "round 0" in the log)
    assert "at the start: client 1 (node 1001) restarted and reloaded its state from its state file" in caplog.text
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert not (run / "failure.json").exists() and not (run / "checkpoint.pt").exists()
    assert not (run / "resume-app").exists()  # the stopped run's record goes with failure.json
    assert all(r["rejoined"] == {str(i): "restarted with its state restored from its state file" for i in range(3)}
               for r in rows[2:3])
    for key in want["accuracy"]:
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)


class HangingGrid(PushPullGrid):
    """A SuperLink that dies during round ``hang_round``: from then on a pull never returns (as
    Flower's ServerApp retries a SuperLink it cannot reach, without end)."""

    def __init__(self, *a, hang_round: int = 2, **kw):
        super().__init__(*a, **kw)
        self.hang_round, self.release = hang_round, threading.Event()
        self.hanging = False

    def push_messages(self, messages):
        messages = list(messages)
        if messages and messages[0].metadata.message_type == "train" and \
                messages[0].metadata.group_id == str(self.hang_round):
            self.hanging = True  # the SuperLink is gone: the messages are never delivered
            return [f"lost{i}" for i in range(len(messages))]
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        if self.hanging:
            self.release.wait(120)
            raise RuntimeError("released")
        return super().pull_messages(message_ids)


def test_a_superlink_that_stops_answering_stops_the_run_within_round_timeout_with_failure_json(tmp_path):
    """A call to the SuperLink that does not return (Flower retries a dead SuperLink
    without end) stops the run after ``round-timeout`` s with a TrainingError naming the call;
    failure.json and the checkpoint of round 1 are in the run folder, and its lock is released."""
    from fedproto.flower.records import FlowerOptions

    uc = _user_config()
    grid = HangingGrid(uc, [0, 1, 2, 3], hang_round=2)
    run = tmp_path / "run"
    t0 = time.monotonic()
    try:
        # round-timeout 10 s: this grid's push runs the ClientApps in this process (their set-up and
        # training: seconds on a loaded machine); the wait in round 2 is max(10 s, 3 x round 1's exchange)
        with pytest.raises(TrainingError, match=r"the SuperLink did not answer pull_messages within [\d.]+ s "
                                                r"\(round-timeout; Flower keeps retrying it\)"):
            FlowerEngine(run_config(uc), grid, out=run, options=FlowerOptions(poll_interval=0.01,
                                                                              round_timeout=10)).run()
    finally:
        grid.release.set()
    assert time.monotonic() - t0 < 120
    failure = json.loads((run / "failure.json").read_text())
    assert (failure["round"], failure["rounds_completed"], failure["error"], failure["checkpoint"]) == \
        (2, 1, "TrainingError", True)
    assert "did not answer pull_messages" in failure["message"]
    assert [json.loads(x)["round"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert not (run / ".lock").exists()  # released: the resumed run (another ServerApp) may write here


def test_a_signal_to_the_server_app_writes_failure_json_before_flowers_handler(tmp_path):
    """Flower ends the ServerApp on SIGINT/SIGTERM (also when a restarted SuperLink refuses its
    token) and may end it with os._exit: failure_on_signal writes failure.json first (error
    Stopped, naming the signal), then hands the signal on; the handlers are put back afterwards."""
    import os
    import signal

    from fedproto.flower.server_app import failure_on_signal

    seen = []

    def flowers_handler(signum, frame):  # stands for Flower's graceful_exit_handler
        seen.append(signum)
        raise SystemExit(1)

    def stop(grid, kind, group):
        if kind == "train" and group == "3":
            os.kill(os.getpid(), signal.SIGTERM)

    uc = _user_config()
    grid = LocalGrid(uc, [0, 1, 2, 3])
    grid.on_send = stop
    run = tmp_path / "run"
    before = signal.signal(signal.SIGTERM, flowers_handler)
    try:
        engine = FlowerEngine(run_config(uc), grid, out=run)
        with pytest.raises(SystemExit), failure_on_signal(engine):
            engine.run()
        assert signal.getsignal(signal.SIGTERM) is flowers_handler
    finally:
        signal.signal(signal.SIGTERM, before)
    assert seen == [signal.SIGTERM]
    failure = json.loads((run / "failure.json").read_text())
    assert (failure["round"], failure["rounds_completed"], failure["error"]) == (3, 2, "Stopped")
    assert failure["message"] == "the ServerApp process got SIGTERM" and failure["checkpoint"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pathspec's, inside Flower's FAB build
def test_the_resume_app_holds_every_option_of_the_stopped_run_and_flower_builds_it(tmp_path):
    """failure.json's command had placeholders (``<app folder> <connection>``): it is now
    ``flwr run '<run folder>/resume-app' --stream``, an app whose config is the stopped run's
    whole run config with ``resume-from`` (absolute) and ``wait-nodes`` >= 180 s; Flower validates
    and builds it as it would the user's own app."""
    from flwr.cli.build import build_fab_from_disk
    from flwr.common.config import validate_fields_in_config

    from fedproto.flower.server_app import write_resume_app

    cfg = {"rounds": 4, "lr": 0.05, "out-dir": "/r uns/a", "name": "it's \\ \"q\"", "tensorboard": False,
           "resume-from": "", "wait-nodes": 60.0}
    run = tmp_path / "run s"
    run.mkdir()
    app = write_resume_app(run, cfg)
    assert app == run.absolute() / "resume-app"
    text = tomllib.loads((app / "pyproject.toml").read_text())
    assert text["tool"]["flwr"]["app"]["config"] == {**cfg, "resume-from": str(run.absolute()), "wait-nodes": 180.0}
    ok, errors, warnings = validate_fields_in_config(text)
    assert ok and errors == [] and warnings == [], (errors, warnings)
    assert len(build_fab_from_disk(app)) > 100  # a FAB, as `flwr run` builds it
    assert tomllib.loads((write_resume_app(run, {**cfg, "wait-nodes": 600}) / "pyproject.toml").read_text())[
        "tool"]["flwr"]["app"]["config"]["wait-nodes"] == 600.0
    # from the breaker: a DEL character made invalid TOML; a value Flower cannot hold is refused, nothing written
    odd = {"s": "a\x7fb\x00c\n\"'\\", "k y": 1, "nan": float("nan"), "wait-nodes": float("nan")}
    got = tomllib.loads((write_resume_app(run, odd) / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert got["s"] == odd["s"] and got["k y"] == 1 and got["wait-nodes"] == 180.0 and got["nan"] != got["nan"]
    before = (app / "pyproject.toml").read_bytes()
    for bad, why in (({"x": None}, "x=None: a Flower run config holds bools, numbers and strings only"),
                     ({"x": [1]}, "x=\\[1\\]"), ({"x": "\ud800"}, "cannot be written as TOML")):
        with pytest.raises(ValueError, match=why):
            write_resume_app(run, bad)
        assert (app / "pyproject.toml").read_bytes() == before


def test_the_resume_command_gives_every_option_of_the_stopped_run_as_flower_parses_it():
    """failure.json's command lists the stopped run's whole run config (so that the resumed run
    has its options, whatever its --run-config was), in the form ``flwr run --run-config`` parses."""
    from flwr.common.config import parse_config_args

    from fedproto.flower.server_app import resume_config

    cfg = {"rounds": 4, "lr": 0.05, "out-dir": "/r uns/a", "name": "it's", "tensorboard": False, "resume-from": "/x"}
    text = resume_config(cfg)
    assert text == "rounds=4 lr=0.05 out-dir='/r uns/a' name=\"it's\" tensorboard=false "
    assert parse_config_args([text + "resume-from='/r uns/a/run'"]) == {**cfg, "resume-from": "/r uns/a/run"}


def test_the_fallback_resume_command_is_one_shell_word_per_argument(tmp_path, monkeypatch):
    """When the resume app cannot be written, the command for the user's own app folder is printed:
    it broke in a shell on a value with a single quote, and would have run a ``$(...)`` in a value.
    (A value holding both quotes cannot be given by ``--run-config`` at all: Flower's parser takes
    no escaped quote; the resume app holds it.)"""
    from flwr.common.config import parse_config_args

    from fedproto.flower import server_app

    def unwritable(*a):
        raise OSError("read-only file system")

    monkeypatch.setattr(server_app, "write_resume_app", unwritable)
    eng = server_app.FlowerEngine.__new__(server_app.FlowerEngine)
    eng.run_cfg = {"data-dir": "it's x", "note": "a$(id) `b`", "rounds": 4}
    eng.run_dir = type("R", (), {"path": tmp_path / "ru n's"})()
    args = shlex.split(eng._resume_command())
    assert args[:5] == ["flwr", "run", "YOUR_APP_FOLDER", "--stream", "--run-config"] and len(args) == 6
    assert parse_config_args([args[5]]) == {**eng.run_cfg, "resume-from": str((tmp_path / "ru n's").absolute())}
