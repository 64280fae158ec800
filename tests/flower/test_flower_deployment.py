"""Real deployments on 127.0.0.1 (``fedproto.deploy.local_federation``: Flower's own SuperLink and
SuperNode processes, ``flwr run``): the benchmark app on SuperNodes and on Flower's simulation
runtime, three own-data nodes, and the warm executor give the simulator's and the Python API's
numbers; TLS and SuperNode-authentication credentials (private keys, renewal under the same CA);
the warm executor's options; and the slow drills: an authenticated node SIGKILLed mid-run is
restarted by its supervisor and rejoins with its state, and a SuperLink killed mid-run is
restarted and the printed resume command finishes the run. Every process is stopped at the end."""

from __future__ import annotations

import csv
import json
import shlex
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower

import tomllib  # noqa: E402  (flwr needs Python >= 3.11, which has it)
from flower_helpers import (  # noqa: E402  (the Flower tests' grid, configs and node folders)
    flower_process,
    in_process_reference,
    node_configs,
    write_node_folders,
)

from fedproto.errors import ConfigError  # noqa: E402
from fedproto.flower.records import run_config  # noqa: E402
from fedproto.simulation import Simulation  # noqa: E402


@pytest.fixture(autouse=True)
def _flower_process(tmp_path, monkeypatch):
    """The ServerApp process's task identity and a node-state cache of this test's own
    (:func:`flower_helpers.flower_process`)."""
    yield from flower_process(tmp_path, monkeypatch)


def _benchmark_run_matches_the_simulation(tmp_path, simulation: bool):
    """``flwr run`` of the benchmark app (examples/flower, digits, partition-id nodes) with
    clients=2 rounds=2, on a deployment of 2 SuperNodes or on the simulation runtime: the
    simulator's numbers."""
    from pathlib import Path

    from fedproto.deploy.local_federation import LocalFederation

    app_dir = Path(__file__).resolve().parents[2] / "examples" / "flower"
    src = str(Path(__file__).resolve().parents[2] / "src")
    out = tmp_path / "out"
    t0 = time.time()
    with LocalFederation(tmp_path / "fed", simulation=simulation, env={"PYTHONPATH": src}) as fed:
        fed.start_superlink()
        if not simulation:
            for i in range(2):
                fed.start_supernode({"partition-id": i, "num-partitions": 2})
        res = fed.flwr_run(app_dir, {"clients": 2, "rounds": 2, "out-dir": str(out)}, timeout=400,
                           num_supernodes=2 if simulation else None)
    logs = res.stdout + res.stderr
    assert "fedproto: fedproto on digits: accuracy" in logs, logs[-3000:]
    summaries = list(out.glob("*/summary.json"))
    assert len(summaries) == 1, logs[-3000:]
    got = json.loads(summaries[0].read_text())
    print(f"flwr run took {time.time() - t0:.0f} s")
    app_cfg = {k: v for k, v in tomllib.loads((app_dir / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
               ["config"].items() if k != "out-dir"}
    cfg = run_config({**app_cfg, "clients": 2, "rounds": 2, "execution": "sequential"})
    want = Simulation(cfg, out=False).run()
    assert got["clients"] == 2 and got["rounds"] == 2
    for key in want["accuracy"]:
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
    assert got["params_per_round"] == want["params_per_round"]


@pytest.mark.slow
def test_flower_deployment_on_localhost_gives_the_simulation_numbers(tmp_path):
    """The benchmark mode on a real deployment: a SuperLink and two SuperNodes on 127.0.0.1;
    every ClientApp call runs in its own process, client state persists in the SuperNode."""
    _benchmark_run_matches_the_simulation(tmp_path, simulation=False)


@pytest.mark.slow
def test_flower_simulation_runtime_gives_the_simulation_numbers(tmp_path):
    """Flower's simulation runtime (a SuperLink started with --simulation, Ray backend,
    ``--federation-config num-supernodes=2``): the simulator's numbers."""
    pytest.importorskip("ray", reason="Flower's simulation runtime needs Ray: pip install \"fedproto[flower-sim]\"")
    _benchmark_run_matches_the_simulation(tmp_path, simulation=True)


def test_deployment_of_three_own_data_nodes_on_localhost_gives_the_python_api_numbers(tmp_path):
    """The real thing (a CI test): a SuperLink and 3 SuperNodes on 127.0.0.1 (free ports), each
    with its own .npz folder and model (cnn, projcnn:16-32, cnn), ``flwr run`` of the own-data
    Flower App (examples/flower/own_data), whose ServerApp has no dataset. Same numbers as
    federate() with the same clients; every process is stopped at the end."""
    from pathlib import Path

    from fedproto.deploy.local_federation import LocalFederation
    from fedproto.flower.records import FLOWER_KEYS

    app = Path(__file__).resolve().parents[2] / "examples" / "flower" / "own_data"
    src = str(Path(__file__).resolve().parents[2] / "src")
    app_cfg = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    folders = write_node_folders(tmp_path / "data")
    out = tmp_path / "runs"
    with LocalFederation(tmp_path / "fed", env={"PYTHONPATH": src}) as fed:
        fed.start_superlink()
        for nc in node_configs(folders):
            fed.start_supernode(nc)
        res = fed.flwr_run(app, {"rounds": 2, "out-dir": str(out), "seed": 7}, timeout=300)
        procs = list(fed.procs.values())
    assert all(p.poll() is not None for p in procs)  # all stopped
    logs = res.stdout + res.stderr
    assert "fedproto: fedproto on custom: accuracy" in logs, logs[-3000:] + fed.log("superlink")[-2000:]
    run = next(out.glob("*/summary.json")).parent
    got = json.loads((run / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["replied"] for r in rows] == [[0, 1, 2], [0, 1, 2]]
    opts = {k.replace("-", "_"): v for k, v in app_cfg.items()
            if k.replace("-", "_") not in (*FLOWER_KEYS, "dataset", "classes", "clients", "embedding_dim", "out_dir")}
    ref = in_process_reference(folders, **{**opts, "rounds": 2, "seed": 7})
    want = ref.run()
    for key in ("acc", "acc_proto"):
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
        assert got["accuracy"][key]["std"] == pytest.approx(want["accuracy"][key]["std"], abs=1e-9)
    for a, b in zip(rows, ref.history):
        assert a["loss_ce"] == pytest.approx(b["loss_ce"], rel=1e-6)
        assert a["loss_proto"] == pytest.approx(b["loss_proto"], rel=1e-6, abs=1e-12)
    assert got["params_per_round"] == want["params_per_round"]


def test_the_warm_executor_gives_the_numbers_of_the_default_path(tmp_path):
    """A CI test (45-55 s on 2 loaded cores): the three own-data SuperNodes started with
    ``--isolation process`` and ``python -m fedproto.deploy.warm_executor`` each (one warm process
    that forks per message) give the in-process numbers, as the default path does in the test
    above; every executor decoded its node's data and warmed up before the first task, ran one
    forked ClientApp per message (query, 2 x train, evaluate) and is stopped at the end."""
    from pathlib import Path

    from fedproto.deploy.local_federation import LocalFederation
    from fedproto.flower.records import FLOWER_KEYS

    app = Path(__file__).resolve().parents[2] / "examples" / "flower" / "own_data"
    src = str(Path(__file__).resolve().parents[2] / "src")
    app_cfg = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    folders = write_node_folders(tmp_path / "data")
    out = tmp_path / "runs"
    with LocalFederation(tmp_path / "fed", env={"PYTHONPATH": src}) as fed:
        fed.start_superlink()
        for nc in node_configs(folders):
            fed.start_supernode(nc, executor="fedproto")
        res = fed.flwr_run(app, {"rounds": 2, "out-dir": str(out), "seed": 7}, timeout=300)
        procs = list(fed.procs.values())
        logs = {name: fed.log(name) for name in fed.procs}
    assert sorted(logs) == ["node0", "node0-executor", "node1", "node1-executor", "node2", "node2-executor",
                            "superlink"]
    assert all(p.poll() is not None for p in procs)  # all stopped
    text = res.stdout + res.stderr
    assert "fedproto: fedproto on custom: accuracy" in text, text[-3000:] + logs["node0-executor"][-3000:]
    for i in range(3):
        ex = logs[f"node{i}-executor"]
        assert "ready in" in ex and "64 samples decoded, warm-up done" in ex, ex[-2000:]  # 4 classes x (12 + 4)
        assert ex.count("ClientApp in process") == 4, ex[-3000:]  # query, train x 2, evaluate: one fork each
        assert "exited with" not in ex, ex[-3000:]
    run = next(out.glob("*/summary.json")).parent
    got = json.loads((run / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["replied"] for r in rows] == [[0, 1, 2], [0, 1, 2]]
    opts = {k.replace("-", "_"): v for k, v in app_cfg.items()
            if k.replace("-", "_") not in (*FLOWER_KEYS, "dataset", "classes", "clients", "embedding_dim", "out_dir")}
    want = in_process_reference(folders, **{**opts, "rounds": 2, "seed": 7}).run()
    for key in ("acc", "acc_proto"):
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
        assert got["accuracy"][key]["std"] == pytest.approx(want["accuracy"][key]["std"], abs=1e-9)


def test_executor_options_are_checked_with_the_fix(tmp_path):
    from fedproto.deploy.local_federation import LocalFederation
    from fedproto.deploy.warm_executor import parse_node_config, preload, serve

    assert parse_node_config('client-id=0 data="/d" model="cnn"') == {"client-id": 0, "data": "/d", "model": "cnn"}
    assert parse_node_config(None) == {} == parse_node_config("  ")
    with pytest.raises(ConfigError, match=r"--node-config 'client-id=0 data=/d' cannot be parsed"):
        parse_node_config("client-id=0 data=/d")
    with pytest.raises(ConfigError, match=r"give --insecure .* or --root-certificates CA.pem"):
        serve("127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"poll_interval=0.0: give seconds between 0.01 and 60"):
        serve("127.0.0.1:1", insecure=True, poll_interval=0.0)
    with pytest.raises(ConfigError, match=r"executor='warm': choose None \(Flower's default\), 'fedproto' or 'flower'"):
        LocalFederation(tmp_path / "fed").start_supernode({"client-id": 0}, executor="warm")
    # what cannot be preloaded is said, not fatal: the ClientApp then reads the data per message
    from fedproto.data.folder import keep_decoded

    try:
        info = preload({"client-id": 0, "data": str(tmp_path / "missing"), "model": "cnn"})
    finally:
        keep_decoded(False)  # preload keeps decoded folders for the whole process: not for the tests after this
    assert info["samples"] is None and info["warm"] is False
    assert "does not exist" in info["skipped"][0] and "each message decodes it" in info["skipped"][0]


def test_credentials_for_tls_and_node_authentication(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from fedproto.deploy.local_federation import LocalFederation, config_arg, make_credentials

    c = make_credentials(tmp_path, 2)
    cert = x509.load_pem_x509_certificate(c.server_cert.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "127.0.0.1" in [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    assert cert.issuer == x509.load_pem_x509_certificate(c.ca_cert.read_bytes()).subject
    priv, pub = c.node_keys[1]
    key = serialization.load_ssh_private_key(priv.read_bytes(), None)
    assert key.curve.name == "secp384r1" and pub.read_text().startswith("ecdsa-sha2-nistp384 ")
    assert config_arg({"client-id": 0, "data": "/a b", "x": 1.5}) == 'client-id=0 data="/a b" x=1.5'
    with pytest.raises(ConfigError, match="SuperNode authentication needs TLS"):
        LocalFederation(tmp_path / "fed", auth=True)


def test_credentials_keep_private_keys_private_and_renew_under_the_same_ca(tmp_path):
    """server.key was written with mode 0644, the CA key was not kept (no renewal), certificates lasted 30 days."""
    import datetime
    import stat

    from cryptography import x509

    from fedproto.deploy.local_federation import make_credentials

    folder = tmp_path / "creds"
    c = make_credentials(folder, 2, days=90)
    ca_key = tmp_path / "creds-ca" / "ca.key"
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert [mode(p) for p in (c.server_key, ca_key, c.node_keys[0][0], c.node_keys[1][0])] == [0o600] * 4
    assert mode(ca_key.parent) == 0o700 and not any(p.name.endswith(".key") and p.name != "server.key"
                                                    for p in folder.iterdir())  # the CA key is not in the folder
    cert = x509.load_pem_x509_certificate(c.server_cert.read_bytes())
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert life == datetime.timedelta(days=90)
    ca_before, node_before = c.ca_cert.read_bytes(), c.node_keys[1][1].read_bytes()
    r = make_credentials(folder, 3, days=30)  # renewal: same CA and node keys, a new server certificate, node 2 added
    renewed = x509.load_pem_x509_certificate(r.server_cert.read_bytes())
    assert r.ca_cert.read_bytes() == ca_before and r.node_keys[1][1].read_bytes() == node_before
    assert renewed.serial_number != cert.serial_number and len(r.node_keys) == 3
    ca = x509.load_pem_x509_certificate(r.ca_cert.read_bytes())
    renewed.verify_directly_issued_by(ca)  # raises if the renewed certificate is not the kept CA's
    ca_key.unlink()
    with pytest.raises(ConfigError, match="a CA is renewed from its certificate and its key together"):
        make_credentials(folder, 1)
    with pytest.raises(ConfigError, match="days=0"):
        make_credentials(tmp_path / "other", 1, days=0)


@pytest.mark.slow
def test_an_authenticated_node_killed_mid_run_is_restarted_by_its_supervisor_and_rejoins_with_its_state(tmp_path):
    """On 127.0.0.1 with TLS and SuperNode authentication: node 1 runs under
    ``python -m fedproto.deploy.supervisor``; SIGKILLed in round 2, the supervisor deactivates its
    node id at the SuperLink (signed with its key), so its restart is let in at once, not refused
    for up to 60 s until its heartbeat expires ("Failed to activate SuperNode", Flower exit code
    305, before); it activates under the same node id, reloads its state file (same instance,
    restored 1) and takes part again; the run finishes."""
    import os
    import signal
    import threading

    from fedproto.deploy.local_federation import LocalFederation

    app = Path(__file__).resolve().parents[2] / "examples" / "flower" / "own_data"
    src = str(Path(__file__).resolve().parents[2] / "src")
    folders = write_node_folders(tmp_path / "data")
    out, state = tmp_path / "runs", tmp_path / "state1"
    ncs = node_configs(folders, extra={1: {"state-dir": str(state)}})
    got: dict = {}
    with LocalFederation(tmp_path / "fed", tls=True, auth=True, env={"PYTHONPATH": src}) as fed:
        fed.start_superlink()
        for i, nc in enumerate(ncs):
            fed.start_supernode(nc, restart=(1.0, 4.0) if i == 1 else None)
        run = threading.Thread(target=lambda: got.update(res=fed.flwr_run(
            app, {"rounds": 4, "out-dir": str(out), "seed": 7, "round-timeout": 60, "min-replies": 1},
            timeout=1200)))
        run.start()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not list(out.glob("*/metrics.jsonl")):
            time.sleep(0.5)
        metrics = next(out.glob("*/metrics.jsonl"))
        while time.monotonic() < deadline and not metrics.read_text().strip():  # until round 1 is logged
            time.sleep(0.5)
        time.sleep(0.5)  # round 2 is under way
        os.kill(fed.supernode_pids("node1")[-1], signal.SIGKILL)
        before = torch.load(next(state.glob("*.pt")), weights_only=True)
        run.join(1200)
        node_log = fed.log("node1")
    res = got["res"]
    logs = res.stdout + res.stderr
    assert "fedproto: fedproto on custom: accuracy" in logs, logs[-3000:] + node_log[-3000:]
    assert len(fed.supernode_pids("node1")) >= 2, node_log[-3000:]  # restarted
    assert "(Fleet API DeactivateNode): it can rejoin at once" in node_log and "restart 1 in 1 s" in node_log
    assert "Failed to activate SuperNode" not in node_log  # not refused: the heartbeat was not waited for
    assert node_log.count("SuperNode ID:") == 2
    run_dir = next(out.glob("*/summary.json")).parent
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    missed = [r["round"] for r in rows if 1 not in r["replied"]]
    assert 1 in rows[0]["replied"] and missed[:1] == [2], rows  # killed in round 2
    assert before["round"] in (1, 2)  # its state file when it was killed
    assert 1 in rows[-1]["replied"], rows  # back, under the same node id
    after = torch.load(next(state.glob("*.pt")), weights_only=True)
    assert after["instance"] == before["instance"] and after["round"] == rows[-1]["round"]
    # the server saw it come back with its state: recorded, logged, and scored as the others
    rejoined = [r["rejoined"] for r in rows if "rejoined" in r]
    assert rejoined == [{"1": "restarted with its state restored from its state file"}], rows
    assert "restarted and reloaded its state from its state file" in logs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["left_out"] == {}
    assert [c["state_lost_round"] for c in csv.DictReader(open(run_dir / "clients.csv"))] == ["", "", ""]


@pytest.mark.slow
def test_a_superlink_killed_mid_run_is_restarted_and_the_resume_command_finishes_the_run(tmp_path):
    """On 127.0.0.1 with TLS and SuperNode authentication: three own-data nodes
    (each under ``python -m fedproto.deploy.supervisor``), FedProto, 4 rounds. The SuperLink is
    SIGKILLed in round 2 (its process only: the ServerApp it started lives on, as after a crash);
    the run folder then holds failure.json and a checkpoint of round 1 (or 2). The SuperLink is
    started again on the same port and database file (the node keys stay registered); the nodes
    reconnect, and ``flwr run ... --run-config "resume-from='<run folder>'"`` (the same overrides
    plus resume-from) finishes the run: rounds 1..4 each once in metrics.jsonl, failure.json gone,
    summary.json written, and every node whose SuperNode restarted recorded as restored."""
    import os
    import signal
    import threading

    from fedproto.deploy.local_federation import LocalFederation
    from fedproto.outputs.checkpoint import load_checkpoint

    app = Path(__file__).resolve().parents[2] / "examples" / "flower" / "own_data"
    src = str(Path(__file__).resolve().parents[2] / "src")
    folders = write_node_folders(tmp_path / "data")
    out = tmp_path / "runs"
    ncs = node_configs(folders, extra={i: {"state-dir": str(tmp_path / f"state{i}")} for i in range(3)})
    overrides = {"rounds": 4, "out-dir": str(out), "seed": 7, "round-timeout": 60, "min-replies": 1}
    got: dict = {}
    with LocalFederation(tmp_path / "fed", tls=True, auth=True, env={"PYTHONPATH": src}) as fed:
        fed.start_superlink()
        for nc in ncs:
            fed.start_supernode(nc, restart=(1.0, 4.0))
        first = threading.Thread(target=lambda: got.update(first=fed.flwr_run(app, overrides, timeout=900)))
        first.start()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not list(out.glob("*/metrics.jsonl")):
            time.sleep(0.5)
        metrics = next(out.glob("*/metrics.jsonl"))
        run_dir = metrics.parent
        while time.monotonic() < deadline and not metrics.read_text().strip():  # until round 1 is logged
            time.sleep(0.5)
        time.sleep(0.5)  # round 2 is under way
        os.kill(fed.procs["superlink"].pid, signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() < deadline and not (run_dir / "failure.json").exists():  # within round-timeout
            time.sleep(0.5)
        noticed = time.monotonic() - killed
        failure = json.loads((run_dir / "failure.json").read_text())
        stopped = [json.loads(x)["round"] for x in metrics.read_text().splitlines()]
        assert failure["rounds_completed"] == len(stopped) and stopped in ([1], [1, 2]), (failure, stopped)
        assert failure["checkpoint"] and (run_dir / "checkpoint.pt").is_file()
        assert load_checkpoint(run_dir / "checkpoint.pt")["round"] == len(stopped)
        assert failure["resume"] == f"flwr run {shlex.quote(str(run_dir.absolute() / 'resume-app'))} --stream"
        resume_app = tomllib.loads((run_dir / "resume-app" / "pyproject.toml").read_text())
        assert {k: resume_app["tool"]["flwr"]["app"]["config"][k] for k in ("rounds", "seed", "out-dir",
                                                                            "resume-from", "wait-nodes")} == \
            {"rounds": 4, "seed": 7, "out-dir": str(out), "resume-from": str(run_dir.absolute()), "wait-nodes": 180.0}
        assert not (run_dir / "summary.json").exists()
        starts = {f"node{i}": len(fed.supernode_pids(f"node{i}")) for i in range(3)}
        fed.start_superlink(name="superlink2")
        res = fed.run_printed(failure["resume"], timeout=900)  # as printed: no placeholder to fill in
        restarted = {i for i in range(3) if len(fed.supernode_pids(f"node{i}")) > 1}
        first.join(60)  # the first flwr run (its stream retries the SuperLink, then sees its run finished)
        logs = {name: fed.log(name) for name in fed.procs}
    text = res.stdout + res.stderr
    assert "fedproto: fedproto on custom: accuracy" in text, (text[-3000:], {k: v[-1500:] for k, v in logs.items()})
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4], rows
    assert not (run_dir / "failure.json").exists() and (run_dir / "summary.json").is_file()
    assert not (run_dir / "checkpoint.pt").exists()
    rejoined = {}
    for r in rows[len(stopped):]:
        rejoined.update(r.get("rejoined", {}))
    # a new Flower run: every node starts from a fresh context (restarted SuperNode or not) and reloads its state file
    assert rejoined == {str(i): "restarted with its state restored from its state file" for i in range(3)}, rows
    assert "did not answer" in failure["message"] and noticed < 60 + 30, (failure, noticed)  # round-timeout=60
    print(f"failure.json {noticed:.0f} s after the kill: {failure['message'][:80]}; stopped after rounds {stopped}; "
          f"SuperNode starts when the SuperLink was killed: {starts}; restarted by the end: {sorted(restarted)}; "
          f"first flwr run: {got['first'].returncode if 'first' in got else 'still running'}")
