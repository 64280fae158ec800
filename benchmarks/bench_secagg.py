"""What secure aggregation costs per round: bytes and seconds, with and without ``secagg``.

The simulator runs the protocol's code (fedproto.secagg: the same client and server steps a Flower
deployment runs), so the protocol's bytes and its seconds of key agreement, secret sharing and
masking are those of a deployment, without the transport. For 3 and 20 digits clients (FedProto,
``aggregation`` mean; ``--clients`` and ``--neighbours`` choose others) it runs ``--rounds`` rounds
plain and under ``secagg`` and prints, per
setting: the median per round of the uplink and downlink bytes (``up_bytes``, ``down_bytes``:
what the round loop counts, under secagg the masked vectors and the downlink with the shares
routed to each client), of the protocol's other bytes (``secagg_bytes``: public keys, encrypted
shares, unmask messages), of the round's seconds (``train_time_s``) and of the protocol's own
seconds (``secagg_s``), the final accuracies (equal within the fixed-point error) and the load
average (``os.getloadavg``) before and after each run.

    OMP_NUM_THREADS=1 FEDPROTO_DATA=... python benchmarks/bench_secagg.py --rounds 5 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from bench_args import positive


def run(clients: int, secagg: bool, rounds: int, neighbours: int = 0, shots: int | None = None,
        minimum: int = 2) -> dict:
    from fedproto.config.run_config import build_config
    from fedproto.simulation import Simulation

    cfg = build_config(overrides=dict(dataset="digits", clients=clients, rounds=rounds, threads=1, secagg=secagg,
                                      execution="sequential", eval_every=0, secagg_neighbours=neighbours,
                                      secagg_min_contributors=minimum,
                                      **({"shots": shots} if shots else {})))
    load = os.getloadavg()[0]
    sim = Simulation(cfg, out=False)
    summary = sim.run()
    h = sim.history
    med = {k: statistics.median(r.get(k, 0) for r in h) for k in ("up_bytes", "down_bytes", "secagg_bytes",
                                                                   "train_time_s", "secagg_s")}
    return {"clients": clients, "secagg": secagg, "neighbours": neighbours if secagg else "", **med,
            "acc": summary["accuracy"]["acc"]["mean"],
            "acc_proto": summary["accuracy"]["acc_proto"]["mean"], "load_before": load,
            "load_after": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=positive, default=5, help="rounds per run (default 5)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--clients", default="3,20", help="comma-separated client counts (default 3,20)")
    ap.add_argument("--neighbours", default="0", help="secagg_neighbours per client count, comma-separated, or one "
                    "value for all (default 0: every client shares with all; e.g. 0,0,20 for --clients 3,20,100)")
    ap.add_argument("--shots", type=positive, default=None, help="shots per class (default: the dataset's; digits "
                    "fits 100 clients with --shots 2)")
    ap.add_argument("--min-contributors", type=positive, default=2, help="secagg_min_contributors (default 2; 1: "
                    "one mask group, no per-class seeds)")
    args = ap.parse_args()
    counts = [int(x) for x in args.clients.split(",")]
    nb = [int(x) for x in args.neighbours.split(",")]
    nb = nb * len(counts) if len(nb) == 1 else nb
    if len(nb) != len(counts):
        ap.error(f"--neighbours {args.neighbours!r} gives {len(nb)} values for {len(counts)} client counts")
    rows = [run(n, s, args.rounds, k, args.shots, args.min_contributors)
            for n, k in zip(counts, nb, strict=True) for s in (False, True)]
    print(f"{'clients':>7} {'secagg':>6} {'nbrs':>4} {'up B':>9} {'down B':>9} {'protocol B':>11} {'round s':>8} "
          f"{'protocol s':>10} {'acc':>7} {'acc_proto':>9} {'load':>10}")
    for r in rows:
        print(f"{r['clients']:>7} {str(r['secagg']):>6} {r['neighbours']!s:>4} {r['up_bytes']:>9.0f} "
              f"{r['down_bytes']:>9.0f} "
              f"{r['secagg_bytes']:>11.0f} {r['train_time_s']:>8.2f} {r['secagg_s']:>10.2f} {r['acc']:>7.4f} "
              f"{r['acc_proto']:>9.4f} {r['load_before']:>4.1f}-{r['load_after']:<4.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
