"""Paired wall and CPU time of the official FedProto code and ``fedproto run``, whole processes.

Each pair runs the official code (through ``benchmarks/official_shim.py``, MNIST, its defaults
but batch 8) and then ``fedproto run`` (the paper's default MNIST setting), both for the same
number of rounds on the same thread count, one process after the other; the pairs repeat. The
table gives each process's wall and CPU seconds (``os.wait4``: user + system of the child) with the
load average read just before it, then the medians and their ratios. Beside each ``fedproto run``:
the model's training rate (GFLOP/s over the run's own ``train_time_s``) and its share of the
machine's float32 matmul rate, measured right after it with the same threads.

Usage::

    FEDPROTO_DATA=/path/to/data OMP_NUM_THREADS=1 python benchmarks/bench_official.py \\
        --official /path/to/FedProto --pairs 3 --rounds 20 --threads 1
    python benchmarks/bench_official.py --share-only --pairs 3 --rounds 20 --threads 1
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

from bench_args import positive

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


def model_share(run_dir: Path, threads: int) -> tuple[float, float]:
    """The model's training rate in a finished ``fedproto run`` folder (GFLOP/s: rounds x training
    samples x the paper CNN's FLOPs per sample over the run's ``train_time_s``) and the machine's
    float32 matmul rate measured now in a fresh process with the same threads (GFLOP/s)."""
    import csv
    import json

    from bench_engine import cnn_train_flops_per_sample

    from fedproto.models.cnn import PaperCNN

    summary = json.loads((run_dir / "summary.json").read_text())
    with open(run_dir / "clients.csv") as f:
        rows = list(csv.DictReader(f))
    rounds = max(int(r["rounds_trained"]) for r in rows)
    samples = sum(int(r["train_samples"]) for r in rows)
    model = rounds * samples * cnn_train_flops_per_sample(PaperCNN()) / summary["train_time_s"] / 1e9
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import torch; torch.set_num_threads({threads}); "
            "from bench_engine import matmul_gflops; print(matmul_gflops())")
    rate = float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                text=True).stdout.split()[-1])
    return model, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--official", type=Path, default=None, help="checkout or bare git dir of the official code")
    parser.add_argument("--pairs", type=positive, default=3, help="official/fedproto pairs (default 3)")
    parser.add_argument("--rounds", type=positive, default=20, help="rounds of each run (default 20)")
    parser.add_argument("--threads", type=positive, default=1, help="torch threads of each run (default 1)")
    parser.add_argument("--share-only", action="store_true", help="fedproto runs and the matmul share only")
    args = parser.parse_args()
    if args.official is None and not args.share_only:
        parser.error("--official is required (a checkout or bare git dir of github.com/yuetan031/FedProto)")
    source = str(args.official.resolve()) if args.official else ""
    official = [sys.executable, str(HERE / "official_shim.py"), "--official", source,
                "--threads", str(args.threads), "--", "--rounds", str(args.rounds), "--local_bs", "8"]
    times: dict[str, list[tuple[float, float, str]]] = {"official": [], "fedproto": []}
    shares: list[float] = []
    print("| pair | process | wall s | CPU s | load average (1 min) before |\n|---|---|--:|--:|--:|")
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(1, args.pairs + 1):
            ours = [sys.executable, "-m", "fedproto", "run", "--rounds", str(args.rounds), "--eval-every", "0",
                    "--threads", str(args.threads), "--out-dir", str(Path(tmp) / f"run{pair}")]
            for name, cmd in (("official", official), ("fedproto", ours)):
                if name == "official" and args.share_only:
                    continue
                wall, cpu, load = _timed(cmd, tmp)
                times[name].append((wall, cpu, load))
                note = ""
                if name == "fedproto":
                    model, rate = model_share(next((Path(tmp) / f"run{pair}").iterdir()), args.threads)
                    shares.append(model / rate)
                    note = f" (model {model:.1f} GFLOP/s in training, matmul {rate:.1f} GFLOP/s: {model / rate:.1%})"
                print(f"| {pair} | {name} | {wall:.1f} | {cpu:.1f} | {load} |{note}", flush=True)
    if shares:
        print(f"\nthe model's share of the matmul rate (fedproto's training): median {statistics.median(shares):.1%}")
    if args.share_only:
        return
    med = {k: (statistics.median(w for w, _, _ in v), statistics.median(c for _, c, _ in v)) for k, v in times.items()}
    (ow, oc), (fw, fc) = med["official"], med["fedproto"]
    print(f"\nmedians: official {ow:.1f} s wall / {oc:.1f} s CPU; fedproto {fw:.1f} s wall / {fc:.1f} s CPU; "
          f"ratio {ow / fw:.2f}x wall, {oc / fc:.2f}x CPU")


if __name__ == "__main__":
    main()
