"""Local training: reference path behaviour and client-batched equivalence."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import digits_config, needs_cifar

from fedproto.algorithms.proto_term import ProtoTerm
from fedproto.config.run_config import build_config
from fedproto.models.cnn import PaperCNN
from fedproto.models.resnet import ResNet18
from fedproto.prototypes import prototype_table
from fedproto.simulation import Simulation
from fedproto.training import (
    AUGMENT_PAD,
    Objective,
    OptimConfig,
    Phase,
    WeightAnchor,
    augment_batch,
    make_plan,
    train_client,
    train_group,
)


def _clients(G=4, seed=0, size=28, dtype=torch.float64):
    """G paper CNNs and random data. float64 by default: the equivalence tests compare two code
    paths, and in float32 a rounding difference can flip a ReLU or max-pool decision near a tie
    on some CPUs; in float64 rounding sits near 1e-15, so a 1e-9 bound separates
    logic differences from rounding on any machine."""
    torch.manual_seed(seed)
    models = [PaperCNN(input_size=size).to(dtype) for _ in range(G)]
    xs = [torch.randn(21 + 4 * g, 1, size, size, dtype=dtype) for g in range(G)]  # unequal sizes -> masked steps
    ys = [torch.randint(0, 10, (len(x),)) for x in xs]
    return models, xs, ys


def _rel(a, b):
    return ((a - b).norm() / a.norm()).item()


TIGHT = 1e-9

"""Relative bound for two paths in float64 (measured: below 1e-14)."""


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
    """Same seed, float64: batched and sequential give the same per-client weights, embedding sums
    and losses within 1e-9 relative."""
    models, xs, ys = _clients(4)
    ref = [copy.deepcopy(m) for m in models]
    opt = OptimConfig()
    table, mask = prototype_table(np.arange(7), np.random.default_rng(1).random((7, 50), dtype=np.float32), 10, 50)
    obj = Objective([Phase(2)], collect=True, terms=(ProtoTerm(1.0, table, mask, form),))
    plans = _plans(models, xs, obj, opt)
    seq = [train_client(ref[g], xs[g], ys[g], plans[g], obj, opt) for g in range(4)]
    bat = train_group(models, xs, ys, plans, obj, opt)
    for g in range(4):
        for (name, a), (_, b) in zip(ref[g].named_parameters(), models[g].named_parameters()):
            rel = _rel(a, b)
            assert rel < TIGHT, (g, name, rel)
        assert torch.equal(seq[g].counts, bat[g].counts)
        assert _rel(seq[g].sums, bat[g].sums) < TIGHT
        assert seq[g].steps == bat[g].steps
        assert seq[g].loss_ce == pytest.approx(bat[g].loss_ce, rel=TIGHT)
        assert seq[g].loss_proto == pytest.approx(bat[g].loss_proto, rel=TIGHT)
        assert seq[g].loss_proto > 0
        assert seq[g].emb_norm_max == pytest.approx(bat[g].emb_norm_max, rel=1e-6) and seq[g].emb_norm_max > 0


def test_batched_prox_and_head_only_phase_match_sequential():
    models, xs, ys = _clients(3)
    ref_w = {k: v.detach().clone() + 0.05 for k, v in models[0].named_parameters()}
    ref = [copy.deepcopy(m) for m in models]
    opt = OptimConfig()
    obj = Objective([Phase(1, trains=lambda n: n.startswith("fc2.")),
                     Phase(1, trains=lambda n: not n.startswith("fc2."))], anchor=WeightAnchor(0.5, ref_w))
    plans = _plans(models, xs, obj, opt)
    for g in range(3):
        train_client(ref[g], xs[g], ys[g], plans[g], obj, opt)
    train_group(models, xs, ys, plans, obj, opt)
    for g in range(3):
        for (name, a), (_, b) in zip(ref[g].named_parameters(), models[g].named_parameters()):
            assert _rel(a, b) < TIGHT, name


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
        assert _rel(a, b) < TIGHT, n


def test_trailing_batch_rule_for_batchnorm_models():
    """A 202-sample client at batch size 8 would end each epoch on a 2-sample batch, and
    BatchNorm (layer4's maps are 1x1 in ResNet18) blew its embeddings up. Models with BatchNorm
    fold a trailing batch below half the batch size into the batch before it."""
    from fedproto.training import min_batch

    assert [min_batch(ResNet18(), b) for b in (1, 2, 3, 4, 5, 8, 9, 10)] == [1, 2, 3, 4, 4, 4, 5, 5]
    assert [min_batch(PaperCNN(), b) for b in (2, 8, 10)] == [1, 1, 1]
    opt = OptimConfig(batch_size=8)
    # at batch size 4 a rule of half the batch size alone kept 2-sample batches, and the client blew up
    plan = make_plan(202, [Phase(1)], OptimConfig(batch_size=4), {}, 0.0, np.random.default_rng(0),
                     min_batch=min_batch(ResNet18(), 4))
    assert (plan.weight[0] > 0).sum(1).tolist() == [4] * 49 + [6]
    for n, mb, rows in ((202, 4, [8] * 24 + [10]), (202, 1, [8] * 25 + [2]), (205, 4, [8] * 25 + [5]),
                        (200, 4, [8] * 25), (3, 4, [3]), (11, 4, [11]), (8, 4, [8])):
        plan = make_plan(n, [Phase(2)], opt, {"fc1": 5}, 0.5, np.random.default_rng(0), min_batch=mb)
        w = plan.weight[0]
        assert (w > 0).sum(1).tolist() == rows * 2, (n, mb)
        assert plan.order[0].shape == (2 * len(rows), max(rows + [8])) and plan.noise[0]["fc1"].shape[:2] == w.shape
        for e in range(2):  # every sample once per epoch
            rows_e = slice(e * len(rows), (e + 1) * len(rows))
            assert sorted(plan.order[0][rows_e][w[rows_e] > 0].tolist()) == list(range(n))
    # drop_last still drops, whatever the model
    plan = make_plan(202, [Phase(1)], OptimConfig(batch_size=8, drop_last=True), {}, 0.0, np.random.default_rng(0),
                     min_batch=4)
    assert plan.order[0].shape == (25, 8) and plan.weight[0].sum() == 200
    # without a fold the draws are those of earlier versions: the plan does not depend on min_batch
    a = make_plan(205, [Phase(1)], opt, {"fc1": 5}, 0.5, np.random.default_rng(3), min_batch=1)
    b = make_plan(205, [Phase(1)], opt, {"fc1": 5}, 0.5, np.random.default_rng(3), min_batch=4)
    assert torch.equal(a.order[0], b.order[0]) and torch.equal(a.noise[0]["fc1"], b.noise[0]["fc1"])


def test_batched_path_reads_folded_plans_as_the_sequential_path():
    """The fold is in the plan, so both paths follow it: a group whose plans have wider rows than
    the batch size (folded trailing batches) trains as the sequential reference (float64)."""
    models, xs, ys = _clients(3)
    ref = [copy.deepcopy(m) for m in models]
    opt = OptimConfig(batch_size=8)
    obj = Objective([Phase(2)], collect=True)
    plans = [make_plan(len(x), obj.phases, opt, m.noise_widths(), m.dropout, np.random.default_rng([5, g]), min_batch=6)
             for g, (m, x) in enumerate(zip(models, xs))]
    assert [p.order[0].shape[1] for p in plans] == [13, 9, 13]  # 21 = 8 + 13, 25 = 2 x 8 + 9, 29 = 2 x 8 + 13
    seq = [train_client(ref[g], xs[g], ys[g], plans[g], obj, opt) for g in range(3)]
    bat = train_group(models, xs, ys, plans, obj, opt)
    for g in range(3):
        assert seq[g].steps == bat[g].steps and torch.equal(seq[g].counts, bat[g].counts)
        for (name, a), (_, b) in zip(ref[g].named_parameters(), models[g].named_parameters()):
            assert _rel(a, b) < TIGHT, (g, name)


def test_group_refuses_objectives_that_differ():
    """train_group must not apply the first client's objective to all: objectives that differ
    in anything but the anchor's references are refused (here λ, the prototype term's weight)."""
    models, xs, ys = _clients(2)
    opt = OptimConfig()
    table, mask = prototype_table(np.arange(3), np.ones((3, 50), np.float32), 10, 50)
    a = Objective([Phase(1)], terms=(ProtoTerm(1.0, table, mask),))
    b = Objective([Phase(1)], terms=(ProtoTerm(0.5, table, mask),))
    plans = _plans(models, xs, a, opt)
    with pytest.raises(ValueError, match="client 1 of the group has another objective"):
        train_group(models, xs, ys, plans, a, opt, [a, b])


# -- two stages, full test split -----------------------------------------------------------------
@pytest.mark.parametrize("algorithm,execution", [("fedproto", "sequential"), ("fedproto", "batched"),
                                                 ("fedavg", "batched"), ("local", "sequential")])
def test_second_stage_trains_the_head_only(algorithm, execution):
    cfg = digits_config(algorithm=algorithm, execution=execution, rounds=3, freeze_after=2)
    sim = Simulation(cfg, out=False)
    before = {}

    def snap(row):
        if row["round"] == 2:
            before.update({n: p.detach().clone() for n, p in sim.setup.states[0].model.named_parameters()})

    msgs = []
    sim.on_round = lambda row: (snap(row), msgs.append(dict(sim.message)))
    sim.run()
    model = sim.setup.states[0].model
    if algorithm == "fedavg":  # clients load the global model: its body stays as it was after round 2
        body = [n for n, _ in model.named_parameters() if not model.is_head_param(n)]
        assert body and all(np.array_equal(msgs[1]["w/" + n], msgs[2]["w/" + n]) for n in body)
        assert not all(np.array_equal(msgs[1]["w/" + n], msgs[2]["w/" + n]) for n, _ in model.named_parameters()
                       if model.is_head_param(n))
    else:
        for n, p in model.named_parameters():
            changed = not torch.equal(before[n], p.detach())
            assert changed == model.is_head_param(n), n
    assert "head_only" in sim.message and "head_only" not in msgs[0]


def _reference_augment(x, params, pad):
    out = []
    for xi, (dy, dx, flip) in zip(x, params.tolist()):
        xp = torch.nn.functional.pad(xi, (pad, pad, pad, pad))
        crop = xp[:, dy : dy + x.shape[2], dx : dx + x.shape[3]]
        out.append(crop.flip(-1) if flip else crop)
    return torch.stack(out)


@pytest.mark.usefixtures("one_thread")
def test_augmentation_is_a_crop_and_flip_of_the_padded_image():
    x = torch.arange(1, 6 * 3 * 32 * 32 + 1, dtype=torch.float32).reshape(6, 3, 32, 32)  # distinct values
    plan = make_plan(6, [Phase(1)], OptimConfig(batch_size=6, augment=True), {}, 0.0, np.random.default_rng(0))
    params = plan.aug[0][0]
    assert params.shape == (6, 3)
    params[0] = torch.tensor([AUGMENT_PAD, AUGMENT_PAD, 0])  # centre crop, no flip: identity
    params[1] = torch.tensor([AUGMENT_PAD, AUGMENT_PAD, 1])  # centre crop + flip: mirror
    params[2] = torch.tensor([0, 2 * AUGMENT_PAD, 1])  # corner crop + flip
    out = augment_batch(x, params)
    assert torch.equal(out, _reference_augment(x, params, AUGMENT_PAD))
    assert torch.equal(out[0], x[0]) and torch.equal(out[1], x[1].flip(-1))
    for xi, oi, (dy, dx, _flip) in zip(x, out, params.tolist()):
        vals = oi[oi != 0]
        assert len(vals) == len(torch.unique(vals)) and bool(torch.isin(vals, xi).all())  # values moved, not mixed
        assert (oi == 0).sum() == 3 * (32 * 32 - (32 - abs(dy - AUGMENT_PAD)) * (32 - abs(dx - AUGMENT_PAD)))
    # the plan's draws cover the offsets and both flip values; no augmentation -> same plan otherwise
    big = make_plan(400, [Phase(1)], OptimConfig(augment=True), {"fc1": 5}, 0.5, np.random.default_rng(1))
    plain = make_plan(400, [Phase(1)], OptimConfig(), {"fc1": 5}, 0.5, np.random.default_rng(1))
    a = big.aug[0]
    assert set(a[..., :2].unique().tolist()) == set(range(2 * AUGMENT_PAD + 1))
    assert set(a[..., 2].unique().tolist()) == {0, 1}
    assert plain.aug == [] and torch.equal(big.order[0], plain.order[0])
    assert torch.equal(big.noise[0]["fc1"], plain.noise[0]["fc1"])


@pytest.mark.usefixtures("one_thread")
def test_augmented_batched_matches_sequential_on_cifar_sized_cnn():
    G = 3
    torch.manual_seed(0)
    models = [PaperCNN(in_channels=3, input_size=32).double() for _ in range(G)]  # float64: see conftest.float64_sim
    xs = [torch.randn(11 + 5 * g, 3, 32, 32, dtype=torch.float64) for g in range(G)]
    ys = [torch.randint(0, 10, (len(x),)) for x in xs]
    ref = [copy.deepcopy(m) for m in models]
    opt = OptimConfig(augment=True)
    table, mask = prototype_table(np.arange(6), np.random.default_rng(1).random((6, 50), dtype=np.float32), 10, 50)
    obj = Objective([Phase(2)], collect=True, terms=(ProtoTerm(1.0, table, mask),))
    plans = [make_plan(len(x), obj.phases, opt, m.noise_widths(), m.dropout, np.random.default_rng([7, g]))
             for g, (m, x) in enumerate(zip(models, xs))]
    seq = [train_client(ref[g], xs[g], ys[g], plans[g], obj, opt) for g in range(G)]
    bat = train_group(models, xs, ys, plans, obj, opt)
    for g in range(G):
        for (name, a), (_, b) in zip(ref[g].named_parameters(), models[g].named_parameters()):
            assert ((a - b).norm() / a.norm()).item() < 1e-9, (g, name)
        assert ((seq[g].sums - bat[g].sums).norm() / seq[g].sums.norm()).item() < 1e-9
        assert seq[g].loss_ce == pytest.approx(bat[g].loss_ce, rel=1e-9)
    # augmentation is applied: the same plan without it trains to different weights
    plain = copy.deepcopy(models[0])
    torch.manual_seed(0)
    start = PaperCNN(in_channels=3, input_size=32).double()
    plan_plain = make_plan(len(xs[0]), obj.phases, OptimConfig(), start.noise_widths(), start.dropout,
                           np.random.default_rng([7, 0]))
    train_client(start, xs[0], ys[0], plan_plain, obj, OptimConfig())
    assert not torch.allclose(start.fc1.weight, plain.fc1.weight)


@pytest.mark.usefixtures("one_thread")
def test_optim_config_reads_augment():
    from fedproto.algorithms.algorithm import optim_config

    assert optim_config(build_config(overrides={"augment": True})).augment is True
    assert optim_config(build_config()).augment is False


@pytest.mark.usefixtures("one_thread")
@needs_cifar
@pytest.mark.slow  # ResNet18 on real CIFAR-10, 3 rounds: 8-16 s on one thread
@pytest.mark.parametrize("batch_size", [10, 4])
def test_resnet18_on_a_two_sample_trailing_batch_learns(caplog, batch_size):
    """A run that once failed (``--clients 2 --ways 2 --stdev 0 --batch-size 10 --rounds 3``, ResNet18):
    202 samples per client end each epoch on a 2-sample batch. Before the fold rule, both clients'
    test embeddings reached median norms of ~2e6 and ~6e17 and both accuracies sat at chance
    (50.00 / 48.75); with the trailing batch folded into the one before it, ~80% and norms ~25.
    (It was run with ``--shots 100``: that drew 101 shots then; with stdev 0 meaning exactly the
    shots asked for, ``--shots 101`` gives the same clients and data.) Batch size 4:
    a first rule kept a 2-sample trailing batch there, and one client reached norm 5.8e9."""
    cfg = build_config(overrides=dict(dataset="cifar10", model="resnet18", clients=2, ways=2, stdev=0, shots=101,
                                      batch_size=batch_size, rounds=3, eval_every=0))
    sim = Simulation(cfg, out=False)
    assert [len(d.x) for d in sim.setup.data] == [202, 202]
    summary = sim.run()
    per_client = sim.evaluate()
    assert summary["accuracy"]["acc"]["mean"] > 0.7 and summary["accuracy"]["acc_proto"]["mean"] > 0.7
    assert all(m["nonfinite"] == 0.0 and 1.0 < m["emb_norm"] < 1e3 for m in per_client), per_client
    assert "emb_norm" not in summary["accuracy"] and not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_train_on_every_path_with_float32_prototype_sums(dtype):
    """A breaker's float16 and bfloat16 models crashed the batched path (index_add_ of float32 rows
    into half sums). Every path now trains them, and the prototype sums are kept in float32 or
    better whatever the model's dtype."""
    from conftest import own_digits_clients

    from fedproto.federation import federate

    got = {}
    for execution in ("sequential", "batched", "auto"):
        clients = own_digits_clients(2)
        for c in clients:
            c.model.to(dtype)
        before = [torch.cat([p.detach().float().flatten() for p in c.model.parameters()]) for c in clients]
        fed = federate(clients, num_classes=10, rounds=2, threads=1, execution=execution, out=False)
        summary = fed.run()
        for s, b in zip(fed.setup.states, before):
            after = torch.cat([p.detach().float().flatten() for p in s.model.parameters()])
            assert next(s.model.parameters()).dtype == dtype and not torch.equal(after, b), execution
        protos = np.asarray(fed.message["protos"])
        assert protos.dtype == np.float32 and np.isfinite(protos).all() and len(protos), execution
        got[execution] = summary["accuracy"]["acc"]["mean"]
    assert all(np.isfinite(v) for v in got.values())
