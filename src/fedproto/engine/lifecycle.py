"""One run lifecycle for every front end (docs/architecture.md, "Observer and Stage").

The simulator (:class:`fedproto.simulation.Simulation`) and the Flower ServerApp
(:class:`fedproto.flower.server_app.FlowerEngine`) build their observers with
:func:`standard_observers` (the same health and NaN policy, the same run folder and checkpoint
writers, the user's own observers, progress last) and run with :func:`run_rounds` (restore a
checkpoint, open the run folder, run the loop, give the folder back on an error). What differs
between them is the executor and the observers only one of them can have (the simulator's
simulated attack and full-test evaluation, which need the clients' data in this process).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from fedproto.config.common_options import CommonConfig
from fedproto.engine.loop import Observer, RoundLoop
from fedproto.engine.observers.checkpoints import Checkpoints, restore
from fedproto.engine.observers.health import Health
from fedproto.engine.observers.progress import Progress
from fedproto.engine.observers.rundir import RunFolder
from fedproto.engine.summary import Row, Summary
from fedproto.errors import ConfigError
from fedproto.outputs.run_folder import RunDir

log = logging.getLogger(__name__)


def check_observers(observers: Sequence[Any]) -> list[Observer]:
    """The user's observers as a list, each an :class:`~fedproto.engine.loop.Observer`.

    Raises:
        ConfigError: an entry is not an Observer (names its type).
    """
    out = list(observers or ())
    for o in out:
        if not isinstance(o, Observer):
            raise ConfigError(f"observers: {type(o).__name__} is not a fedproto.engine.loop.Observer; subclass it "
                              "and override the hooks you need (start, replies, aggregated, evaluated, round_done, "
                              "summary, finish)")
    return out


def standard_observers(cfg: CommonConfig, health: Health, run_dir: RunDir | None,
                       config_record: Callable[[], dict[str, Any]], on_round: Callable[[Row], None] | None, *,
                       checkpoint_every: int, before: Sequence[Observer] = (), run_folder: Sequence[Observer] = (),
                       user: Sequence[Observer] = (),
                       models: Callable[[], Iterable[torch.nn.Module]] | None = None) -> list[Observer]:
    """A run's observers, in the order the loop calls them: ``health`` (a non-finite loss stops
    the run, the method's alerts), the front end's own ``before`` (the simulator's attack and
    full test), with a run folder :class:`RunFolder` then :class:`Checkpoints` every
    ``checkpoint_every`` rounds then ``run_folder`` (embeddings, TensorBoard), then the
    ``user``'s observers, and :class:`Progress` last (so a round's row is in ``metrics.jsonl`` and
    in a checkpoint before anyone is told of it)."""
    obs: list[Observer] = [health, *before]
    if run_dir:
        obs += [RunFolder(run_dir, config_record, models), Checkpoints(run_dir, checkpoint_every), *run_folder]
    return [*obs, *user, Progress(on_round)]


def run_rounds(loop: RoundLoop, run_dir: RunDir | None, checkpoint: dict[str, Any] | None = None, where: str = "",
               on_error: Callable[[BaseException], None] | None = None) -> Summary:
    """Run ``loop`` (whose ``message`` is set) from a ``checkpoint`` (None: round 1) into
    ``run_dir`` (None: write nothing): restore, :meth:`RunDir.begin`, :meth:`RoundLoop.run`; on
    any error ``on_error(e)`` and :meth:`RunDir.abort` (an earlier finished run comes back unless
    a checkpoint is left to resume), then the error is raised again. Returns the summary.

    Raises:
        CheckpointMismatch, CheckpointError: see :func:`fedproto.engine.observers.checkpoints.restore`.
    """
    if checkpoint is not None:
        restore(loop, checkpoint, where)
        log.info("resuming %s after round %d", run_dir.path if run_dir else "the run", loop.start_round - 1)
    if run_dir is None:
        return loop.run()
    run_dir.begin(loop.history if checkpoint is not None else None)
    try:
        return loop.run()
    except BaseException as e:
        if on_error is not None:
            on_error(e)
        if run_dir.abort():
            log.warning("the earlier finished run in %s is back in place", run_dir.path)
        raise

