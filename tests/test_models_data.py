"""Natural (per-writer) and FEMNIST few-shot partitions, ResNet18 (names, shapes, pretrained
loading), train-time augmentation (crop + flip, batched == sequential), CIFAR-10 end to end."""

import copy
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DATA

from fedproto.config import build_config
from fedproto.data.partition import fewshot_partition, natural_partition
from fedproto.engine.setup import prepare
from fedproto.errors import ConfigError, DataError, ModelError, PartitionError
from fedproto.models.cnn import PaperCNN
from fedproto.models.resnet import ResNet18, load_pretrained
from fedproto.models.zoo import build_client_models, mh_resnet_strides
from fedproto.prototypes import prototype_table
from fedproto.simulation import Simulation
from fedproto.training import (
    AUGMENT_PAD,
    Objective,
    OptimConfig,
    Phase,
    augment_batch,
    make_plan,
    train_client,
    train_group,
)


def _has(*parts: str) -> bool:
    return bool(DATA) and Path(DATA, *parts).exists()


needs_femnist = pytest.mark.skipif(not _has("femnist"), reason="set FEDPROTO_DATA to a folder with femnist/")
needs_cifar = pytest.mark.skipif(not _has("cifar10"), reason="set FEDPROTO_DATA to a folder with cifar10/")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: one intra-op thread is as fast, and immune to the 10-50x slowdown of
    oversubscribed OpenMP threads when other processes share the CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def femnist():
    from fedproto.data.datasets import load_dataset

    return load_dataset("femnist", DATA, download=False)


# --- partitions ---------------------------------------------------------------------------------


@needs_femnist
def test_natural_partition_one_client_per_writer(femnist):
    ds = femnist
    tr_g, te_g, tr_y, te_y = ds.train_groups, ds.test_groups, ds.train_y.numpy(), ds.test_y.numpy()
    W = len(ds.group_names)
    p = natural_partition(tr_g, te_g, tr_y, te_y, W, seed=0)
    assert p.num_clients == W and sorted(p.writers) == list(range(W))
    all_train = np.concatenate(p.train_idx)
    assert np.array_equal(np.sort(all_train), np.arange(len(tr_y)))  # disjoint and complete
    assert np.array_equal(np.sort(np.concatenate(p.test_idx)), np.arange(len(te_y)))
    unseen = 0
    for tr, te, cls, k, w in zip(p.train_idx, p.test_idx, p.classes, p.shots, p.writers):
        assert np.all(tr_g[tr] == w) and np.all(te_g[te] == w)
        assert len(tr) == (tr_g == w).sum() and len(te) == (te_g == w).sum() >= 1
        assert np.array_equal(cls, np.unique(tr_y[tr]))
        assert np.array_equal(k, np.bincount(tr_y[tr], minlength=62)[cls]) and k.sum() == len(tr)
        unseen += int((~np.isin(te_y[te], cls)).sum())
    assert unseen > 0  # test samples of classes the writer never trained on are kept

    a = natural_partition(tr_g, te_g, tr_y, te_y, 20, seed=3)
    b = natural_partition(tr_g, te_g, tr_y, te_y, 20, seed=3)
    c = natural_partition(tr_g, te_g, tr_y, te_y, 20, seed=4)
    assert a.writers == b.writers and a.writers != c.writers and a.writers == sorted(a.writers)
    assert len(set(a.writers)) == 20
    with pytest.raises(PartitionError, match=rf"only {W} writers are available.*use clients={W} or fewer"):
        natural_partition(tr_g, te_g, tr_y, te_y, W + 1, seed=0)


@needs_femnist
def test_natural_partition_through_prepare(femnist):
    cfg = build_config(overrides=dict(dataset="femnist", partition="natural", clients=5, rounds=1))
    setup = prepare(cfg, dataset=femnist)
    assert len(setup.states) == 5 and setup.partition.writers
    for s, d, w in zip(setup.states, setup.data, setup.partition.writers):
        assert len(d.x) == (femnist.train_groups == w).sum()
        assert set(d.y.tolist()) == set(s.classes.tolist())


def test_natural_partition_needs_writer_ids():
    cfg = build_config(overrides=dict(dataset="digits", partition="natural", clients=2))
    with pytest.raises(ConfigError, match="natural.*writer ids"):
        prepare(cfg)


@needs_femnist
def test_femnist_fewshot_feasible_and_capacity_error(femnist):
    tr_y, te_y = femnist.train_y.numpy(), femnist.test_y.numpy()
    # 20 clients, 3 ways: ~10 shots and <= 3 test shots fit the LEAF 5% writer sample
    p = fewshot_partition(tr_y, te_y, 62, 20, 3, 10, 1, 3, "uniform", 1234, "femnist")
    assert p.num_clients == 20
    assert len(np.unique(np.concatenate(p.train_idx))) == sum(len(t) for t in p.train_idx)
    for tr, cls, k in zip(p.train_idx, p.classes, p.shots):
        assert 10 <= k[0] <= 11  # official FEMNIST range [k - s + 1, k + s]
        assert np.all(np.bincount(tr_y[tr], minlength=62)[cls] == k)
    with pytest.raises(PartitionError, match=r"runs short.*largest that fits.*LEAF writer sample"):
        fewshot_partition(tr_y, te_y, 62, 20, 3, 100, 1, 3, "uniform", 1234, "femnist")
    with pytest.raises(PartitionError, match=r"test_shots=40.*LEAF writer sample"):
        fewshot_partition(tr_y, te_y, 62, 20, 3, 10, 1, 40, "uniform", 1234, "femnist")


def test_capacity_hint_is_the_largest_shots_that_fits():
    tr_y, te_y = np.repeat(np.arange(10), 60), np.repeat(np.arange(10), 20)
    with pytest.raises(PartitionError, match=r"shots=(\d+) is the largest") as e:
        fewshot_partition(tr_y, te_y, 10, 20, 3, 40, 2, 5, "uniform", 5, "cifar10")
    fit = int(str(e.value).split("shots=")[-1].split()[0])
    fewshot_partition(tr_y, te_y, 10, 20, 3, fit, 2, 5, "uniform", 5, "cifar10")
    with pytest.raises(PartitionError):
        fewshot_partition(tr_y, te_y, 10, 20, 3, fit + 1, 2, 5, "uniform", 5, "cifar10")


# --- ResNet18 -----------------------------------------------------------------------------------


def _torchvision_resnet18_keys() -> list[str]:
    """torchvision.models.resnet18().state_dict().keys(), written out (122 keys)."""
    bn = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    keys = ["conv1.weight", *[f"bn1.{b}" for b in bn]]
    for layer in (1, 2, 3, 4):
        for block in (0, 1):
            p = f"layer{layer}.{block}."
            keys += [p + "conv1.weight", *[p + f"bn1.{b}" for b in bn]]
            keys += [p + "conv2.weight", *[p + f"bn2.{b}" for b in bn]]
            if layer > 1 and block == 0:
                keys += [p + "downsample.0.weight", *[p + f"downsample.1.{b}" for b in bn]]
    return keys + ["fc.weight", "fc.bias"]


TORCHVISION_SHAPES = {  # a few spot checks of torchvision's shapes
    "conv1.weight": (64, 3, 7, 7),
    "layer1.0.conv1.weight": (64, 64, 3, 3),
    "layer2.0.downsample.0.weight": (128, 64, 1, 1),
    "layer3.1.bn2.running_var": (256,),
    "layer4.0.conv1.weight": (512, 256, 3, 3),
    "layer4.1.conv2.weight": (512, 512, 3, 3),
    "fc.weight": (1000, 512),
}


def test_resnet18_names_match_torchvision():
    m = ResNet18(num_classes=1000)
    sd = m.state_dict()
    expected = _torchvision_resnet18_keys()
    assert len(expected) == 122
    assert list(sd) == expected
    for k, shape in TORCHVISION_SHAPES.items():
        assert tuple(sd[k].shape) == shape, k
    assert sum(p.numel() for p in m.parameters()) == 11_689_512  # torchvision resnet18
    assert m.is_head_param("fc.weight") and not m.is_head_param("layer4.1.bn2.weight")
    # FedPer/FedRep: ResNet18's only fully connected layer is fc, so both splits keep fc alone
    for layers in ("fc", "head"):
        assert m.is_personal_param("fc.bias", layers) and not m.is_personal_param("layer4.1.conv2.weight", layers)
    assert m.arch_key() is None


@pytest.mark.parametrize("strides", [(2, 2), (1, 4)])
def test_resnet18_embedding_is_layer4_output(strides):
    torch.manual_seed(0)
    m = ResNet18(10, 3, *strides).eval()
    x = torch.randn(2, 3, 32, 32)
    fmap = m.feature_map(x)
    assert fmap.shape == (2, 512, 1, 1)  # official prototype: layer4 output, 512x1x1 on 32x32
    logits, h = m(x)
    assert h.shape == (2, 512) and logits.shape == (2, 10)
    assert torch.equal(h, fmap.flatten(1))
    big = torch.randn(2, 3, 64, 64)
    assert m.feature_map(big).shape == (2, 512, 2, 2) and m.embed(big).shape == (2, 512)  # pooled to 1x1


def test_resnet18_single_sample_training_batch():
    m = ResNet18(10).train()
    before = m.layer4[1].bn2.running_mean.clone()
    logits, h = m(torch.randn(1, 3, 32, 32))
    assert h.shape == (1, 512) and m.training and m.layer4[1].bn2.training
    assert torch.equal(before, m.layer4[1].bn2.running_mean)


def test_resnet18_zoo_names_and_mh_strides():
    assert [mh_resnet_strides(i, 20) for i in range(20)] == [(1, 4)] * 10 + [(2, 2)] * 10  # official: 0-9
    assert [m.strides for m in build_client_models("resnet18-mh", 3, 3, 10, 32)] == [(1, 4), (1, 4), (2, 2)]
    assert all(m.strides == (2, 2) for m in build_client_models("resnet18", 2, 3, 10, 32))


def _saved_weights(tmp_path) -> tuple[Path, dict]:
    torch.manual_seed(1)
    sd = ResNet18(num_classes=1000).state_dict()
    sd = {k: (v + 1.0 if v.is_floating_point() else v + 7) for k, v in sd.items()}  # perturbed
    path = tmp_path / "resnet18.pth"
    torch.save(sd, path)
    return path, sd


def test_pretrained_loads_all_but_conv1_bn1_fc(tmp_path):
    path, saved = _saved_weights(tmp_path)
    torch.manual_seed(2)
    fresh = ResNet18(num_classes=10)
    init = copy.deepcopy(fresh.state_dict())
    loaded = load_pretrained(fresh, path)
    assert len(loaded) == 114
    after = fresh.state_dict()
    for k in after:
        if k.startswith(("conv1.", "bn1.", "fc.")):
            assert torch.equal(after[k], init[k]), k
            assert k.startswith("fc.") or not torch.equal(after[k], saved[k]), k
        else:
            assert torch.equal(after[k], saved[k]), k
    models = build_client_models("resnet18-mh", 3, 3, 10, 32, pretrained=str(path))
    for m in models:
        assert torch.equal(m.layer3[0].conv1.weight, saved["layer3.0.conv1.weight"])


def test_pretrained_errors(tmp_path):
    path, saved = _saved_weights(tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        load_pretrained(ResNet18(), tmp_path / "nope.pth")
    bad = tmp_path / "corrupt.pth"
    bad.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(DataError, match="cannot read pretrained weights"):
        load_pretrained(ResNet18(), bad)
    wrong = dict(saved, **{"layer2.1.conv1.weight": torch.zeros(64, 64, 3, 3)})
    with pytest.raises(ModelError, match=r"'layer2.1.conv1.weight'.*\(64, 64, 3, 3\).*\(128, 128, 3, 3\)"):
        load_pretrained(ResNet18(), wrong)
    missing = {k: v for k, v in saved.items() if k != "layer4.1.bn2.running_var"}
    with pytest.raises(ModelError, match="lack 'layer4.1.bn2.running_var'"):
        load_pretrained(ResNet18(), missing)
    # reported: a NaN tensor was only caught as "training diverged ... lower --lr"
    nan = dict(saved, **{"layer3.0.bn1.weight": saved["layer3.0.bn1.weight"].clone().fill_(float("nan"))})
    with pytest.raises(ModelError, match=r"'layer3.0.bn1.weight' .* holds 256 NaN or infinite value"):
        load_pretrained(ResNet18(), nan)
    as_int = dict(saved, **{"layer1.0.conv1.weight": saved["layer1.0.conv1.weight"].long()})
    with pytest.raises(ModelError, match=r"'layer1.0.conv1.weight' .* dtype torch.int64"):
        load_pretrained(ResNet18(), as_int)
    with pytest.raises(DataError, match="is not a regular file"):
        load_pretrained(ResNet18(), tmp_path)
    with pytest.raises(ModelError, match="'layer5.0.conv1.weight', not a resnet18 key"):
        load_pretrained(ResNet18(), dict(saved, **{"layer5.0.conv1.weight": torch.zeros(1)}))
    with pytest.raises(ModelError, match="resnet18"):
        build_client_models("cnn", 2, 1, 10, 28, pretrained=str(path))


def test_projcnn_spec_bounds():
    from fedproto.models.zoo import check_model_name, projcnn_channels

    assert projcnn_channels("projcnn:16") == (16,) and projcnn_channels("projcnn:32-64") == (32, 64)
    for bad in ("projcnn:99999999999999999999-2", "projcnn:\u0661\u0666-32", "projcnn:0-4", "projcnn:4-",
                "projcnn:" + "-".join(["4"] * 9)):
        with pytest.raises(ModelError, match="bad model spec"):
            check_model_name(bad)


def test_config_is_strict_and_frozen():
    from pydantic import ValidationError

    from fedproto.errors import ConfigError

    for bad, expect in ((dict(clients=True), "clients=True: Input should be a valid integer"),
                        (dict(lr="0.1"), "lr='0.1': Input should be a valid number"),
                        (dict(augment=1), "augment=1: Input should be a valid boolean"),
                        (dict(dataset=["digits"]), "dataset=['digits']: Input should be a valid string"),
                        (dict(stdev=10**20), "less than or equal to 10000000"),
                        (dict(name="a b"), "is not a plain folder name"),
                        (dict(out_dir=""), "out_dir='': String should have at least 1 character"),
                        (dict(model="resnet18", embedding_dim=64), "embedding_dim=64 does not apply to resnet18")):
        with pytest.raises(ConfigError, match=re.escape(expect)):
            build_config(overrides=bad)
    cfg = build_config()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.ways = 11
    assert cfg.ways == 3
    assert build_config(overrides={"lambda_proto": 1}).lam == 1.0  # an int is a fine float


# --- augmentation -------------------------------------------------------------------------------


def _reference_augment(x, params, pad):
    out = []
    for xi, (dy, dx, flip) in zip(x, params.tolist()):
        xp = torch.nn.functional.pad(xi, (pad, pad, pad, pad))
        crop = xp[:, dy : dy + x.shape[2], dx : dx + x.shape[3]]
        out.append(crop.flip(-1) if flip else crop)
    return torch.stack(out)


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


def test_augmented_batched_matches_sequential_on_cifar_sized_cnn():
    G = 3
    torch.manual_seed(0)
    models = [PaperCNN(in_channels=3, input_size=32).double() for _ in range(G)]  # float64: see conftest.float64_sim
    xs = [torch.randn(11 + 5 * g, 3, 32, 32, dtype=torch.float64) for g in range(G)]
    ys = [torch.randint(0, 10, (len(x),)) for x in xs]
    ref = [copy.deepcopy(m) for m in models]
    opt = OptimConfig(augment=True)
    table, mask = prototype_table(np.arange(6), np.random.default_rng(1).random((6, 50), dtype=np.float32), 10, 50)
    obj = Objective([Phase(2)], lambda_proto=1.0, table=table, mask=mask, collect=True)
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


def test_optim_config_reads_augment():
    from fedproto.algorithms.base import optim_config

    assert optim_config(build_config(overrides={"augment": True})).augment is True
    assert optim_config(build_config()).augment is False


def test_model_and_rounds_default_to_the_papers_per_dataset():
    # §Experiments: CNN for MNIST/FEMNIST, ResNet18 for CIFAR-10; tab. 1: 100 / 120 / 110 rounds
    got = {ds: (c.model, c.rounds, c.lam) for ds in ("mnist", "femnist", "cifar10", "digits")
           for c in [build_config(overrides={"dataset": ds})]}
    assert got == {"mnist": ("cnn", 100, 1.0), "femnist": ("cnn", 120, 1.0),
                   "cifar10": ("resnet18", 110, 0.1), "digits": ("cnn", 20, 1.0)}
    explicit = build_config(overrides={"dataset": "cifar10", "model": "cnn-mh", "rounds": 3})
    assert (explicit.model, explicit.rounds) == ("cnn-mh", 3)
    # the run name carries the model when it is not the dataset's default, so runs do not collide
    assert build_config(overrides={"dataset": "cifar10"}).run_name() == "fedproto-cifar10-n3-k100-s1234"
    assert explicit.run_name() == "fedproto-cifar10-cnn-mh-n3-k100-s1234-r3"  # rounds 3 differs from 110
    odd = build_config(overrides={"model": "projcnn:32-64,projcnn:16-32"})
    assert odd.run_name() == "fedproto-mnist-projcnn_32-64_projcnn_16-32-n3-k100-s1234"


# --- end to end ---------------------------------------------------------------------------------


@needs_cifar
def test_cifar10_paper_cnn_one_round_end_to_end(tmp_path):
    cfg = build_config(overrides=dict(dataset="cifar10", model="cnn", clients=4, ways=3, shots=20, stdev=1,
                                      test_shots=10, rounds=1, augment=True, data_dir=DATA, download=False,
                                      out_dir=str(tmp_path)))
    sim = Simulation(cfg, out=False)
    assert isinstance(sim.setup.states[0].model, PaperCNN) and sim.setup.states[0].model.in_channels == 3
    summary = sim.run()
    assert summary["clients"] == 4 and 0.0 <= summary["accuracy"]["acc"]["mean"] <= 1.0
    assert sim.history[0]["loss_ce"] > 0


def test_resnet18_runs_in_the_simulation_sequentially(tmp_path):
    """resnet18-mh with --pretrained through the engine (8x8 grey digits: conv1 differs from the
    file's 3-channel conv1, which is never loaded)."""
    path, saved = _saved_weights(tmp_path)
    cfg = build_config(overrides=dict(dataset="digits", model="resnet18-mh", clients=2, ways=2, shots=5, stdev=0,
                                      test_shots=5, rounds=1, pretrained=str(path)))
    sim = Simulation(cfg, out=False)
    # _groups gives (clients, process) pairs: each client alone, in the main process
    assert sim.setup.embedding_dim == 512 and sim.executor._groups([0, 1]) == [([0], 0), ([1], 0)]
    assert [s.model.strides for s in sim.setup.states] == [(1, 4), (2, 2)]
    assert all(torch.equal(s.model.layer2[1].conv2.weight, saved["layer2.1.conv2.weight"]) for s in sim.setup.states)
    summary = sim.run()
    assert summary["clients"] == 2 and sim.history[0]["loss_ce"] > 0
    with pytest.raises(ModelError, match="resnet18"):
        prepare(cfg.model_copy(update={"model": "cnn"}))


def test_pretrained_pickled_model_and_relative_path(tmp_path, monkeypatch):
    """Reported: a whole pickled model printed torch's weights_only advice; a relative
    --pretrained path was stored relative, so onboard and --resume from another folder failed."""
    whole = tmp_path / "module.pth"
    torch.save(torch.nn.Linear(2, 2), whole)
    with pytest.raises(DataError, match="holds pickled Python objects .* not a state dict; save model.state_dict"):
        load_pretrained(ResNet18(), whole)
    monkeypatch.chdir(tmp_path)
    from fedproto.config import build_config

    cfg = build_config(overrides={"dataset": "cifar10", "pretrained": "w.pth"})
    assert cfg.pretrained == str(tmp_path / "w.pth")


def test_sweep_cell_names_are_plain_folder_names(tmp_path):
    """Reported: sweeping a model spec or a path failed with 'is not a plain folder name'."""
    from fedproto.errors import ConfigError
    from fedproto.reproduce import plan_sweep

    cells = plan_sweep(tmp_path, "model", "model", ["projcnn:8-8", "cnn"], "digits", 3, ["fedproto"], [1])
    assert [c.name for c in cells] == ["digits-n3-fedproto-s1-modelprojcnn_8-8", "digits-n3-fedproto-s1-modelcnn"]
    with pytest.raises(ConfigError, match="would share a run folder"):
        plan_sweep(tmp_path, "pretrained", "pretrained", ["/a/x.pth", "/b/x.pth"], "cifar10", 3, ["fedproto"], [1])


def test_python_api_misuse_is_a_config_error():
    """Reported: raw TypeError/AttributeError for common mistakes in the Python API."""
    from fedproto import ConfigError, Simulation, build_config
    from fedproto.reproduce import plan_sweep

    with pytest.raises(ConfigError, match=r"pass options as build_config\(overrides="):
        build_config({"dataset": "digits"})
    with pytest.raises(ConfigError, match="not a list"):
        build_config(overrides=["dataset=digits"])
    with pytest.raises(ConfigError, match="needs a RunConfig"):
        Simulation({"dataset": "digits"})
    with pytest.raises(ConfigError, match=r"out=123"):
        Simulation(build_config(overrides={"dataset": "digits"}), out=123)
    assert build_config(overrides={"lambda": 0.5, "lambda_proto": None}).lambda_proto == 0.5
    with pytest.raises(ConfigError, match="sweep model with fedproto-mh"):
        plan_sweep(Path("/tmp/x"), "model", "model", ["cnn", "cnn-mh"], "digits", 3, ["fedproto-mh"], [1])


@needs_cifar
@pytest.mark.slow  # ResNet18 on real CIFAR-10, 3 rounds: 8-16 s on one thread
@pytest.mark.parametrize("batch_size", [10, 4])
def test_resnet18_on_a_two_sample_trailing_batch_learns(caplog, batch_size):
    """Issue #10's input (``--clients 2 --ways 2 --stdev 0 --batch-size 10 --rounds 3``, ResNet18):
    202 samples per client end each epoch on a 2-sample batch. Before the fold rule, both clients'
    test embeddings reached median norms of ~2e6 and ~6e17 and both accuracies sat at chance
    (50.00 / 48.75); with the trailing batch folded into the one before it, ~80% and norms ~25.
    (The issue said ``--shots 100``: that drew 101 shots then; with stdev 0 meaning exactly the
    shots asked for, ``--shots 101`` gives the same clients and data.) Batch size 4 (helper 1):
    the first rule kept a 2-sample trailing batch there, and one client reached norm 5.8e9."""
    cfg = build_config(overrides=dict(dataset="cifar10", model="resnet18", clients=2, ways=2, stdev=0, shots=101,
                                      batch_size=batch_size, rounds=3, eval_every=0))
    sim = Simulation(cfg, out=False)
    assert [len(d.x) for d in sim.setup.data] == [202, 202]
    summary = sim.run()
    per_client = sim.evaluate()
    assert summary["accuracy"]["acc"]["mean"] > 0.7 and summary["accuracy"]["acc_proto"]["mean"] > 0.7
    assert all(m["nonfinite"] == 0.0 and 1.0 < m["emb_norm"] < 1e3 for m in per_client), per_client
    assert "emb_norm" not in summary["accuracy"] and not [r for r in caplog.records if r.levelname == "WARNING"]


@needs_cifar
def test_one_way_resnet18_client_predicts_its_only_class():
    """Issue #10: a 1-way ResNet18 client (``--ways 1 --stdev 0 --shots 9 --batch-size 8``) scored
    0% prototype accuracy: its 1-sample trailing batch and overflowing distances sent every
    prediction to class 0. Its one class is the only possible answer: 100%."""
    cfg = build_config(overrides=dict(dataset="cifar10", model="resnet18", clients=2, ways=1, stdev=0, shots=9,
                                      batch_size=8, rounds=2, eval_every=0, test_shots=10))
    sim = Simulation(cfg, out=False)
    assert [len(s.classes) for s in sim.setup.states] == [1, 1] and [len(d.x) for d in sim.setup.data] == [9, 9]
    summary = sim.run()
    assert summary["accuracy"]["acc_proto"]["mean"] == 1.0


def test_exploding_and_nonfinite_embeddings_are_reported(tmp_path, caplog):
    """Issue #10: a blown-up client gave a silent chance-level number. Now a warning names the
    client and round, and ``clients.csv`` flags it (``emb_norm``, ``nonfinite``)."""
    import csv

    cfg = build_config(overrides=dict(dataset="digits", clients=3, ways=2, shots=10, test_shots=5, rounds=1,
                                      eval_every=1, lr=1e-12))  # the models stay about as set below
    sim = Simulation(cfg, out=tmp_path / "run")
    with torch.no_grad():
        sim.setup.states[1].model.fc1.weight.mul_(1e7)  # embeddings of norm ~1e7, finite
    tx = sim.setup.data[2].test_x  # a view gathers a new tensor: change it, then give it to the client
    tx[0] = float("inf")  # one of client 2's test embeddings is not finite
    sim.setup.data[2].test_x = tx
    with caplog.at_level("WARNING"):
        sim.run()
    text = caplog.text
    assert "round 1: client 1's training embeddings reached norm" in text
    assert "round 1: client 1's test embeddings have median norm" in text
    assert "round 1: client 2's test embeddings or scores are not finite" in text
    assert "client 0" not in text
    rows = list(csv.DictReader(open(tmp_path / "run" / "clients.csv")))
    assert [float(r["nonfinite"]) for r in rows] == [0.0, 0.0, 1.0]
    assert float(rows[0]["emb_norm"]) < 1e3 < 1e4 < float(rows[1]["emb_norm"])


def test_eval_mode_blow_up_below_the_norm_limit_is_reported(caplog):
    """Helper 1: a client at chance with test embeddings of norm ~700 against ~20 in training went
    unreported (below the 1e4 limit). Test embeddings 10x larger than any training embedding of
    the client's last round are reported."""
    sim = Simulation(build_config(overrides=dict(dataset="digits", clients=3, rounds=1)), out=False)
    sim.health.train_norm.update({0: 20.0, 1: 20.0, 2: 0.0})
    with caplog.at_level("WARNING"):
        sim.health.evaluated(sim.loop, 4, [{"emb_norm": 25.0, "nonfinite": 0.0}, {"emb_norm": 727.0, "nonfinite": 0.0},
                              {"emb_norm": 727.0, "nonfinite": 0.0}])
    assert "round 4: client 1's test embeddings (median norm 727) are 36x larger" in caplog.text
    assert "client 0" not in caplog.text and "client 2" not in caplog.text  # no training norm known: no claim


def test_tsne_leaves_out_nonfinite_embeddings(tmp_path, caplog):
    """Helper 1: `fedproto plot` of a run with a blown-up client called its files damaged."""
    from fedproto.plots import plot_tsne_arrays

    rng = np.random.default_rng(0)
    h = rng.normal(size=(40, 5)).astype(np.float32)
    h[[3, 7]] = np.nan
    client = np.repeat(np.arange(4), 10)
    with caplog.at_level("WARNING"):
        path = plot_tsne_arrays(h, rng.integers(0, 3, 40), client, tmp_path / "t.png", max_per_client=None)
    assert path.is_file() and "leaves out 2 test embedding(s)" in caplog.text and "clients [0]" in caplog.text


def test_the_model_zoo_and_the_loader_are_public_and_documented():
    """fedproto.models exports the zoo (build_model and friends, each from its module); the API
    reference documents the zoo's modules and the data loader a user calls."""
    import fedproto.models as zoo

    for name in zoo.__all__:
        assert getattr(zoo, name) is not None, name
    assert zoo.build_model is build_client_models.__globals__["build_model"] and zoo.ResNet18 is ResNet18
    model = zoo.build_model("cnn", cid=0, in_channels=1, num_classes=10, input_size=28)  # the docstring's example
    logits, h = model(torch.zeros(2, 1, 28, 28))
    assert isinstance(model, PaperCNN) and logits.shape == (2, 10) and h.shape == (2, 50)
    assert [m.conv2.out_channels for m in zoo.build_client_models("cnn-mh", 3, 1, 10, 28)] == [18, 20, 22]
    with pytest.raises(AttributeError, match="no attribute 'build'"):
        zoo.build  # noqa: B018
    api = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text(encoding="utf-8")
    for module in ("fedproto.models", "fedproto.models.zoo", "fedproto.models.base", "fedproto.models.cnn",
                   "fedproto.models.resnet", "fedproto.data.datasets.load_dataset", "fedproto.data.datasets.Dataset"):
        assert f"::: {module}\n" in api, module
