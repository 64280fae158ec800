"""Engine benchmark (issue: client-batched execution).

Measures, in one run, for the default MNIST FedProto setting (20 clients, ways 3, shots 100,
batch size 8) and each execution mode: wall time per round (median over rounds after a warm-up
round), training samples per second, evaluation time and peak memory (each mode in its own
subprocess so peaks do not mix); the machine's float32 matrix-multiply rate in the same run, so
the model's achieved FLOP rate is stated as a fraction of it; and how time and memory per round
grow with the number of clients (ways 3, shots 10).

    python benchmarks/bench_engine.py                 # full table (a few minutes on 2 cores)
    python benchmarks/bench_engine.py --rounds 3 --scale 100,300,1000

Needs MNIST (``FEDPROTO_DATA`` or ``--data-dir``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def matmul_gflops(n: int = 1024, reps: int = 20) -> float:
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


def worker(args) -> dict:
    import torch

    from fedproto.config import build_config
    from fedproto.simulation import Simulation, prepare

    torch.set_num_threads(args.threads) if args.threads else None
    cfg = build_config(overrides=dict(
        dataset="mnist", data_dir=args.data_dir, clients=args.clients, ways=3, shots=args.shots,
        rounds=args.rounds + 1, execution=args.mode, eval_every=0, seed=1,
    ))
    setup = prepare(cfg, progress=False)
    sim = Simulation(cfg, setup=setup, out=False)
    sim.run()
    times = [r["train_time_s"] for r in sim.history[1:]]  # drop the warm-up round
    med = statistics.median(times)
    n_samples = sum(len(d.x) for d in setup.data)
    t = time.perf_counter()
    sim.evaluate()
    eval_s = time.perf_counter() - t
    flops = cnn_train_flops_per_sample(setup.states[0].model)
    return {
        "mode": args.mode, "clients": args.clients, "shots": args.shots,
        "round_s_median": med, "round_s_all": times, "samples_per_s": n_samples / med,
        "train_samples": n_samples, "eval_s": eval_s, "model_gflops": n_samples * flops / med / 1e9,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "acc_mean": sim.history[-1].get("acc_mean"), "acc_proto_mean": sim.history[-1].get("acc_proto_mean"),
    }


def run_worker(**kw) -> dict:
    cmd = [sys.executable, __file__, "--worker"] + [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()
                                                    if v is not None]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="batched")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--shots", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="alternating runs per mode (default 2)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--scale", default="100,300,1000", help="client counts for the scaling table ('' to skip)")
    p.add_argument("--json", default=None, help="also write all results to this file")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    import torch

    if args.threads:  # the workers use this many threads: measure the reference matmul rate alike
        torch.set_num_threads(args.threads)
    gf = matmul_gflops()
    print(f"machine: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"float32 matmul 1024^3: {gf:.1f} GFLOP/s (median of 20)")
    # the modes alternate (seq, batched, seq, batched, ...) so that drift in the machine's speed
    # hits both alike; each mode's figure is the median over all its timed rounds
    runs: dict[str, list[dict]] = {"sequential": [], "batched": []}
    for _ in range(args.repeats):
        for m in runs:
            runs[m].append(run_worker(mode=m, clients=20, shots=100, rounds=args.rounds, data_dir=args.data_dir,
                                      threads=args.threads or None))
    rows = []
    for rs in runs.values():
        r = dict(rs[0])
        r["round_s_all"] = [t for x in rs for t in x["round_s_all"]]
        r["round_s_median"] = statistics.median(r["round_s_all"])
        r["samples_per_s"] = r["train_samples"] / r["round_s_median"]
        r["model_gflops"] = rs[0]["model_gflops"] * rs[0]["round_s_median"] / r["round_s_median"]
        r["eval_s"] = statistics.median(x["eval_s"] for x in rs)
        r["peak_rss_mb"] = max(x["peak_rss_mb"] for x in rs)
        rows.append(r)
    seq = rows[0]["round_s_median"]
    print("\nDefault MNIST FedProto (20 clients, ways 3, shots 100, batch 8), median of "
          f"{args.repeats} x {args.rounds} rounds (each run after 1 warm-up round, modes alternating):")
    print("| mode | s/round | samples/s | speed-up | model GFLOP/s | % of matmul | eval s | peak RSS MB "
          f"| acc % after {args.rounds + 1} rounds (classifier / prototype) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['round_s_median']:.3f} | {r['samples_per_s']:.0f} | "
              f"{seq / r['round_s_median']:.2f}x | {r['model_gflops']:.2f} | {100 * r['model_gflops'] / gf:.1f}% | "
              f"{r['eval_s']:.3f} | {r['peak_rss_mb']:.0f} | "
              f"{100 * r['acc_mean']:.4f} / {100 * r['acc_proto_mean']:.4f} |")
    scale = []
    if args.scale:
        print("\nScaling (batched, ways 3, shots 10):")
        print("| clients | train samples | s/round | s/round per 100 clients | peak RSS MB |")
        print("|---|---|---|---|---|")
        for m in [int(x) for x in args.scale.split(",")]:
            r = run_worker(mode="batched", clients=m, shots=10, rounds=max(2, args.rounds // 2),
                           data_dir=args.data_dir, threads=args.threads or None)
            scale.append(r)
            print(f"| {m} | {r['train_samples']} | {r['round_s_median']:.3f} | "
                  f"{100 * r['round_s_median'] / m:.3f} | {r['peak_rss_mb']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"matmul_gflops": gf, "modes": rows, "scale": scale}, f, indent=2)


if __name__ == "__main__":
    main()
