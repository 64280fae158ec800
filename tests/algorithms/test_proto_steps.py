"""FedProto's server steps (fedproto.algorithms.proto_steps), each on its own with values worked
out by hand, and their composition (proto_round) as FedProto runs it."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from fedproto.algorithms.proto_steps import (
    AggregationRule,
    ClassCheck,
    DistanceMonitor,
    Momentum,
    OutlierExclusion,
    ProtoSteps,
    Rows,
    SampleFilter,
    proto_round,
)


def rows(*replies) -> Rows:
    """Rows from (cid, classes, protos, counts) tuples."""
    return Rows([r[0] for r in replies], [np.array(r[1], np.int64) for r in replies],
                [np.array(r[2], np.float64) for r in replies], [np.array(r[3], np.int64) for r in replies])


def scalar_rows(values, cls=0) -> Rows:
    """One 1-d prototype of class ``cls`` per client, client i sending values[i] from 5 samples."""
    return rows(*[(i, [cls], [[v]], [5]) for i, v in enumerate(values)])


def test_sample_filter_drops_prototypes_from_too_few_samples():
    got = SampleFilter(5)(rows((0, [0, 1], [[0, 0], [4, 0]], [10, 3]), (1, [1], [[8, 0]], [5])))
    assert got.cids == [0, 1] and [c.tolist() for c in got.classes] == [[0], [1]]
    assert [p.tolist() for p in got.protos] == [[[0, 0]], [[8, 0]]]


def test_aggregation_rule_mean_weighted_and_min_contributors():
    r = rows((0, [0], [[0.0]], [1]), (1, [0, 1], [[3.0], [5.0]], [2, 4]))
    cls, protos, contrib = AggregationRule(2, "mean")(1, r)
    assert cls.tolist() == [0, 1] and protos[:, 0].tolist() == [1.5, 5.0] and contrib.tolist() == [2, 1]
    _, protos, _ = AggregationRule(2, "weighted")(1, r)
    assert protos[0, 0] == pytest.approx((0 * 1 + 3 * 2) / 3)  # eq. 6: weights by sample count
    cls, _, contrib = AggregationRule(2, "mean", min_contributors=2)(1, r)
    assert cls.tolist() == [0] and contrib.tolist() == [2]  # class 1 has one contributor


def test_momentum_blends_with_the_previous_prototypes_and_keeps_unsent_classes():
    previous = {"classes": np.array([0, 1, 3]), "protos": np.array([[0, 0], [6, 0], [9, 9]], np.float32)}
    cls, protos, contrib = Momentum(0.75)(previous, np.array([0, 1, 2]), np.array([[4, 0], [10, 0], [2, 2]],
                                                                                   np.float32), np.array([1, 2, 1]))
    assert cls.tolist() == [0, 1, 2, 3]
    np.testing.assert_allclose(protos, [[1, 0], [7, 0], [2, 2], [9, 9]])  # 0.75 old + 0.25 new; new; kept
    assert contrib.tolist() == [1, 2, 1, 0]
    same = Momentum(0.75)({}, np.array([0]), np.array([[4.0, 0.0]]), np.array([1]))  # no previous prototypes
    assert same[1].tolist() == [[4.0, 0.0]]


def test_class_check_leaves_out_a_row_sent_under_another_class():
    refs = np.array([[0, 0], [10, 0], [0, 10], [10, 10]], np.float32)
    rng = np.random.default_rng(0)
    honest = [(i, [i % 4, (i + 1) % 4], refs[[i % 4, (i + 1) % 4]] + rng.normal(0, 0.1, (2, 2)), [5, 5])
              for i in range(6)]
    flipped = (6, [0], refs[[3]], [5])  # class 3's prototype sent as class 0
    kept, metrics = ClassCheck(3.0, 2)(2, rows(*honest, flipped), {"classes": np.arange(4), "protos": refs})
    assert metrics == {"flagged": [6], "flagged_rows": 1, "flagged_many": 0}
    assert kept.cids == list(range(7)) and len(kept.classes[6]) == 0 and all(len(c) == 2 for c in kept.classes[:6])
    _, none = ClassCheck(3.0, 2)(2, rows(*honest), {"classes": np.arange(4), "protos": refs})
    assert none == {"flagged": [], "flagged_rows": 0, "flagged_many": 0}


def test_class_check_warns_when_it_flags_more_than_a_third_of_the_clients(caplog):
    """3 flipped of 8 clients (3/8 > 1/3): all three left out, the metric set and a warning
    naming them; 2 of 7 (below a third): no warning."""
    refs = np.array([[0, 0], [10, 0], [0, 10], [10, 10]], np.float32)
    rng = np.random.default_rng(1)
    honest = [(i, [i % 4, (i + 1) % 4], refs[[i % 4, (i + 1) % 4]] + rng.normal(0, 0.1, (2, 2)), [5, 5])
              for i in range(5)]
    flipped = [(5 + j, [j], refs[[(j + 3) % 4]] + rng.normal(0, 0.1, (1, 2)), [5]) for j in range(3)]
    ref = {"classes": np.arange(4), "protos": refs}
    with caplog.at_level(logging.WARNING, logger="fedproto.algorithms.proto_steps"):
        _, metrics = ClassCheck(3.0, 2)(4, rows(*honest, *flipped), ref)
    assert metrics == {"flagged": [5, 6, 7], "flagged_rows": 3, "flagged_many": 1}
    assert "3 of 8 clients flagged (more than a third" in caplog.text and "[5, 6, 7]" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedproto.algorithms.proto_steps"):
        _, metrics = ClassCheck(3.0, 2)(4, rows(*honest, *flipped[:2]), ref)
    assert metrics["flagged"] == [5, 6] and metrics["flagged_many"] == 0 and "more than a third" not in caplog.text


def test_outlier_exclusion_leaves_out_the_far_client_and_says_when_it_cannot_act(caplog):
    kept, metrics = OutlierExclusion(3.0, 1)(1, scalar_rows([0.0, 1.0, 1.2, 0.8, 20.0]))
    assert metrics == {"excluded": [4]} and kept.cids == [0, 1, 2, 3]
    with caplog.at_level(logging.WARNING):
        kept, metrics = OutlierExclusion(3.0, 1)(1, scalar_rows([0.0, 20.0]))  # 2 holders: nobody comparable
    assert metrics == {"excluded": []} and kept.cids == [0, 1]
    assert "exclude_outliers cannot act: no class is held by 3 or more clients" in caplog.text


def test_distance_monitor_metrics_and_alerts():
    r = scalar_rows([0.0, 1.0, 1.2, 0.8, 20.0])
    d = DistanceMonitor(3.0).distances(r, np.array([0]), np.array([[1.0]]))
    np.testing.assert_allclose(d, [1.0, 0.0, 0.2, 0.2, 19.0], atol=1e-12)
    metrics, alerts = DistanceMonitor(3.0)(r, d)
    assert metrics["proto_dist"] == pytest.approx(20.4 / 5) and metrics["proto_dist_max"] == pytest.approx(19.0)
    assert metrics["proto_dist_argmax"] == 4
    # above 3 x the median 0.2: client 0 (1.0, 5x) and client 4 (19, 95x)
    assert [a.cid for a in alerts] == [0, 4] and "5.0x the median 0.2" in alerts[0].text
    assert "lie 19 from the global ones, 95.0x the median 0.2" in alerts[1].text
    assert DistanceMonitor(0.0)(r, d)[1] == []  # 0: no alert, the metrics stay


def test_proto_round_composes_the_steps_in_order():
    steps = ProtoSteps(SampleFilter(5), None, None, AggregationRule(2), Momentum(0.5), DistanceMonitor(3.0))
    previous = {"classes": np.array([0]), "protos": np.array([[2.0]], np.float32)}
    state = proto_round(steps, 3, {4: {"classes": np.array([0, 1]), "protos": np.array([[0.0], [6.0]], np.float32),
                                       "counts": np.array([5, 1])}, 7: {}}, previous, 1.0, 0.5)
    assert state.message["classes"].tolist() == [0] and state.message["protos"].tolist() == [[1.0]]  # class 1 filtered
    assert state.message["lambda"].tolist() == [0.5]
    assert state.metrics["lambda"] == 1.0 and state.metrics["proto_dist_argmax"] == 4  # the empty reply is skipped
    assert state.checkpoint["last_cids"].tolist() == [4] and state.checkpoint["last_contributors"].tolist() == [1]
    assert state.files["prototypes.npz"]["contributors"].tolist() == [1]
