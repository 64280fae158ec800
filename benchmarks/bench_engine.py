"""Engine benchmark: every execution mode side by side, in one run.

For the default MNIST FedProto setting (20 clients, ways 3, shots 100, batch size 8) it measures
each mode's wall time per round (median over rounds after a warm-up round, and the fastest round in
parentheses: on machines whose speed jumps, it shows what each mode can do; each mode in its own
subprocess, the modes alternating ``--repeats`` times so that drift in the machine's speed hits
all alike), samples per second, the model's FLOP rate as a share of the machine's float32 matmul
rate (measured in the same run), peak memory, and the accuracy reached (so that every mode is
seen doing the same work). The modes:

* ``official-style``: one client after another, a ``DataLoader`` per client, batch size 8, a
  plain ``nn.Module`` (benchmarks/official_style.py; the official code's way of training);
* ``sequential``: fedproto's reference path (``--execution sequential``);
* ``batched``: the client-batched engine in one process (``--workers 1``);
* ``batched, N workers``: the batched engine on N processes (``--workers N``), each with
  threads / N torch threads;
* with ``--before SRC``: ``batched`` from another source tree (an earlier commit checked out
  with ``git worktree add``), for a before/after comparison in the same run.

Then the torch profiler's top entries for one round of the batched engine, and how time and
memory per round grow with the number of clients (ways 3, shots 5; 10,000 clients need
``overlap``: MNIST holds ~6,000 training samples per class).

    python benchmarks/bench_engine.py                       # full table (~10 minutes on 2 cores)
    python benchmarks/bench_engine.py --rounds 3 --repeats 1 --scale 100,1000
    python benchmarks/bench_engine.py --before /tmp/before/src --full-run

Needs MNIST (``FEDPROTO_DATA`` or ``--data-dir``). Absolute times depend on the machine and its
load; quote the ratios and the share of the matmul rate.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_args import positive

HERE = Path(__file__).resolve().parent


def matmul_gflops(n: int = 1024, reps: int = 20) -> float:
    """The machine's float32 matrix-multiply rate (GFLOP/s, median of ``reps`` n x n products)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(ts) / 1e9


def cnn_train_flops_per_sample(model) -> float:
    """Forward multiply-adds x 2 of the paper CNN (28x28 input), x 3 for forward + backward."""
    flops = 0
    c1, c2 = model.conv1, model.conv2
    k = model.kernel
    s1 = 28 - k + 1 + 2 * model.pad
    s2 = s1 // 2 - k + 1 + 2 * model.pad
    flops += 2 * s1 * s1 * c1.out_channels * c1.in_channels * k * k
    flops += 2 * s2 * s2 * c2.out_channels * c2.in_channels * k * k
    flops += 2 * model.fc1.in_features * model.fc1.out_features
    flops += 2 * model.fc2.in_features * model.fc2.out_features
    return 3.0 * flops


def _overrides(args) -> dict:
    ov = dict(dataset="mnist", data_dir=args.data_dir, clients=args.clients, ways=3, shots=args.shots,
              rounds=args.rounds + args.warmup, eval_every=0, seed=1, threads=args.threads or 0)
    if args.stdev is not None:
        ov["stdev"] = args.stdev
    if args.overlap:
        ov["overlap"] = True
    return ov


def worker(args) -> dict:
    """One mode in this process: the default setting for ``rounds`` + 1 rounds."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from fedproto.config.run_config import build_config
    from fedproto.models.cnn import PaperCNN
    from fedproto.simulation import Simulation, prepare

    ov = _overrides(args)
    flops = cnn_train_flops_per_sample(PaperCNN())
    if args.mode == "official-style":
        sys.path.insert(0, str(HERE))
        from official_style import official_round_times

        r = official_round_times({k: v for k, v in ov.items() if k != "rounds"}, args.rounds + 1, args.threads)
        times = r["round_times_s"][1:]
        med = statistics.median(times)
        return {"mode": args.mode, "round_s_median": med, "round_s_all": times,
                "train_samples": r["samples_per_round"], "samples_per_s": r["samples_per_round"] / med,
                "model_gflops": r["samples_per_round"] * flops / med / 1e9, "eval_s": None,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "acc_mean": r["accuracy"], "acc_proto_mean": None}
    ov["execution"] = "sequential" if args.mode == "sequential" else "batched"
    if args.workers:  # else the default (auto; an earlier version may not know the option)
        ov["workers"] = args.workers
    cfg = build_config(overrides=ov)
    t = time.perf_counter()
    store = {"off": False, "memory": True}.get(args.client_store, args.client_store)
    setup = prepare(cfg, progress=False, **({"client_store": store} if store else {}))
    setup_s = time.perf_counter() - t
    setup_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t_run = time.perf_counter()
    sim = Simulation(cfg, setup=setup, out=False)
    if args.profile:
        return {"profile": _profile(sim)}
    if args.skip_final_eval:  # the loop evaluates every client after the last round: not part of a round's cost
        sim.executor.evaluate = lambda messages: [{} for _ in range(sim.executor.num_clients)]
    cpu_s: list[float] = []  # this process's CPU seconds in each round's client training (load-proof)
    train = sim.executor.train_clients

    def timed_train(round, msgs):
        c = time.process_time()
        try:
            return train(round, msgs)
        finally:
            cpu_s.append(time.process_time() - c)

    sim.executor.train_clients = timed_train
    load_before = os.getloadavg()
    sim.run()
    load_after = os.getloadavg()
    times = [r["train_time_s"] for r in sim.history[args.warmup:]]  # drop the warm-up round (and the workers' start)
    med = statistics.median(times)
    n_samples = sum(len(d.x) for d in setup.data)
    eval_s = None
    if not args.no_eval:
        t = time.perf_counter()
        sim.evaluate()
        eval_s = time.perf_counter() - t
    return {
        "mode": args.mode, "clients": args.clients, "shots": args.shots, "setup_s": setup_s,
        "round_s_median": med, "round_s_all": times, "samples_per_s": n_samples / med,
        "train_samples": n_samples, "eval_s": eval_s, "model_gflops": n_samples * flops / med / 1e9,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "workers_peak_rss_mb": getattr(sim, "worker_peak_rss_mb", 0.0), "setup_rss_mb": setup_rss_mb,
        "store_bytes": _store_bytes(setup), "load_before": load_before, "load_after": load_after,
        "run_wall_s": time.perf_counter() - t_run, "round_cpu_s_all": cpu_s[args.warmup:],
        "round_cpu_s_median": statistics.median(cpu_s[args.warmup:]) if cpu_s[args.warmup:] else None,
        "acc_mean": sim.history[-1].get("acc_mean"), "acc_proto_mean": sim.history[-1].get("acc_proto_mean"),
    }


def _store_bytes(setup) -> int:
    """Bytes of the clients' ClientStore rows (0: one module per client)."""
    st = getattr(setup.states[0], "store", None)
    return st.nbytes if st is not None else 0


def _profile(sim, top: int = 10) -> list[dict]:
    """The torch profiler's top entries (self CPU time) over the rounds after the first."""
    from torch.profiler import profile

    sim.cfg = sim.cfg.model_copy(update={"rounds": 1})
    sim.run()  # warm-up round, outside the profile
    sim._ran = False
    sim.cfg = sim.cfg.model_copy(update={"rounds": 2})
    with profile() as p:
        sim.run()
    rows = sorted(p.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) or 1
    return [{"name": e.key, "share": e.self_cpu_time_total / total, "calls": e.count} for e in rows[:top]]


def run_worker(src: str | None = None, **kw) -> dict:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = str(Path(src).resolve())
    cmd = [sys.executable, __file__, "--worker"] + [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}")
                                                    for k, v in kw.items() if v is not None and v is not False]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode:
        sys.exit(f"error: the benchmark run {' '.join(cmd[2:])} failed (exit code {run.returncode}):\n"
                 f"{run.stderr.strip()[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def full_run(threads: int) -> float:
    """Wall seconds of ``fedproto run`` with every default (100 rounds), as a user starts it."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "fedproto", "run", "-q", "--out-dir", d, "--name", "full"]
        if threads:
            cmd += ["--threads", str(threads)]
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-eval", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="batched", help=argparse.SUPPRESS)  # the options of one measured run
    p.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--clients", type=int, default=20, help=argparse.SUPPRESS)
    p.add_argument("--shots", type=int, default=100, help=argparse.SUPPRESS)
    p.add_argument("--stdev", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--client-store", default="off", help="scaling runs: the clients' weights in one flat store "
                   "('memory'), in a file in this folder (a path), or one module per client ('off', the default); "
                   "fedproto.engine.client_store")
    p.add_argument("--warmup", type=int, choices=(0, 1), default=1, help="untimed rounds before the timed ones "
                   "(default 1; 0 for scaling rows too slow to run twice)")
    p.add_argument("--skip-final-eval", action="store_true", help="scaling runs: leave out the evaluation of every "
                   "client after the last round (at 100,000 clients it takes longer than the rounds)")
    p.add_argument("--rounds", type=positive, default=5, help="timed rounds after one warm-up round (default 5)")
    p.add_argument("--threads", type=int, default=0, help="threads of each run in all (default: every core)")
    p.add_argument("--repeats", type=positive, default=3, help="alternating runs per mode (default 3)")
    p.add_argument("--max-workers", type=int, default=0, help="largest worker count measured (default: threads)")
    p.add_argument("--before", default=None, help="source tree (its src/ folder) of an earlier version: adds "
                   "its batched mode to the table")
    p.add_argument("--no-official", action="store_true", help="skip the official-style loop")
    p.add_argument("--scale-only", action="store_true", help="only the scaling table")
    p.add_argument("--full-run", action="store_true", help="also time a full default `fedproto run`")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--scale", default="100,1000,10000", help="client counts for the scaling table ('' to skip)")
    p.add_argument("--json", default=None, help="also write all results to this file")
    args = p.parse_args()
    if args.before and not (Path(args.before) / "fedproto" / "__init__.py").is_file():
        p.error(f"--before {args.before}: no fedproto package there; give the src/ folder of the earlier checkout "
                "(e.g. /tmp/before/src)")  # else the installed fedproto would be measured as 'before'
    try:
        args.scale_clients = [int(x) for x in args.scale.split(",")] if args.scale else []
    except ValueError:
        p.error(f"--scale {args.scale!r}: give client counts separated by commas (e.g. 100,1000), or '' to skip")
    if any(m < 2 for m in args.scale_clients):
        p.error(f"--scale {args.scale!r}: each client count must be at least 2")
    if args.max_workers < 0:
        p.error(f"--max-workers {args.max_workers}: give 1 or more (0: every core)")
    if args.worker:
        print(json.dumps(worker(args)))
        return

    import torch

    from fedproto.engine.executors.worker_pool import available_cores

    cores = available_cores()
    threads = args.threads or cores
    torch.set_num_threads(threads)
    gf = matmul_gflops()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?") \
        if os.path.exists("/proc/cpuinfo") else "?"
    print(f"machine: {cpu}, {cores} cores; torch {torch.__version__}, {threads} thread{'s' if threads > 1 else ''}; "
          f"float32 matmul 1024^3: {gf:.1f} GFLOP/s (median of 20)")
    rows, prof, full = [], None, None
    if not args.scale_only:
        modes: list[tuple[str, dict]] = []
        if not args.no_official:
            modes.append(("official-style", dict(mode="official-style")))
        modes.append(("sequential", dict(mode="sequential")))
        if args.before:
            modes.append(("batched (before)", dict(mode="batched", src=args.before)))
        modes.append(("batched", dict(mode="batched", workers=1)))
        for w in range(2, min(args.max_workers or threads, threads) + 1):  # a process needs a thread
            modes.append((f"batched, {w} workers", dict(mode="batched", workers=w)))
        runs: dict[str, list[dict]] = {name: [] for name, _ in modes}
        for _ in range(args.repeats):
            for name, kw in modes:
                kw = dict(kw)
                src = kw.pop("src", None)
                runs[name].append(run_worker(src=src, clients=20, shots=100, rounds=args.rounds, data_dir=args.data_dir,
                                             threads=threads, **kw))
        rows = []
        for name, rs in runs.items():
            r = dict(rs[0], mode=name)
            r["round_s_all"] = [t for x in rs for t in x["round_s_all"]]
            r["round_s_median"] = statistics.median(r["round_s_all"])
            r["samples_per_s"] = r["train_samples"] / r["round_s_median"]
            r["model_gflops"] = rs[0]["model_gflops"] * rs[0]["round_s_median"] / r["round_s_median"]
            r["peak_rss_mb"] = max(x["peak_rss_mb"] for x in rs)
            rows.append(r)
        ref = {r["mode"]: r["round_s_median"] for r in rows}
        base = ref.get("batched (before)", ref["batched"])
        unit = "thread" if threads == 1 else "threads"
        print(f"\nDefault MNIST FedProto (20 clients, ways 3, shots 100, batch 8), {threads} {unit} per run, "
              f"median of {args.repeats} x {args.rounds} rounds (after 1 warm-up round each, modes alternating):")
        cols = ["official-style", "sequential", "batched (before)" if args.before else "batched"]
        print("| mode | s/round (fastest) | samples/s | " + " | ".join(f"speed-up over {c}" for c in cols if c in ref)
              + f" | model GFLOP/s | % of matmul | peak RSS MB | acc % after {args.rounds + 1} rounds |")
        print("|---" * (7 + sum(c in ref for c in cols)) + "|")
        for r in rows:
            ups = " | ".join(f"{ref[c] / r['round_s_median']:.2f}x" for c in cols if c in ref)
            wk = r.get("workers_peak_rss_mb")
            rss = f"{r['peak_rss_mb']:.0f}" + (f" + {wk:.0f}" if wk else "")
            fastest = min(r["round_s_all"])
            print(f"| {r['mode']} | {r['round_s_median']:.3f} ({fastest:.3f}) | {r['samples_per_s']:.0f} | {ups} | "
                  f"{r['model_gflops']:.2f} | {100 * r['model_gflops'] / gf:.1f}% | {rss} | "
                  f"{100 * r['acc_mean']:.2f} |")
        best = min((r for r in rows if r["mode"].startswith("batched") and "before" not in r["mode"]),
                   key=lambda r: r["round_s_median"])
        print(f"\nfastest batched mode: {best['mode']}, {base / best['round_s_median']:.2f}x "
              f"{'the earlier version' if args.before else 'the one-process batched engine'}")

        prof = run_worker(mode="batched", workers=1, clients=20, shots=100, rounds=1, data_dir=args.data_dir,
                          threads=threads, profile=True)["profile"]
        print("\nWhere a round of the batched engine spends its time (torch profiler, self CPU, one process):")
        print("| op | share | calls |\n|---|---|---|")
        for e in prof:
            print(f"| {e['name']} | {100 * e['share']:.1f}% | {e['calls']} |")

        full = None
        if args.full_run:
            full = full_run(args.threads)
            print(f"\nfull default `fedproto run` (100 rounds, evaluation every 10): {full:.1f} s wall "
                  f"(float32 matmul {gf:.0f} GFLOP/s on this machine)")

    scale = []
    if args.scale:
        W = min(args.max_workers or threads, threads)
        sizes = args.scale_clients
        shared = "; runs over 3,333 clients share samples: --overlap" if max(sizes) * 15 > 50_000 else ""
        print(f"\nScaling (batched, {W} process{'es' if W > 1 else ''}, ways 3, shots 5, stdev 0{shared}), median of "
              "the timed rounds:")
        store = {"off": "one module per client", "memory": "ClientStore in memory"}.get(
            args.client_store, f"ClientStore in a file in {args.client_store}")
        print(f"clients' weights: {store}{'; no final evaluation' if args.skip_final_eval else ''}")
        print("| clients | train samples | s/round | s/round per 1,000 clients | peak RSS MB (main + largest "
              "worker) | peak RSS MB after set-up | store MB | load average (1 min) before/after | s of each "
              "timed round | CPU s/round (main process) | CPU s/round per 1,000 clients |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for m in sizes:
            r = run_worker(mode="batched", clients=m, shots=5, stdev=0, rounds=max(2, args.rounds) if args.warmup
                           else args.rounds, warmup=args.warmup,
                           overlap=m * 15 > 50_000, data_dir=args.data_dir, threads=threads, workers=W,
                           no_eval=True, client_store=args.client_store if args.client_store != "off" else None,
                           skip_final_eval=args.skip_final_eval)
            scale.append(r)
            load = "/".join(f"{x:.1f}" for x in (*r["load_before"][:1], *r["load_after"][:1]))
            print(f"| {m} | {r['train_samples']} | {r['round_s_median']:.3f} | "
                  f"{1000 * r['round_s_median'] / m:.3f} | {r['peak_rss_mb']:.0f} + {r['workers_peak_rss_mb']:.0f} | "
                  f"{r['setup_rss_mb']:.0f} | {r['store_bytes'] / 1e6:.0f} | {load} | "
                  f"{' '.join(f'{x:.1f}' for x in r['round_s_all'])} | {r['round_cpu_s_median']:.1f} | "
                  f"{1000 * r['round_cpu_s_median'] / m:.3f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"matmul_gflops": gf, "modes": rows, "profile": prof, "full_run_s": full, "scale": scale}, f,
                      indent=2)


if __name__ == "__main__":
    main()
