"""Start-up benchmark: how long the command line takes before it does any work.

Prints, as markdown, the median wall time (each command run ``--repeats`` times, default 5,
after one unmeasured warm-up run) of ``python -c "import fedproto"``, ``python -m fedproto run
--help`` and a 1-round default MNIST run (``--threads 1``; left out when MNIST is not found),
then the 8 modules with the largest cumulative import time under ``python -X importtime -m
fedproto run --help`` (median of as many runs).

    python benchmarks/bench_startup.py
    python benchmarks/bench_startup.py --repeats 3 --data-dir /path/to/data

The fedproto measured is this checkout's (its ``src`` comes first on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_args import positive

SRC = Path(__file__).resolve().parents[1] / "src"
ENV = dict(os.environ, OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]))


def wall(cmd: list[str], repeats: int) -> tuple[float | None, str]:
    """Median wall seconds of ``cmd`` over ``repeats`` runs after a warm-up; (None, why) when a
    run fails."""
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            why = lines[0].split(". ")[0] if i == 0 else lines[-1]  # no data set: the message's first sentence
            return None, f"{why} (exit code {proc.returncode})" if lines else f"exit code {proc.returncode}"
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times), ""


def top_imports(cmd: list[str], repeats: int, n: int = 8) -> list[tuple[str, float, float]]:
    """(module, cumulative ms, self ms) of the ``n`` largest cumulative times under -X importtime,
    each the median of ``repeats`` runs."""
    times: dict[str, list[tuple[int, int]]] = {}
    for _ in range(repeats):
        err = subprocess.run([sys.executable, "-X", "importtime", *cmd], env=ENV, capture_output=True,
                             text=True).stderr
        for line in err.splitlines():
            m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|\s*(\S+)", line)
            if m:
                times.setdefault(m[3], []).append((int(m[2]), int(m[1])))
    rows = [(name, statistics.median(c for c, _ in v) / 1000, statistics.median(s for _, s in v) / 1000)
            for name, v in times.items()]
    return sorted(rows, key=lambda r: -r[1])[:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=positive, default=5, help="timed runs per command (default 5)")
    p.add_argument("--data-dir", default=None, help="folder with mnist/ (default: $FEDPROTO_DATA, the cache)")
    args = p.parse_args()

    py = sys.executable
    with tempfile.TemporaryDirectory() as out:
        run = [py, "-m", "fedproto", "run", "--dataset", "mnist", "--rounds", "1", "--threads", "1", "--quiet",
               "--no-download", "--out-dir", out, "--name", "x"]
        if args.data_dir:
            run += ["--data-dir", args.data_dir]
        cases = [('python -c "import fedproto"', [py, "-c", "import fedproto"]),
                 ("python -m fedproto run --help", [py, "-m", "fedproto", "run", "--help"]),
                 ("1-round MNIST run, --threads 1", run)]
        print(f"| command | median wall s (of {args.repeats}) |\n|---|---:|")
        for label, cmd in cases:
            t, why = wall(cmd, args.repeats)
            print(f"| `{label}` | {t:.3f} |" if t is not None else f"| `{label}` | skipped: {why} |", flush=True)

    print(f"\nTop 8 modules by cumulative import time, `python -X importtime -m fedproto run --help` "
          f"(median of {args.repeats}):\n")
    print("| module | cumulative ms | self ms |\n|---|---:|---:|")
    for name, cum, own in top_imports(["-m", "fedproto", "run", "--help"], args.repeats):
        print(f"| {name} | {cum:.1f} | {own:.1f} |")


if __name__ == "__main__":
    main()
