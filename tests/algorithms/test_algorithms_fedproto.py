"""FedProto algorithm and engine: evaluation bookkeeping, reproducibility, real-data runs."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from conftest import (
    REFS,
    SMALL,
    Interrupted,
    csv_rows,
    digits_config,
    digits_eval_config,
    honest_replies,
    interrupt_at,
    needs_cifar,
)

from fedproto.algorithms.algorithm import ClientData, ClientState
from fedproto.algorithms.fedproto import FedProto
from fedproto.algorithms.server_state import ServerState
from fedproto.config.run_config import build_config
from fedproto.errors import ConfigError
from fedproto.models.proto_model import WrappedModel
from fedproto.prototypes import (
    aggregate_prototypes,
    client_distances,
    nearest_prototype,
    proto_loss,
)
from fedproto.prototypes.dp import epsilon
from fedproto.simulation import Simulation
from fedproto.training import (
    OptimConfig,
)


class Fixed(torch.nn.Module):
    """A 'model' whose embedding is its 2-d input and whose head returns fixed logits."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, x):
        return x.flatten(1)


def _state(cid, logits, classes):
    head = torch.nn.Linear(2, 3)
    m = WrappedModel(Fixed(logits), head, 2, 3)
    m.head = lambda h, noise=None: logits[: len(h)]
    return ClientState(cid, m, np.array(classes))


def test_accuracy_is_per_client_and_per_mode():
    """No running totals across clients or across classifier/prototype passes (official fault)."""
    alg = FedProto(3, OptimConfig(), embedding_dim=2)
    msg = {"classes": np.array([0, 1, 2]), "protos": np.array([[0, 0], [10, 0], [0, 10]], np.float32)}
    # client 0: classifier all right, prototypes all wrong; client 1: the opposite
    x0 = torch.tensor([[0.0, 10.0], [0.0, 10.0]]).view(2, 1, 1, 2)  # near class 2
    y0 = torch.tensor([0, 0])
    s0 = _state(0, torch.tensor([[5.0, 0, 0], [5.0, 0, 0]]), [0, 2])
    x1 = torch.tensor([[10.0, 0.0], [10.0, 0.0], [10.0, 0.0]]).view(3, 1, 1, 2)  # near class 1
    y1 = torch.tensor([1, 1, 1])
    s1 = _state(1, torch.tensor([[5.0, 0, 0]] * 3), [0, 1])
    r0 = alg.evaluate(s0, msg, ClientData(x0, y0, x0, y0))
    r1 = alg.evaluate(s1, msg, ClientData(x1, y1, x1, y1))
    assert (r0["acc"], r0["acc_proto"]) == (1.0, 0.0)
    assert (r1["acc"], r1["acc_proto"]) == (0.0, 1.0)
    # evaluating again in the other order gives the same values (no state carried)
    assert alg.evaluate(s0, msg, ClientData(x0, y0, x0, y0)) == r0


def test_proto_inference_restricted_to_own_classes():
    msg = {"classes": np.array([0, 1, 2]), "protos": np.array([[0, 0], [10, 0], [0, 10]], np.float32)}
    x = torch.tensor([[9.0, 0.0]]).view(1, 1, 1, 2)
    y = torch.tensor([0])
    s = _state(0, torch.tensor([[5.0, 0, 0]]), [0, 2])  # class 1 is not the client's own
    own = FedProto(3, OptimConfig(), embedding_dim=2, proto_classes="own").evaluate(s, msg, ClientData(x, y, x, y))
    everything = FedProto(3, OptimConfig(), embedding_dim=2, proto_classes="all").evaluate(s, msg,
                                                                                            ClientData(x, y, x, y))
    assert own["acc_proto"] == 1.0 and everything["acc_proto"] == 0.0


def test_prototype_loss_positive_after_round_one_and_reproducible():
    a = Simulation(digits_eval_config(), out=False)
    a.run()
    h = a.history
    assert h[0]["loss_proto"] == 0.0  # round 1 has no global prototypes (official code)
    assert h[1]["loss_proto"] > 0.0 and h[2]["loss_proto"] > 0.0
    assert h[0]["down_params"] == 0 and h[1]["down_params"] > 0
    b = Simulation(digits_eval_config(), out=False)
    b.run()
    assert [r["loss_ce"] for r in a.history] == [r["loss_ce"] for r in b.history]
    assert a.history[-1]["acc_mean"] == b.history[-1]["acc_mean"]


def test_up_message_size_is_classes_times_embedding():
    sim = Simulation(digits_eval_config(rounds=1), out=False)
    sim.run()
    ways = sum(len(s.classes) for s in sim.setup.states)
    # per client: protos (ways_i x 50) + class ids (ways_i) + counts (ways_i)
    assert sim.history[0]["up_params"] == ways * (50 + 2)


def test_sampled_rounds_keep_prototypes_of_classes_nobody_sent():
    """Under client sampling a class no sampled client holds keeps its previous global
    prototype (0 contributors that round); a client whose class has no global prototype yet
    trains it with cross-entropy only, without error."""
    alg = FedProto(4, OptimConfig(), embedding_dim=2)

    def msg(classes, value):
        return {"classes": np.array(classes), "protos": np.full((len(classes), 2), value, np.float32),
                "counts": np.full(len(classes), 5)}

    first = alg.aggregate(1, {0: msg([0, 1], 1.0), 1: msg([2, 3], 2.0)})
    assert first.message["classes"].tolist() == [0, 1, 2, 3]
    state = alg.aggregate(2, {1: msg([2, 3], 5.0)}, first)  # only client 1 sampled
    second = state.message
    assert second["classes"].tolist() == [0, 1, 2, 3]
    np.testing.assert_array_equal(second["protos"][:2], 1.0)  # kept from round 1
    np.testing.assert_array_equal(second["protos"][2:], 5.0)
    assert state.checkpoint["last_contributors"].tolist() == [0, 0, 1, 1]
    assert state.checkpoint["last_cids"].tolist() == [1]
    assert state.files["prototypes.npz"]["contributors"].tolist() == [0, 0, 1, 1]
    # round 2 with participation 1 of 6: runs, and a count works as well as a fraction
    sim = Simulation(digits_eval_config(rounds=3, participation=1.0 / 6, eval_every=1), out=False)
    sim.run()
    assert all(len(r["sampled"]) == 1 for r in sim.history)
    sim2 = Simulation(digits_eval_config(rounds=2, participation=2.0, eval_every=0), out=False)
    sim2.run()
    assert all(len(r["sampled"]) == 2 for r in sim2.history)
    with pytest.raises(Exception, match=r"participation=2.5"):
        digits_eval_config(participation=2.5)
    with pytest.raises(Exception, match=r"participation=7"):
        digits_eval_config(participation=7.0)


def test_fedproto_validates_its_own_options():
    """Unknown option values are refused by name: FedProto(proto_source="typo") must not run as
    after_training, nor proto_classes="typo" as all."""
    for kw, name in ((dict(proto_source="typo"), "proto_source"), (dict(proto_classes="typo"), "proto_classes"),
                     (dict(distance="cos"), "distance"), (dict(aggregation="max"), "aggregation")):
        with pytest.raises(ValueError, match=f"{name}="):
            FedProto(10, OptimConfig(), **kw)


@pytest.mark.parametrize("clients, trim, hint", [
    (3, 0.45, "no trim below 0.5 cuts anything from 2 or fewer contributors"),  # was: "raise trim (below 0.5)"
    (12, 0.2, "raise trim to 0.333 or more (below 0.5) or use aggregation='median'"),
])
def test_trimmed_mean_warning_gives_a_fix_that_exists(caplog, clients, trim, hint):
    import logging

    from fedproto.config.run_config import build_config
    from fedproto.simulation import Simulation

    cfg = build_config(overrides={"dataset": "digits", "clients": clients, "rounds": 1, "threads": 1,
                                  "aggregation": "trimmed", "trim": trim})
    with caplog.at_level(logging.WARNING):
        Simulation(cfg, out=False).run()
    warned = [r.getMessage() for r in caplog.records if "cuts nothing" in r.getMessage()]
    assert len(warned) == 1 and hint in warned[0], warned
    assert "at most 1 clients" not in warned[0]


def test_lambda_warmup_is_sent_and_used():
    plain = Simulation(digits_config(), out=False)
    plain.run()
    warm = Simulation(digits_config(lambda_warmup=4), out=False)
    warm.run()
    assert float(warm.message["lambda"][0]) == pytest.approx(1.0)  # round 5 would use the full λ = 1
    # the server sends one more number per client from round 2 on (round 1's message is empty)
    m = 6
    assert [w["down_params"] - p["down_params"] for w, p in zip(warm.history, plain.history)] == [0, m, m, m]
    # a smaller λ in rounds 2-4 pulls less: the prototype loss the clients see stays larger
    assert warm.history[1]["loss_ce"] != plain.history[1]["loss_ce"]
    obj = warm.setup.algorithm.objective(warm.setup.states[0], {**warm.message, "lambda": np.array([0.25], np.float32)})
    assert [type(t).__name__ for t in obj.terms] == ["ProtoTerm"] and obj.terms[0].weight == 0.25


def _msg(classes, protos, counts):
    return {"classes": np.array(classes, np.int64), "protos": np.array(protos, np.float32),
            "counts": np.array(counts, np.int64)}


def test_server_momentum_filtering_and_monitoring():
    alg = FedProto(3, OptimConfig(), proto_momentum=0.75, min_proto_samples=5, embedding_dim=2)
    s1 = alg.aggregate(1, {0: _msg([0, 1], [[0, 0], [4, 0]], [10, 10]), 1: _msg([1], [[8, 0]], [10])})
    r1 = s1.message
    assert r1["classes"].tolist() == [0, 1] and r1["protos"].tolist() == [[0, 0], [6, 0]]
    # round 2: client B's class-1 prototype rests on 3 samples and is ignored (min_proto_samples=5)
    s2 = alg.aggregate(2, {0: _msg([0, 1], [[4, 0], [10, 0]], [10, 10]), 1: _msg([1, 2], [[100, 0], [2, 2]], [3, 9])},
                       s1)
    r2 = s2.message
    assert r2["classes"].tolist() == [0, 1, 2]
    assert r2["protos"].tolist() == [[1, 0], [7, 0], [2, 2]]  # 0.75*0+0.25*4, 0.75*6+0.25*10, new class
    assert s2.checkpoint["last_contributors"].tolist() == [1, 1, 1]
    # monitoring covers every client's sent prototypes, the ignored one included
    np.testing.assert_allclose(s2.checkpoint["last_distances"], [(3 + 3) / 2, (93 + 0) / 2])
    # λ the clients used in round 2 (no warm-up: the full λ = 1)
    assert s2.metrics == {"lambda": 1.0, "proto_dist": 24.75, "proto_dist_max": 46.5, "proto_dist_argmax": 1}


def test_client_distances_and_outlier_warning(caplog):
    d = client_distances([np.array([0]), np.array([0, 1]), np.array([2])],
                         [np.array([[3.0, 4.0]]), np.array([[0.0, 0.0], [1.0, 1.0]]), np.array([[1.0, 1.0]])],
                         np.array([0, 1]), np.array([[0.0, 0.0], [1.0, 1.0]]))
    np.testing.assert_allclose(d[:2], [5.0, 0.0])
    assert np.isnan(d[2])  # none of its classes has a global prototype
    alg = FedProto(2, OptimConfig(), embedding_dim=1, proto_dist_alert=3.0)
    state = alg.aggregate(1, {i: _msg([0], [[v]], [5]) for i, v in enumerate((0.0, 1.0, 1.2, 0.8, 20.0))})
    assert [a.cid for a in state.alerts] == [4] and "proto_dist_alert=3" in state.alerts[0].text
    sim = Simulation(digits_config(rounds=2), out=False)
    sim.setup.algorithm.proto_dist_alert = 1e-9  # every client above the median is flagged
    with caplog.at_level(logging.WARNING, logger="fedproto"):
        sim.run()
    assert "prototypes lie" in caplog.text and "check its data" in caplog.text
    assert all(k in sim.history[-1] for k in ("proto_dist", "proto_dist_max", "proto_dist_argmax"))
    assert sim.history[-1]["proto_dist_max"] >= sim.history[-1]["proto_dist"] > 0


def test_normalized_loss_and_inference():
    h = torch.tensor([[3.0, 4.0]])
    table, mask = torch.tensor([[0.0, 2.0]]), torch.tensor([True])
    y = torch.tensor([0])
    # (0.6, 0.8) vs (0, 1): squared distance 0.4, over B * d = 2
    assert float(proto_loss(h, y, table, mask, "mse", normalize=True)) == pytest.approx(0.2)
    assert float(proto_loss(h, y, table, mask, "mse")) == pytest.approx((9 + 4) / 2)
    protos, allowed = torch.tensor([[1.0, 0.1], [9.0, 5.0]]), torch.tensor([True, True])
    x = torch.tensor([[10.0, 0.0]])
    assert nearest_prototype(x, protos, allowed).tolist() == [1]  # Euclidean: (9, 5) is nearer
    assert nearest_prototype(x, protos, allowed, normalize=True).tolist() == [0]  # direction: (1, 0.1)
    # measured at seed 1234: acc 0.83, acc_proto 0.64 (clients hold 2-4 classes), loss_proto 0.008
    sim = Simulation(digits_config(proto_normalize=True, rounds=6, lr=0.05), out=False)
    sim.run()
    assert sim.history[-1]["loss_proto"] < 0.05  # unit vectors: squared distances at most 4 / d
    assert sim.history[-1]["acc_mean"] > 0.7 and sim.history[-1]["acc_proto_mean"] > 0.5


def test_options_validated_and_resumable(tmp_path):
    for bad in ({"proto_momentum": 1.0}, {"lambda_warmup": -1}, {"min_proto_samples": 0}, {"proto_dist_alert": -1}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            digits_config(**bad)
    cfg = digits_config(proto_momentum=0.5, lambda_warmup=3, checkpoint_every=2)
    whole = Simulation(cfg, out=tmp_path / "a")
    whole.run()
    with pytest.raises(Interrupted):
        Simulation(cfg, out=tmp_path / "b", on_round=interrupt_at(3)).run()
    resumed = Simulation(cfg, out=tmp_path / "b")
    resumed.run(resume=True)
    drop = ("train_time_s", "eval_time_s")
    assert [{k: v for k, v in r.items() if k not in drop} for r in resumed.history] == [
        {k: v for k, v in r.items() if k not in drop} for r in whole.history]


def test_trimmed_mean_that_cuts_nothing_is_reported_once(caplog):
    cfg = build_config(overrides={**SMALL, "clients": 3, "rounds": 2, "aggregation": "trimmed", "trim": 0.2})
    with caplog.at_level(logging.WARNING):
        Simulation(cfg, out=False).run()
    warned = [r.getMessage() for r in caplog.records if "cuts nothing" in r.getMessage()]
    assert len(warned) == 1, warned  # 2 rounds, one warning
    assert "trim=0.2" in warned[0] and "fewer than 5 contributors" in warned[0] and "round 1" in warned[0]


def test_the_lambda_used_each_round_is_in_the_metrics():
    sim = Simulation(digits_config(lambda_warmup=2, lambda_schedule="cosine", rounds=4), out=False)
    sim.run()
    assert [h["lambda"] for h in sim.history] == pytest.approx([0.0, 0.5, 1.0, 1.0])


def test_bad_replies_are_dropped_and_named(caplog):
    alg = FedProto(10, OptimConfig(), embedding_dim=2)
    good = {"classes": np.array([1, 2]), "protos": np.ones((2, 2), np.float32), "counts": np.array([3, 3])}
    bad = {"classes": np.array([1, 2, 11]), "protos": np.array([[np.nan, 0], [5, 5], [1, 1]], np.float32),
           "counts": np.array([3, 0, 3])}
    wrong = {"classes": np.array([1]), "protos": np.ones((1, 3), np.float32), "counts": np.array([1])}
    from fedproto.engine.checks import check_replies

    replies = {0: (good, None), 4: (bad, None), 7: (wrong, None)}
    reasons, whole = check_replies(alg, 2, 1, {}, replies)  # the one reply check, as the round loop runs it
    assert sorted(reasons) == [4, 7] and whole == {4, 7}  # no row of client 4's is usable
    out = alg.aggregate(1, {i: m for i, (m, _) in replies.items() if i not in whole}).message
    assert out["classes"].tolist() == [1, 2] and out["protos"].tolist() == [[1, 1], [1, 1]]
    text = caplog.text
    assert "dropped the reply of client 4" in text and "class 1: values that are not finite" in text
    assert "count 0 below 1" in text and "class 11 outside 0..9" in text
    assert "client 7: prototypes have shape (1, 3)" in text and "(embedding size 2)" in text


def test_class_check_keeps_flipped_prototypes_out_of_the_aggregate():
    """The server with class_check: the global prototypes from the honest replies only, the
    flipping clients named in the metrics; without it, the flipped prototypes move the global ones."""
    rng = np.random.default_rng(1)
    honest = honest_replies(rng, REFS, [[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    flipped = [((c + 1) % 4, p, n) for c, p, n in honest_replies(rng, REFS, [[0, 1], [2, 3]])]
    msgs = {i: {"classes": c, "protos": p.astype(np.float32), "counts": n} for i, (c, p, n) in
            enumerate(honest + flipped)}
    clean = aggregate_prototypes([c for c, _, _ in honest], [p for _, p, _ in honest],
                                 [n for _, _, n in honest], 4)[1]
    for z, expect_flagged in ((3.0, [6, 7]), (0.0, None)):
        alg = FedProto(4, OptimConfig(), embedding_dim=2, class_check=z)
        before = ServerState({"classes": np.arange(4), "protos": REFS.astype(np.float32)})
        state = alg.aggregate(2, msgs, before)
        out = state.message
        if expect_flagged:
            assert np.allclose(out["protos"], clean, atol=1e-6)
            assert state.metrics["flagged"] == [6, 7] and state.metrics["flagged_rows"] == 4
        else:
            assert np.abs(out["protos"] - clean).max() > 1.0  # 2 of 5 contributors of each class flipped
            assert "flagged" not in state.metrics


def test_robust_and_private_options_refuse_or_report_their_edge_cases(caplog, tmp_path):
    """Edge cases of the robust and private options: ε never below 0; exclusion does not drop sole
    holders of a class (MAD 0) and says it cannot act; BatchNorm statistics stay frozen in the
    second stage; attacks that would change nothing, all-attacker runs and unreachable
    min_contributors are refused; λ is 0 in the metrics while no global prototype exists; the
    attackers are marked in clients.csv."""
    assert epsilon([(5.0, 1.0, 1)], 0.1) >= 0.0
    with pytest.raises(ConfigError, match="dp_delta"):
        digits_config(dp="prototypes", dp_delta=0.5)
    for kw, match in ((dict(algorithm="fedavg", attack="flip", attackers=1), "without class ids"),
                      (dict(algorithm="local", attack="scale", attackers=1), "sends nothing"),
                      (dict(attack="scale", attackers=6), "no honest")):
        with pytest.raises(ConfigError, match=match):
            digits_config(**kw)
    with pytest.raises(ConfigError, match="min_contributors=7 is more than any class"):
        Simulation(digits_config(min_contributors=7), out=False)
    with pytest.raises(ConfigError, match="min_contributors=3"):  # 2 of 6 clients per round
        Simulation(digits_config(min_contributors=3, participation=2.0), out=False)
    # sole holders of a class are not outliers: 2 clients, nobody comparable
    alg = FedProto(4, OptimConfig(), embedding_dim=2, exclude_outliers=3.0)
    msgs = {i: {"classes": np.array([i]), "protos": np.full((1, 2), float(i), np.float32),
                "counts": np.array([5])} for i in range(4)}
    state = alg.aggregate(1, msgs)
    assert state.message["classes"].tolist() == [0, 1, 2, 3] and state.metrics["excluded"] == []
    assert "exclude_outliers cannot act" in caplog.text
    # BatchNorm running statistics of the body stay as they were in the second stage
    sim = Simulation(digits_config(model="resnet18", embedding_dim=512, rounds=2, freeze_after=1, clients=2, shots=10),
                     out=False)
    snap = {}
    sim.on_round = lambda row: snap.update({k: v.clone() for k, v in sim.setup.states[0].model.state_dict().items()}
                                           if row["round"] == 1 else {})
    sim.run()
    after = sim.setup.states[0].model.state_dict()
    body = [k for k in after if not sim.setup.states[0].model.is_head_param(k)]
    assert any("running_var" in k for k in body) and all(torch.equal(snap[k], after[k]) for k in body)
    # λ reported 0 while no prototype existed; attackers marked where docs/robustness.md says
    s = Simulation(digits_config(rounds=2, attack="nan", attackers=2, lambda_warmup=0), out=tmp_path / "run")
    summary = s.run()
    assert [h["lambda"] for h in s.history] == [0.0, 1.0]
    rows = csv_rows(tmp_path / "run" / "clients.csv")
    marked = [int(r["client"]) for r in rows if r["attacker"] == "1"]
    assert len(rows) == 6 and len(marked) == 2 and all(r["attacker"] in ("0", "1") for r in rows)
    assert summary["attack"] == {"kind": "nan", "clients": marked}
    honest = [float(r["acc"]) for r in rows if r["attacker"] == "0"]
    assert summary["accuracy_honest"]["acc"]["mean"] == pytest.approx(np.mean(honest), abs=1e-6)


@pytest.mark.usefixtures("one_thread")
@needs_cifar
def test_one_way_resnet18_client_predicts_its_only_class():
    """A 1-way ResNet18 client (``--ways 1 --stdev 0 --shots 9 --batch-size 8``) once scored
    0% prototype accuracy: its 1-sample trailing batch and overflowing distances sent every
    prediction to class 0. Its one class is the only possible answer: 100%."""
    cfg = build_config(overrides=dict(dataset="cifar10", model="resnet18", clients=2, ways=1, stdev=0, shots=9,
                                      batch_size=8, rounds=2, eval_every=0, test_shots=10))
    sim = Simulation(cfg, out=False)
    assert [len(s.classes) for s in sim.setup.states] == [1, 1] and [len(d.x) for d in sim.setup.data] == [9, 9]
    summary = sim.run()
    assert summary["accuracy"]["acc_proto"]["mean"] == 1.0
