"""The comparison table of the use-case examples (keyboard_prediction.py, sensor_maintenance.py,
hospital_records.py): each method over several seeds on the same clients, as a Markdown table.

``compare(runs, num_classes, seeds, **options)`` builds the clients anew for every run
(``make_clients(seed)``: a list of fedproto.federation.Client), trains each method with
fedproto.federation.federate and prints one row per entry of ``runs`` ((label, method,
make_clients)): the mean ± standard deviation over the seeds of the clients' mean test accuracy
(each client's own model on its own test set, the personal protocol), and the median wall time
of one run. The load average of the machine is
printed beside it (wall times depend on it).
"""

from __future__ import annotations

import os
import statistics
import time

from fedproto.errors import FedprotoError
from fedproto.federation import federate

NAMES = {"fedproto": "FedProto", "local": "Local", "fd": "FD", "fedavg": "FedAvg"}
"""The methods' names as the tables print them."""


def _positive(text: str) -> int:
    """argparse type: a whole number >= 1 (argparse prints ``error:`` and exits 2 otherwise)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give 1 or more")
    return value


def add_arguments(parser, rounds: int) -> None:
    """The options every use-case script takes (bad values: argparse's ``error:`` line, exit 2, before any run)."""
    parser.add_argument("--rounds", type=_positive, default=rounds, help="communication rounds")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="one run per seed and method")
    parser.add_argument("--methods", nargs="+", default=["fedproto", "local", "fd"], choices=sorted(NAMES),
                        help="fedproto, local, fd (and fedavg where the models allow)")
    parser.add_argument("--threads", type=_positive, default=1, help="CPU threads of each run")


def compare(runs, num_classes: int, seeds, *, title: str, **options) -> list[dict]:
    """Run every entry of ``runs`` on the clients of every seed; print and return the table's rows.

    Args:
        runs: (label, algorithm name, make_clients) per row; make_clients: seed -> list of Client
            (the split and the models' initial weights follow the seed). A method whose set-up
            refuses the clients' models gets a row saying so (its message names the methods that
            run them).
        num_classes: C. seeds: run seeds.
        title: the table's caption. options: run options for federate (rounds, lr, ...).
    Returns:
        One dict per row: label, mean, std (accuracy in %), seconds (median wall time), or refused.
    """
    rows = []
    for label, method, make_clients in runs:
        accs, secs, refused = [], [], None
        for seed in seeds:
            t0 = time.perf_counter()
            try:
                sim = federate(make_clients(seed), num_classes, algorithm=method, seed=seed, out=False, eval_every=0,
                               **options)
            except FedprotoError as e:
                refused = str(e)
                break
            summary = sim.run()
            secs.append(time.perf_counter() - t0)
            accs.append(100 * summary["accuracy"]["acc"]["mean"])
        if refused:
            rows.append({"label": label, "refused": refused})
            continue
        rows.append({"label": label, "mean": statistics.fmean(accs),
                     "std": statistics.stdev(accs) if len(accs) > 1 else 0.0, "seconds": statistics.median(secs)})
    load = " ".join(open("/proc/loadavg").read().split()[:3]) if os.path.exists("/proc/loadavg") else "n/a"
    print(f"\n{title}; {len(seeds)} seeds ({', '.join(map(str, seeds))}), {options.get('rounds')} rounds, "
          f"load average {load}\n")
    print("| method | accuracy % (mean ± std over seeds) | wall time per run (median) |")
    print("| --- | --- | --- |")
    for r in rows:
        name = r["label"]
        if "refused" in r:
            runs_them = r["refused"].split("as they are: ")[-1] if "as they are: " in r["refused"] else ""
            why = r["refused"].split(",")[0].split(";")[0]
            also = f"; these models run with {runs_them}" if runs_them else ""
            print(f"| {name} | refused ({why[:90]}){also} | |")
        else:
            print(f"| {name} | {r['mean']:.1f} ± {r['std']:.1f} | {r['seconds']:.1f} s |")
    return rows
