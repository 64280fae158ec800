"""Two versions of fedproto side by side: is the default run slower after a change?

Runs ``fedproto run`` (the MNIST defaults, ``--rounds R``) from two source trees, alternating
A, B, A, B, ... so that both meet the same background load, and prints the median wall time of
each (the run's ``train_time_s`` over rounds, from its summary) and their ratio, in one run.

    git worktree add /tmp/before <commit>
    python benchmarks/bench_versions.py --before /tmp/before/src --after src --rounds 5 --reps 5

Needs MNIST (``FEDPROTO_DATA``). Quote the ratio: absolute times depend on the machine and load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def one_run(src: str, rounds: int, threads: int, out: Path) -> float:
    """Training seconds per round of one ``fedproto run`` with ``src`` first on the path."""
    env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
    cmd = [sys.executable, "-m", "fedproto", "run", "--rounds", str(rounds), "--threads", str(threads), "-q",
           "--eval-every", "0", "--out-dir", str(out), "--name", "bench"]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    s = json.loads((out / "bench" / "summary.json").read_text())
    return s["train_time_s"] / rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="src folder of the earlier version")
    ap.add_argument("--after", default="src", help="src folder of the later version")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    times: dict[str, list[float]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.reps):
            for name, src in (("before", a.before), ("after", a.after)) if r % 2 == 0 else (
                    ("after", a.after), ("before", a.before)):
                times[name].append(one_run(src, a.rounds, a.threads, Path(tmp) / name))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"default MNIST run, {a.rounds} rounds, {a.threads} thread(s), {a.reps} runs each (alternating)")
    for k in ("before", "after"):
        print(f"  {k:6s}: median {med[k]:.3f} s per round (runs: {', '.join(f'{t:.3f}' for t in times[k])})")
    print(f"  after / before: {med['after'] / med['before']:.3f}")


if __name__ == "__main__":
    main()
