"""Sequential against batched training for models without a hand-written batched forward:
the generic path (:func:`fedproto.training.train_group_generic`: grouped operations for CNNs of
standard layers, ``torch.func`` ``functional_call`` + ``vmap`` for the others) in one run, s/round per mode.

Cases:

* ``two-cnn``: the guide's two-CNN CIFAR-10 federation (examples/own_federation.py's ``CNN``, widths
  32 and 16, ``embedding_dim=128``, 10 clients, Dirichlet alpha 0.1 over 10% of the training split,
  batch size 32, momentum 0.9);
* ``projcnn``: a heterogeneous ProjectedCNN family on MNIST (``projcnn:16-32,projcnn:32-64``, 20
  clients, ways 3, shots 100, batch size 8);
* ``resnet18``: ResNet18 (BatchNorm) on CIFAR-10, 20 clients, ways 3, ``--resnet-shots`` shots, one
  round (the round is the timed one: no warm-up round).

Each case runs its modes one after the other in this process, fresh models each time (same seeds); a mode's
figure is the median CPU time (``time.process_time``, all the process's threads) of a round's training
after the first round (a warm-up); the wall-clock ``train_time_s`` is printed beside it, and the load
average: on a shared machine CPU time is the steadier measure. Needs
``FEDPROTO_DATA`` with mnist/ and cifar10/.

    python benchmarks/bench_models.py --threads 1
    python benchmarks/bench_models.py --threads 1 --cases two-cnn,projcnn --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

MODES = ("sequential", "batched")


def two_cnn(mode: str, rounds: int, threads: int):
    """examples/own_federation.py's federation on CIFAR-10 (its models and options)."""
    import numpy as np
    import torch
    from own_federation import CNN

    from fedproto.data import load_dataset
    from fedproto.data.partition import dirichlet_partition
    from fedproto.federation import Client, federate

    torch.manual_seed(0)
    ds = load_dataset("cifar10")
    keep = np.random.default_rng(0).permutation(len(ds.train_y))[: int(0.1 * len(ds.train_y))]
    part = dirichlet_partition(ds.train_y[keep].numpy(), ds.test_y.numpy(), num_classes=10, num_clients=10,
                               alpha=0.1, min_samples=20, test_shots=40, seed=0)
    clients = []
    for i, (tr_i, te_i) in enumerate(zip(part.train_idx, part.test_idx)):
        tr, te = torch.as_tensor(keep[tr_i]), torch.as_tensor(te_i)
        clients.append(Client(CNN(3, width=32 if i < 5 else 16), (ds.train_x[tr], ds.train_y[tr]),
                              (ds.test_x[te], ds.test_y[te]), embedding_dim=128))
    return federate(clients, dataset="cifar10", rounds=rounds, batch_size=32, lr=0.01, momentum=0.9, out=False,
                    eval_every=0, threads=threads, execution=mode)


def from_config(overrides: dict):
    def build(mode: str, rounds: int, threads: int):
        from fedproto.config.run_config import build_config
        from fedproto.simulation import Simulation

        cfg = build_config(overrides={**overrides, "rounds": rounds, "eval_every": 0, "threads": threads,
                                      "execution": mode})
        return Simulation(cfg, out=False)
    return build


def cases(resnet_shots: int) -> dict:
    return {
        "two-cnn": ("two-CNN CIFAR-10 federation (own_federation.py, 10 clients, batch 32)", two_cnn, None),
        "projcnn": ("projcnn:16-32,projcnn:32-64 on MNIST (20 clients, ways 3, shots 100, batch 8)",
                    from_config(dict(dataset="mnist", model="projcnn:16-32,projcnn:32-64", clients=20)), None),
        "resnet18": (f"ResNet18 on CIFAR-10 (20 clients, ways 3, shots {resnet_shots}, batch 8), one round",
                     from_config(dict(dataset="cifar10", model="resnet18", clients=20, ways=3,
                                      shots=resnet_shots)), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run (1 on a shared machine)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per run; the first is a warm-up (not resnet18)")
    ap.add_argument("--cases", default="two-cnn,projcnn,resnet18")
    ap.add_argument("--resnet-shots", type=int, default=25, help="training samples per class of a ResNet18 client")
    ap.add_argument("--profile", action="store_true", help="also print each mode's top operations (torch profiler, "
                    "self CPU) in a run of one more round")
    a = ap.parse_args()
    import torch

    import fedproto.engine.executors.batched as batched
    from fedproto.engine.executors.in_process import LocalExecutor

    groups: list[int] = []
    orig = batched.train_group_generic

    def counting(models, *args, **kw):
        groups.append(len(models))
        return orig(models, *args, **kw)

    batched.train_group_generic = counting
    cpu: list[float] = []  # CPU seconds of each round's training (all the process's threads)
    for cls in (LocalExecutor, batched.BatchedExecutor):
        def timed(self, *args, _f=cls.train_clients, **kw):
            t = time.process_time()
            out = _f(self, *args, **kw)
            cpu.append(time.process_time() - t)
            return out
        cls.train_clients = timed
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {a.threads} thread(s) per run; load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} (1/5/15 min) on {os.cpu_count()} cores")
    rows = []
    for name in a.cases.split(","):
        title, build, rounds = cases(a.resnet_shots)[name]
        rounds = rounds or a.rounds
        times, walls = {}, {}
        for mode in MODES:
            groups.clear()
            cpu.clear()
            t = time.perf_counter()
            sim = build(mode, rounds, a.threads)
            summary = sim.run()
            wall = time.perf_counter() - t
            per_round = [r["train_time_s"] for r in sim.history]
            timed_cpu = cpu[1:] or cpu
            times[mode] = statistics.median(timed_cpu)
            walls[mode] = statistics.median(per_round[1:] or per_round)
            acc = summary["accuracy"]["acc"]["mean"] if summary.get("accuracy") else float("nan")
            print(f"  {name} {mode}: CPU {[round(x, 2) for x in cpu]} s, wall {[round(x, 2) for x in per_round]} s "
                  f"(all: {wall:.1f} s), generic groups {sorted(groups)[:8]}{'...' if len(groups) > 8 else ''}, "
                  f"acc {100 * acc:.2f} %", flush=True)
            if a.profile:
                profile_round(build(mode, 1, a.threads))
        load = os.getloadavg()
        rows.append((title, times["sequential"], times["batched"], walls["sequential"], walls["batched"],
                     len(timed_cpu), f"{load[0]:.1f}"))
    print("\n| case | sequential CPU s/round | batched CPU s/round | speed-up | wall s/round (seq / batched) "
          "| timed rounds | load average |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for title, s, b, ws, wb, n, ld in rows:
        print(f"| {title} | {s:.3f} | {b:.3f} | {s / b:.2f}x | {ws:.2f} / {wb:.2f} | {n} | {ld} |")


def profile_round(sim) -> None:
    """The top operations (self CPU) of the one-round run ``sim``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sim.run()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))


if __name__ == "__main__":
    main()
