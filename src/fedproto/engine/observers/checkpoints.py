"""Checkpoints of the round loop (:mod:`fedproto.outputs.checkpoint` for the file format): written every
``checkpoint_every`` rounds, read back by :func:`restore` to resume a run after its last
completed round with the numbers an uninterrupted run gives."""

from __future__ import annotations

import time
from typing import Any

from fedproto.config.common_options import CommonConfig
from fedproto.config.run_config import ADDED_FIELDS, result_fields
from fedproto.engine.checks import message_problem
from fedproto.engine.loop import Observer, RoundLoop
from fedproto.engine.summary import Row
from fedproto.errors import CheckpointError, CheckpointMismatch, first_line
from fedproto.outputs.checkpoint import save_checkpoint
from fedproto.outputs.run_folder import RunDir


def checkpoint_state(loop: RoundLoop, r: int) -> dict[str, Any]:
    """The checkpoint after round ``r``: options, server message and state, the clients' state
    where the server holds it (``[]`` under Flower: nodes keep their own), their data's
    fingerprint, the metrics rows, communication totals and times."""
    return {
        "round": r,
        "config": loop.cfg.result_fields(),
        "message": loop.message,
        "server_state": loop.server.checkpoint,
        "clients": loop.executor.client_states() or [],
        "data": loop.executor.data_fingerprint(),
        "history": loop.history,
        "totals": dict(loop.totals),
        "train_time_s": loop.train_time,
        "wall_time_s": loop.elapsed(),
    }


class Checkpoints(Observer):
    """Writes a checkpoint into ``run_dir`` after every ``every``-th round but the last."""

    def __init__(self, run_dir: RunDir, every: int) -> None:
        self.run_dir, self.every = run_dir, every

    def round_done(self, loop: RoundLoop, row: Row) -> None:
        r = row["round"]
        if self.every and r % self.every == 0 and r < loop.cfg.rounds:
            self.run_dir.write_checkpoint(save_checkpoint, checkpoint_state(loop, r))


def check_options(cfg: CommonConfig, ckpt: dict[str, Any], where: str,
                  fix: str = "resume with the same options, or delete it to start from round 1") -> None:
    """Refuse a checkpoint written under other result-changing options than ``cfg``'s.

    Raises:
        CheckpointMismatch: names up to five options that differ, their values there and now, and ``fix``.
    """
    mine = cfg.result_fields()
    theirs = result_fields({**ADDED_FIELDS, **ckpt["config"]}) if isinstance(ckpt["config"], dict) else {}
    diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if diff:
        shown = ", ".join(f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} now" for k in diff[:5])
        raise CheckpointMismatch(f"{where} was written by a run with other options ({shown}); {fix}")


def restore(loop: RoundLoop, ckpt: dict[str, Any], where: str) -> None:
    """Load a checkpoint into ``loop`` (and its executor's clients): the next round, message,
    server state, metrics rows, totals and times.

    Args:
        loop: a loop whose ``message`` is the algorithm's first broadcast (the shapes to check against).
        ckpt: from :func:`fedproto.outputs.checkpoint.load_checkpoint`. where: how errors name the file.
    Raises:
        CheckpointMismatch: the checkpoint belongs to other options or other client data (names them).
        CheckpointError: its content does not fit these clients' models, or it is damaged.
    """
    check_options(loop.cfg, ckpt, where)
    ex = loop.executor
    fp = ex.data_fingerprint()
    if ckpt.get("data") is not None and fp is not None and ckpt["data"] != fp:
        bad = [i for i, (a, b) in enumerate(zip(ckpt["data"], fp)) if a != b]
        raise CheckpointMismatch(f"{where} was written for other client data (clients {bad[:10]} differ in sample "
                                 "counts or labels); resume with the same data, or delete it to start anew")
    holds = ex.client_states() is not None
    n = len(ckpt["clients"])
    if (holds and n != ex.num_clients) or (not holds and n) or not 0 < int(ckpt["round"]) <= loop.cfg.rounds:
        raise CheckpointError(f"{where} does not fit this run ({n} clients, round {ckpt['round']}); delete it to "
                              "start anew")
    try:
        if holds:
            ex.restore_clients(ckpt["clients"])
        loop.server = loop.algorithm.resume_state(ckpt["message"], ckpt["server_state"])
    except (RuntimeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where} does not fit this run's models ({type(e).__name__}: "
                              f"{first_line(e)[:200]}); delete it to start anew") from None
    problem = message_problem(loop.algorithm, ckpt["message"], loop.message, loop.embedding_dim)
    if problem:
        raise CheckpointError(f"{where} is damaged: its server message {problem}; delete it to start from round 1")
    loop.message = ckpt["message"]
    loop.history = list(ckpt["history"])
    loop.start_round = int(ckpt["round"]) + 1
    loop.totals.update({k: int(v) for k, v in ckpt["totals"].items() if k in loop.totals})
    loop.train_time, loop.wall_before = float(ckpt["train_time_s"]), float(ckpt["wall_time_s"])
    loop.t_start = time.perf_counter() - loop.wall_before
