"""Benchmark clients of Flower's simulation runtime (fedproto.flower.virtual) and docs/flower.md's
simulation section, run as written."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib
import torch

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower

from conftest import DATA, DOCS, needs_mnist  # noqa: E402
from flower_helpers import LocalGrid  # noqa: E402
from flwr.app import Error, Message  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedproto.config.run_config import build_config  # noqa: E402
from fedproto.flower import client_app, virtual  # noqa: E402
from fedproto.flower.records import run_config  # noqa: E402
from fedproto.flower.server_app import FlowerEngine  # noqa: E402
from fedproto.models.proto_model import ProtoModel  # noqa: E402
from fedproto.simulation import Simulation  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BASE = dict(dataset="digits", clients=6, ways=3, shots=12, stdev=1, test_shots=6, rounds=2, model="cnn",
            eval_every=0, lr=0.05, threads=1)


class OneProcessGrid(LocalGrid):
    """A Flower Grid whose virtual nodes (``partition-id`` 0..n-1) all run in this process, as the
    nodes of one Ray actor do: each message goes to the real ClientApp with its node's ``Context``
    (kept across rounds, as Flower's simulation runtime keeps it); ``served``: the partitions served, in order."""

    def __init__(self, run_config: dict, n: int):
        super().__init__(run_config, list(range(n)), n)
        self.served: list[int] = []

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = f"m{next(self._ids)}"
            nid = msg.metadata.dst_node_id
            try:
                replies.append(client_app.app(msg, self.contexts[nid]))
            except Exception as e:  # noqa: BLE001 - a SuperNode turns a ClientApp exception into an error reply
                replies.append(Message(Error(code=1, reason=f"{type(e).__name__}: {e}"), reply_to=msg))
            self.served.append(nid - 1000)
        return replies


@pytest.fixture(autouse=True)
def _server_process(monkeypatch, tmp_path):
    """Play the ServerApp process (Flower's task identity), keep torch's thread count, and give the
    test its own decoded-dataset cache."""
    for k, v in {"_run_id": 1, "_node_id": 0, "_task_id": 0}.items():
        monkeypatch.setattr(TaskIdentity, k, v)
    monkeypatch.setenv("FEDPROTO_DECODED_CACHE", str(tmp_path / "decoded"))
    n = torch.get_num_threads()
    client_app.forget_clients()
    yield
    client_app.forget_clients()
    torch.set_num_threads(n)


def _models_alive() -> int:
    gc.collect()
    return sum(issubclass(type(o), ProtoModel) for o in gc.get_objects())  # type(): no lazy attribute touched


@pytest.mark.parametrize("algorithm", ["fedproto", "fedavg"])
def test_a_simulation_actor_holds_one_client_not_the_run(algorithm, monkeypatch):
    """Six virtual nodes served by one process that keeps one client built (``KEEP=1``): every
    message rebuilds or reuses only its own client, so the process never holds more than one client
    model (the run's set-up models are dropped once the algorithm is built), the kept client's
    inputs are its own rows (not a view of the dataset), and the numbers are the in-process
    simulator's: accuracies, losses and message sizes."""
    monkeypatch.setattr(virtual, "KEEP", 1)
    uc = {k.replace("_", "-"): v for k, v in {**BASE, "algorithm": algorithm}.items()}
    ref = Simulation(build_config(overrides={**BASE, "algorithm": algorithm, "execution": "sequential"}), out=False)
    want = ref.run()
    ref_history = ref.history
    del ref
    before = _models_alive()
    grid = OneProcessGrid(uc, BASE["clients"])
    eng = FlowerEngine(run_config(uc), grid, out=False)
    got = eng.run()
    for key in want["accuracy"]:
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
    for a, b in zip(eng.history, ref_history):
        assert a["loss_ce"] == pytest.approx(b["loss_ce"], rel=1e-6)
        assert (a["up_params"], a["down_params"]) == (b["up_params"], b["down_params"])
    assert sorted(set(grid.served)) == list(range(BASE["clients"]))
    kept = virtual.kept_clients()
    assert kept == [grid.served[-1]]  # the last client served, alone
    assert _models_alive() - before == 1  # its model; the six clients' other models are gone
    run = virtual.run_for(run_config(uc))
    state, data, _ = virtual.virtual_client(run_config(uc), kept[0], fresh=False)
    assert not data.is_view and len(data.x) == len(run.partition.train_idx[kept[0]]) < len(run.dataset.train_x)
    assert torch.equal(data.x, run.dataset.train_x[torch.as_tensor(run.partition.train_idx[kept[0]])])


MEASURE = textwrap.dedent("""
    import json, os, sys, tomllib
    from fedproto.flower.records import run_config
    from fedproto.flower import virtual
    def mb():
        f = {}
        for line in open("/proc/self/smaps_rollup"):
            p = line.split()
            if len(p) >= 2 and p[1].isdigit():
                f[p[0][:-1]] = int(p[1]) * 1024
        return (f["Private_Clean"] + f["Private_Dirty"]) / 2**20
    app = tomllib.load(open(sys.argv[1], "rb"))["tool"]["flwr"]["app"]["config"]
    cfg = run_config({**app, "dataset": "mnist", "clients": 100, "rounds": 1})
    run = virtual.run_for(cfg)
    start = mb()
    for cid in range(100):
        state, data, alg = virtual.virtual_client(cfg, cid, fresh=True)
        data.x, data.test_x
    mapped = any("train_x.npy" in line for line in open("/proc/self/maps"))
    print(json.dumps({"start": start, "end": mb(), "kept": virtual.kept_clients(), "mapped": mapped,
                      "dataset_mb": run.dataset.train_x.numel() * 4 / 2**20}))
""")


@pytest.mark.slow
@needs_mnist
def test_an_actor_serving_100_mnist_clients_holds_their_rows_not_the_dataset(tmp_path):
    """A fresh process (an actor) serves all 100 clients of the MNIST benchmark setting: its
    private memory grows by less than 40 MB (the decoded training split alone is 179 MB, which
    every process used to decode and hold), it keeps the last KEEP clients, and the dataset is
    a memory map of the cache file."""
    env = {**os.environ, "FEDPROTO_DATA": DATA, "FEDPROTO_DECODED_CACHE": str(tmp_path / "decoded"),
           "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", MEASURE, str(ROOT / "examples" / "flower" / "pyproject.toml")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["dataset_mb"] > 170
    assert got["end"] - got["start"] < 40, got
    assert got["kept"] == list(range(100 - virtual.KEEP, 100)) and got["mapped"]


def _section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.index("\n### ", start + len(title))
    return text[start:end]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@needs_mnist
def test_flower_docs_simulation_commands_run_as_written(tmp_path):
    """docs/flower.md's simulation section, pasted into a shell from a clone's root (here a folder
    whose ``examples`` is the clone's): its first bash block (environment and SuperLink), its
    config.toml block into ``$FLWR_HOME/config.toml``, its ``flwr run`` block. Only the placeholders
    change: the data folder (``/path/to/data``) and the port (9093, a free one here). The run
    finishes with the in-process simulator's accuracy."""
    pytest.importorskip("ray", reason="Flower's simulation runtime needs Ray: pip install \"fedproto[flower-sim]\"")
    section = _section((DOCS / "flower.md").read_text(), "### (a) Flower's simulation runtime")
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    assert [lang for lang, _ in blocks] == ["bash", "toml", "bash"], blocks
    (_, start), (_, toml), (_, run) = blocks
    assert "--disable-runtime-dependency-installation" in start and "FEDPROTO_DATA" in start
    port = str(_free_port())
    swap = {"/path/to/data": DATA, "9093": port}
    for old, new in swap.items():
        start, toml, run = (b.replace(old, new) for b in (start, toml, run))
    tomllib.loads(toml)  # the block parses as TOML
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    script = "\n".join([
        "set -e", start, "SUPERLINK=$!",
        f"for i in $(seq 240); do (echo > /dev/tcp/127.0.0.1/{port}) 2>/dev/null && break; sleep 0.5; done",
        "cat > \"$FLWR_HOME/config.toml\" <<'TOML'", toml.strip(), "TOML", run,
        "kill $SUPERLINK; wait $SUPERLINK || true"])
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
           # this checkout's fedproto also for a Flower installed outside its environment (as the other tests)
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    env.pop("FEDPROTO_DECODED_CACHE", None)  # the cache where the docs say: next to the data or the user cache
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    log = tmp_path / "commands.log"  # a file, not a pipe: Ray's processes outlive the script and keep it open
    with open(log, "w") as f:
        p = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            p.wait(timeout=900)
        finally:  # whatever the script left in its session (Ray's processes)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    out = log.read_text(errors="replace")
    assert p.returncode == 0, out[-4000:]
    summaries = list((tmp_path / "runs" / "sim").glob("*/summary.json"))
    assert len(summaries) == 1, out[-4000:]
    got = json.loads(summaries[0].read_text())
    overrides = dict(re.findall(r"(\S+)=(\"[^\"]*\"|\S+)", re.search(r"--run-config '([^']*)'", run).group(1)))
    overrides = {k: tomllib.loads(f"v = {v}")["v"] for k, v in overrides.items() if k != "out-dir"}
    assert overrides["dataset"] == "mnist"
    app = tomllib.loads((ROOT / "examples" / "flower" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    app = {k: v for k, v in app.items() if k not in ("out-dir", "resume-from")}
    want = Simulation(run_config({**app, **overrides, "execution": "sequential"}), out=False).run()
    assert got["clients"] == overrides["clients"] and got["rounds"] == overrides["rounds"]
    for key in want["accuracy"]:
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
