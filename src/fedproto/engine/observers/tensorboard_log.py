"""TensorBoard logging of the per-round metrics (the ``tensorboard`` option; the ``tensorboard`` extra).

:class:`TensorBoardObserver` receives each row that ``metrics.jsonl`` gets (one dict per round) and
writes every numeric entry as a TensorBoard scalar at step ``row["round"]``, with
``torch.utils.tensorboard.SummaryWriter`` into ``<run dir>/tensorboard/``. It changes no number of a run
(the option is result-neutral); ``metrics.jsonl`` stays the record, and the events follow it: a run resumed
from a checkpoint after round ``c`` purges the events of rounds after ``c`` that the interrupted process had
written (TensorBoard's ``purge_step``), so each round is logged once; a new run in the same folder moves the
old event files aside with the rest of the old run (:data:`fedproto.outputs.run_folder.RESULT_FILES`). View with
``tensorboard --logdir <run dir>/tensorboard`` (or the parent folder of several run directories).

Needs the ``tensorboard`` package: ``pip install "fedproto[tensorboard]"``.
"""

from __future__ import annotations

import math
import numbers
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedproto.engine.loop import Observer
from fedproto.errors import ConfigError

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from fedproto.engine.loop import RoundLoop

TENSORBOARD_DIR = "tensorboard"
"""Folder of the event files inside a run directory."""

INSTALL = 'pip install "fedproto[tensorboard]"'


def _summary_writer() -> type[SummaryWriter]:
    """``torch.utils.tensorboard.SummaryWriter``; ConfigError naming the extra when tensorboard is missing."""
    try:
        import tensorboard  # noqa: F401 - torch.utils.tensorboard needs it; checked here for a clear message
        from torch.utils.tensorboard import SummaryWriter as writer_cls
    except ImportError as e:
        raise ConfigError(f"tensorboard logging needs the tensorboard package, which is not installed ({e})",
                          option="tensorboard", value=True,
                          hint=f"install the extra: {INSTALL}, or leave the tensorboard option off") from None
    return writer_cls


def tensorboard_observers(cfg: Any, run_dir: Any) -> list[Observer]:
    """``[TensorBoardObserver]`` for a run with ``tensorboard`` on and a run folder, else ``[]``
    (the front ends pass it to :func:`fedproto.engine.lifecycle.standard_observers`)."""
    return [TensorBoardObserver(run_dir.path)] if cfg.tensorboard and run_dir else []


def require_tensorboard() -> None:
    """Check that TensorBoard logging can work, before a run starts.

    Raises:
        ConfigError: the ``tensorboard`` package is not installed (names the extra to install).
    """
    _summary_writer()


def purge_events(log_dir: str | Path, first_step: object) -> int:
    """Remove from the event files in ``log_dir`` every scalar event at a step ``>= first_step`` (the rounds a
    resumed run runs again), rewriting each file atomically; a file left with no summary is deleted.

    Args:
        log_dir: a run's ``tensorboard/`` folder (missing: nothing to do).
        first_step: the first redone round (>= 1).
    Returns:
        The number of events removed.
    Raises:
        ValueError: ``first_step`` is below 1.
        ConfigError: the ``tensorboard`` package is not installed.
    """
    if isinstance(first_step, bool) or not isinstance(first_step, numbers.Integral) or first_step < 1:
        raise ValueError(f"purge_events: first_step must be a round number >= 1, got {first_step!r}")
    folder = Path(log_dir)
    if not folder.is_dir():
        return 0
    _summary_writer()
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    removed = 0
    for f in sorted(p for p in folder.iterdir() if p.is_file() and "tfevents" in p.name):
        kept: list[bytes] = []
        dropped = summaries = 0
        for raw in RawEventFileLoader(str(f)).Load():
            ev = Event.FromString(raw)
            if ev.step >= int(first_step) and (ev.HasField("summary") or ev.HasField("session_log")):
                dropped += 1
                continue
            summaries += ev.HasField("summary")
            kept.append(raw)
        if not dropped:
            continue
        removed += dropped
        if not summaries:
            f.unlink()
            continue
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".purge-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                w = RecordWriter(out)
                for raw in kept:
                    w.write(raw)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, f)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return removed


class TensorBoardObserver(Observer):
    """Writes the per-round metrics rows of a run as TensorBoard scalars.

    Args:
        run_dir_path: the run directory; the event files go to ``run_dir_path/tensorboard/`` (created).

    Each numeric entry of a row (int or float, not bool; ``None`` and non-finite values are skipped, as
    are lists and texts such as ``sampled`` or ``dropped_why``) becomes the scalar of the same name at step
    ``row["round"]`` (``acc_mean``, ``loss_ce``, ``lr``, ``up_bytes``...). Nested dicts of numbers are
    written as ``<key>/<subkey>``.

    Raises:
        ConfigError: the ``tensorboard`` package is not installed (the message names
            ``pip install "fedproto[tensorboard]"``).
    """

    def __init__(self, run_dir_path: str | Path) -> None:
        self._writer_cls = _summary_writer()  # a missing extra is an error before round 1
        self.log_dir = Path(run_dir_path) / TENSORBOARD_DIR
        # opened with the first row, once the run folder is set up (RunDir.begin)
        self._writer: SummaryWriter | None = None
        self.purge_step: int | None = None  # resumed runs: the first round this process runs (see start)

    def _open(self) -> SummaryWriter:
        if self._writer is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = self._writer_cls(log_dir=str(self.log_dir), purge_step=self.purge_step)
        return self._writer

    @staticmethod
    def scalars(row: dict[str, object]) -> dict[str, float]:
        """The entries of ``row`` that :meth:`on_round` writes: name -> value (see the class docstring)."""
        out: dict[str, float] = {}

        def add(name: str, v: object) -> None:
            if isinstance(v, dict):
                for k, x in v.items():
                    add(f"{name}/{k}", x)
            elif not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(float(v)):
                out[name] = float(v)

        for k, v in row.items():
            if k != "round":
                add(k, v)
        return out

    def on_round(self, row: dict[str, object]) -> None:
        """Write the numeric entries of one metrics row at step ``row["round"]``.

        Raises:
            ValueError: ``row`` has no whole-number ``round``.
        """
        r = row.get("round")
        if isinstance(r, bool) or not isinstance(r, numbers.Integral):
            raise ValueError(f"a metrics row needs its round (a whole number) as row['round'], got {r!r}")
        writer = self._open()
        for name, v in self.scalars(row).items():
            writer.add_scalar(name, v, global_step=int(r))
        writer.flush()

    def close(self) -> None:
        """Flush and close the event file (if a row was written)."""
        if self._writer is not None:
            self._writer.close()

    # the round loop's hooks (fedproto.engine.loop.Observer)
    def start(self, loop: RoundLoop) -> None:
        """A resumed run (``loop.start_round`` > 1) purges the events at and after its first round: the
        interrupted process may have logged rounds after its last checkpoint, which are run again: they are
        removed from the old event files (:func:`purge_events`) before this process writes them again."""
        self.purge_step = loop.start_round if loop.start_round > 1 else None
        if self.purge_step is not None:
            purge_events(self.log_dir, self.purge_step)

    def round_done(self, loop: RoundLoop, row: dict[str, Any]) -> None:
        self.on_round(row)

    def finish(self, loop: RoundLoop, summary: dict[str, Any], per_client: list[dict[str, Any]]) -> None:
        self.close()
