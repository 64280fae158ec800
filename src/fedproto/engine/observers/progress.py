"""Progress of a run: the caller's per-round callback (the CLI's progress bar) and one INFO log
line per evaluated round (:func:`fedproto.outputs.run_folder.round_line`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fedproto.engine.loop import Observer, RoundLoop
from fedproto.engine.summary import Row
from fedproto.outputs.run_folder import round_line

log = logging.getLogger("fedproto.simulation")  # the logger Python users turn INFO on for


class Progress(Observer):
    """Calls ``on_round(row)`` after every round (and for the rounds a resumed run restored, at
    its start) and logs one line per evaluated round at INFO.

    Args:
        on_round: callback(row) or None.
    """

    def __init__(self, on_round: Callable[[Row], None] | None = None) -> None:
        self.on_round = on_round

    def start(self, loop: RoundLoop) -> None:
        if self.on_round:
            for row in loop.history:
                self.on_round(row)

    def round_done(self, loop: RoundLoop, row: Row) -> None:
        if "acc_mean" in row:  # one line per evaluated round, for Python users who turn INFO logging on
            log.info("%s", round_line(row, loop.cfg.rounds, loop.elapsed()))
        if self.on_round:
            self.on_round(row)
