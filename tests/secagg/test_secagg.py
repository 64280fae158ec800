"""Secure aggregation (fedproto.secagg) in the simulator: the server holds masked vectors only,
their sum gives the plain aggregation within the fixed-point error, dropouts below the threshold
are survived, options that need individual replies are refused. The Flower side is in
tests/flower/test_flower_secagg.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("Crypto", reason="secure aggregation uses the flower extra's primitives: pip install "
                    "\"fedproto[flower]\"")
pytestmark = pytest.mark.flower

from conftest import Interrupted, digits_config, interrupt_at, run_cli  # noqa: E402

from fedproto.engine.loop import Observer  # noqa: E402
from fedproto.errors import ConfigError, TrainingError  # noqa: E402
from fedproto.secagg import codec  # noqa: E402
from fedproto.secagg.protocol import Client, Server, share_group, threshold  # noqa: E402
from fedproto.simulation import Simulation  # noqa: E402

STEP = 2.0 ** -codec.FRAC_BITS  # one unit of the fixed-point encoding


class Seen(Observer):
    """What the server side of the loop is handed each round (the replies after the executor)."""

    def __init__(self):
        self.rounds: dict[int, dict] = {}

    def replies(self, loop, round, replies):
        self.rounds[round] = {i: dict(m) for i, (m, _) in replies.replies.items()}


def _sim(**kw) -> tuple[Simulation, Seen, dict]:
    """A simulation of 6 digits clients; returns it, the server-side observer and, per round, each
    client's plain reply as its client made it (captured inside the client side, before masking)."""
    sim = Simulation(digits_config(**kw), out=False)
    seen, plain = Seen(), {}
    sim.loop.observers.insert(0, seen)
    inner = getattr(sim.executor, "_ex", sim.executor)
    train = inner.train

    def spy(r, sent, downlink=None):
        got = train(r, sent, downlink)
        plain[r] = {i: {k: np.array(v) for k, v in m.items()} for i, (m, _) in got.replies.items()}
        return got

    inner.train = spy
    return sim, seen, plain


def _mean_protos(replies: dict[int, dict], weighted: bool) -> dict[int, np.ndarray]:
    """Eq. 6 by hand: per class, the (count-weighted) mean of the replies' prototypes, float64."""
    sums, weights = {}, {}
    for m in replies.values():
        for c, p, n in zip(m["classes"].tolist(), m["protos"].astype(np.float64), m["counts"].tolist()):
            w = float(n) if weighted else 1.0
            sums[c] = sums.get(c, 0.0) + w * p
            weights[c] = weights.get(c, 0.0) + w
    return {c: sums[c] / weights[c] for c in sums}


def test_secagg_server_sees_no_individual_prototype():
    sim, seen, plain = _sim(secagg=True, rounds=2, secagg_min_contributors=1)
    sim.run()
    C, d = sim.setup.algorithm.num_classes, sim.setup.embedding_dim
    for r in (1, 2):
        assert sorted(seen.rounds[r]) == sorted(plain[r]) == list(range(6))
        for i, msg in seen.rounds[r].items():
            # the server holds one masked uint64 vector per client: no classes, prototypes or counts
            v = msg["secagg"]
            assert list(msg) == ["secagg"] and v.dtype == np.uint64 and v.shape == (C * (d + 2),)
            mine = codec.decode(msg["secagg"]).reshape(-1)[:C * d].reshape(C, d)
            for c, p in zip(plain[r][i]["classes"], plain[r][i]["protos"]):
                # the row the client encoded, decoded from what the server holds: mask noise of 2^31 scale
                assert np.abs(mine[c] - p).min() > 1.0, (r, i, c)
            # nor can any other client's prototype be read from it
            others = np.concatenate([m["protos"] for j, m in plain[r].items() if j != i])
            assert not np.isclose(mine[:, None, :], others[None], atol=1e-3).all(-1).any()
    # yet the sum of the masked vectors, less the masks, is the sum of the clients' encodings exactly
    alg, rnd = sim.loop.algorithm, sim.loop.algorithm._session.last
    total = sum(m["secagg"] for m in seen.rounds[2].values()) - rnd.masks
    want = sum(codec.encode(alg._codec.vector(i, m, {}), 6) for i, m in plain[2].items())
    assert np.array_equal(total, want)


@pytest.mark.parametrize("aggregation", ["mean", "weighted"])
def test_secagg_matches_plain_aggregation(aggregation):
    got, _, plain = _sim(secagg=True, rounds=3, eval_every=1, aggregation=aggregation, secagg_min_contributors=1)
    ref, _, ref_plain = _sim(rounds=3, eval_every=1, aggregation=aggregation)
    sg, sr = got.run(), ref.run()
    # every client step saw the same global prototypes (within the fixed-point error): same replies
    for r in (1, 2, 3):
        for i in range(6):
            assert np.abs(plain[r][i]["protos"] - ref_plain[r][i]["protos"]).max() <= 1e-5
    # the global prototypes are eq. 6 of the clients' plain replies, to the fixed-point error
    want = _mean_protos(plain[3], aggregation == "weighted")
    msg = got.message
    assert sorted(want) == msg["classes"].tolist()
    for c, p in zip(msg["classes"].tolist(), msg["protos"]):
        assert np.abs(p - want[c]).max() <= 6 * STEP + 1e-6 * np.abs(want[c]).max()  # float32 rounding
    for key in ("acc", "acc_proto"):
        assert sg["accuracy"][key]["mean"] == pytest.approx(sr["accuracy"][key]["mean"], abs=1e-9)
    assert sg["secure_aggregation"]["fixed_point_bits"] == codec.FRAC_BITS and "secure_aggregation" not in sr
    # the uplink is one masked vector per client: C * (d + 2) uint64 words
    C, d = got.setup.algorithm.num_classes, got.setup.embedding_dim
    assert got.history[0]["up_bytes"] == 6 * 8 * C * (d + 2) and got.history[0]["secagg_bytes"] > 0


def test_secagg_matches_plain_weight_averaging():
    got, _, plain = _sim(secagg=True, rounds=2, algorithm="fedavg")
    got.run()
    n = {i: float(m["n"][0]) for i, m in plain[2].items()}
    for k in (k for k in got.message if k.startswith("w/")):
        want = sum(n[i] * plain[2][i][k].astype(np.float64) for i in n) / sum(n.values())
        assert np.abs(got.message[k] - want).max() <= 1e-6 * max(1.0, float(np.abs(want).max()))


def test_secagg_survives_a_dropout_below_the_threshold():
    sim, seen, plain = _sim(secagg=True, rounds=2, momentum=0.0, secagg_min_contributors=1)
    sim.executor.drop = {2: [3]}  # client 3 sends its keys and shares in round 2, then no masked vector
    sim.run()
    assert sorted(seen.rounds[2]) == [0, 1, 2, 4, 5]
    assert sim.history[1]["secagg_dropped"] == [3] and sim.history[0]["secagg_dropped"] == []
    want = _mean_protos({i: m for i, m in plain[2].items() if i != 3}, weighted=False)
    msg = sim.message
    for c, p in zip(msg["classes"].tolist(), msg["protos"]):
        if c in want:
            assert np.abs(p - want[c]).max() <= 1e-5
    # a class only the dropped client held keeps its previous global prototype (no contributor this round)
    held = {c for i, m in plain[2].items() if i != 3 for c in m["classes"].tolist()}
    only3 = set(plain[2][3]["classes"].tolist()) - held
    contributors = sim.loop.server.checkpoint["last_contributors"]
    assert all(contributors[msg["classes"].tolist().index(c)] == 0 for c in only3)
    # at or above the threshold (t = 4 of 6: at most 2 dropouts), the round stops with a clear error
    over, _, _ = _sim(secagg=True, rounds=1)
    over.executor.drop = {1: [0, 1, 2]}
    with pytest.raises(TrainingError, match=r"3 alive members of its share group \(threshold 4\).*too few to unmask"):
        over.run()


def test_secagg_refuses_median_and_class_check(capsys, monkeypatch):
    with pytest.raises(ConfigError, match=r"aggregation='median' needs each client's prototype"):
        Simulation(digits_config(secagg=True, aggregation="median"), out=False)
    with pytest.raises(ConfigError, match=r"class_check=3(\.0)? checks each client's prototype rows"):
        Simulation(digits_config(secagg=True, class_check=3.0), out=False)
    for bad, why in ((dict(aggregation="trimmed"), "aggregation='trimmed'"), (dict(exclude_outliers=3.0), "exclude_"),
                     (dict(algorithm="fedtgp"), "algorithm='fedtgp' aggregates each client's reply"),
                     (dict(attack="scale", attackers=1), "attack='scale' changes replies")):
        with pytest.raises(ConfigError, match=why):
            Simulation(digits_config(secagg=True, **bad), out=False)
    code, out = run_cli(["run", "--dataset", "digits", "--secagg", "--aggregation", "median", "--rounds", "1",
                         "--threads", "1"], capsys, monkeypatch)
    assert code == 2 and "--aggregation median needs each client's prototype" in out


def test_protocol_rebuilds_the_sum_from_shares_and_refuses_double_unmasking():
    """The protocol alone, on a SecAgg+ ring (each client with 2 neighbours): sum of 5 vectors with
    client 4 dropped after sharing; a client refuses to reveal both shares of one client."""
    ids = [0, 1, 2, 3, 4]
    assert share_group(ids, 0, 2) == [0, 1, 4] and share_group(ids, 2, 2) == [1, 2, 3] and share_group(ids, 2) == ids
    assert (threshold(3, 0.5), threshold(20, 0.5), threshold(5, 0.0)) == (2, 11, 1)
    srv = Server(ids, 0.5, 2)
    cl = {i: Client() for i in ids}
    pks = {i: cl[i].keys(i, 1, **srv.setup(i)) for i in ids}
    routed = srv.route({i: cl[i].shares(srv.keys_for(i, pks)) for i in ids})
    rng = np.random.default_rng(0)
    xs = {i: rng.normal(0, 10, 7) for i in ids}
    masked = {i: cl[i].masked(codec.encode(xs[i], 5), routed[i]) for i in ids if i != 4}
    alive, dead = srv.unmask_request(sorted(masked))
    assert (alive, dead) == ([0, 1, 2, 3], [4])
    with pytest.raises(TrainingError, match="both shares"):
        cl[0].view([1, 4], [4])
    shares = _unmask(srv, cl, alive, dead)
    total = codec.decode(sum(masked.values()) - srv.masks(alive, dead, shares, np.zeros(7, np.int64)))
    assert np.abs(total - sum(xs[i] for i in alive)).max() <= 4 * STEP


def test_cli_secagg_run_records_secure_aggregation(tmp_path, capsys, monkeypatch):
    args = ["run", "--dataset", "digits", "--clients", "4", "--rounds", "2", "--threads", "1", "--out-dir",
            str(tmp_path)]
    # secagg_min_contributors 1: every class decoded, as plain aggregation uses it (the default 2 withholds some)
    assert run_cli([*args, "--secagg", "--secagg-min-contributors", "1", "--name", "sa"], capsys, monkeypatch)[0] == 0
    assert run_cli([*args, "--name", "plain"], capsys, monkeypatch)[0] == 0
    sa, plain = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("sa", "plain"))
    assert sa["secure_aggregation"]["threshold_fraction"] == 0.5 and sa["secure_aggregation"]["extra_bytes"] > 0
    assert json.loads((tmp_path / "sa" / "config.json").read_text())["secagg"] is True
    for key in ("acc", "acc_proto"):
        assert sa["accuracy"][key]["mean"] == pytest.approx(plain["accuracy"][key]["mean"], abs=1e-9)


def test_secagg_with_dp_adds_each_clients_share_of_the_noise():
    """Distributed noise: each client's class sums and counts get noise of multiplier σ / √h, so a
    sum over h honest clients carries σ's; the summary states ε for the sum and each client's own."""
    import torch

    from fedproto.prototypes.dp import epsilon
    from fedproto.secagg.epsilon import noisy_sums

    sim = Simulation(digits_config(secagg=True, dp="prototypes", aggregation="weighted", dp_noise=1.0, dp_clip=5.0,
                                   secagg_honest=4, rounds=2), out=False)
    alg, state, data = sim.setup.algorithm, sim.setup.states[0], sim.setup.data[0]
    assert alg.dp_noise == 0.5  # 1 / sqrt(4)
    C, d = alg.num_classes, alg.embedding_dim
    with torch.no_grad():
        state.model.eval()
        h = state.model.embed(data.x).to(torch.float64)
    h = h * torch.clamp(5.0 / h.norm(dim=1, keepdim=True), max=1.0)  # each embedding clipped to norm 5
    rng = np.random.default_rng(0)
    draws = np.stack([noisy_sums(alg, state, data, rng) for _ in range(300)])
    for c in state.classes.tolist():
        clean = h[data.y == c].sum(0).numpy()
        noise = draws[:, c * d:(c + 1) * d] - clean
        assert abs(noise.mean()) < 0.1 and noise.std() == pytest.approx(0.5 * np.sqrt(2) * 5.0, rel=0.03)
        cn = draws[:, C * d + c] - float((data.y == c).sum())
        assert cn.std() == pytest.approx(0.5 * np.sqrt(2), rel=0.15)
    assert (draws[:, C * (d + 1):] == np.isin(np.arange(C), state.classes)).all()
    summary = sim.run()["secure_aggregation"]["dp"]
    # epsilon_sum: the worst class's, from the contributors present (test_secagg_dp_epsilon_counts_...)
    assert summary["epsilon_sum"] == max(summary["epsilon_per_class"].values()) > 0
    assert summary["epsilon_client_max"] == pytest.approx(epsilon([(0.5, 1.0, 2)], 1e-5))
    assert summary["epsilon_client_max"] > summary["epsilon_sum"] and summary["honest_clients_assumed"] == 4
    for bad, why in ((dict(dp="full"), "DP-SGD's noise is each client's own"),
                     (dict(dp="prototypes"), "use aggregation='weighted'")):
        with pytest.raises(ConfigError, match=why):
            Simulation(digits_config(secagg=True, **bad), out=False)


def test_settings_that_hide_little_are_warned_about(caplog):
    """One or two clients, a threshold of one share, more neighbours than clients: secagg ran without a word."""
    from types import SimpleNamespace

    from fedproto.secagg import weak

    def cfg(clients, threshold=0.5, neighbours=0, minimum=2):
        return SimpleNamespace(clients=clients, secagg_threshold=threshold, secagg_neighbours=neighbours,
                               secagg_min_contributors=minimum)

    assert weak(cfg(20)) == [] and weak(cfg(3, neighbours=2)) == []
    with caplog.at_level("WARNING", logger="fedproto.secagg"):
        one, two = weak(cfg(1)), weak(cfg(2))
    assert len(one) >= 1 and "secure aggregation needs 3 clients or more" in one[0]
    assert "needs 3 clients or more" in two[0] and "secagg: with 2 client(s)" in caplog.text
    assert any("1 share enough to rebuild" in w for w in weak(cfg(5, threshold=0.0)))  # t = floor(0 * 5) + 1 = 1
    assert not any("1 share" in w for w in weak(cfg(5, threshold=0.2)))  # t = floor(0.2 * 5) + 1 = 2
    assert any("more than the 2 other clients" in w for w in weak(cfg(3, neighbours=10)))
    assert any("decode a class held by one client" in w for w in weak(cfg(20, minimum=1)))
    assert any("collect both shares of one client" in w for w in weak(cfg(20, threshold=0.4)))


def test_secagg_refuses_fewer_clients_than_the_minimum_of_contributors():
    with pytest.raises(ConfigError, match=r"secagg_min_contributors=4 decodes a sum only over at least 4 clients, "
                                          r"but the run has 3"):
        Simulation(digits_config(secagg=True, clients=3, secagg_min_contributors=4), out=False)


def test_secagg_contributor_history_survives_a_resume(tmp_path):
    """The contributors of each decoded class per round are in the checkpoint: a run stopped
    after round 2 and resumed to 3 states the same epsilon_per_class as an uninterrupted one."""
    cfg = digits_config(secagg=True, dp="prototypes", aggregation="weighted", rounds=3, clients=5, checkpoint_every=1)
    whole = Simulation(cfg, out=tmp_path / "whole").run()["secure_aggregation"]
    with pytest.raises(Interrupted):
        Simulation(cfg, out=tmp_path / "part", on_round=interrupt_at(3)).run()
    resumed = Simulation(cfg, out=tmp_path / "part").run(resume=True)["secure_aggregation"]
    assert whole["dp"]["epsilon_per_class"] and resumed["dp"]["epsilon_per_class"] == whole["dp"]["epsilon_per_class"]
    assert resumed["withheld_rounds"] == whole["withheld_rounds"] and len(whole["withheld_rounds"]) == 3


# --- the guarantees, each tested as the attack on it (docs/secure-aggregation.md, "Guarantees") -------

class Recorder:
    """Every answer the server's side of the protocol receives at steps 4 and 5, by client (the
    server's whole view of the seeds), recorded around the simulator's protocol clients."""

    def __init__(self, monkeypatch):
        from fedproto.secagg import protocol

        self.unmask: dict[int, dict] = {}
        self.reveal: dict[int, dict] = {}
        unmask, reveal = protocol.Client.unmask, protocol.Client.reveal

        def spy_unmask(client, *a, **kw):
            out = unmask(client, *a, **kw)
            self.unmask[client._int("cid")] = out
            return out

        def spy_reveal(client, groups, *a, **kw):
            out = reveal(client, groups, *a, **kw)
            self.reveal[client._int("cid")] = (list(groups), out)
            return out

        monkeypatch.setattr(protocol.Client, "unmask", spy_unmask)
        monkeypatch.setattr(protocol.Client, "reveal", spy_reveal)


@pytest.mark.parametrize("dropout", [False, True])
def test_secagg_a_class_with_too_few_contributors_stays_masked(monkeypatch, dropout):
    """The server's view, rebuilt from all it holds (the masked vectors, every step-4 and step-5
    answer): a class held by one alive client is never decoded. With a dropout, a class held by
    two clients of which one drops is withheld too (the case the issue found decoded to 1e-10)."""
    rec = Recorder(monkeypatch)
    sim, seen, plain = _sim(secagg=True, rounds=1, clients=5, ways=3)
    holders: dict[int, list[int]] = {}
    for i, st in enumerate(sim.setup.states):
        for c in st.classes.tolist():
            holders.setdefault(c, []).append(i)
    gone = []
    if dropout:  # drop one holder of a class that two clients hold
        c2 = next(c for c, h in sorted(holders.items()) if len(h) == 2)
        gone = [holders[c2][0]]
        sim.executor.drop = {1: gone}
    sim.run()
    C, d = sim.setup.algorithm.num_classes, sim.setup.embedding_dim
    alive = [i for i in range(5) if i not in gone]
    n_alive = {c: len([i for i in h if i in alive]) for c, h in holders.items()}
    weak = sorted(c for c, n in n_alive.items() if n == 1)
    assert weak and (not dropout or c2 in weak)
    assert sim.history[0]["secagg_withheld"] == weak
    # what the server holds: the sum of the masked vectors, and the seeds of every group it was given
    srv_groups = [g for _, (groups, _) in rec.reveal.items() for g in groups]
    assert not set(srv_groups) & {1 + c for c in weak}  # no answer ever carried a weak class's seed
    rnd = sim.loop.algorithm._session.last
    total = codec.decode(sum(m["secagg"] for m in seen.rounds[1].values()) - rnd.masks).reshape(-1)
    for c in weak:
        (i,) = [i for i in holders[c] if i in alive]
        p = plain[1][i]["protos"][plain[1][i]["classes"].tolist().index(c)]
        assert np.abs(total[c * d:(c + 1) * d] - p).min() > 1.0  # masked: the 2^32-scale ring noise
        assert abs(total[C * d + c] - plain[1][i]["counts"][plain[1][i]["classes"].tolist().index(c)]) > 1.0
    # the global prototypes: only classes with at least 2 alive contributors; the others named in the run
    msg = sim.message
    assert sorted(msg["classes"].tolist()) == sorted(c for c, n in n_alive.items() if n >= 2)
    assert (sim.loop.server.checkpoint["last_contributors"] >= 2).all()
    # and those are decoded exactly: eq. 6 of the alive holders' plain replies
    want = _mean_protos({i: plain[1][i] for i in alive}, weighted=False)
    for c, p in zip(msg["classes"].tolist(), msg["protos"]):
        assert np.abs(p - want[c]).max() <= 1e-5


def test_cli_secagg_names_the_withheld_classes_in_the_run_folder(tmp_path, capsys, monkeypatch):
    """The acceptance command: every class in prototypes.npz has at least 2 contributors; the
    withheld ones are in metrics.jsonl and summary.json."""
    code, _ = run_cli(["run", "--dataset", "digits", "--secagg", "--clients", "5", "--rounds", "1", "--threads", "1",
                       "--out-dir", str(tmp_path), "--name", "sa"], capsys, monkeypatch)
    assert code == 0
    protos = np.load(tmp_path / "sa" / "prototypes.npz")
    assert len(protos["classes"]) and (protos["contributors"] >= 2).all()
    row = json.loads((tmp_path / "sa" / "metrics.jsonl").read_text().splitlines()[0])
    summary = json.loads((tmp_path / "sa" / "summary.json").read_text())["secure_aggregation"]
    assert row["secagg_withheld"] and not set(row["secagg_withheld"]) & set(protos["classes"].tolist())
    assert summary["withheld_rounds"] == {"1": row["secagg_withheld"]} and summary["min_contributors"] == 2


def _unmask(srv, cl, alive, dead, minimum=1):
    """Steps 4 and 5 (consistency, unmask) for the alive clients: their answers by client."""
    routed = srv.route_tags({i: cl[i].view(alive, dead, minimum) for i in alive})
    return {i: cl[i].unmask(routed[i]) for i in alive}


def _protocol_round(xs: dict[int, np.ndarray], groups: np.ndarray, neighbours: int = 0):
    """Steps 1-3 of a round of the protocol alone: (server, clients, masked vectors)."""
    ids = sorted(xs)
    srv = Server(ids, 0.5, neighbours)
    cl = {i: Client() for i in ids}
    pks = {i: cl[i].keys(i, 7, **srv.setup(i)) for i in ids}
    routed = srv.route({i: cl[i].shares(srv.keys_for(i, pks), int(groups.max()) + 1) for i in ids})
    return srv, cl, {i: cl[i].masked(codec.encode(xs[i], len(ids)), routed[i], groups) for i in ids}


def test_a_second_unmask_request_in_a_round_is_refused(caplog):
    """The attack: ask every client to unmask with all alive, then again with one survivor marked
    dropped, to collect both shares of it and rebuild its whole vector. The second request is
    refused (and logged on the client); so are a second consistency step, a second reveal, one
    before the unmask, and one for a class under the minimum."""
    rng = np.random.default_rng(1)
    xs = {i: rng.normal(0, 3, 6) for i in range(5)}
    groups = np.array([0, 0, 1, 1, 2, 2])
    srv, cl, masked = _protocol_round(xs, groups)
    with pytest.raises(TrainingError, match="before the round's unmask"):
        cl[0].reveal([1], np.array([3, 3]), 2)
    everyone = list(range(5))
    first = _unmask(srv, cl, everyone, [], 2)
    with caplog.at_level("WARNING", logger="fedproto.secagg"):
        for i in everyone:
            with pytest.raises(TrainingError, match="a second unmask request in round 7"):
                cl[i].view([0, 1, 2, 3], [4], 2)
            with pytest.raises(TrainingError, match="a second unmask request in round 7"):
                cl[i].unmask({})
    assert "client 0 refuses: a second unmask request" in caplog.text
    # what the server could rebuild of client 4 from all it got: its group-0 seed, not its masking key
    assert all("k.4" not in m for m in first.values()) and all("s.4" in m for m in first.values())
    with pytest.raises(TrainingError, match="revealed only with at least 2 contributors"):
        cl[1].reveal([1, 2], np.array([1, 3]), 2)
    got = {i: cl[i].reveal([2], np.array([3, 3]), 2) for i in everyone}
    with pytest.raises(TrainingError, match="a second reveal request"):
        cl[2].reveal([1], np.array([3, 3]), 2)
    # the honest path decodes groups 0 and 2 exactly, and group 1 (never revealed) stays masked
    masks = srv.masks(everyone, [], first, groups) + srv.class_masks(everyone, [2], got, groups)
    total = codec.decode(sum(masked.values()) - masks)
    want = sum(xs.values())
    assert np.abs(total[[0, 1, 4, 5]] - want[[0, 1, 4, 5]]).max() <= 6 * STEP
    assert np.abs(total[[2, 3]] - want[[2, 3]]).min() > 1.0
    # a client masks once per round: a second vector under the same masks would give their difference
    with pytest.raises(TrainingError, match="a second masked vector in round 7"):
        cl[0].masked(codec.encode(xs[0], 5), {}, groups)
    # fewer alive clients than the minimum: nothing is unmasked at all
    _, cl2, _ = _protocol_round({i: xs[i] for i in range(3)}, groups)
    with pytest.raises(TrainingError, match=r"2 alive clients \(minimum of contributors 3\)"):
        cl2[0].view([0, 1], [2], 3)


def test_a_server_that_shows_clients_different_dropouts_gets_no_shares(caplog):
    """The attacks a breaker ran on the first version: (1) each client told another alive set, so
    that the target's seed comes from those that see it alive and its neighbours' masking keys
    from those that see them dead; (2) a made-up client id to pass the minimum; (3) a share group
    of one with threshold 1 sent at the key step; (4) a ring of one neighbour. Each is refused by
    a client before any share leaves it."""
    rng = np.random.default_rng(2)
    xs = {i: rng.normal(0, 3, 4) for i in range(5)}
    groups = np.zeros(4, np.int64)
    srv, cl, _ = _protocol_round(xs, groups)  # t = 3 of 5
    v1, v2 = ([0, 1, 2], [3, 4]), ([0, 3, 4], [1, 2])  # target 0: alive in both; 1, 2 dead in the second
    tags = {i: cl[i].view(*v1, 2) for i in (0, 1, 2)}
    tags.update({i: cl[i].view(*v2, 2) for i in (3, 4)})
    routed = srv.route_tags(tags)
    answered = {}
    with caplog.at_level("WARNING", logger="fedproto.secagg"):
        for i in range(5):
            try:
                answered[i] = cl[i].unmask(routed[i])
            except TrainingError as e:
                assert "saw other clients alive or dead" in str(e) or "fewer than the threshold" in str(e)
    # 0 got client 3's and 4's tags of the other view: it refuses; 3 and 4 are refused by 0's tag
    assert 0 not in answered and 3 not in answered and 4 not in answered
    assert "showed different dropouts to different clients" in caplog.text
    got_k = [m for m in answered.values() if "k.1" in m or "k.2" in m]
    assert len(got_k) < 3  # fewer than t shares of any masking key: nothing to unmask client 0 with
    # (2) a phantom client: alive [0, 999] passes a minimum of 2 only by a name nobody holds shares of
    _, cl3, _ = _protocol_round({i: xs[i] for i in range(3)}, groups)
    with pytest.raises(TrainingError, match="too few to unmask"):
        cl3[0].view([0, 999], [1, 2], 2)
    # (3) a group of one, threshold 1, at the key step
    with pytest.raises(TrainingError, match="must hold this client and another"):
        Client().keys(0, 1, [0], 1)
    with pytest.raises(TrainingError, match="threshold must be at least 3 of 5"):
        Client().keys(0, 1, range(5), 1, fraction=0.5)
    # (4) secagg_neighbours 1 gave each client a group of itself: refused at set-up
    with pytest.raises(ConfigError, match="secagg_neighbours=1"):
        Simulation(digits_config(secagg=True, secagg_neighbours=1), out=False)


def test_combine_equals_pycryptodome_shamir():
    """The server's interpolation with cached Lagrange coefficients gives the secret
    pycryptodome's Shamir.combine gives, chunk by chunk, for any set of t holders."""
    import os

    from Crypto.Protocol.SecretSharing import Shamir

    from fedproto.secagg.primitives import combine, split

    secret = os.urandom(64)
    shares = split(secret, 4, 7)
    for pick in ([0, 1, 2, 3], [6, 2, 4, 1], [5, 3, 0, 6]):
        got = b"".join(combine([shares[k] for k in pick]))
        assert got == secret
        for c in range(4):
            ref = Shamir.combine([(int.from_bytes(shares[k][:4], "little"), shares[k][4 + 16 * c:20 + 16 * c])
                                  for k in pick], ssss=False)
            assert ref == secret[16 * c:16 * (c + 1)]
    assert b"".join(combine([shares[k] for k in (0, 1, 2)])) != secret  # t - 1 shares: not the secret


def test_secagg_hides_label_sets_from_the_server():
    """Two federations with the same per-class totals but different holders: everything the
    server receives has the same keys and shapes, the same decoded group 0 (the per-class
    contributor counts) and the same class sums; the reveal requests and answers do not depend on
    who holds what. So the server learns per-class totals, not which client holds which class."""
    C, d = 3, 2
    groups = np.concatenate([np.repeat(np.arange(1, C + 1), d), np.arange(1, C + 1), np.zeros(C, np.int64)])

    def vec(classes, protos):
        out = np.zeros(C * (d + 2))
        for c in classes:
            out[c * d:(c + 1) * d] = protos[c]
            out[C * d + c] = 5
            out[C * (d + 1) + c] = 1
        return out

    protos = {0: np.array([1.0, 2.0]), 1: np.array([-1.0, 0.5]), 2: np.array([3.0, 3.0])}
    views = []
    for labels in ([[0, 1], [1, 2], [0, 2], []], [[0, 2], [0, 1], [1, 2], []]):  # same totals: 2 holders each
        xs = {i: vec(cs, protos) for i, cs in enumerate(labels)}
        srv, cl, masked = _protocol_round(xs, groups)
        alive = sorted(masked)
        a = _unmask(srv, cl, alive, [], 2)
        m = srv.masks(alive, [], a, groups)
        opened = codec.decode(sum(masked.values()) - m) * (groups == 0)
        counts = np.rint(opened[C * (d + 1):]).astype(np.int64)
        wanted = [1 + c for c in range(C) if counts[c] >= 2]
        b = {i: cl[i].reveal(wanted, counts, 2) for i in alive}
        total = codec.decode(sum(masked.values()) - m - srv.class_masks(alive, wanted, b, groups))
        shape = [(i, sorted(msg), [v.shape for v in msg.values()]) for i, msg in sorted({**a, **b}.items())]
        views.append((counts.tolist(), wanted, shape, [masked[i].shape for i in alive], np.round(total, 6).tolist()))
    assert views[0] == views[1]
    assert views[0][0] == [2, 2, 2]


def test_secagg_dp_epsilon_counts_the_contributors_present():
    """ε from the noise actually in each class's sums: a class decoded over n contributors, each
    with multiplier σ/√h, carries σ·√(n/h). With h = 4 and classes decoded over 2 or 3 clients,
    the old report (ε of σ for every class) was too small; now each class's ε is computed from
    its contributors per round, and epsilon_sum is the largest."""
    from fedproto.prototypes.dp import epsilon

    sim = Simulation(digits_config(secagg=True, dp="prototypes", aggregation="weighted", dp_noise=1.0,
                                   secagg_honest=4, rounds=2, clients=5), out=False)
    holders: dict[int, int] = {}
    for st in sim.setup.states:
        for c in st.classes.tolist():
            holders[c] = holders.get(c, 0) + 1
    dp = sim.run()["secure_aggregation"]["dp"]
    want = {str(c): epsilon([(np.sqrt(n / 4), 1.0, 2)], 1e-5) for c, n in holders.items() if n >= 2}
    assert dp["epsilon_per_class"].keys() == want.keys()
    for c, e in want.items():
        assert dp["epsilon_per_class"][c] == pytest.approx(e, rel=1e-9)
    assert dp["epsilon_sum"] == pytest.approx(max(want.values())) and dp["fewest_contributors_decoded"] < 4
    assert dp["epsilon_sum"] > epsilon([(1.0, 1.0, 2)], 1e-5)  # fewer than h contributors: more than sigma's


def test_secagg_with_a_minimum_of_one_shares_one_seed():
    """secagg_min_contributors 1 withholds nothing, so FedProto's vector is one mask group: one
    self-mask seed to share (12 + 16 + 4 + 16 * 3 bytes per encrypted share), no reveal step;
    with 2, one seed per class (C + 1 seeds)."""
    rows = {}
    for m in (1, 2):
        sim = Simulation(digits_config(secagg=True, rounds=1, secagg_min_contributors=m), out=False)
        sim.run()
        rows[m] = sim.history[0]["secagg_bytes"]
        assert codec.codec_of(sim.setup.algorithm, m).n_groups({}) == (1 if m == 1 else 11)
    # per round, 6 clients x 5 encrypted shares each way: 16 bytes more per extra seed, 10 extra seeds
    assert rows[2] - rows[1] >= 2 * 6 * 5 * 16 * 10
