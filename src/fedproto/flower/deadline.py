"""How long the Flower server waits for a round's replies: a deadline that follows the measured
round times, so that a machine slowed down by other work slows the run and does not stop it.

The configured ``round-timeout`` is the floor; once rounds have been measured, the deadline is
``max(round-timeout, FACTOR x the median of the exchanges measured so far)``. An exchange in
which every node replied counts with its duration; one in which no node replied in time counts
with the time it waited (a lower bound of how long a reply takes there), so that after a round
whose nodes were all too slow the next wait is longer, and the round's retry (``round-retries``)
gets it. One in which some nodes replied and others did not is not counted: the others are more
likely gone than slow, and waiting longer for them would slow every later round. The median,
not the last or the largest, so that one slow round (a node restarting) does not stretch every
later deadline, and a run that got slower (load that came later) still gets room: with FACTOR 3 a
round may take three times the typical one before a node counts as timed out. Used by
:class:`fedproto.flower.flower_executor.FlowerExecutor`.
"""

from __future__ import annotations

import statistics

FACTOR = 3.0
"""How many times the median measured exchange a deadline allows (above the configured floor)."""


class RoundDeadline:
    """The seconds to wait for the replies of the next exchange.

    Args:
        floor: the configured ``round-timeout`` in seconds (> 0): no deadline is shorter.
        factor: the multiple of the median measured exchange time (> 0), :data:`FACTOR` by default.

    Raises:
        ValueError: ``floor`` or ``factor`` not above 0.
    """

    def __init__(self, floor: float, factor: float = FACTOR):
        if not floor > 0 or not factor > 0:
            raise ValueError(f"round deadline: floor={floor!r} and factor={factor!r} must be above 0")
        self.floor, self.factor = float(floor), float(factor)
        self.measured: list[float] = []

    def seconds(self) -> float:
        """``max(floor, factor x median(measured))``, or ``floor`` before any measurement (s)."""
        if not self.measured:
            return self.floor
        return max(self.floor, self.factor * statistics.median(self.measured))

    def adapted(self, least: float) -> float:
        """``max(least, factor x median(measured))`` (s): a wait of ``least`` seconds that grows with the measured
        exchanges, as a deadline does, without this deadline's floor (the join wait: ``wait-nodes``)."""
        if not self.measured:
            return float(least)
        return max(float(least), self.factor * statistics.median(self.measured))

    def record(self, seconds: float) -> None:
        """Adds the duration (s) of an exchange in which every node replied, or the time waited in
        one in which none replied in time; a negative duration is ignored."""
        if seconds >= 0:
            self.measured.append(float(seconds))
