"""Local training: reference path behaviour and client-batched equivalence."""

import copy

import numpy as np
import pytest
import torch

from fedproto.models.cnn import PaperCNN
from fedproto.prototypes import prototype_table
from fedproto.training import Objective, OptimConfig, Phase, make_plan, train_client, train_group


def _clients(G=4, seed=0, size=28):
    torch.manual_seed(seed)
    models = [PaperCNN(input_size=size) for _ in range(G)]
    xs = [torch.randn(21 + 4 * g, 1, size, size) for g in range(G)]  # unequal sizes -> masked steps
    ys = [torch.randint(0, 10, (len(x),)) for x in xs]
    return models, xs, ys


def _plans(models, xs, obj, opt, round_seed=0):
    return [make_plan(len(x), obj.phases, opt, m.noise_widths(), m.dropout, np.random.default_rng([round_seed, g]))
            for g, (m, x) in enumerate(zip(models, xs))]


def test_weights_change_after_one_local_step():
    models, xs, ys = _clients(1)
    m = models[0]
    before = copy.deepcopy(m.state_dict())
    opt = OptimConfig(batch_size=8)
    obj = Objective([Phase(1)])
    plan = make_plan(8, obj.phases, opt, m.noise_widths(), m.dropout, np.random.default_rng(0))
    res = train_client(m, xs[0][:8], ys[0][:8], plan, obj, opt)
    assert res.steps == 1
    for k, v in m.state_dict().items():
        assert not torch.equal(v, before[k]), k


def test_plan_batches_cover_each_sample_once_per_epoch():
    opt = OptimConfig(batch_size=8)
    plan = make_plan(21, [Phase(2)], opt, {}, 0.0, np.random.default_rng(0))
    order, w = plan.order[0], plan.weight[0]
    assert order.shape == (6, 8)  # 3 steps per epoch (8 + 8 + 5 padded), 2 epochs
    assert w.sum() == 42
    for e in range(2):
        ep = order[3 * e : 3 * e + 3][w[3 * e : 3 * e + 3] > 0]
        assert sorted(ep.tolist()) == list(range(21))
    plan = make_plan(21, [Phase(1)], OptimConfig(batch_size=8, drop_last=True), {}, 0.0, np.random.default_rng(0))
    assert plan.order[0].shape == (2, 8) and plan.weight[0].sum() == 16


@pytest.mark.parametrize("form", ["mse", "squared_l2", "l2"])
def test_batched_matches_sequential(form):
    """Same seed: batched and sequential give the same per-client weights within 1e-5 relative."""
    models, xs, ys = _clients(4)
    ref = [copy.deepcopy(m) for m in models]
    opt = OptimConfig()
    table, mask = prototype_table(np.arange(7), np.random.default_rng(1).random((7, 50), dtype=np.float32), 10, 50)
    obj = Objective([Phase(2)], lambda_proto=1.0, table=table, mask=mask, form=form, collect=True)
    plans = _plans(models, xs, obj, opt)
    seq = [train_client(ref[g], xs[g], ys[g], plans[g], obj, opt) for g in range(4)]
    bat = train_group(models, xs, ys, plans, obj, opt)
    for g in range(4):
        for (name, a), (_, b) in zip(ref[g].named_parameters(), models[g].named_parameters()):
            rel = ((a - b).norm() / a.norm()).item()
            assert rel < 1e-5, (g, name, rel)
        assert torch.equal(seq[g].counts, bat[g].counts)
        assert torch.allclose(seq[g].sums, bat[g].sums, rtol=1e-4, atol=1e-4)
        assert seq[g].steps == bat[g].steps
        assert seq[g].loss_ce == pytest.approx(bat[g].loss_ce, rel=1e-5)
        assert seq[g].loss_proto == pytest.approx(bat[g].loss_proto, rel=1e-4)
        assert seq[g].loss_proto > 0


def test_batched_prox_and_head_only_phase_match_sequential():
    models, xs, ys = _clients(3)
    ref_w = {k: v.detach().clone() + 0.05 for k, v in models[0].named_parameters()}
    ref = [copy.deepcopy(m) for m in models]
    opt = OptimConfig()
    obj = Objective([Phase(1, trains=lambda n: n.startswith("fc2.")), Phase(1, trains=lambda n: not n.startswith("fc2."))],
                    prox_mu=0.5, prox_ref=ref_w)
    plans = _plans(models, xs, obj, opt)
    for g in range(3):
        train_client(ref[g], xs[g], ys[g], plans[g], obj, opt)
    train_group(models, xs, ys, plans, obj, opt)
    for g in range(3):
        for (name, a), (_, b) in zip(ref[g].named_parameters(), models[g].named_parameters()):
            assert ((a - b).norm() / a.norm()).item() < 1e-5, name


def test_finished_client_keeps_weights_in_batched_steps():
    """A client with fewer batches is untouched by the steps after its data ran out."""
    models, xs, ys = _clients(2)
    xs[0], ys[0] = xs[0][:8], ys[0][:8]  # one step only
    alone = copy.deepcopy(models[0])
    opt = OptimConfig()
    obj = Objective([Phase(1)])
    plans = _plans(models, xs, obj, opt)
    train_client(alone, xs[0], ys[0], plans[0], obj, opt)
    res = train_group(models, xs, ys, plans, obj, opt)
    assert res[0].steps == 1 and res[1].steps > 1
    for (n, a), (_, b) in zip(alone.named_parameters(), models[0].named_parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), n
