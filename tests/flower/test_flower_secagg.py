"""Secure aggregation over Flower (``fedproto.flower.secagg_messages``; the protocol itself is in
tests/secagg/test_secagg.py): in this process (:class:`WireGrid` keeps every reply the server
receives), the server sees no individual prototype, the decoded sums equal plain aggregation's
(also after a dropout, the classes one survivor holds alone withheld), a class with too few
contributors stays masked, label sets stay hidden, a node refuses a second unmask request, median
and class check are refused, and under DP only the masked noised sums are sent; the same on a TLS
deployment with SuperNode authentication (slow, one module fixture for the four tests)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower

from flower_helpers import (  # noqa: E402  (the Flower tests' grid, configs and node folders)
    NODE_CLASSES,
    LocalGrid,
    _own_config,
    flower_process,
    in_process_reference,
    node_configs,
    write_node_folders,
)
from flwr.app import Context, Message, RecordDict  # noqa: E402

from fedproto.errors import ConfigError, TrainingError  # noqa: E402
from fedproto.flower import client_app  # noqa: E402
from fedproto.flower.node_state import INSTANCE_KEYS  # noqa: E402
from fedproto.flower.records import MESSAGE, from_record, run_config  # noqa: E402
from fedproto.flower.server_app import FlowerEngine  # noqa: E402
from fedproto.secagg import codec as secagg_codec  # noqa: E402


@pytest.fixture(autouse=True)
def _flower_process(tmp_path, monkeypatch):
    """The ServerApp process's task identity and a node-state cache of this test's own
    (:func:`flower_helpers.flower_process`)."""
    yield from flower_process(tmp_path, monkeypatch)


class WireGrid(LocalGrid):
    """A LocalGrid that keeps every reply the server receives (what the server process holds)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.received: list[Message] = []

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        self.received += replies
        return replies


def _plain_replies(monkeypatch) -> dict:
    """(round, client id) -> the reply each node's client step made, before anything masks it."""
    got: dict = {}
    step = client_app.client_step

    def spy(alg, state, message, data, seed, r):
        out, res = step(alg, state, message, data, seed, r)
        got[(r, state.cid)] = {k: np.array(v) for k, v in out.items()}
        return out, res

    monkeypatch.setattr(client_app, "client_step", spy)
    return got


def _secagg_run(tmp_path, monkeypatch, name="sa", extra=None, **kw):
    folders = write_node_folders(tmp_path / name)
    uc = _own_config(**kw)
    grid = WireGrid(uc, node_configs=node_configs(folders, extra=extra))
    plain = _plain_replies(monkeypatch)
    eng = FlowerEngine(run_config(uc), grid, out=tmp_path / f"run-{name}")
    return eng, grid, plain, folders, eng.run()


def test_secagg_server_sees_no_individual_prototype_on_flower(tmp_path, monkeypatch):
    eng, grid, plain, _, _ = _secagg_run(tmp_path, monkeypatch, secagg=True)
    rows = [np.asarray(p, np.float32) for m in plain.values() for p in m["protos"]]
    assert len(plain) == 6 and len(rows) == 24  # 3 nodes x 2 rounds x 4 classes
    wire = [from_record(r.content[MESSAGE]) for r in grid.received if MESSAGE in r.content]
    assert len(wire) == len(grid.received) - 3  # every reply but the 3 final evaluations (metrics only)
    kinds = {r.metadata.message_type for r in grid.received}
    assert kinds == {"query", "query.secagg", "train", "evaluate"}
    for msg in wire:  # no prototype row of any client, in any reply the server got (keys, shares, vectors)
        for v in msg.values():
            blob = np.ascontiguousarray(v).tobytes()
            assert not any(row.tobytes() in blob for row in rows)
    trains = [from_record(r.content[MESSAGE]) for r in grid.received if r.metadata.message_type == "train"]
    assert len(trains) == 6 and all(list(m) == ["secagg"] and m["secagg"].dtype == np.uint64 for m in trains)
    C, d = 10, 50
    for m in trains:  # decoded alone, a masked vector is noise of the ring's scale, not a prototype
        assert np.median(np.abs(secagg_codec.decode(m["secagg"])[:C * d])) > 1e6
    assert "sum" not in eng.loop.server.checkpoint and "secagg_bytes" in eng.history[0]


def test_secagg_matches_plain_aggregation_on_flower(tmp_path, monkeypatch):
    eng, _, plain, folders, got = _secagg_run(tmp_path, monkeypatch, secagg=True)
    want = in_process_reference(folders).run()
    for key in ("acc", "acc_proto"):
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
    protos = np.load(tmp_path / "run-sa" / "prototypes.npz")
    sums: dict = {}
    for (r, _), m in plain.items():  # eq. 6 (unweighted mean) of round 2's plain replies, by hand
        for c, p in zip(m["classes"].tolist(), m["protos"].astype(np.float64)):
            if r == 2:
                sums.setdefault(c, []).append(p)
    assert protos["classes"].tolist() == sorted(sums)
    for c, p in zip(protos["classes"].tolist(), protos["protos"]):
        assert np.abs(p - np.mean(sums[c], axis=0)).max() <= 1e-6
    assert protos["contributors"].tolist() == [len(sums[c]) for c in sorted(sums)]
    assert got["secure_aggregation"]["dropouts"] == 0


def test_flower_secagg_with_a_dropout_gives_the_plain_prototypes(tmp_path, monkeypatch):
    """Node 1 sends its keys and shares each round, then fails its train step: 2 of 3 are left
    (t = 2). The global prototypes and contributor counts are eq. 6 of the survivors' plain
    replies for the classes both hold (0, 1); the classes each survivor holds alone (2, 3 and 4, 5)
    are withheld: never decoded (no seed of theirs reached the server), named in metrics.jsonl."""
    eng, grid, plain, _, got = _secagg_run(tmp_path, monkeypatch, extra={1: {"misbehave": "vanish"}}, secagg=True)
    rows = [json.loads(x) for x in (tmp_path / "run-sa" / "metrics.jsonl").read_text().splitlines()]
    assert [r["replied"] for r in rows] == [[0, 2], [0, 2]] and [r["secagg_dropped"] for r in rows] == [[1], [1]]
    assert [r["secagg_withheld"] for r in rows] == [[2, 3, 4, 5], [2, 3, 4, 5]]
    assert set(plain) == {(1, 0), (1, 2), (2, 0), (2, 2)}
    protos = np.load(tmp_path / "run-sa" / "prototypes.npz")
    assert protos["classes"].tolist() == [0, 1] and protos["contributors"].tolist() == [2, 2]
    for c, p in zip(protos["classes"].tolist(), protos["protos"]):
        rows2 = [m["protos"][m["classes"].tolist().index(c)].astype(np.float64)
                 for (r, _), m in plain.items() if r == 2]
        assert np.abs(p - np.mean(rows2, axis=0)).max() <= 1e-6
    # the server's view: every step-5 request and answer names only the classes 0 and 1 (groups 1, 2)
    reveals = [from_record(r.content[MESSAGE]) for r in grid.received
               if r.metadata.message_type == "query.secagg" and MESSAGE in r.content]
    lengths = [len(v) for m in reveals for k, v in m.items() if k.startswith("s.")]
    # step 4: one chunk (group 0's seed); step 5: two chunks (classes 0 and 1); never 3 or more
    assert set(lengths) == {4 + 16, 4 + 16 * 2}
    assert got["secure_aggregation"]["dropouts"] == 2
    assert got["secure_aggregation"]["withheld_rounds"] == {"1": [2, 3, 4, 5], "2": [2, 3, 4, 5]}


def test_secagg_a_class_with_too_few_contributors_stays_masked_on_flower(tmp_path, monkeypatch):
    """Without a dropout: node 2 alone holds class 6. The server's whole view (every reply it
    received) holds no seed of class 6's group, its sum stays masked in what the server can
    subtract, and prototypes.npz has no class 6; metrics.jsonl names it each round."""
    folders = write_node_folders(tmp_path / "d", labels=[(0, 1, 2, 3), (2, 3, 4, 5), (4, 5, 0, 1, 6)])
    uc = _own_config(secagg=True)
    grid = WireGrid(uc, node_configs=node_configs(folders))
    plain = _plain_replies(monkeypatch)
    eng = FlowerEngine(run_config(uc), grid, out=tmp_path / "run")
    eng.run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["secagg_withheld"] for r in rows] == [[6], [6]]
    protos = np.load(tmp_path / "run" / "prototypes.npz")
    assert protos["classes"].tolist() == [0, 1, 2, 3, 4, 5] and (protos["contributors"] == 2).all()
    lengths = {len(v) for r in grid.received if r.metadata.message_type == "query.secagg" and MESSAGE in r.content
               for k, v in from_record(r.content[MESSAGE]).items() if k.startswith("s.")}
    assert lengths == {4 + 16, 4 + 16 * 6}  # group 0 at step 4; the six classes 0-5 at step 5, never class 6
    d = 50
    rnd = eng.loop.algorithm._session.last
    trains = [from_record(r.content[MESSAGE])["secagg"] for r in grid.received if r.metadata.message_type == "train"]
    total = secagg_codec.decode(sum(trains[-3:]) - rnd.masks)
    mine = plain[(2, 2)]
    p6 = mine["protos"][mine["classes"].tolist().index(6)]
    assert np.abs(total[6 * d:7 * d] - p6).min() > 1.0  # class 6's sum: still masked


def test_flower_secagg_hides_label_sets_from_the_server(tmp_path, monkeypatch):
    """Under secagg (secagg_hide_labels, the default) no node's join, train or evaluate reply carries
    its label set, sample counts or step count; clients.csv says 'hidden'. With secagg_hide_labels
    false they are sent."""
    eng, grid, _, _, _ = _secagg_run(tmp_path, monkeypatch, secagg=True)
    queries = [dict(r.content["fedproto.config"]) for r in grid.received if r.metadata.message_type == "query"
               and "fedproto.config" in r.content]
    assert len(queries) == 3 and all(not {"classes", "train-samples", "test-samples"} & set(q) for q in queries)
    trains = [r for r in grid.received if r.metadata.message_type == "train"]
    assert trains and all(not {"num-examples", "steps"} & set(r.content["fedproto.metrics"]) for r in trains)
    evals = [r for r in grid.received if r.metadata.message_type == "evaluate"]
    assert evals and all("num-examples" not in r.content["fedproto.metrics"] for r in evals)
    rows = list(csv.DictReader((tmp_path / "run-sa" / "clients.csv").open()))
    assert [r["classes"] for r in rows] == ["hidden"] * 3
    _, grid2, _, _, _ = _secagg_run(tmp_path, monkeypatch, name="sent", secagg=True, secagg_hide_labels=False)
    sent = [dict(r.content["fedproto.config"]) for r in grid2.received if r.metadata.message_type == "query"
            and "fedproto.config" in r.content]
    assert sorted(tuple(q["classes"]) for q in sent) == sorted(tuple(sorted(c)) for c in NODE_CLASSES)


def test_a_second_unmask_request_in_a_round_is_refused_by_a_flower_node(tmp_path, monkeypatch):
    """The Flower node keeps its answers in its context: asked again in the round (the second time
    with a survivor marked dropped, to collect both its shares), it refuses; so it does a second
    masked vector and new keys for a round it keyed already; a node that restarted (a fresh
    context) holds nothing to reveal; a site's node-config floor is not lowered by the run config."""
    from fedproto.flower.secagg_messages import STATE, masked_reply, step
    from fedproto.secagg.protocol import Client, Server

    folders = write_node_folders(tmp_path)
    uc = _own_config(secagg=True)
    grid = LocalGrid(uc, node_configs=node_configs(folders))
    FlowerEngine(run_config(uc), grid, out=False).run()
    ctx = grid.contexts[1000]
    n = client_app.node(ctx)
    srv = Server([0, 1, 2])
    others = {j: Client() for j in (1, 2)}
    key1 = {"stage": np.array([1]), "round": np.array([9]), "parties": np.array([3]), "group": np.array([0, 1, 2]),
            "t": np.array([2])}
    pk = {0: step(n, key1, ctx)}
    pk.update({j: c.keys(j, 9, **srv.setup(j)) for j, c in others.items()})
    cts = {0: step(n, {"stage": np.array([2]), "groups": np.array([11]), **srv.keys_for(0, pk)}, ctx)}
    cts.update({j: c.shares(srv.keys_for(j, pk), 11) for j, c in others.items()})
    routed = srv.route(cts)
    down = {"secagg.ct.1": routed[0]["ct.1"], "secagg.ct.2": routed[0]["ct.2"]}
    _, finish = masked_reply(n, dict(down), ctx, 9)
    finish({})  # an empty reply: zeros, masked
    with pytest.raises(TrainingError, match="masked its vector of round 9 already"):
        masked_reply(n, dict(down), ctx, 9)
    groups = secagg_codec.codec_of(n.algorithm).groups({})
    for j, c in others.items():
        c.masked(np.zeros(len(groups), np.uint64), routed[j], groups)
    view = {"stage": np.array([4]), "alive": np.array([0, 1, 2]), "dead": np.array([], np.int64)}
    tags = {0: step(n, view, ctx), **{j: c.view([0, 1, 2], [], 2) for j, c in others.items()}}
    to0 = srv.route_tags(tags)[0]
    first = step(n, {"stage": np.array([5]), **to0}, ctx)
    assert sorted(first) == ["s.0", "s.1", "s.2"]
    with pytest.raises(TrainingError, match="a second unmask request in round 9"):
        step(n, {"stage": np.array([4]), "alive": np.array([0, 1]), "dead": np.array([2])}, ctx)
    with pytest.raises(TrainingError, match="a second unmask request in round 9"):
        step(n, {"stage": np.array([5]), **to0}, ctx)
    with pytest.raises(TrainingError, match="refuses new keys for round 9"):
        step(n, key1, ctx)
    fresh = Context(run_id=1, node_id=1000, node_config=ctx.node_config, state=RecordDict(),
                    run_config=ctx.run_config)
    with pytest.raises(TrainingError, match="holds no shares of the round"):
        step(n, {"stage": np.array([4]), "alive": np.array([0, 1]), "dead": np.array([2])}, fresh)
    # a site's floor: node config secagg-threshold 0.9 makes t = 2 of 3 too low for this node
    strict = Context(run_id=1, node_id=1000, node_config={**ctx.node_config, "secagg-threshold": 0.9},
                     state=RecordDict(), run_config=ctx.run_config)
    with pytest.raises(TrainingError, match="threshold must be at least 3 of 3"):
        step(n, key1, strict)
    assert STATE in ctx.state


def test_secagg_refuses_median_and_class_check_on_flower(tmp_path):
    folders = write_node_folders(tmp_path)
    for bad, why in ((dict(aggregation="median"), "aggregation='median' needs each client's prototype"),
                     (dict(class_check=3.0), "class_check=3(.0)? checks each client's prototype rows")):
        uc = _own_config(secagg=True, **bad)
        with pytest.raises(ConfigError, match=why):
            FlowerEngine(run_config(uc), LocalGrid(uc, node_configs=node_configs(folders)), out=False)


def test_secagg_with_dp_sends_only_the_masked_noised_sums_on_flower(tmp_path, monkeypatch):
    """Under secagg and dp prototypes a node's train reply is its masked vector alone (no losses),
    and the summary states epsilon for the sum and for each node's own noise."""
    from fedproto.prototypes.dp import epsilon

    folders = write_node_folders(tmp_path)
    uc = _own_config(secagg=True, dp="prototypes", aggregation="weighted", secagg_honest=2, dp_noise=1.0)
    grid = WireGrid(uc, node_configs=node_configs(folders))
    got = FlowerEngine(run_config(uc), grid, out=tmp_path / "run").run()
    trains = [r for r in grid.received if r.metadata.message_type == "train"]
    assert len(trains) == 6 and all(list(from_record(r.content[MESSAGE])) == ["secagg"] for r in trains)
    assert all(set(r.content["fedproto.metrics"]) <= set(INSTANCE_KEYS) for r in trains)
    dp = got["secure_aggregation"]["dp"]
    assert dp["epsilon_sum"] == pytest.approx(epsilon([(1.0, 1.0, 2)], 1e-5))
    assert dp["epsilon_client_max"] == pytest.approx(epsilon([(1.0 / np.sqrt(2), 1.0, 2)], 1e-5))
    protos = np.load(tmp_path / "run" / "prototypes.npz")  # classes 0..5, each from its 2 holders' noised sums
    assert protos["classes"].tolist() == [0, 1, 2, 3, 4, 5] and np.isfinite(protos["protos"]).all()


@pytest.fixture(scope="module")
def secagg_deployment(tmp_path_factory):
    """Two federations on 127.0.0.1 with TLS and SuperNode authentication, 3 own-data nodes each
    (the second's node 1 fails every train step: ``misbehave = "vanish"``); ``flwr run`` of the
    own-data app for one round under ``secagg`` on each, and with ``aggregation = "median"`` on the
    first. Returns the runs' folders and outputs, and each client's plain reply of that round made
    by the Python API with the same clients (round 1 needs no global prototype, so a node's reply
    is the same with and without secagg)."""
    from fedproto.deploy.local_federation import LocalFederation

    root = tmp_path_factory.mktemp("secagg-deployment")
    app = Path(__file__).resolve().parents[2] / "examples" / "flower" / "own_data"
    src = str(Path(__file__).resolve().parents[2] / "src")
    folders = write_node_folders(root / "data")
    runs: dict = {}
    for fed_name, extra in (("fed", None), ("fed-vanish", {1: {"misbehave": "vanish"}})):
        with LocalFederation(root / fed_name, tls=True, auth=True, env={"PYTHONPATH": src}) as fed:
            fed.start_superlink()
            for nc in node_configs(folders, extra=extra):
                fed.start_supernode(nc)
            todo = {"secagg": {}, **({"median": {"aggregation": "median"}} if extra is None else {})}
            for name, opts in todo.items():
                out = root / "runs" / f"{fed_name}-{name}"
                res = fed.flwr_run(app, {"rounds": 1, "out-dir": str(out), "seed": 7, "round-timeout": 600,
                                         "secagg": True, **opts}, timeout=1200)
                runs[f"{fed_name}-{name}"] = (next(iter(out.glob("*/")), None), res.stdout + res.stderr)
    ref = in_process_reference(folders, rounds=1)
    plain: dict = {}
    step = ref.executor.train

    def spy(r, sent, downlink=None):
        got = step(r, sent, downlink)
        plain.update({i: m for i, (m, _) in got.replies.items()})
        return got

    ref.executor.train = spy
    summary = ref.run()
    return runs, plain, summary


def _run_files(run_dir) -> tuple[dict, list[dict]]:
    return (json.loads((run_dir / "summary.json").read_text()),
            [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()])


def _class_means(replies: dict) -> dict:
    """Eq. 6 (unweighted mean) of the replies' prototypes, per class, by hand."""
    rows: dict = {}
    for m in replies.values():
        for c, p in zip(m["classes"].tolist(), m["protos"].astype(np.float64)):
            rows.setdefault(c, []).append(p)
    return {c: np.mean(v, axis=0) for c, v in rows.items()}


@pytest.mark.slow
def test_secagg_server_sees_no_individual_prototype_on_a_tls_deployment(secagg_deployment):
    runs, plain, _ = secagg_deployment
    run_dir, logs = runs["fed-secagg"]
    assert run_dir is not None and "fedproto: fedproto on custom: accuracy" in logs, logs[-3000:]
    _, rows = _run_files(run_dir)
    C, d = 10, 50
    # what reached the server's round loop: one masked (C * (d + 2),) uint64 vector per node
    assert rows[0]["up_bytes"] == 3 * 8 * C * (d + 2) and rows[0]["secagg_bytes"] > 0
    rows_plain = [np.asarray(p, np.float32).tobytes() for m in plain.values() for p in m["protos"]]
    assert len(rows_plain) == 12  # 3 nodes x 4 classes
    for f in run_dir.rglob("*"):  # nothing the server process wrote holds a node's prototype
        if f.is_file():
            blob = f.read_bytes()
            assert not any(row in blob for row in rows_plain), f


@pytest.mark.slow
def test_secagg_matches_plain_aggregation_on_a_tls_deployment(secagg_deployment):
    runs, plain, want = secagg_deployment
    got, _ = _run_files(runs["fed-secagg"][0])
    for key in ("acc", "acc_proto"):
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
    protos, means = np.load(runs["fed-secagg"][0] / "prototypes.npz"), _class_means(plain)
    assert protos["classes"].tolist() == sorted(means)
    for c, p in zip(protos["classes"].tolist(), protos["protos"]):
        assert np.abs(p - means[c]).max() <= 1e-6
    assert got["secure_aggregation"]["dropouts"] == 0


@pytest.mark.slow
def test_flower_secagg_with_a_dropout_gives_the_plain_prototypes_on_a_tls_deployment(secagg_deployment):
    runs, plain, _ = secagg_deployment
    run_dir, logs = runs["fed-vanish-secagg"]
    assert run_dir is not None and "fedproto: fedproto on custom: accuracy" in logs, logs[-3000:]
    got, rows = _run_files(run_dir)
    assert rows[0]["replied"] == [0, 2] and rows[0]["secagg_dropped"] == [1] and "1" in rows[0]["failed"]
    assert got["secure_aggregation"]["dropouts"] == 1
    # the global prototypes are the mean of clients 0 and 2 alone (node 1's masks rebuilt from their shares)
    # for the classes both hold; the classes one survivor holds alone stay masked (secagg_min_contributors 2)
    protos, means = np.load(run_dir / "prototypes.npz"), _class_means({i: plain[i] for i in (0, 2)})
    assert protos["classes"].tolist() == [0, 1] and protos["contributors"].tolist() == [2, 2]
    assert rows[0]["secagg_withheld"] == [2, 3, 4, 5]
    for c, p in zip(protos["classes"].tolist(), protos["protos"]):
        assert np.abs(p - means[c]).max() <= 1e-6


@pytest.mark.slow
def test_secagg_refuses_median_and_class_check_on_a_tls_deployment(secagg_deployment):
    runs, _, _ = secagg_deployment
    run_dir, logs = runs["fed-median"]
    assert 'aggregation="median" needs each client\'s prototype' in logs, logs[-3000:]
    assert run_dir is None or not (run_dir / "metrics.jsonl").exists()
