"""The objective names no method: FedProto's prototype term is a LossTerm like any other, the step's
loss is composed from the terms alike on every path, and DP-SGD trains per-sample terms only."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedproto.algorithms.proto_term import ProtoTerm
from fedproto.training import DPSGD, LossTerm, Objective, OptimConfig, Phase, make_plan, step_terms, train_client


class Half(LossTerm):
    """0.5 x the mean squared embedding (a plain term: reported in ``loss_terms``)."""

    def __call__(self, logits, h, y, w):
        return 0.5 * ((h ** 2).sum(-1) * w).sum(-1) / w.sum(-1).clamp_min(1.0)


def test_the_step_loss_is_ce_plus_the_weighted_prototype_term_plus_the_other_terms():
    g = torch.Generator().manual_seed(0)
    logits, h = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g, dtype=torch.float64)
    y, w = torch.tensor([0, 1, 2, 1, 0]), torch.ones(5, dtype=torch.float64)
    table = torch.tensor([[1.0, 0.0], [0.0, 1.0], [9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([True, True, False])
    ce, reported, extra, loss = step_terms(logits, h, y, w, Objective([Phase(1)], terms=(ProtoTerm(0.5, table, mask),
                                                                                          Half())))
    # by hand: mse form = sum over covered samples of the squared distance / (B x d); class 2 has no prototype
    sq = ((h - table[y]) ** 2).sum(-1) * mask[y]
    assert float(reported) == pytest.approx(float(sq.sum() / (5 * 2)), rel=1e-12)
    assert float(extra) == pytest.approx(float(0.5 * (h ** 2).sum(-1).mean()), rel=1e-12)
    assert float(ce) == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-12)
    assert float(loss) == pytest.approx(float(ce + 0.5 * reported + extra), rel=1e-12)
    none = step_terms(logits, h, y, w, Objective([Phase(1)]))
    assert float(none[1]) == 0.0 and float(none[2]) == 0.0 and torch.equal(none[3], none[0])


def test_dp_sgd_refuses_a_term_that_is_not_per_sample_and_names_it():
    pytest.importorskip("opacus")
    from fedproto.models.cnn import PaperCNN

    model = PaperCNN(in_channels=1, input_size=8, num_classes=3, embedding_dim=4, dropout=0.0).double()
    x, y = torch.randn(6, 1, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    opt = OptimConfig(batch_size=6)
    plan = make_plan(6, [Phase(1)], opt, model.noise_widths(), 0.0, np.random.default_rng(0))
    table, mask = torch.zeros(3, 4, dtype=torch.float64), torch.ones(3, dtype=torch.bool)
    assert ProtoTerm(1.0, table, mask, "mse").per_sample and not ProtoTerm(1.0, table, mask, "l2").per_sample
    obj = Objective([Phase(1)], terms=(ProtoTerm(1.0, table, mask, "l2"),), dp_sgd=DPSGD(0.0, 1e9, 6))
    with pytest.raises(ValueError, match=r"not per sample \(ProtoTerm"):
        train_client(model, x, y, plan, obj, opt)
