"""The run folder of a run (:class:`fedproto.outputs.run_folder.RunDir`): ``config.json`` at the start,
``metrics.jsonl`` one row per round, and at the end ``summary.json``, ``clients.csv``, the
algorithm's own result files (FedProto: ``prototypes.npz``) and, with ``save_models``, ``models.pt``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from fedproto.engine.loop import Observer, RoundLoop
from fedproto.engine.summary import ClientMetrics, Row, Summary
from fedproto.outputs.run_folder import RunDir


class RunFolder(Observer):
    """Writes a run's files into ``run_dir``.

    Args:
        run_dir: the run folder.
        config_record: () -> the ``config.json`` dict (options plus what is in force).
        models: () -> the client models for ``models.pt`` (in-process), or None where the server
            holds none (Flower).
    """

    def __init__(self, run_dir: RunDir, config_record: Callable[[], dict[str, Any]],
                 models: Callable[[], Iterable[torch.nn.Module]] | None = None) -> None:
        self.run_dir, self.config_record, self.models = run_dir, config_record, models

    def start(self, loop: RoundLoop) -> None:
        self.run_dir.write_config(self.config_record())

    def evaluated(self, loop: RoundLoop, round: int, per_client: list[ClientMetrics]) -> None:
        if loop.executor.membership_changes:  # nodes that joined or were refused after the start
            self.run_dir.write_config(self.config_record())

    def round_done(self, loop: RoundLoop, row: Row) -> None:
        self.run_dir.log_round(row)

    def finish(self, loop: RoundLoop, summary: Summary, per_client: list[ClientMetrics]) -> None:
        rd = self.run_dir
        rd.write_summary(summary)
        rows: list[dict[str, Any]] = [{**base, **m} for base, m in zip(loop.executor.client_rows(), per_client)]
        rows = [{**r, "rounds_trained": n} for r, n in zip(rows, loop.rounds_trained())]
        rd.write_clients(rows)
        if loop.cfg.save_models and self.models is not None:
            rd.write_models(self.models())
        for name, arrays in loop.server.files.items():  # the method's own files (FedProto: prototypes.npz)
            rd.write_arrays(name, arrays)
        rd.checkpoint.unlink(missing_ok=True)  # finished: nothing left to resume
        rd.finish()
