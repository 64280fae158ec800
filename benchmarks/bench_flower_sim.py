"""Memory and time of one setting: in-process, Flower's simulation runtime (1, 2, 4 actors), a deployment.

The benchmark app of ``examples/flower`` (FedProto, the app's settings) with ``--dataset`` and
``--clients`` overriding its run config, run as:

* ``in-process``: the simulator (:class:`fedproto.simulation.Simulation`, sequential) in a child
  process, the same run config as the Flower runs;
* ``simulation, N actors``: a SuperLink started with ``--simulation`` on 127.0.0.1 and ``flwr run``
  with ``--federation-config "num-supernodes=<clients> client-resources-num-cpus=1
  init-args-num-cpus=N"`` (N Ray actors), Ray bound to 127.0.0.1;
* ``deployment``: a SuperLink and one SuperNode per client (``partition-id``; only with
  ``--deployment``, for a few clients).

Every 0.2 s a sampler reads, for every process below the one started (the SuperLink and
everything it starts, Ray's included), its resident set (RSS) and its proportional set (PSS: shared
pages divided among the processes that map them; ``/proc/<pid>/smaps_rollup``). Printed per
run: the peak of the summed RSS and of the summed PSS, the largest RSS and USS (private memory)
of one Ray actor, seconds per round (the run's ``train_time_s`` / rounds), the wall time (of
``flwr run``, or of the in-process run), both accuracies (identical in every row) and the load
average (``os.getloadavg``) before and after.

    OMP_NUM_THREADS=1 FEDPROTO_DATA=... PATH=/path/to/venv/bin:$PATH \\
        python benchmarks/bench_flower_sim.py --dataset mnist --clients 3 --rounds 3 --deployment
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "flower"


def _tree(root: int) -> list[int]:
    """``root`` and every process below it (from ``/proc/*/stat``)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _memory(pid: int) -> tuple[str, int, int, int] | None:
    """(command line, RSS, PSS, USS) in bytes of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        fields = {}
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                    fields[parts[0][:-1]] = int(parts[1]) * 1024
    except OSError:
        return None
    uss = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return cmd, fields.get("Rss", 0), fields.get("Pss", 0), uss


class Sampler(threading.Thread):
    """Samples the memory of a process tree every ``every`` seconds until stopped."""

    def __init__(self, roots, every: float = 0.2):
        super().__init__(daemon=True)
        self.roots, self.every, self.stop_flag = roots, every, threading.Event()
        self.peak_rss = self.peak_pss = self.actor_rss = self.actor_uss = self.actors = 0

    def run(self) -> None:
        while not self.stop_flag.is_set():
            rss = pss = actors = 0
            for pid in {p for root in self.roots() for p in _tree(root)}:
                m = _memory(pid)
                if m is None:
                    continue
                cmd, r, p, u = m
                rss, pss = rss + r, pss + p
                if "ClientAppActor" in cmd:
                    actors += 1
                    self.actor_rss, self.actor_uss = max(self.actor_rss, r), max(self.actor_uss, u)
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.actors = max(self.actors, actors)
            time.sleep(self.every)

    def stop(self) -> dict:
        self.stop_flag.set()
        self.join()
        mb = 1 / 2**20
        return {"peak_rss_mb": round(self.peak_rss * mb), "peak_pss_mb": round(self.peak_pss * mb),
                "actor_rss_mb": round(self.actor_rss * mb), "actor_uss_mb": round(self.actor_uss * mb),
                "actors_seen": self.actors}


def _summary(out: Path) -> dict:
    found = sorted(out.glob("*/summary.json"))
    if len(found) != 1:
        raise SystemExit(f"expected one summary.json under {out}, found {len(found)}")
    return json.loads(found[0].read_text())


def in_process(run_config: dict, out: Path) -> dict:
    code = ("import sys, json; from fedproto.flower.records import run_config; from fedproto.simulation import "
            "Simulation; Simulation(run_config(json.loads(sys.argv[1])), out=sys.argv[2]).run()")
    cfg = {**run_config, "execution": "sequential"}
    cfg.pop("out-dir", None)
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", code, json.dumps(cfg), str(out / "in-process")])
    sampler = Sampler(lambda: [p.pid])
    sampler.start()
    rc = p.wait()
    wall = time.perf_counter() - t0
    mem = sampler.stop()
    if rc != 0:
        raise SystemExit(f"the in-process run failed (exit status {rc})")
    return {**mem, "wall_s": wall, "summary": _summary(out)}


def flower(run_config: dict, work: Path, actors: int | None, env: dict) -> dict:
    from fedproto.deploy.local_federation import LocalFederation

    clients = int(run_config["clients"])
    with LocalFederation(work, simulation=actors is not None, env=env) as fed:
        fed.start_superlink()
        if actors is None:
            for i in range(clients):
                fed.start_supernode({"partition-id": i, "num-partitions": clients}, name=f"node{i}")
        sampler = Sampler(lambda: [p.pid for p in fed.procs.values()])  # the SuperLink (and Ray), the SuperNodes
        sampler.start()
        for attempt in range(3):  # Ray gives its raylet 30 s to start: too little on a loaded machine
            t0 = time.perf_counter()
            res = fed.flwr_run(APP, run_config, timeout=3000, num_supernodes=clients if actors else None,
                               federation_config={"client-resources-num-cpus": 1, "init-args-num-cpus": actors}
                               if actors else None)
            wall = time.perf_counter() - t0
            if "timed out during startup" not in res.stdout + res.stderr:
                break
            print(f"Ray did not start in time (attempt {attempt + 1}); again", flush=True)
        mem = sampler.stop()
    if res.returncode != 0 or "accuracy" not in res.stdout + res.stderr:
        raise SystemExit(f"flwr run failed:\n{(res.stdout + res.stderr)[-3000:]}")
    return {**mem, "wall_s": wall, "summary": _summary(Path(run_config["out-dir"]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="mnist")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--actors", default="1,2,4", help="comma-separated actor counts of the simulation runs")
    ap.add_argument("--deployment", action="store_true", help="also a deployment of one SuperNode per client")
    ap.add_argument("--round-timeout", type=float, default=1800.0,
                    help="the run config's round-timeout: long enough that no reply is lost on a loaded machine")
    ap.add_argument("--skip-in-process", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    for name in ("clients", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} {getattr(args, name)}: give 1 or more")
    try:
        actors = [int(a) for a in args.actors.split(",") if a.strip()]
    except ValueError:
        ap.error(f"--actors {args.actors!r}: give actor counts separated by commas, e.g. 1,2,4")
    if any(a < 1 for a in actors):
        ap.error(f"--actors {args.actors!r}: each actor count must be at least 1")
    app_cfg = tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": str(ROOT / "src")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-flower-sim-") as tmp:
        tmp = Path(tmp)
        runs = ([] if args.skip_in_process else [("in-process", None)]) + [(f"simulation, {a} actor(s)", a)
                                                                          for a in actors]
        runs += [(f"deployment, {args.clients} SuperNodes", -1)] if args.deployment else []
        for k, (label, kind) in enumerate(runs):
            out = tmp / f"run{k}"
            cfg = {**app_cfg, "dataset": args.dataset, "clients": args.clients, "rounds": args.rounds,
                   "out-dir": str(out), "round-timeout": args.round_timeout}
            load0 = os.getloadavg()[0]
            if kind is None:
                res = in_process(cfg, out)
            else:
                res = flower(cfg, tmp / f"fed{k}", None if kind == -1 else kind, env)
            load1 = os.getloadavg()[0]
            s = res.pop("summary")
            row = {"run": label, **res, "s_per_round": s["train_time_s"] / args.rounds,
                   "accuracy": {k2: v["mean"] for k2, v in s["accuracy"].items()}, "load": [load0, load1]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{args.dataset}, {args.clients} clients, {args.rounds} rounds")
    print("| run | peak RSS, all processes (MB) | peak PSS (MB) | largest actor RSS / USS (MB) | s per round | "
          "wall (s) | accuracy | load average (1 min) before -> after |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        actor = f"{r['actor_rss_mb']} / {r['actor_uss_mb']}" if r["actors_seen"] else "-"
        acc = " / ".join(f"{v:.6f}" for v in r["accuracy"].values())
        print(f"| {r['run']} | {r['peak_rss_mb']} | {r['peak_pss_mb']} | {actor} | {r['s_per_round']:.2f} | "
              f"{r['wall_s']:.1f} | {acc} | {r['load'][0]:.2f} -> {r['load'][1]:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
