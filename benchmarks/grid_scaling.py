"""The wall time a `fedproto reproduce` grid can be expected to take with --jobs P, computed (not
measured) from the per-cell wall times of a run's status.json.

    python benchmarks/grid_scaling.py OUT/status.json --jobs 1,2,4,8,16,32

The cells are handed out in the grid's order to the first free of P slots (what --jobs P and a Ray
cluster of P one-thread workers do); each cell is assumed to take the time it took in the measured
run. Left out: the start of each process (about the time of `import torch` once per slot) and any
slowdown of cells sharing memory bandwidth, so the figures are lower bounds on a machine with P
free cores.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from pathlib import Path


def makespan(times: list[float], slots: int) -> float:
    """Wall time of list scheduling ``times`` in order on ``slots`` parallel slots (seconds)."""
    free = [0.0] * slots
    for t in times:
        heapq.heappush(free, heapq.heappop(free) + t)
    return max(free)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("status", type=Path, help="OUT/status.json of a finished grid (cells run, not skipped)")
    p.add_argument("--jobs", default="1,2,4,8,16,32", help="comma list of slot counts (default 1,2,4,8,16,32)")
    a = p.parse_args(argv)
    try:
        jobs = [int(j) for j in a.jobs.split(",")]
    except ValueError:
        p.error(f"--jobs {a.jobs!r}: give whole numbers separated by commas, e.g. 1,2,4")
    if any(j < 1 for j in jobs):
        p.error(f"--jobs {a.jobs!r}: each slot count must be 1 or more")
    try:
        cells = json.loads(a.status.read_text())
    except (OSError, ValueError) as e:
        p.error(f"{str(a.status)!r}: not a readable status.json ({e})")
    times = [float(c["wall_s"]) for c in cells if c.get("status") == "done"]
    if not times:
        p.error(f"{str(a.status)!r} has no cell that ran (skipped cells carry no time)")
    total = sum(times)
    print(f"{len(times)} cells, {total:.0f} s in all, {min(times):.0f}-{max(times):.0f} s each")
    print("| jobs | computed wall s | speed-up | efficiency |")
    print("|--:|--:|--:|--:|")
    for j in jobs:
        w = makespan(times, j)
        print(f"| {j} | {w:.0f} | {total / w:.2f}x | {total / w / j:.0%} |")


if __name__ == "__main__":
    main(sys.argv[1:])
