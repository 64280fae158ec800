"""The Flower ``ServerApp``: the engine's round loop with the Flower executor.

:class:`FlowerEngine` builds a :class:`fedproto.flower.executor.FlowerExecutor` (the clients on
their SuperNodes), the run's algorithm (its server side) and the round loop
(:class:`fedproto.engine.loop.RoundLoop`) the simulator runs, with the observers of a run that
holds no client data: the run folder, health checks and progress. Nothing here trains a client,
and the server holds no data and no client model (DESIGN.md).

Run options come from the Flower run config (``[tool.flwr.app.config]`` of the Flower app, or
``flwr run --run-config``): every :class:`fedproto.config.RunConfig` option (``-`` or ``_``) plus
the keys of :class:`fedproto.flower.common.FlowerOptions`. For nodes with their own data
(:mod:`fedproto.flower.node`) the run config needs only ``dataset = "custom"``, ``classes``,
``embedding-dim`` and the algorithm's options. The run directory is written where the ServerApp
runs: ``out_dir/<run name>-run<Flower run id>``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedproto.config import RunConfig
from fedproto.engine.loop import RoundLoop
from fedproto.engine.observers.health import Health
from fedproto.engine.observers.progress import Progress
from fedproto.engine.observers.rundir import RunFolder
from fedproto.engine.setup import build_algorithm
from fedproto.errors import ConfigError, FedprotoError
from fedproto.flower.common import FlowerOptions, run_config
from fedproto.flower.executor import NODE_UNAVAILABLE, REPLY_UNAVAILABLE, FlowerExecutor
from fedproto.results import RunDir

log = logging.getLogger(__name__)

app = ServerApp()


class FlowerEngine:
    """Run a configured experiment with one Flower SuperNode per client.

    Args:
        cfg: the run configuration (``checkpoint_every`` must be 0: client models stay on the
            nodes, so the server cannot checkpoint them).
        grid: the Flower :class:`~flwr.serverapp.Grid` of the run.
        out: run directory (a path; False: write nothing).
        options: the Flower engine's options (timeouts, minimum replies, retries).
        wait_s, timeout_s: override ``options.wait_nodes`` and ``options.round_timeout``.
        on_round: optional callback(row) after each round.
    Raises:
        ConfigError: checkpoints requested; see :class:`~fedproto.flower.executor.FlowerExecutor`.
        TrainingError: too few nodes joined (:class:`~fedproto.flower.executor.FlowerExecutor`).
    """

    def __init__(self, cfg: RunConfig, grid: Grid, out=None, options: FlowerOptions | None = None,
                 wait_s: float | None = None, timeout_s: float | None = None,
                 on_round: Callable[[dict], None] | None = None):
        if cfg.checkpoint_every:
            raise ConfigError(f"checkpoint_every={cfg.checkpoint_every}: under Flower the client models stay on "
                              "the SuperNodes, so the server cannot checkpoint them; set checkpoint_every=0")
        opts = options or FlowerOptions()
        opts = FlowerOptions(round_timeout=opts.round_timeout if timeout_s is None else timeout_s,
                             min_replies=opts.min_replies, round_retries=opts.round_retries,
                             wait_nodes=opts.wait_nodes if wait_s is None else wait_s, class_names=opts.class_names)
        self.cfg = cfg
        self.executor = FlowerExecutor(cfg, grid, opts)
        self.algorithm = build_algorithm(cfg, self.executor.embedding_dim)
        self.executor.bind(self.algorithm)
        self.run_dir = None if out is False else RunDir(out if out is not None else Path(cfg.out_dir) / cfg.run_name())
        observers = [Health(cfg)]
        if self.run_dir:
            observers.append(RunFolder(self.run_dir, self.config_record))
            if cfg.tensorboard:  # the optional extra (fedproto[tensorboard])
                from fedproto.tensorboard import TensorBoardObserver

                observers.append(TensorBoardObserver(self.run_dir.path))
        observers.append(Progress(on_round))
        self.loop = RoundLoop(cfg, self.algorithm, self.executor, self.executor.embedding_dim, observers)

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
        return {**self.cfg.model_dump(), "lambda_proto_in_force": self.cfg.lam, **self.executor.config_record()}

    def run(self, resume: bool = False) -> dict:
        """Run all rounds; returns the summary (also ``summary.json`` in the run folder).

        Raises:
            ConfigError: ``resume`` (not supported under Flower: client models stay on the nodes).
            TrainingError: a round stayed below ``min-replies`` after its retries, or no node
                replied to the final evaluation.
        """
        if resume:
            raise ConfigError("resume is not supported under Flower (client models stay on the nodes)")
        self.loop.message = self.loop.initial_message()
        if not self.run_dir:
            return self.loop.run()
        self.run_dir.acquire()
        try:
            self.run_dir.begin()
            try:
                return self.loop.run()
            except BaseException:
                self.run_dir.abort()
                raise
        finally:
            self.run_dir.release()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """ServerApp entry point: run the configured experiment and log its summary."""
    try:
        cfg = run_config(context.run_config)
        opts = FlowerOptions.from_user_config(context.run_config)
        out = Path(cfg.out_dir) / f"{cfg.run_name()}-run{context.run_id}"
        summary = FlowerEngine(cfg, grid, out=out, options=opts).run()
    except FedprotoError as e:  # a user mistake: one line, no traceback (flwr run still exits 0)
        from fedproto.options import flower_wording

        log.error("fedproto: %s", e.render(flower_wording))  # options named as run-config keys
        return
    acc = summary["accuracy"].get("acc", {})
    n = summary["clients"]
    if not acc and cfg.dp != "off":
        log.warning("fedproto: %s on %s with dp=%s: each node kept its accuracy (and logged it); results in %s",
                    cfg.algorithm, cfg.dataset, cfg.dp, out)
        return
    over = f"{summary['clients_evaluated']} of {n}" if "clients_evaluated" in summary else f"{n}"
    log.warning("fedproto: %s on %s: accuracy %.2f ± %.2f %% over %s clients, %.1fk parameters up per round; "
                "results in %s", cfg.algorithm, cfg.dataset, 100 * acc.get("mean", float("nan")),
                100 * acc.get("std", float("nan")), over, summary["params_per_round"]["up"] / 1e3, out)


__all__ = ["NODE_UNAVAILABLE", "REPLY_UNAVAILABLE", "FlowerEngine", "app", "main"]
