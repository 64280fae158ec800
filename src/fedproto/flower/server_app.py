"""The Flower ``ServerApp``: the engine's round loop with the Flower executor.

:class:`FlowerEngine` builds a :class:`fedproto.flower.flower_executor.FlowerExecutor` (the clients on
their SuperNodes), the run's algorithm (its server side) and the round loop
(:class:`fedproto.engine.loop.RoundLoop`) the simulator runs, with the observers of a run that
holds no client data: the run folder, health checks and progress. Nothing here trains a client,
and the server holds no data and no client model (docs/architecture.md).

Run options come from the Flower run config (``[tool.flwr.app.config]`` of the Flower app, or
``flwr run --run-config``): every :class:`fedproto.config.run_config.RunConfig` option (``-`` or ``_``) plus
the keys of :class:`fedproto.flower.records.FlowerOptions`. For nodes with their own data
(:mod:`fedproto.flower.node`) the run config needs only ``dataset = "custom"``, ``classes``,
``embedding-dim`` and the algorithm's options. The run directory is written where the ServerApp
runs: ``out_dir/<run name>-run<Flower run id>``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedproto.config.run_config import RunConfig
from fedproto.engine.lifecycle import check_observers, run_rounds, standard_observers
from fedproto.engine.loop import Observer, RoundLoop
from fedproto.engine.observers.checkpoints import check_options
from fedproto.engine.observers.health import Health
from fedproto.engine.observers.tensorboard_log import tensorboard_observers
from fedproto.engine.setup import build_algorithm
from fedproto.engine.summary import over_clients
from fedproto.errors import ConfigError, FedprotoError, TrainingError, first_line
from fedproto.flower.flower_executor import NODE_UNAVAILABLE, REPLY_UNAVAILABLE, FlowerExecutor
from fedproto.flower.records import FlowerOptions, run_config
from fedproto.flower.resume_app import RESTART_APP, RESUME_APP, RESUME_WAIT_NODES, resume_config, write_resume_app
from fedproto.flower.secagg_messages import install as install_secagg
from fedproto.outputs.atomic import make_private_tree
from fedproto.outputs.checkpoint import load_checkpoint
from fedproto.outputs.run_folder import RunDir, atomic_write_json

log = logging.getLogger(__name__)

app = ServerApp()


class FlowerEngine:
    """Run a configured experiment with one Flower SuperNode per client.

    The server writes a checkpoint of its own state (server message, algorithm state, metrics rows)
    into the run folder after every round (``checkpoint_every``, default every round under Flower);
    the clients keep theirs on their nodes (:mod:`fedproto.flower.node_state`). When the run stops
    (the SuperLink did not answer within ``round-timeout``, too few replies, SIGINT or SIGTERM under
    :func:`failure_on_signal`), ``failure.json`` in the run folder says when and why,
    and the run can be continued from its last completed round, also on a new SuperLink, with the
    Flower run config ``resume-from="<run folder>"`` (:attr:`FlowerOptions.resume_from`).

    Args:
        cfg: the run configuration.
        grid: the Flower :class:`~flwr.serverapp.Grid` of the run.
        out: run directory (a path; False: write nothing).
        options: the Flower engine's options (timeouts, minimum replies, retries, ``resume_from``).
        wait_s: overrides ``options.wait_nodes``.
        timeout_s: overrides ``options.round_timeout``.
        on_round: optional callback(row) after each round.
        observers: your own :class:`~fedproto.engine.loop.Observer` s, as
            :class:`fedproto.simulation.Simulation` takes them (the same order and policy:
            :func:`fedproto.engine.lifecycle.standard_observers`).
    Raises:
        ConfigError: ``resume_from`` names no run folder of this run (see :meth:`run`); see
            :class:`~fedproto.flower.flower_executor.FlowerExecutor`.
        TrainingError: too few nodes joined (:class:`~fedproto.flower.flower_executor.FlowerExecutor`).
    """

    def __init__(self, cfg: RunConfig, grid: Grid, out=None, options: FlowerOptions | None = None,
                 wait_s: float | None = None, timeout_s: float | None = None,
                 on_round: Callable[[dict], None] | None = None, observers: Sequence[Observer] = (),
                 run_cfg: dict | None = None):
        if run_cfg is not None:
            self.run_cfg = dict(run_cfg)
        opts = options or FlowerOptions()
        opts = replace(opts, round_timeout=opts.round_timeout if timeout_s is None else timeout_s,
                       wait_nodes=opts.wait_nodes if wait_s is None else wait_s)
        self.cfg, self.opts = cfg, opts
        self._failure_recorded = False
        if cfg.tensorboard and out is not False:  # a missing extra stops the run before its folder exists
            from fedproto.engine.observers.tensorboard_log import require_tensorboard

            require_tensorboard()
        if opts.resume_from:
            out = Path(opts.resume_from).expanduser()
            if not out.is_dir():
                raise ConfigError(f"resume-from={opts.resume_from!r} is not a folder; give the run folder of the "
                                  "interrupted run (it holds config.json and checkpoint.pt)")
        # what the nodes sent stays the server's: the run folder 0700 from its creation, its files 0600
        self.run_dir = None if out is False else RunDir(out if out is not None else Path(cfg.out_dir) / cfg.run_name(),
                                                        private=True)
        self.run_key = self._run_key()
        self._checkpoint = self._resumable() if opts.resume_from else None  # checked before any node is asked
        try:
            self.executor = FlowerExecutor(cfg, grid, opts, self.run_key)
        except TrainingError as e:  # too few nodes joined: the run never reached round 1
            self._record_start_failure(e)
            raise
        self.algorithm = build_algorithm(cfg, self.executor.embedding_dim)
        # secure aggregation (fedproto.flower.secagg_messages; unchanged when off): the executor runs the protocol
        server, self.executor = install_secagg(cfg, self.algorithm, self.executor)
        health = Health(cfg, algorithm=self.algorithm)  # the simulator's policy: a non-finite loss stops the run
        observers = standard_observers(cfg, health, self.run_dir, self.config_record, on_round,
                                       checkpoint_every=cfg.checkpoint_every or 1, user=check_observers(observers),
                                       run_folder=tensorboard_observers(cfg, self.run_dir))
        self.loop = RoundLoop(cfg, server, self.executor, self.executor.embedding_dim, observers)

    run_cfg: dict = {}
    """The Flower run config as the SuperLink gave it (the ServerApp's ``main`` sets it): every
    key, so that the resume app (:func:`write_resume_app`) has the options of the stopped run
    whatever its ``--run-config`` was."""

    def _run_key(self) -> str:
        """The run's key (the nodes' state files belong to it): a resumed run's own, read from its
        ``config.json``; else a new random one."""
        if self.opts.resume_from and self.run_dir:
            path = self.run_dir.path / "config.json"
            try:
                key = json.loads(path.read_text())["flower"]["run_key"]
            except (OSError, ValueError, KeyError, TypeError):
                raise ConfigError(f"resume-from={self.opts.resume_from!r}: {str(path)!r} is not the config.json of a "
                                  "Flower run of fedproto; give the run folder of the interrupted run (it holds "
                                  "config.json and checkpoint.pt)") from None
            if isinstance(key, str) and key:
                return key
        return secrets.token_hex(8)

    def _resumable(self) -> dict:
        """The checkpoint ``resume_from`` continues, checked before the nodes are asked anything.

        Raises:
            ConfigError: the folder holds no checkpoint (a finished run removes it).
            CheckpointMismatch: it was written under other options (names them).
        """
        ck = self.run_dir.checkpoint
        if not ck.is_file():
            raise ConfigError(f"resume-from={str(self.run_dir.path)!r} holds no checkpoint.pt: nothing to resume (a "
                              "finished run removes it); run without resume-from to start anew")
        ckpt = load_checkpoint(ck)
        check_options(self.cfg, ckpt, str(ck), "resume with the same run config")
        return ckpt

    @property
    def history(self) -> list[dict]:
        """The metrics rows of the rounds run so far."""
        return self.loop.history

    @property
    def nodes(self) -> dict[int, int]:
        """Client id -> node id of its (current) SuperNode."""
        return self.executor.nodes

    def config_record(self) -> dict:
        """``config.json``: the options, λ in force, the Flower options, the nodes and refusals."""
        return {**self.cfg.model_dump(), "lambda_proto_in_force": self.cfg.lam,
                "ignored_options": self.cfg.ignored_options(), **self.executor.config_record()}

    def run(self, resume: bool = False) -> dict:
        """Run all rounds; returns the summary (also ``summary.json`` in the run folder).

        Args:
            resume: continue from the run folder's checkpoint (set by ``resume_from``).
        Raises:
            ConfigError: resuming without a run folder or without a checkpoint in it.
            CheckpointMismatch: the checkpoint belongs to other options.
            TrainingError: a round stayed below ``min-replies`` after its retries, or no node
                replied to the final evaluation (``failure.json`` records it).
        """
        resume = resume or bool(self.opts.resume_from)
        self.loop.message = self.loop.initial_message()
        rd = self.run_dir
        if not rd:
            if resume:
                raise ConfigError("resume needs the run folder of the interrupted run (resume-from)")
            return self.loop.run()
        ckpt = None
        if resume:
            ckpt = self._checkpoint if self._checkpoint is not None else self._resumable()
            log.warning("fedproto: resuming %s after round %d", rd.path, int(ckpt["round"]))
        rd.acquire()
        try:
            return run_rounds(self.loop, rd, ckpt, str(rd.checkpoint), self._record_failure)
        finally:
            rd.release()
            make_private_tree(rd.path)  # also what others wrote (TensorBoard's event files, plots)

    def _resume_command(self) -> str:
        """The command that continues this run: ``flwr run <run folder>/resume-app --stream``
        (:func:`write_resume_app`), or, when that folder cannot be written (or the engine has no
        Flower run config), the ``--run-config`` form for the user's own app folder."""
        import shlex

        try:
            if self.run_cfg:  # else an engine built without Flower's run config (in-process): no app to write
                return shlex.join(["flwr", "run", str(write_resume_app(self.run_dir.path, self.run_cfg)), "--stream"])
        except (OSError, ValueError) as err:
            log.warning("cannot write the resume app in %s: %s", self.run_dir.path, err)
        overrides = resume_config({**self.run_cfg, "resume-from": None}) + \
            f"resume-from={json.dumps(str(self.run_dir.path.absolute()))}"
        return shlex.join(["flwr", "run", "YOUR_APP_FOLDER", "--stream", "--run-config", overrides])

    def _record_start_failure(self, e: TrainingError) -> None:
        """``failure.json`` of a run that never reached round 1: why, the nodes seen (``nodes_seen``: online,
        joined, refused and unanswered, with the reasons) and the command that starts it again (a resumed run:
        its resume command)."""
        if self.run_dir is None:
            return
        import shlex

        missing = getattr(e, "missing", {})
        # nodes online that did not join in time: a longer wait; nodes missing: the same wait, once they are started
        wait = max(300.0, 5 * self.opts.wait_nodes) if missing.get("online_not_joined") else self.opts.wait_nodes
        run_cfg = {**self.run_cfg, "wait-nodes": wait}
        try:
            if not self.run_cfg:
                raise ValueError("no Flower run config")
            restart = shlex.join(["flwr", "run", str(write_resume_app(self.run_dir.path, run_cfg, RESTART_APP)),
                                  "--stream"])
        except (OSError, ValueError):  # an engine built in-process: the user's own app with the run config
            restart = shlex.join(["flwr", "run", "YOUR_APP_FOLDER", "--stream", "--run-config",
                                  resume_config(run_cfg).strip()])
        record = {"round": 1, "rounds_completed": 0, "error": type(e).__name__, "message": str(e)[:2000],
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "nodes_seen": getattr(e, "nodes_seen", None),
                  "missing": missing, "checkpoint": self._checkpoint is not None, "restart": restart,
                  "restart_note": getattr(e, "fix", "")}
        if self._checkpoint is not None:
            record["resume"] = self._resume_command()
        try:
            atomic_write_json(self.run_dir.path / "failure.json", record, private=True)
        except OSError as err:
            log.warning("cannot write %s: %s", self.run_dir.path / "failure.json", err)
        log.error("fedproto: the run did not start (%s); %s", first_line(e), self.run_dir.path / "failure.json")

    def _record_failure(self, e: BaseException) -> None:
        """``failure.json``: the round the run stopped in, why, and how to continue it (once: the
        first record, e.g. the signal that stopped the run, is kept)."""
        if self._failure_recorded:
            return
        self._failure_recorded = True
        done = len(self.loop.history)
        record = {"round": done + 1, "rounds_completed": done, "error": type(e).__name__,
                  "message": str(e)[:2000], "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "checkpoint": self.run_dir.checkpoint.is_file(),
                  "resume": self._resume_command(),
                  "resume_note": "run it where the run folder is (or copy its resume-app folder), after starting the "
                                 "SuperLink again; flwr uses the default connection of FLWR_HOME/config.toml "
                                 "([superlink] default = ...): for another, put its name after the app folder"}
        try:
            atomic_write_json(self.run_dir.path / "failure.json", record, private=True)
        except OSError as err:  # never hide the run's own error behind this one
            log.warning("cannot write %s: %s", self.run_dir.path / "failure.json", err)
        log.error("fedproto: the run stopped in round %d (%s); rounds 1..%d are in %s%s", done + 1, type(e).__name__,
                  done, self.run_dir.path, f"; continue it with: {record['resume']}" if record["checkpoint"] else "")


class Stopped(Exception):
    """The ServerApp process was told to stop (SIGINT or SIGTERM) while the run was under way."""


@contextlib.contextmanager
def failure_on_signal(engine: FlowerEngine):
    """While the run is under way, SIGINT and SIGTERM first write ``failure.json`` (error
    ``Stopped``), then go to the handler that was there (Flower's: it ends the process, and may
    end it with ``os._exit`` before the run's own ``except`` is reached). Flower sends the ServerApp
    SIGINT itself when a restarted SuperLink refuses its token (flwr 1.42, ``http_retry``). Only
    in the main thread (elsewhere, as in tests, nothing changes)."""
    if threading.current_thread() is not threading.main_thread() or not engine.run_dir:
        yield
        return
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, frame):
        prev = before[signum]
        if prev == signal.SIG_IGN:
            return
        engine._record_failure(Stopped(f"the ServerApp process got {signal.Signals(signum).name}"))
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_DFL and signum == signal.SIGTERM:
            raise SystemExit(128 + signum)
        else:
            raise KeyboardInterrupt

    for sig in before:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, prev in before.items():
            signal.signal(sig, prev)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """ServerApp entry point: run the configured experiment and log its summary."""
    try:
        cfg = run_config(context.run_config)
        opts = FlowerOptions.from_user_config(context.run_config)
        out = Path(cfg.out_dir) / f"{cfg.run_name()}-run{context.run_id}"  # resume_from: that folder instead
        engine = FlowerEngine(cfg, grid, out=out, options=opts, run_cfg=dict(context.run_config))
        if opts.resume_from:
            out = engine.run_dir.path
        with failure_on_signal(engine):
            summary = engine.run()
    except FedprotoError as e:  # a user mistake: one line, no traceback (flwr run still exits 0)
        from fedproto.config.run_options import flower_wording

        log.error("fedproto: %s", e.render(flower_wording))  # options named as run-config keys
        return
    acc = summary["accuracy"].get("acc", {})
    if not acc and cfg.dp != "off":
        log.warning("fedproto: %s on %s with dp=%s: each node kept its accuracy (and logged it); results in %s",
                    cfg.algorithm, cfg.dataset, cfg.dp, out)
        return
    over = over_clients(summary)
    log.warning("fedproto: %s on %s: accuracy %.2f ± %.2f %% over %s clients, %.1fk parameters up per round; "
                "results in %s", cfg.algorithm, cfg.dataset, 100 * acc.get("mean", float("nan")),
                100 * acc.get("std", float("nan")), over, summary["params_per_round"]["up"] / 1e3, out)


__all__ = ["NODE_UNAVAILABLE", "REPLY_UNAVAILABLE", "RESTART_APP", "RESUME_APP", "RESUME_WAIT_NODES", "FlowerEngine",
           "Stopped", "app", "failure_on_signal", "main", "resume_config", "write_resume_app"]
