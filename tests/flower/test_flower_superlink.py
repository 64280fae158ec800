"""A real Flower deployment in the fast suite: a SuperLink and two SuperNodes on 127.0.0.1.

The other fast Flower tests talk to the real ClientApp through an in-process stand-in of the
SuperLink (tests/flower/flower_helpers.py's ``LocalGrid``); this one starts Flower's own processes, so the
wire format, the SuperLink's scheduling and the SuperNodes' process isolation are exercised on
every run of the suite. Kept to one round of two small clients; the longer deployments (restarts,
TLS, authentication, several rounds) are in tests/flower/test_flower_deployment.py and
test_flower_secagg.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedproto.simulation import Simulation

pytestmark = pytest.mark.flower

ROOT = Path(__file__).resolve().parents[2]


def test_a_real_superlink_round_in_the_fast_suite(tmp_path):
    """``flwr run`` of the benchmark app (examples/flower: digits, partition-id nodes) with clients=2,
    rounds=1 against a SuperLink and two SuperNodes on free ports of 127.0.0.1, each SuperNode with
    a warm executor (``python -m fedproto.deploy.warm_executor``: one process that forks per message).
    The run folder holds the sequential simulator's accuracies for the same config and seed, both
    nodes replied in the round, each node ran query, train and evaluate in its own forked process,
    and every process is stopped at the end."""
    pytest.importorskip("flwr")
    import tomllib

    from fedproto.deploy.local_federation import LocalFederation
    from fedproto.flower.records import run_config

    app = ROOT / "examples" / "flower"
    out = tmp_path / "runs"
    with LocalFederation(tmp_path / "fed", env={"PYTHONPATH": str(ROOT / "src")}) as fed:
        fed.start_superlink()
        for i in range(2):
            fed.start_supernode({"partition-id": i, "num-partitions": 2}, executor="fedproto")
        res = fed.flwr_run(app, {"clients": 2, "rounds": 1, "out-dir": str(out)}, timeout=240)
        procs = list(fed.procs.values())
        logs = {name: fed.log(name) for name in fed.procs}
    assert sorted(logs) == ["node0", "node0-executor", "node1", "node1-executor", "superlink"]
    assert all(p.poll() is not None for p in procs)  # all stopped
    text = res.stdout + res.stderr
    assert "fedproto: fedproto on digits: accuracy" in text, text[-3000:] + logs["superlink"][-2000:]
    for i in range(2):
        assert logs[f"node{i}-executor"].count("ClientApp in process") == 3, logs[f"node{i}-executor"][-3000:]
    run = next(out.glob("*/summary.json")).parent
    got = json.loads((run / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1] and rows[0]["replied"] == [0, 1]
    app_cfg = {k: v for k, v in tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
               ["config"].items() if k != "out-dir"}
    want = Simulation(run_config({**app_cfg, "clients": 2, "rounds": 1, "execution": "sequential"}), out=False).run()
    assert got["clients"] == 2 and got["rounds"] == 1
    for key in want["accuracy"]:
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
        assert got["accuracy"][key]["std"] == pytest.approx(want["accuracy"][key]["std"], abs=1e-9)
    assert got["params_per_round"] == want["params_per_round"]


@pytest.mark.slow
def test_run_local_compare_runs(tmp_path):
    """``examples/flower/run_local.py --compare`` (once refused by ``federate``: unknown options
    poll_interval, resume_from, which are the Flower engine's keys): the deployment of two nodes,
    then the same clients in-process, the same accuracies printed side by side (about 40 s)."""
    pytest.importorskip("flwr")
    import os
    import re
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "flower" / "run_local.py"), "--compare", "--rounds",
                           "1", "--nodes", "2", "--executor", "fedproto", "--workdir", str(tmp_path / "fl")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "unknown option" not in text and "round  deployment_s  simulator_s" in text
    for key in ("acc", "acc_proto"):
        got = re.search(rf"^{key}: deployment ([0-9.]+), simulator ([0-9.]+)$", text, re.M)
        assert got is not None, text[-3000:]
        assert float(got[1]) == pytest.approx(float(got[2]), abs=1e-6) and 0 < float(got[1]) <= 1
