"""Start-up benchmark: how long the command line takes before and around a short run.

Runs each command ``--repeats`` times (default 5, after one unmeasured warm-up round), the commands
interleaved (one of each in turn, so a change in the machine's load touches all of them alike), and
prints, as markdown, the median wall time and the median CPU time (user + system of the process and
its children) of:

* ``python -c "import torch"``: the reference (a run cannot start faster than torch imports);
* ``python -c "import fedproto"`` and ``fedproto --help``;
* ``fedproto run --rounds 1 --eval-every 0 --threads 1`` on MNIST (the paper's setting; left out
  when MNIST is not found), with each figure's ratio to ``import torch``;
* with ``--before SRC`` (another checkout's ``src``), the same fedproto commands on that code, in
  the same interleaved loop;
* MNIST loaded in a fresh process, decoded from its files and memory-mapped from the decoded-dataset
  cache (``load_dataset(..., mapped=True)``, what a run does).

The load average (``os.getloadavg``) before and after is printed beside the table. Then the modules
with the largest cumulative import time in a run's start (``python -X importtime``, torch and numpy
imported first so that what remains is fedproto's own cost; median of as many runs).

    python benchmarks/bench_startup.py
    python benchmarks/bench_startup.py --repeats 7 --before /tmp/before/src

The fedproto measured is this checkout's (its ``src`` comes first on ``PYTHONPATH``). The run's
dataset is decoded once into the decoded-dataset cache by the warm-up round (as on a user's first
run) and memory-mapped from it afterwards; ``--before`` code that decodes at every start does so.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_args import positive

SRC = Path(__file__).resolve().parents[1] / "src"


def env_for(src: Path) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])]))


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, '' or why it failed) of one run of ``cmd``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return wall, cpu, (lines[0].split(". ")[0] if lines else "") + f" (exit code {proc.returncode})"
    return wall, cpu, ""


def top_imports(code: str, env: dict[str, str], repeats: int, n: int = 12) -> list[tuple[str, float, float]]:
    """(module, cumulative ms, self ms) of the ``n`` largest cumulative times under -X importtime of
    ``python -c code`` after torch and numpy, each the median of ``repeats`` runs."""
    times: dict[str, list[tuple[int, int]]] = {}
    for _ in range(repeats):
        err = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import torch, numpy\n{code}"], env=env,
                             capture_output=True, text=True).stderr
        rows = [m for m in (re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", x) for x in err.splitlines())
                if m]
        first = max(i for i, m in enumerate(rows) if m[4] in ("torch", "numpy") and len(m[3]) == 1) + 1
        for m in rows[first:]:
            times.setdefault(m[4], []).append((int(m[2]), int(m[1])))
    out = [(name, statistics.median(c for c, _ in v) / 1000, statistics.median(s for _, s in v) / 1000)
           for name, v in times.items()]
    return sorted(out, key=lambda r: -r[1])[:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=positive, default=5, help="timed rounds (default 5)")
    p.add_argument("--data-dir", default=None, help="folder with mnist/ (default: $FEDPROTO_DATA, the cache)")
    p.add_argument("--before", type=Path, default=None, help="another checkout's src folder, measured alongside")
    args = p.parse_args()

    py = sys.executable
    with tempfile.TemporaryDirectory() as out:
        run = ["-m", "fedproto", "run", "--dataset", "mnist", "--rounds", "1", "--eval-every", "0", "--threads", "1",
               "--quiet", "--no-download", "--out-dir", out, "--name", "x"]
        if args.data_dir:
            run += ["--data-dir", args.data_dir]
        fp = [('python -c "import fedproto"', ["-c", "import fedproto"]),
              ("fedproto --help", ["-m", "fedproto", "--help"]),
              ("fedproto run --rounds 1 --eval-every 0 --threads 1 (MNIST)", run)]
        cases = [('python -c "import torch"', [py, "-c", "import torch"], env_for(SRC))]
        cases += [(label, [py, *cmd], env_for(SRC)) for label, cmd in fp]
        if args.before:
            cases += [(f"{label}, before", [py, *cmd], env_for(args.before.resolve())) for label, cmd in fp]
        walls: dict[str, list[float]] = {c[0]: [] for c in cases}
        cpus: dict[str, list[float]] = {c[0]: [] for c in cases}
        failed: dict[str, str] = {}
        load0 = os.getloadavg()
        for i in range(args.repeats + 1):
            for label, cmd, env in cases:
                if label in failed:
                    continue
                wall, cpu, why = timed(cmd, env)
                if why:
                    failed[label] = why
                elif i:
                    walls[label].append(wall)
                    cpus[label].append(cpu)
        load1 = os.getloadavg()
    ref_wall = statistics.median(walls[cases[0][0]])
    ref_cpu = statistics.median(cpus[cases[0][0]])
    print(f"load average (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in load0)} before, "
          f"{' '.join(f'{x:.2f}' for x in load1)} after; {os.cpu_count()} cores\n")
    print(f"| command | median wall s (of {args.repeats}) | x import torch | median CPU s | x import torch |\n"
          "|---|---:|---:|---:|---:|")
    for label, _, _ in cases:
        if label in failed:
            print(f"| `{label}` | skipped: {failed[label]} | | | |")
            continue
        w, c = statistics.median(walls[label]), statistics.median(cpus[label])
        print(f"| `{label}` | {w:.3f} | {w / ref_wall:.2f} | {c:.3f} | {c / ref_cpu:.2f} |", flush=True)

    load = ("import time, torch\nfrom fedproto.data.datasets import load_dataset\nt = time.perf_counter()\n"
            "load_dataset('mnist', {root}download=False, mapped={mapped})\nprint(time.perf_counter() - t)")
    root = f"{args.data_dir!r}, " if args.data_dir else ""
    took: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for mapped in (False, True):
            proc = subprocess.run([py, "-c", load.format(root=root, mapped=mapped)], env=env_for(SRC),
                                  capture_output=True, text=True)
            if proc.returncode == 0:
                took[mapped].append(float(proc.stdout.split()[-1]))
    if took[False] and took[True]:
        print(f"\nMNIST loaded in a fresh process (median of {args.repeats}, alternating): decoded from its files "
              f"{statistics.median(took[False]):.3f} s, memory-mapped from the decoded-dataset cache "
              f"{statistics.median(took[True]):.3f} s (what `fedproto run` does)")

    run_code = "import fedproto.cli.app, fedproto.engine.setup, fedproto.simulation, fedproto.outputs.run_folder"
    for title, src in (("this checkout", SRC), *((("before", args.before.resolve()),) if args.before else ())):
        rows = top_imports(run_code, env_for(src), args.repeats)
        total = sum(own for _, _, own in top_imports(run_code, env_for(src), 1, n=10_000))
        print(f"\nfedproto's own import cost in a run ({title}): modules a run imports after torch and numpy, "
              f"`python -X importtime -c \"import torch, numpy; {run_code}\"`; self times summed: {total:.0f} ms "
              f"(one run); the largest cumulative (median of {args.repeats}):\n")
        print("| module | cumulative ms | self ms |\n|---|---:|---:|")
        for name, cum, own in rows:
            print(f"| {name} | {cum:.1f} | {own:.1f} |")


if __name__ == "__main__":
    main()
