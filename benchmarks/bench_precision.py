"""Reduced precision (``--precision``): speed in alternating pairs of whole processes, and accuracy
over seeds, for fp32 against bf16 (issue 45, item 1).

Speed: ``fedproto run --rounds R --threads 1 --precision P`` for P in the compared precisions,
alternating (bf16, fp32, bf16, fp32...) ``--pairs`` times, each a whole process (import, data,
set-up, training, evaluation, files), with the wall time, the process's CPU time (user + system,
from ``getrusage`` of the child) and ``/proc/loadavg`` before and after each run; medians per
precision and the median of the per-pair ratios. On a machine others share, the CPU time is the
steadier figure (wall time counts the time the run waits for a core).

Accuracy: ``fedproto run --rounds R --seed S --threads 1 --precision P`` for each seed, the final
mean accuracy over clients (``summary.json``'s ``accuracy.acc.mean``, the classifier's) and the
nearest-prototype one, their mean and spread (max - min) over seeds per precision.

    python benchmarks/bench_precision.py speed --pairs 3 --rounds 20
    python benchmarks/bench_precision.py step --pairs 20       # one training step, in-process
    python benchmarks/bench_precision.py accuracy --rounds 100 --seeds 1,2,3
    python benchmarks/bench_precision.py accuracy --rounds 20 --seeds 1234,1235,1236 --extra="--model cnn-mh"

Step: one training step of the batched engine on the paper CNN (20 clients, batch 8, MNIST-sized
inputs, the default dropout's masks: the grouped forward under :func:`fedproto.training.devices.autocast_call`,
the losses, the gradients), in-process on one thread, blocks of 50 steps alternating between the
precisions ``--pairs`` times; the median and the fastest block per precision (on a loaded machine
the fastest block shows what the core does when the run has it).

Writes the raw rows and the summary as JSON (``--out``, default ``precision_<mode>.json``) and
prints them. Needs MNIST (``FEDPROTO_DATA``). Runs every command with ``--threads 1`` and
``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_args import positive


def loadavg() -> str:
    """The machine's 1, 5 and 15-minute load averages (``/proc/loadavg``), or '' where there is none."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return ""


def run_once(precision: str, rounds: int, seed: int | None, extra: list[str], out_dir: str) -> dict:
    """One whole ``fedproto run`` process; returns its wall and CPU seconds, the load around it and
    its summary's accuracy and precision."""
    cmd = [sys.executable, "-m", "fedproto", "run", "--rounds", str(rounds), "--threads", "1",
           "--precision", precision, "--out-dir", out_dir, *extra]
    name = f"p-{precision}-r{rounds}-s{seed}-{time.monotonic_ns()}"
    cmd += ["--name", name]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = loadavg()
    t0 = time.perf_counter()
    pid = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err = pid.communicate()
    wall = time.perf_counter() - t0
    if pid.returncode != 0:
        raise SystemExit(f"fedproto run failed ({shlex.join(cmd)}):\n{err[-2000:]}")
    summary = json.loads((Path(out_dir) / name / "summary.json").read_text())
    acc = summary["accuracy"]
    return {"precision": precision, "precision_used": summary.get("precision"), "seed": seed, "rounds": rounds,
            "wall_s": round(wall, 3), "run_wall_s": round(summary["wall_time_s"], 3),
            "acc": acc["acc"]["mean"], "acc_proto": acc.get("acc_proto", {}).get("mean"),
            "load_before": before, "load_after": loadavg(), "command": shlex.join(cmd[1:])}


def timed(precision: str, rounds: int, extra: list[str], out_dir: str) -> dict:
    """:func:`run_once` with the child's CPU time (user + system) from ``getrusage``."""
    import resource

    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = run_once(precision, rounds, None, extra, out_dir)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    row["cpu_s"] = round((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), 3)
    return row


def speed(args, extra: list[str], out_dir: str) -> dict:
    rows = []
    for i in range(args.pairs):
        for p in args.precisions:
            row = timed(p, args.rounds, extra, out_dir)
            row["pair"] = i + 1
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"mode": "speed", "rounds": args.rounds, "pairs": args.pairs, "rows": rows, "median": {}}
    for p in args.precisions:
        mine = [r for r in rows if r["precision"] == p]
        out["median"][p] = {k: statistics.median(r[k] for r in mine) for k in ("wall_s", "cpu_s", "run_wall_s")}
    a, b = args.precisions[0], args.precisions[-1]
    for k in ("wall_s", "cpu_s", "run_wall_s"):
        def of(i, p, k=k):
            return next(r for r in rows if r["pair"] == i and r["precision"] == p)[k]

        ratios = [of(i, b) / of(i, a) for i in range(1, args.pairs + 1)]
        out[f"ratio_{b}_over_{a}_{k}"] = {"per_pair": [round(x, 3) for x in ratios],
                                          "median": statistics.median(ratios)}
    return out


def accuracy(args, extra: list[str], out_dir: str) -> dict:
    rows = []
    for s in args.seeds:
        for p in args.precisions:
            row = run_once(p, args.rounds, s, extra, out_dir)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"mode": "accuracy", "rounds": args.rounds, "seeds": args.seeds, "rows": rows, "by_precision": {}}
    for p in args.precisions:
        mine = [r for r in rows if r["precision"] == p]
        entry = {}
        for k in ("acc", "acc_proto"):
            v = [r[k] for r in mine if r[k] is not None]
            if v:
                entry[k] = {"mean": statistics.mean(v), "min": min(v), "max": max(v), "spread": max(v) - min(v),
                            "per_seed": v}
        out["by_precision"][p] = entry
    return out


def step(args) -> dict:
    import torch
    import torch.nn.functional as F

    from fedproto.models.cnn import PaperCNN
    from fedproto.training.devices import autocast_call

    torch.set_num_threads(1)
    torch.manual_seed(0)
    G, B = 20, 8
    model = PaperCNN()
    P = {k: torch.stack([p.detach()] * G).clone().requires_grad_(True) for k, p in model.named_parameters()}
    xb = torch.randn(B, G, 28, 28).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (G, B))
    noise = {k: torch.bernoulli(torch.full((G, B, w), 0.5)) * 2 for k, w in model.noise_widths().items()}  # dropout

    def one(p):
        logits, h = autocast_call(p, "cpu", model.grouped_forward, P, xb, G, noise)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) + 0.01 * h.square().mean()
        torch.autograd.grad(loss, list(P.values()))

    for p in args.precisions:
        for _ in range(10):
            one(p)
    rows = []
    for i in range(args.pairs):
        for p in args.precisions:
            t = time.perf_counter()
            for _ in range(50):
                one(p)
            rows.append({"pair": i + 1, "precision": p, "ms_per_step": (time.perf_counter() - t) / 50 * 1e3,
                         "load": loadavg()})
    out = {"mode": "step", "clients": G, "batch": B, "pairs": args.pairs, "rows": rows, "load_end": loadavg(),
           "by_precision": {}}
    for p in args.precisions:
        v = [r["ms_per_step"] for r in rows if r["precision"] == p]
        out["by_precision"][p] = {"median_ms": statistics.median(v), "fastest_ms": min(v)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("speed", "accuracy", "step"))
    ap.add_argument("--rounds", type=positive, default=None, help="rounds per run (speed: 20, accuracy: 100)")
    ap.add_argument("--pairs", type=positive, default=3, help="speed: alternating pairs")
    ap.add_argument("--seeds", default="1,2,3", help="accuracy: seeds separated by commas")
    ap.add_argument("--precisions", default="bf16,fp32", help="precisions compared, in the order each pair runs them")
    ap.add_argument("--extra", default="", help="more fedproto run flags, as one string")
    ap.add_argument("--out", default=None, help="JSON file to write (default: precision_<mode>.json)")
    args = ap.parse_args()
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: give whole numbers separated by commas")
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    bad = [p for p in args.precisions if p not in ("fp32", "bf16", "fp16", "auto")]
    if bad or not args.precisions:
        ap.error(f"--precisions {bad or args.precisions!r}: use fp32, bf16, fp16 or auto, separated by commas")
    args.rounds = args.rounds or (20 if args.mode == "speed" else 100)
    extra = shlex.split(args.extra)
    if args.mode == "step":
        res = step(args)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-precision-") as out_dir:
            res = speed(args, extra, out_dir) if args.mode == "speed" else accuracy(args, extra, out_dir)
    res["extra"] = extra
    path = Path(args.out or f"precision_{args.mode}.json")
    path.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
