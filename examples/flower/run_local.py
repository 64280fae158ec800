"""Run fedproto over Flower on this machine with one command (see docs/flower.md).

Deployment runtime (default): writes one data folder per SuperNode (digits images of classes that
overlap between nodes, so the global prototypes mix several clients), starts a SuperLink and one
SuperNode per folder on 127.0.0.1 (mixed architectures: cnn and projcnn:16-32), runs the
``own_data`` Flower App with ``flwr run`` and stops everything.

    python examples/flower/run_local.py                       # 3 nodes, 3 rounds, no TLS
    python examples/flower/run_local.py --tls --auth --unregistered
    python examples/flower/run_local.py --kill 2@2 --round-timeout 20
    python examples/flower/run_local.py --tls --auth --restart --kill 1@2 --rounds 5   # killed, restarted, back
    python examples/flower/run_local.py --misbehave 1:nan
    python examples/flower/run_local.py --runtime simulation  # Flower's simulation runtime (Ray)
    python examples/flower/run_local.py --compare             # then the same clients in-process, times side by side
    python examples/flower/run_local.py --executor fedproto   # --isolation process + one warm executor per node

``--tls`` makes a CA, a SuperLink certificate and (``--auth``) one registered key pair per
SuperNode; ``--unregistered`` also starts a SuperNode whose key is not registered and prints
what it was told. ``--kill N@R`` kills node N once round R has started (its metrics row will
name it failed or timed out). ``--restart`` runs every SuperNode under ``python -m
fedproto.deploy.supervisor`` (restarted 2, 4, 8, 10, 10... s after a failure), so a killed node comes
back (under ``--auth`` the supervisor first deactivates it at the SuperLink, so it is let in at once);
with ``--kill`` it prints how long after the kill the node was activated and trained again.
``--misbehave N:KIND`` makes node N corrupt what it sends (``nan``; ``scale``, ``random``, ``flip``
with fedproto.engine.attacks).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np

from fedproto.data.datasets import load_dataset
from fedproto.deploy.local_federation import LocalFederation

HERE = Path(__file__).resolve().parent
# classes of each node: neighbours share two classes, every class is held by two nodes
NODE_CLASSES = [(0, 1, 2, 3), (2, 3, 4, 5), (4, 5, 0, 1)]
NODE_MODELS = ["cnn", "projcnn:16-32", "cnn"]


def write_node_data(root: Path, nodes: int, shots: int = 15, test_shots: int = 5, seed: int = 0) -> list[Path]:
    """One folder per node with train.npz and test.npz (digits, 8x8, normalised): node i holds
    ``shots`` training and ``test_shots`` test samples of each class in NODE_CLASSES[i % 3]."""
    ds = load_dataset("digits")
    rng = np.random.default_rng(seed)
    folders = []
    for i in range(nodes):
        folder = root / f"node{i}"
        folder.mkdir(parents=True, exist_ok=True)
        for split, x, y, k in (("train", ds.train_x, ds.train_y, shots), ("test", ds.test_x, ds.test_y, test_shots)):
            idx = np.concatenate([rng.choice(np.flatnonzero(y.numpy() == c), k, replace=False)
                                  for c in NODE_CLASSES[i % 3]])
            np.savez(folder / f"{split}.npz", x=x.numpy()[idx], y=y.numpy()[idx])
        folders.append(folder)
    return folders


KINDS = ("nan", "scale", "random", "flip")  # fedproto.flower.node.MISBEHAVIOURS


def _kill(text: str) -> tuple[int, int]:
    """``N@R`` -> (node N, round R)."""
    node, sep, at = text.partition("@")
    if not (sep and node.isdigit() and at.isdigit() and int(at) >= 1):
        raise argparse.ArgumentTypeError(f"{text!r}: give N@R, node N (0-based) killed once round R (>= 1) started, "
                                         "e.g. 2@2")
    return int(node), int(at)


def _misbehave(text: str) -> tuple[int, str]:
    """``N:KIND`` -> (node N, KIND)."""
    node, sep, kind = text.partition(":")
    if not (sep and node.isdigit() and kind in KINDS):
        raise argparse.ArgumentTypeError(f"{text!r}: give N:KIND, node N (0-based) and KIND one of {', '.join(KINDS)}, "
                                         "e.g. 1:nan")
    return int(node), kind


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--algorithm", default="fedproto")
    ap.add_argument("--runtime", choices=("deployment", "simulation"), default="deployment")
    ap.add_argument("--tls", action="store_true", help="TLS between nodes and the SuperLink")
    ap.add_argument("--auth", action="store_true", help="SuperNode authentication (needs --tls)")
    ap.add_argument("--unregistered", action="store_true", help="also start a node whose key is not registered")
    ap.add_argument("--kill", default=None, type=_kill, metavar="N@R", help="kill node N once round R has started")
    ap.add_argument("--restart", action="store_true",
                    help="run each SuperNode under fedproto.deploy.supervisor: restarted when it fails or is killed")
    ap.add_argument("--misbehave", default=None, type=_misbehave, metavar="N:KIND",
                    help="node N corrupts its messages (nan, scale, random, flip)")
    ap.add_argument("--round-timeout", type=float, default=60.0)
    ap.add_argument("--participation", type=float, default=1.0)
    ap.add_argument("--workdir", default="runs/flower-local")
    ap.add_argument("--executor", choices=("default", "fedproto", "flower"), default="default",
                    help="default: a flwr-clientapp process per message; fedproto: --isolation process and "
                         "python -m fedproto.deploy.warm_executor per node (rounds in seconds); flower: --isolation "
                         "process and Flower's flower-superexec")
    ap.add_argument("--compare", action="store_true",
                    help="then run the same clients in-process and print per-round times side by side")
    args = ap.parse_args()
    for opt, v in (("--kill", args.kill), ("--misbehave", args.misbehave)):
        if v and not 0 <= v[0] < args.nodes:
            ap.error(f"{opt}: node {v[0]} is outside 0..{args.nodes - 1} (--nodes {args.nodes})")

    work = Path(args.workdir).resolve()
    out = work / "runs"
    src = str(Path(__file__).resolve().parents[2] / "src")  # this checkout's fedproto for every process
    env = {"PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)}
    t0 = time.perf_counter()
    with LocalFederation(work, tls=args.tls, auth=args.auth, simulation=args.runtime == "simulation", env=env) as fed:
        fed.start_superlink()
        if args.runtime == "simulation":
            res = fed.flwr_run(HERE, {"clients": args.nodes, "rounds": args.rounds, "out-dir": str(out)},
                               num_supernodes=args.nodes)
            report(res, out, t0, fed)
            return
        bad = {str(args.misbehave[0]): args.misbehave[1]} if args.misbehave else {}
        for i, folder in enumerate(write_node_data(work / "data", args.nodes)):
            nc = {"client-id": i, "data": str(folder), "model": NODE_MODELS[i % len(NODE_MODELS)]}
            if str(i) in bad:
                nc["misbehave"] = bad[str(i)]
            fed.start_supernode(nc, name=f"node{i}", restart=(2.0, 10.0) if args.restart else None,
                                executor=None if args.executor == "default" else args.executor)
        if args.unregistered:
            key, _ = fed.node_key(register=False)
            intruder = fed.start_supernode({"client-id": args.nodes, "data": str(work / "data" / "node0"),
                                            "model": "cnn"}, name="unregistered", key=key, max_wait=15)
        result: dict = {}
        runner = threading.Thread(target=lambda: result.update(res=fed.flwr_run(
            HERE / "own_data", {"clients": args.nodes, "rounds": args.rounds, "algorithm": args.algorithm,
                                "out-dir": str(out), "round-timeout": args.round_timeout,
                                "participation": args.participation})))
        runner.start()
        if args.kill:
            node, at = args.kill
            while runner.is_alive() and rounds_logged(out) < at - 1:
                time.sleep(0.5)
            time.sleep(0.5)  # round `at` is under way
            if args.restart:  # the SuperNode, not its supervisor, which starts it again
                os.kill(fed.supernode_pids(f"node{node}")[-1], signal.SIGKILL)
            else:
                fed.kill(f"node{node}")
            killed = time.perf_counter()
            print(f"killed node{node} during round {at} ({killed - t0:.1f} s)")
            if args.restart:
                watch_rejoin(fed, out, node, killed, runner)
        runner.join()
        if args.unregistered:
            intruder.wait(60) if intruder.poll() is None else None
            text = re.sub(r"\x1b\[[0-9;]*m", "", fed.log("unregistered"))  # no colour codes
            lines = [ln for ln in text.splitlines() if "Exit Code" in ln or "Failed" in ln or "code:" in ln
                     or "rror" in ln or "denied" in ln.lower()]
            told = "\n  ".join(lines[-4:])
            print(f"unregistered SuperNode (exit code {intruder.poll()}) was told:\n  {told}")
            link = re.sub(r"\x1b\[[0-9;]*m", "", fed.log("superlink"))
            print("the SuperLink logged:\n  " + "\n  ".join(ln[:400] for ln in link.splitlines() if "ApiError" in ln))
        report(result["res"], out, t0, fed)
        if args.compare:
            compare(out, work / "data", args)


def simulator_options(app_config: dict, rounds: int, algorithm: str) -> dict:
    """The ``federate`` keywords of the Flower App's run config (``[tool.flwr.app.config]``): its run
    options, without those ``federate`` sets from the clients (dataset, classes, clients, the
    embedding size), the output folder, the participation (the deployment samples its connected
    nodes) and the Flower engine's own keys (:data:`fedproto.config.run_config.FLOWER_KEYS`: round-timeout,
    poll-interval, resume-from, ...), which are no run option."""
    from fedproto.config.run_config import FLOWER_KEYS, normal_key

    skip = {"dataset", "classes", "clients", "embedding_dim", "out_dir", "participation", *FLOWER_KEYS}
    opts = {normal_key(k): v for k, v in app_config.items() if normal_key(k) not in skip}
    return {**opts, "rounds": rounds, "algorithm": algorithm}


def compare(out: Path, data: Path, args) -> None:
    """Run the same clients in-process (fedproto.federation.federate, same options and seed) and
    print each round's wall time beside the deployment's, and both accuracies."""
    import tomllib

    from fedproto.federation import Client, federate
    from fedproto.models.zoo import build_model

    cfg = tomllib.loads((HERE / "own_data" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    opts = simulator_options(cfg, args.rounds, args.algorithm)
    clients = []
    for i in range(args.nodes):
        tr, te = np.load(data / f"node{i}" / "train.npz"), np.load(data / f"node{i}" / "test.npz")
        model = build_model(NODE_MODELS[i % len(NODE_MODELS)], i, 1, cfg["classes"], 8, cfg["embedding-dim"],
                            cfg["dropout"], opts["seed"])
        clients.append(Client(model, (tr["x"], tr["y"]), (te["x"], te["y"])))
    sim = federate(clients, num_classes=cfg["classes"], out=False, **opts)
    want = sim.run()
    run = sorted(out.glob("*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)[-1]
    rows = [json.loads(x) for x in run.read_text().splitlines()]
    got = json.loads((run.parent / "summary.json").read_text())
    print("\nround  deployment_s  simulator_s")
    for a, b in zip(rows, sim.history):
        print(f"{a['round']:5d}  {a['train_time_s']:12.2f}  {b['train_time_s']:11.3f}")
    print(f"final evaluation: deployment {rows[-1].get('eval_time_s', float('nan')):.2f} s, simulator "
          f"{sim.history[-1].get('eval_time_s', float('nan')):.3f} s")
    print(f"wall time: deployment {got['wall_time_s']:.1f} s (ServerApp), simulator {want['wall_time_s']:.2f} s")
    for key in ("acc", "acc_proto"):
        if key in got["accuracy"]:
            a, b = got["accuracy"][key]["mean"], want["accuracy"][key]["mean"]
            print(f"{key}: deployment {a:.6f}, simulator {b:.6f}")


def watch_rejoin(fed: LocalFederation, out: Path, node: int, killed: float, runner: threading.Thread) -> None:
    """After node ``node`` was killed at ``killed`` (perf_counter): print when its SuperNode was
    activated again (its second ``SuperNode ID`` log line) and when a round it trained in was logged."""
    active = trained = None
    logged = rounds_logged(out)
    while runner.is_alive() and trained is None:
        if active is None and fed.log(f"node{node}").count("SuperNode ID:") >= 2:
            active = time.perf_counter() - killed
            print(f"node{node} activated again {active:.1f} s after the kill")
        files = sorted(out.glob("*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)
        rows = [json.loads(x) for x in files[-1].read_text().splitlines()[logged:]] if files else []
        if active is not None and any(node in r.get("replied", []) for r in rows):
            trained = time.perf_counter() - killed
            print(f"node{node} trained again (its reply in a logged round) {trained:.1f} s after the kill")
        time.sleep(0.2)


def rounds_logged(out: Path) -> int:
    files = sorted(out.glob("*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)
    return len(files[-1].read_text().splitlines()) if files else 0


def report(res, out: Path, t0: float, fed: LocalFederation) -> None:
    text = res.stdout + res.stderr
    lines = [ln for ln in text.splitlines() if "fedproto" in ln or "dropped" in ln or "refused" in ln
             or "failed" in ln or "no reply" in ln]
    print("\n".join(lines[-30:]))
    runs = sorted(out.glob("*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)
    if not runs:
        print(text[-4000:])
        print(fed.log("superlink")[-2000:])
        raise SystemExit("no run folder was written")
    print(f"\nrun folder: {runs[-1].parent}  (flwr run: {time.perf_counter() - t0:.1f} s in all)")
    for row in map(json.loads, runs[-1].read_text().splitlines()):
        keep = {k: row[k] for k in ("round", "loss_ce", "loss_proto", "acc_mean", "acc_proto_mean", "train_time_s",
                                    "sampled", "replied", "failed", "timed_out", "dropped", "dropped_why") if k in row}
        print(json.dumps(keep))


if __name__ == "__main__":
    main()
