"""Round times of the three-node Flower deployment on 127.0.0.1: Flower's default isolation vs fedproto's executor.

The deployment of ``examples/flower/run_local.py`` (docs/flower.md, "A deployment on this machine"):
a SuperLink and three SuperNodes on 127.0.0.1 (digits, models cnn / projcnn:16-32 / cnn, the
``own_data`` app, FedProto), run twice with the same run config and seed:

* ``default``: ``flower-supernode`` as is (a fresh ``flwr-clientapp`` process per message);
* ``executor``: ``flower-supernode --isolation process`` plus ``python -m fedproto.deploy.warm_executor``
  per node (one warm process that forks per message).

Then the same with node 0 replaced by a site of ``--big-site`` images (an image folder of 8x8
PNGs, 500 train and the rest test, of its classes), to show whether a message's cost grows with
the site's data. Prints each setting's per-round ``train_time_s`` (the ServerApp's, from
``metrics.jsonl``), their median, the final evaluation's time, both accuracies (which must be
identical) and the load average (``os.getloadavg``) before and after each run.

    OMP_NUM_THREADS=1 FEDPROTO_DATA=... PATH=/path/to/flower-venv/bin:$PATH PYTHONPATH=src \\
        python benchmarks/bench_flower_rounds.py --rounds 4 [--big-site 10000] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "flower" / "own_data"


def _run_local():
    spec = importlib.util.spec_from_file_location("run_local", ROOT / "examples" / "flower" / "run_local.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_big_site(folder: Path, images: int, classes=(0, 1, 2, 3), train: int = 500, seed: int = 0) -> None:
    """An image folder of ``images`` 8x8 grayscale PNGs of digits of ``classes`` (``train`` of them in train/)."""
    from PIL import Image

    from fedproto.data.datasets import load_dataset

    ds = load_dataset("digits")
    x, y = ds.train_x.numpy()[:, 0], ds.train_y.numpy()
    lo, hi = float(x.min()), float(x.max())
    rng = np.random.default_rng(seed)
    pool = np.flatnonzero(np.isin(y, classes))
    pick = rng.choice(pool, images, replace=True)
    for k, i in enumerate(pick):
        split = "train" if k < train else "test"
        d = folder / split / str(int(y[i]))
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.round((x[i] - lo) / (hi - lo) * 255).astype(np.uint8)).save(d / f"{k}.png")


def deployment(work: Path, folders: list[Path], models: list[str], executor: str | None, rounds: int) -> dict:
    """One ``flwr run`` of the own_data app over SuperNodes on ``folders``; its rows and summary."""
    from fedproto.deploy.local_federation import LocalFederation

    out = work / "runs"
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)}
    with LocalFederation(work, env=env) as fed:
        fed.start_superlink()
        for i, folder in enumerate(folders):
            fed.start_supernode({"client-id": i, "data": str(folder), "model": models[i]}, name=f"node{i}",
                                executor=executor)
        res = fed.flwr_run(APP, {"rounds": rounds, "out-dir": str(out)}, timeout=1200)
    runs = list(out.glob("*/summary.json"))
    if not runs:
        raise SystemExit(f"no run folder ({executor or 'default'}):\n{(res.stdout + res.stderr)[-3000:]}")
    rows = [json.loads(x) for x in (runs[0].parent / "metrics.jsonl").read_text().splitlines()]
    got = json.loads(runs[0].read_text())
    return {"rounds_s": [r["train_time_s"] for r in rows], "eval_s": rows[-1].get("eval_time_s"),
            "acc": got["accuracy"]["acc"]["mean"], "acc_proto": got["accuracy"]["acc_proto"]["mean"],
            "wall_s": time.perf_counter() - t0, "load_before": load0, "load_after": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--big-site", type=int, default=10000, help="images of node 0 in the second setting (0: skip)")
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--with-superexec", action="store_true",
                    help="also --isolation process with Flower's own flower-superexec (a process per message)")
    args = ap.parse_args()
    rl = _run_local()
    tmp = Path(tempfile.mkdtemp(prefix="bench-flower-"))
    results = {}
    try:
        folders = rl.write_node_data(tmp / "data", 3)
        settings = [("three nodes", folders)]
        if args.big_site:
            big = tmp / "data" / "big0"
            write_big_site(big, args.big_site)
            settings.append((f"node 0: {args.big_site:,} images", [big, *folders[1:]]))
        for label, fs in settings:
            for ex in (None, "fedproto", *(("flower",) if args.with_superexec else ())):
                key = f"{label} | {ex or 'default'}"
                work = tmp / "".join(c if c.isalnum() else "_" for c in key)
                results[key] = deployment(work, fs, rl.NODE_MODELS, ex, args.rounds)
                r = results[key]
                print(f"{key}: rounds {[round(s, 2) for s in r['rounds_s']]} s, final eval {r['eval_s']:.2f} s, "
                      f"acc {r['acc']:.6f} / {r['acc_proto']:.6f}, load {r['load_before'][0]:.2f} -> "
                      f"{r['load_after'][0]:.2f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{os.cpu_count()} cores; FedProto, {args.rounds} rounds, same run config and seed\n")
    print("| setting | isolation | round times (s) | median round | final evaluation | accuracy (classifier / "
          "prototype) | load average (1 min) before -> after |")
    print("|---|---|---|---|---|---|---|")
    for key, r in results.items():
        label, iso = key.split(" | ")
        iso = {"default": "default (flwr-clientapp per message)", "fedproto": "`--isolation process` + our executor",
               "flower": "`--isolation process` + flower-superexec"}[iso]
        print(f"| {label} | {iso} | {', '.join(f'{s:.2f}' for s in r['rounds_s'])} | "
              f"{statistics.median(r['rounds_s']):.2f} | {r['eval_s']:.2f} | {r['acc']:.6f} / {r['acc_proto']:.6f} | "
              f"{r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f} |")
    for a in [k for k in results if k.endswith("| default")]:
        ra, rb = results[a], results[a.replace("| default", "| fedproto")]
        speed = statistics.median(ra["rounds_s"]) / statistics.median(rb["rounds_s"])
        same = (ra["acc"], ra["acc_proto"]) == (rb["acc"], rb["acc_proto"])
        print(f"{a.split(' | ')[0]}: median round {speed:.1f}x faster with the executor; accuracies "
              f"{'identical' if same else 'DIFFER'}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
