"""Paired wall and CPU time of the official FedProto code and ``fedproto run``, whole processes.

Each pair runs the official code (through ``benchmarks/official_shim.py``, MNIST, its defaults
but batch 8) and then ``fedproto run`` (the paper's default MNIST setting), both for the same
number of rounds on the same thread count, one process after the other; the pairs repeat. The
table gives each process's wall and CPU seconds (``os.wait4``: user + system of the child) with the
load average read just before it, then the medians and their ratios.

Usage::

    FEDPROTO_DATA=/path/to/data OMP_NUM_THREADS=1 python benchmarks/bench_official.py \\
        --official /path/to/FedProto --pairs 3 --rounds 20 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _timed(cmd: list[str], cwd: str) -> tuple[float, float, str]:
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    start = time.perf_counter()
    with open(os.devnull, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=sink, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return wall, usage.ru_utime + usage.ru_stime, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--official", type=Path, required=True, help="checkout or bare git dir of the official code")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    official = [sys.executable, str(HERE / "official_shim.py"), "--official", str(args.official.resolve()),
                "--threads", str(args.threads), "--", "--rounds", str(args.rounds), "--local_bs", "8"]
    times: dict[str, list[tuple[float, float, str]]] = {"official": [], "fedproto": []}
    print("| pair | process | wall s | CPU s | load average (1 min) before |\n|---|---|--:|--:|--:|")
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(1, args.pairs + 1):
            ours = [sys.executable, "-m", "fedproto", "run", "--rounds", str(args.rounds), "--eval-every", "0",
                    "--threads", str(args.threads), "--out-dir", str(Path(tmp) / f"run{pair}")]
            for name, cmd in (("official", official), ("fedproto", ours)):
                wall, cpu, load = _timed(cmd, tmp)
                times[name].append((wall, cpu, load))
                print(f"| {pair} | {name} | {wall:.1f} | {cpu:.1f} | {load} |", flush=True)
    med = {k: (statistics.median(w for w, _, _ in v), statistics.median(c for _, c, _ in v)) for k, v in times.items()}
    print(f"\nmedians: official {med['official'][0]:.1f} s wall / {med['official'][1]:.1f} s CPU; "
          f"fedproto {med['fedproto'][0]:.1f} s wall / {med['fedproto'][1]:.1f} s CPU; "
          f"ratio {med['official'][0] / med['fedproto'][0]:.2f}x wall, {med['official'][1] / med['fedproto'][1]:.2f}x CPU")


if __name__ == "__main__":
    main()
