"""Your own federation (fedproto.federation): user modules outside the zoo, map-style Datasets
with transforms, classifiers split at a named head; FedProto and FedAvg learn on each; bad input
is refused before training, naming the client."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from conftest import client_splits, own_digits_clients
from torch import nn

from fedproto.data.datasets import load_dataset
from fedproto.data.partition import fewshot_partition
from fedproto.errors import ConfigError, DataError, ModelError
from fedproto.federation import Client, federate, with_projection
from fedproto.models.cnn import PaperCNN
from fedproto.privacy import epsilon


class TwoOut(nn.Module):
    """A user's module outside the zoo: returns (logits, embedding)."""

    def __init__(self, width=32, d=16):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, d), nn.ReLU())
        self.out = nn.Linear(d, 10)

    def forward(self, x):
        h = self.body(x)
        return self.out(h), h


class Classifier(nn.Module):
    """torchvision style: features then a final layer named ``fc``."""

    def __init__(self, width=32, d=16):
        super().__init__()
        self.features = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, d), nn.ReLU())
        self.fc = nn.Linear(d, 10)

    def forward(self, x):
        return self.fc(self.features(x))


class Noisy(torch.utils.data.Dataset):
    """A map-style Dataset with its own transform (a small random shift of brightness)."""

    def __init__(self, x, y, seed=0):
        self.x, self.targets = x, y.tolist()
        self.g = torch.Generator().manual_seed(seed)
        self.reads = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.reads += 1
        return self.x[i] + 0.01 * torch.randn(1, generator=self.g), self.targets[i]


@pytest.fixture(scope="module")
def digits():
    ds = load_dataset("digits")
    part = fewshot_partition(ds.train_y.numpy(), ds.test_y.numpy(), 10, 4, 3, 25, 0, 10, seed=5)
    return ds, part


def _clients(digits, make, kind="tensors", head=None):
    ds, part = digits
    out = []
    for i, (tr, te) in enumerate(zip(part.train_idx, part.test_idx)):
        tr, te = torch.as_tensor(tr), torch.as_tensor(te)
        torch.manual_seed(i)
        if kind == "tensors":
            train, test = (ds.train_x[tr], ds.train_y[tr]), (ds.test_x[te].numpy(), ds.test_y[te].numpy())
        else:
            train, test = Noisy(ds.train_x[tr], ds.train_y[tr], i), Noisy(ds.test_x[te], ds.test_y[te], 100 + i)
        out.append(Client(make(), train, test, head=head))
    return out


@pytest.mark.parametrize("algorithm", ["fedproto", "fedavg"])
@pytest.mark.parametrize("kind,make,head", [("tensors", TwoOut, None), ("dataset", TwoOut, None),
                                            ("tensors", Classifier, "fc")])
def test_own_models_and_data_learn(digits, tmp_path, algorithm, kind, make, head):
    clients = _clients(digits, make, kind, head)
    sim = federate(clients, num_classes=10, algorithm=algorithm, rounds=8, lr=0.05, out=tmp_path / "run",
                   lambda_proto=1.0, eval_every=0)
    summary = sim.run()
    acc = summary["accuracy"]["acc"]["mean"]
    assert acc > 0.75, summary["accuracy"]  # 3 classes per client: chance 1/3
    if algorithm == "fedproto":
        assert summary["accuracy"]["acc_proto"]["mean"] > 0.75
        assert summary["params_per_round"]["up"] == sum(3 * (16 + 2) for _ in clients)  # 3 classes x (d + id + count)
    assert (tmp_path / "run" / "summary.json").is_file() and (tmp_path / "run" / "clients.csv").is_file()
    assert (tmp_path / "run" / "embeddings.npz").is_file()  # for fedproto plot's t-SNE, as the CLI writes it
    if kind == "dataset":
        assert clients[0].train.reads > 8 * len(clients[0].train)  # read through the Dataset, transforms and all


def test_heterogeneous_user_models_and_projection(digits):
    """Two model sizes (the guide's walkthrough); embedding sizes that differ are refused naming the
    clients, and with_projection brings them to one size."""
    ds, part = digits
    clients = _clients(digits, lambda: TwoOut(32, 16))
    clients[1].model, clients[3].model = TwoOut(64, 24), TwoOut(64, 24)
    with pytest.raises(ModelError, match=r"d=16: clients \[0, 2\]; d=24: clients \[1, 3\].*give every client "
                       r"Client\(\.\.\., embedding_dim=d\) with one d \(e\.g\. embedding_dim=16\)"):
        federate(clients, 10, out=False)
    for c in clients:  # the fix the error names
        c.embedding_dim = 16
    assert federate(clients, 10, out=False).setup.embedding_dim == 16
    for c in clients:
        c.embedding_dim = None
    from fedproto.federation import adapt

    for i in (1, 3):
        clients[i].model = with_projection(adapt(clients[i].model, None, 10, clients[i].train[0][:1], i), 16)
    sim = federate(clients, 10, rounds=8, lr=0.05, out=False, eval_every=0)
    assert sim.run()["accuracy"]["acc"]["mean"] > 0.7


def test_defaults_follow_the_named_dataset(digits):
    """federate(dataset=...) takes the dataset's defaults as `fedproto run --dataset` does (tab. 1's
    rounds, app. A's λ, its classes); without one: 20 rounds and λ = 1; any keyword overrides."""
    clients = _clients(digits, TwoOut)
    for kw, rounds, lam in (({"dataset": "mnist"}, 100, 1.0), ({"dataset": "cifar10"}, 110, 0.1),
                            ({"num_classes": 10}, 20, 1.0), ({"dataset": "mnist", "rounds": 3}, 3, 1.0),
                            ({"dataset": "cifar10", "lambda_proto": 2.0}, 110, 2.0)):
        cfg = federate(clients, out=False, **kw).cfg
        assert (cfg.rounds, cfg.lam, cfg.num_classes) == (rounds, lam, 10), kw
    with pytest.raises(ConfigError, match=r"dataset='mnits'.*name one of mnist, femnist, cifar10, digits"):
        federate(clients, dataset="mnits", out=False)
    with pytest.raises(ConfigError, match=r"femnist has 62 classes; give num_classes=62 or leave it out"):
        federate(clients, 10, dataset="femnist", out=False)
    with pytest.raises(ConfigError, match=r"federate\(\) needs num_classes"):
        federate(clients, out=False)


def test_bad_input_is_refused_naming_the_client(digits):
    ok = _clients(digits, TwoOut)

    def fails(exc, pattern, **change):
        cs = _clients(digits, TwoOut)
        i = change.pop("client", 2)
        for k, v in change.items():
            setattr(cs[i], k, v)
        with pytest.raises(exc, match=pattern):
            federate(cs, 10, out=False)

    x, y = ok[2].train
    fails(ModelError, r"client 2: the model has no layer 'head'; its last layers", head="head")
    fails(ModelError, r"client 2: .*logits have shape \(1, 7\).*expected \(1, 10\)", model=TwoOutWrong())
    fails(ModelError, r"client 2: the model.s forward returned a Tensor, not \(logits, embedding\); give head=",
          model=Classifier())
    fails(DataError, r"client 2: train label 12 is outside 0..9", train=(x, torch.full_like(y, 12)))
    bad = x.clone()
    bad[3, 0, 0, 0] = float("nan")
    fails(DataError, r"client 2: train item 3: its input holds NaN or infinite values; clean or drop that item "
          r"\(its row\)", train=(bad, y))
    fails(DataError, r"client 2: its test data is empty", test=(x[:0], y[:0]))
    fails(DataError, r"client 2: train has 5 inputs but labels of shape", train=(x[:5], y[:4]))
    fails(DataError, r"client 2: train is a str", train="data/")
    with pytest.raises(ModelError, match=r"with_projection needs an adapted model.*embedding_dim=8"):
        with_projection(TwoOut(), 8)
    with pytest.raises(ConfigError, match=r"drop_last=True leaves clients \[0, 1, 2, 3\] with no batch"):
        federate(ok, 10, drop_last=True, batch_size=500, out=False)
    with pytest.raises(ModelError, match="model is set by federate"):
        federate(ok, 10, model="cnn", out=False)
    with pytest.raises(ConfigError, match="lr"):
        federate(ok, 10, lr=-1.0, out=False)
    with pytest.raises(DataError, match="no clients"):
        federate([], 10)


class TwoOutWrong(TwoOut):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(16, 7)


def test_custom_dataset_is_refused_on_the_command_line(capsys, monkeypatch):
    from conftest import run_cli

    code, text = run_cli(["run", "--dataset", "custom", "--rounds", "1"], capsys, monkeypatch)
    assert code == 2 and "classes" in text


def test_models_data_and_options_that_cannot_work_are_refused_before_training(digits, tmp_path):
    """Refused with a clear error before any training: FedPer or FedRep on a (logits, embedding)
    module with no known head (else FedPer runs as FedAvg, FedRep crashes); a middle layer passed as
    the head; fractional labels (else cut); a dict forward (else a raw AttributeError); participation
    above the client count; resuming with other data."""
    for alg in ("fedper", "fedrep"):
        with pytest.raises(ConfigError, match=rf"{alg} keeps the head on the client, but client 0's model has no "
                                              "known head; give Client\\(..., head="):
            federate(_clients(digits, TwoOut), 10, algorithm=alg, out=False).run()
    cs = _clients(digits, Classifier, head="features.1")
    with pytest.raises(ModelError, match=r"client 0: layer 'features.1' is not the model's final layer"):
        federate(cs, 10, out=False)
    cs = _clients(digits, TwoOut)
    x, y = cs[1].train
    cs[1].train = (x, y.float() + 0.7)
    with pytest.raises(DataError, match=r"client 1: cannot read train labels.*fractions"):
        federate(cs, 10, out=False)

    class Dict(TwoOut):
        def forward(self, x):
            logits, h = super().forward(x)
            return {"logits": logits, "h": h}

    cs = _clients(digits, TwoOut)
    cs[0].model = Dict()
    with pytest.raises(ModelError, match=r"client 0: .*returned a dict, not \(logits, embedding\)"):
        federate(cs, 10, out=False)
    with pytest.raises(ConfigError, match=r"participation=5"):
        federate(_clients(digits, TwoOut), 10, participation=5.0, out=False)
    # a checkpoint of other client data is refused on resume
    run = tmp_path / "ck"
    sim = federate(_clients(digits, TwoOut), 10, rounds=3, checkpoint_every=1, out=run, eval_every=0)
    sim.run_dir.acquire()
    sim.loop.message = sim.loop.initial_message()
    from fedproto.checkpoint import save_checkpoint
    from fedproto.engine.observers.checkpoints import checkpoint_state

    state = checkpoint_state(sim.loop, 1) | {"history": [{"round": 1}]}
    sim.run_dir.write_checkpoint(save_checkpoint, state)
    sim.run_dir.release()
    cs = _clients(digits, TwoOut)
    x, y = cs[2].train
    cs[2].train = (x[:-1], y[:-1])
    with pytest.raises(Exception, match=r"other client data \(clients \[2\] differ"):
        federate(cs, 10, rounds=3, checkpoint_every=1, out=run, eval_every=0).run(resume=True)


def test_robust_and_private_options_through_the_python_api(digits, caplog):
    """The robust and private options reach your own federation: a NaN-sending client is dropped, the median
    keeps the global prototypes finite, DP reports ε, the full-test evaluation is skipped (no shared
    test split) with a warning, and freeze_after needs a known head."""
    sim = federate(_clients(digits, TwoOut), num_classes=10, rounds=3, out=False, attack="nan", attackers=1,
                   aggregation="median", dp="prototypes", dp_noise=1.0, eval_full_test=True, eval_every=0)
    s = sim.run()
    assert np.isfinite(sim.message["protos"]).all() and s["attack"]["clients"] == sorted(sim.attackers)
    assert all(h["dropped"] == sorted(sim.attackers) for h in sim.history)
    assert "accuracy_honest" in s and "accuracy_full_test" not in s and "no shared test split" in caplog.text
    assert s["privacy"]["epsilon_max"] == pytest.approx(epsilon([(1.0, 1.0, 3)], 1e-5))
    with pytest.raises(ConfigError, match="name no head layer"):
        federate(_clients(digits, TwoOut), num_classes=10, rounds=3, out=False, freeze_after=1)


def test_the_docs_script_is_the_example_and_runs(tmp_path):
    """docs/own-federation.md's script is examples/own_federation.py, verbatim; that script runs
    (on digits, two rounds: its code path is MNIST's) and its clients learn."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = (root / "examples" / "own_federation.py").read_text(encoding="utf-8")
    page = (root / "docs" / "own-federation.md").read_text(encoding="utf-8")
    assert f"```python\n{script.rstrip()}\n```" in page, "docs/own-federation.md's script differs from the example"
    spec = importlib.util.spec_from_file_location("own_federation", root / "examples" / "own_federation.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    summary = example.main(dataset="digits", rounds=6, fraction=1.0, threads=1, out=tmp_path / "run")
    acc = summary["accuracy"]
    assert summary["clients"] == 10 and acc["acc"]["mean"] > 0.6 and acc["acc_proto"]["mean"] > 0.35, acc  # 67.6, 52.1
    assert (tmp_path / "run" / "embeddings.npz").is_file()
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["rounds"] == 6 and config["batch_size"] == 32 and config["momentum"] == 0.9


class _Net(nn.Module):
    def __init__(self, d: int = 8, classes: int = 3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, d), nn.ReLU())
        self.fc = nn.Linear(d, classes)

    def forward(self, x):
        h = self.body(x)
        return self.fc(h), h


def _data(n: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    return torch.randn(n, 4, generator=g) + y[:, None].float(), y


@pytest.mark.parametrize("labels, shown", [
    (torch.full((12,), float("inf")), "label inf (item 0)"),
    (np.full(12, 1e20), "label 1e+20 (item 0)"),
    ([2**70] * 12, f"label {2**70} (item 0)"),
    (np.array([1] * 11 + [2**63], dtype=np.uint64), f"label {2**63} (item 11)"),
    (torch.tensor([0.0] * 5 + [float("nan")] * 7), "label nan (item 5)"),
])
def test_labels_int64_cannot_hold_are_named_not_wrapped(labels, shown):
    # Before: inf/1e20/2**63 were cast to int64 and reported as "label -9223372036854775808 is outside
    # 0..2", and Python ints over 2**63 raised a bare OverflowError.
    x, _ = _data()
    with pytest.raises(DataError) as e:
        federate([Client(_Net(), (x, labels), _data(6, 1))], 3, out=False, rounds=1, threads=1)
    assert shown in str(e.value) and "client 0" in str(e.value)
    assert "-9223372036854775808" not in str(e.value)


@pytest.mark.parametrize("bad", [3.0, 3.5, "3", True])
def test_num_classes_must_be_a_whole_number(bad):
    # Before: 3.0 and '3' raised bare TypeErrors, 3.5 reached the model check as "expected (1, 3.5)",
    # True became classes=1.
    from fedproto.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"federate\(num_classes={bad!r}\): give the number of classes"):
        federate([Client(_Net(), _data(), _data(6, 1))], bad, out=False, rounds=1, threads=1)


def test_embedding_dim_bool_refused_numpy_integer_accepted():
    from fedproto.errors import ModelError

    with pytest.raises(ModelError, match="client 0: embedding_dim=True"):  # was silently a projection to size 1
        federate([Client(_Net(), _data(), _data(6, 1), embedding_dim=True)], 3, out=False, rounds=1, threads=1)
    sim = federate([Client(_Net(), _data(), _data(6, 1), embedding_dim=np.int64(4))], 3, out=False, rounds=1,
                   threads=1)  # was refused as "not a whole number"
    assert sim.models[0].embedding_dim == 4


def test_clients_sharing_a_model_or_layer_are_refused():
    # Before: both clients trained the one module in place, silently, so they were not two clients.
    from fedproto.errors import ModelError

    net = _Net()
    with pytest.raises(ModelError, match=r"clients 0 and 1 share parameters \(e.g. 'body.0.weight'"):
        federate([Client(net, _data(), _data(6, 1)), Client(net, _data(seed=2), _data(6, 3))], 3, out=False,
                 rounds=1, threads=1)
    other = _Net()
    other.fc = net.fc  # one shared layer is enough
    with pytest.raises(ModelError, match=r"clients 0 and 2 share parameters \(e.g. 'fc.weight'"):
        federate([Client(net, _data(), _data(6, 1)), Client(_Net(), _data(seed=2), _data(6, 3)),
                  Client(other, _data(seed=4), _data(6, 5))], 3, out=False, rounds=1, threads=1)


def test_head_given_for_a_model_that_returns_logits_and_embedding():
    # Before: AttributeError: 'tuple' object has no attribute 'ndim'.
    from fedproto.errors import ModelError

    with pytest.raises(ModelError, match=r"client 0: the model failed on a training input of shape \(1, 4\) \(its "
                                         r"forward returned a tuple, not the logits tensor head='fc' needs\); if its "
                                         r"forward returns \(logits, embedding\) itself, leave out head='fc'"):
        federate([Client(_Net(), _data(), _data(6, 1), head="fc")], 3, out=False, rounds=1, threads=1)


def test_clients_may_be_any_iterable():
    # Before: a generator raised TypeError: object of type 'generator' has no len().
    sim = federate((Client(_Net(), _data(seed=i), _data(6, 9 + i)) for i in range(2)), 3, out=False, rounds=1,
                   threads=1)
    assert len(sim.models) == 2 and sim.cfg.clients == 2


def test_model_raising_an_exception_without_message_is_named():
    # Before: IndexError from the empty message of a bare `raise RuntimeError`.
    from fedproto.errors import ModelError

    class Broken(_Net):
        def forward(self, x):
            raise RuntimeError

    with pytest.raises(ModelError, match=r"client 0: the model failed on a training input of shape \(1, 4\) "
                                         r"\(RuntimeError: no message\)"):
        federate([Client(Broken(), _data(), _data(6, 1))], 3, out=False, rounds=1, threads=1)


def test_own_clients_config_records_what_the_run_used(tmp_path):
    sim = federate(own_digits_clients(), num_classes=10, rounds=1, threads=1, out=tmp_path / "run", batch_size=10000)
    sim.run()
    conf = json.loads((tmp_path / "run" / "config.json").read_text())
    assert conf["embedding_dim"] == 64  # the models' size, not the option's default 50
    for k in ("ways", "shots", "stdev", "partition", "test_shots", "alpha", "dropout"):
        assert conf[k] is None, k
    assert conf["batch_size"] == 10000 and conf["batch_size_in_force"] == 40  # capped to the largest client

    from fedproto.plots import plot_curves

    title = {}
    import matplotlib.figure

    orig = matplotlib.figure.Figure.suptitle
    matplotlib.figure.Figure.suptitle = lambda self, t, *a, **kw: title.setdefault("t", t)
    try:
        plot_curves(tmp_path / "run")
    finally:
        matplotlib.figure.Figure.suptitle = orig
    assert "ways" not in title["t"] and "64-d embeddings" in title["t"]


def _splits(digits):
    return client_splits(*digits)


class BNNet(nn.Module):
    """A pretrained-style classifier: conv + BatchNorm body, a hidden layer, a final ``fc``."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten())
        self.hidden = nn.Sequential(nn.Linear(6 * 64, 16), nn.ReLU())
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(self.hidden(self.body(x)))


def _freeze(module: nn.Module) -> dict[str, torch.Tensor]:
    """Freeze ``module`` (parameters and, through the BatchNorm rule, its statistics); its state."""
    for p in module.parameters():
        p.requires_grad_(False)
    return {k: v.clone() for k, v in module.state_dict().items()}


def _bn_clients(digits, seed=0):
    out, bodies = [], []
    for i, (train, test) in enumerate(_splits(digits)):
        torch.manual_seed(seed + i)
        m = BNNet()
        with torch.no_grad():  # "pretrained" statistics, not the init's zeros and ones
            m.body[1].running_mean.uniform_(-0.5, 0.5)
            m.body[1].running_var.uniform_(0.5, 2.0)
        bodies.append(_freeze(m.body))
        out.append(Client(m, train, test, head="fc"))
    return out, bodies


def _assert_frozen_kept(clients, bodies, attr="body"):
    for c, before in zip(clients, bodies):
        body = getattr(c.model, attr)
        after = body.state_dict()
        assert after.keys() == before.keys()
        for k in before:
            assert torch.equal(after[k], before[k]), k  # bit for bit: weights and BatchNorm statistics
        assert not any(p.requires_grad for p in body.parameters())  # the user's flags are unchanged
        assert all(p.requires_grad for n, p in c.model.named_parameters() if not n.startswith(attr))


@pytest.mark.parametrize("options", [{}, {"dp": "full", "dp_noise": 0.5}, {"freeze_after": 1}],
                         ids=["sequential", "dp-full", "two-stage"])
def test_frozen_body_and_batchnorm_unchanged_sequential(digits, options):
    clients, bodies = _bn_clients(digits)
    fc0 = [c.model.fc.weight.detach().clone() for c in clients]
    hid0 = [c.model.hidden[0].weight.detach().clone() for c in clients]
    sim = federate(clients, 10, rounds=2, lr=0.05, out=False, eval_every=0, threads=1, **options)
    sim.run()
    _assert_frozen_kept(clients, bodies)
    assert all(not torch.equal(c.model.fc.weight, w) for c, w in zip(clients, fc0))  # the head trained
    if "freeze_after" not in options:  # (two-stage: round 2 trains the head alone; round 1 everything)
        assert all(not torch.equal(c.model.hidden[0].weight, w) for c, w in zip(clients, hid0))


def _cnn_clients(digits):
    out, bodies = [], []
    for i, (train, test) in enumerate(_splits(digits)):
        torch.manual_seed(i)
        m = PaperCNN(1, 10, 8, 16, 8, dropout=0.0, conv1_channels=4)
        bodies.append({k: v.detach().clone() for k, v in m.named_parameters() if k.startswith(("conv1", "conv2"))})
        for n, p in m.named_parameters():
            p.requires_grad_(not n.startswith(("conv1", "conv2")))
        out.append(Client(m, train, test))
    return out, bodies


@pytest.mark.parametrize("workers", [1, 2])
def test_frozen_convolutions_unchanged_batched_and_in_workers(digits, workers):
    clients, bodies = _cnn_clients(digits)
    fc1 = [c.model.fc1.weight.detach().clone() for c in clients]
    sim = federate(clients, 10, rounds=2, lr=0.05, out=False, eval_every=0, execution="batched", workers=workers,
                   threads=workers)  # one thread per process
    summary = sim.run()
    assert summary["processes"] == workers
    for c, before in zip(clients, bodies):
        named = dict(c.model.named_parameters())
        for k, v in before.items():
            assert torch.equal(named[k], v), k
            assert not named[k].requires_grad
        assert named["fc1.weight"].requires_grad and named["fc2.bias"].requires_grad
    assert all(not torch.equal(c.model.fc1.weight, w) for c, w in zip(clients, fc1))


def test_clients_with_other_frozen_layers_are_not_batched_together(digits):
    """A group shares one set of frozen parameters; clients that differ train apart, each kept."""
    clients, bodies = _cnn_clients(digits)
    for p in clients[1].model.parameters():  # client 1 trains everything
        p.requires_grad_(True)
    before1 = clients[1].model.conv1.weight.detach().clone()
    federate(clients, 10, rounds=1, lr=0.05, out=False, eval_every=0, execution="batched", threads=1).run()
    assert torch.equal(clients[0].model.conv1.weight, bodies[0]["conv1.weight"])
    assert not torch.equal(clients[1].model.conv1.weight, before1)


# weight sharing (FedAvg and its family) with frozen bodies: the frozen tensors stay each client's own
SHARING = {"fedavg": {}, "fedprox": {"prox_mu": 0.1}, "fedper": {"personal_layers": "head"},
           "fedrep": {"personal_layers": "head", "rep_head_epochs": 1}, "fesem": {"fesem_clusters": 2}}


@pytest.mark.parametrize("algorithm", list(SHARING))
def test_weight_sharing_keeps_each_clients_frozen_body(digits, algorithm, caplog):
    """Each client's frozen body (its own values: weights and BatchNorm statistics) is neither sent
    nor overwritten; the trainable part is averaged (sample-weighted) and loaded on download; the
    cost counts only what is sent."""
    clients, bodies = _bn_clients(digits)
    assert not torch.equal(bodies[0]["0.weight"], bodies[1]["0.weight"])  # the frozen values differ per client
    sim = federate(clients, 10, rounds=2, lr=0.05, out=False, eval_every=0, threads=1, algorithm=algorithm,
                   **SHARING[algorithm])
    with caplog.at_level("WARNING"):
        sim.run()
    assert "share no tensor" not in caplog.text
    _assert_frozen_kept(clients, bodies)
    alg, states = sim.setup.algorithm, sim.setup.states
    personal = algorithm in ("fedper", "fedrep")
    shared = {n: p for n, p in states[0].model.named_parameters() if "body" not in n and not (personal and "fc" in n)}
    sent = {k.removeprefix("w/") for k in sim.message if k.startswith("w/")}
    assert sent == set(shared)  # no body tensor, no BatchNorm statistic (nor the personal head)
    n_shared = sum(p.numel() for p in shared.values())
    assert [row["up_params"] for row in sim.history] == [len(clients) * (n_shared + 1)] * 2  # weights + count
    if algorithm != "fesem":
        assert [row["down_params"] for row in sim.history] == [len(clients) * n_shared] * 2
        n = np.array([len(c.train[1]) for c in clients], np.float64)
        for k in shared:  # the server's message: the sample-weighted average of the last local weights
            local = np.stack([dict(s.model.named_parameters())[k].detach().numpy() for s in states])
            assert np.allclose(sim.message["w/" + k], np.tensordot(n / n.sum(), local, 1), atol=1e-6), k
    before = [{k: v.detach().clone() for k, v in s.model.named_parameters()} for s in states]
    for s in states:  # the next round's download
        alg.prepare(s, alg.downlink(sim.message, s.cid))
    _assert_frozen_kept(clients, bodies)
    for s, old in zip(states, before):
        for k, v in s.model.named_parameters():
            centre = alg.downlink(sim.message, s.cid).get("w/" + k)
            if k in shared:
                assert np.array_equal(v.detach().numpy(), centre), k  # the global (FeSEM: its cluster's) value
            else:
                assert torch.equal(v, old[k]) and centre is None, k  # frozen or personal: the client's own
    if algorithm == "fedavg":
        w = [s.model.net.hidden[0].weight for s in states]
        assert all(torch.equal(w[0], x) for x in w[1:])  # one global trainable part after the download
    if algorithm == "fedprox":  # the proximal term covers the trained parameters (frozen ones have no reference)
        obj = alg.local_objective(states[0], alg.downlink(sim.message, 0))
        assert obj.anchor.mu == 0.1 and set(obj.anchor.ref) == set(shared)


def test_nothing_left_to_share_is_warned(digits, caplog):
    """FedPer on the paper CNN keeps every fully connected layer; with its convolutions frozen nothing
    is shared: said so, and only the sample counts go up."""
    clients, bodies = _cnn_clients(digits)
    sim = federate(clients, 10, rounds=1, out=False, eval_every=0, threads=1, algorithm="fedper")
    with caplog.at_level("WARNING"):
        sim.run()
    assert "fedper: the clients share no tensor" in caplog.text
    assert sim.history[0]["up_params"] == len(clients)
    for c, before in zip(clients, bodies):
        named = dict(c.model.named_parameters())
        assert all(torch.equal(named[k], v) for k, v in before.items())


def test_fedprox_frozen_convolutions_batched(digits):
    """The batched path's stacked FedProx references leave out the frozen parameters, which stay."""
    clients, bodies = _cnn_clients(digits)
    sim = federate(clients, 10, rounds=2, lr=0.05, out=False, eval_every=0, execution="batched", threads=1,
                   algorithm="fedprox", prox_mu=0.1)
    sim.run()
    for c, before in zip(clients, bodies):
        named = dict(c.model.named_parameters())
        assert all(torch.equal(named[k], v) and not named[k].requires_grad for k, v in before.items())
    assert not any("conv" in k for k in sim.message)
    assert {k.removeprefix("w/") for k in sim.message} == {n for n in dict(sim.setup.states[0].model.named_parameters())
                                                           if "conv" not in n}


@pytest.mark.parametrize("algorithm", ["fedavg", "fesem"])
def test_weight_sharing_refuses_clients_that_freeze_other_tensors(digits, algorithm):
    """A tensor some clients freeze and others share has no one global value: refused at the start,
    naming the clients on each side and the tensor; the Flower server (messages only) says the same."""
    from fedproto.algorithms import FedAvg
    from fedproto.errors import ConfigError
    from fedproto.training import OptimConfig

    clients, bodies = _bn_clients(digits)
    for p in clients[2].model.body.parameters():  # client 2 trains its body
        p.requires_grad_(True)
    with pytest.raises(ConfigError, match=r"clients \[0, 1, 3\] froze '[\w.]*body\.0\.weight'.*clients \[2\] train "
                                          r"and share it.*freeze the same parameters on every client"):
        federate(clients, 10, rounds=1, out=False, eval_every=0, threads=1, algorithm=algorithm).run()
    _assert_frozen_kept(clients[:2], bodies[:2])
    joins = {0: {"w/a": np.zeros(2, np.float32), "w/b": np.zeros(3, np.float32)}, 1: {"w/a": np.zeros(2, np.float32)}}
    with pytest.raises(ConfigError, match=r"clients \[1\] do not send 'b' \(frozen.*clients \[0\] train and share"):
        FedAvg(10, OptimConfig(0.1, 0.0, 0.0, 8, False)).initial_message_from(joins)


class SmallCNN(nn.Module):
    """The guide's kind of user model: a classifier ending in ``fc`` on ``d`` features; clients
    whose d is not 16 are given ``embedding_dim=16``, so fedproto appends a projection and a new head."""

    def __init__(self, width=8, d=16):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                      nn.Linear(width * 16, d), nn.ReLU())
        self.fc = nn.Linear(d, 10)

    def forward(self, x):
        return self.fc(self.features(x))


def _acc(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(x)[0].argmax(1) == y).double().mean())


def test_trained_models_handle_reproduces_the_reported_accuracies(digits, tmp_path):

    from fedproto.federation import HeadSplitModel, Projected
    from fedproto.results import load_models

    def clients():
        out = []
        for i, (train, test) in enumerate(_splits(digits)):
            torch.manual_seed(i)
            out.append(Client(SmallCNN(8, 20) if i % 2 else SmallCNN(12), train, test, head="fc",
                              embedding_dim=16 if i % 2 else None))
        return out

    cs = clients()
    sim = federate(cs, 10, rounds=3, lr=0.05, out=tmp_path / "run", eval_every=0, threads=1, save_models=True)
    summary = sim.run()
    models = sim.models
    assert [type(m) for m in models] == [HeadSplitModel, Projected, HeadSplitModel, Projected]
    assert models[0].net is cs[0].model and models[1].inner.net is cs[1].model  # the user's objects inside
    with open(tmp_path / "run" / "clients.csv") as f:
        reported = [float(r["acc"]) for r in csv.DictReader(f)]
    tests = [test for _, test in _splits(digits)]
    accs = [_acc(m, x, y) for m, (x, y) in zip(models, tests)]
    assert accs == pytest.approx(reported, abs=1e-6)  # the same correct counts (reported in float32)
    assert float(np.mean(accs)) == pytest.approx(summary["accuracy"]["acc"]["mean"], abs=1e-6)
    assert min(accs) > 0.6  # 3 classes per client: chance 1/3
    # a projected client's own object: its body trained, its own fc untouched (not used)
    own = cs[1].model
    assert _acc(models[1], *tests[1]) == accs[1]
    own.eval()
    with torch.no_grad():
        own_acc = float((own(tests[1][0]).argmax(1) == tests[1][1]).double().mean())
    assert own_acc < accs[1]
    # models.pt: loaded into freshly built clients it gives the same numbers
    fresh = federate(clients(), 10, out=False, threads=1).models
    saved = load_models(tmp_path / "run")
    assert len(saved) == 4
    for m, sd in zip(fresh, saved):
        m.load_state_dict(sd)
    assert [_acc(m, x, y) for m, (x, y) in zip(fresh, tests)] == accs


class Relabelled(torch.utils.data.Dataset):
    """A map-style Dataset with a ``targets`` attribute whose items carry other labels: through
    ``target_transform`` or through its own ``__getitem__`` (``remap``)."""

    def __init__(self, x, y, target_transform=None, remap=None):
        self.x, self._y = x, y.tolist()
        self.targets = list(self._y)  # what torchvision's datasets hold: the labels before any transform
        self.target_transform, self.remap = target_transform, remap
        self.reads = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.reads += 1
        y = self._y[i]
        if self.remap is not None:
            y = self.remap[y]
        return self.x[i], self.target_transform(y) if self.target_transform else y


class TorchvisionLike(Relabelled):
    """Stands for torchvision's MNIST/CIFAR10: ``__getitem__`` of a torchvision.datasets module."""

    def __getitem__(self, i):
        return super().__getitem__(i)


TorchvisionLike.__getitem__.__module__ = "torchvision.datasets.mnist"


def _relabelled_clients(digits, make):
    out = []
    for i, ((x, y), (tx, ty)) in enumerate(_splits(digits)):
        torch.manual_seed(i)
        out.append(Client(SmallCNN(), make(x, y), make(tx, ty), head="fc"))
    return out


@pytest.mark.parametrize("how", ["target_transform", "getitem"])
def test_labels_are_what_the_dataset_yields(digits, how):
    shift = {c: (c + 3) % 10 for c in range(10)}
    if how == "target_transform":
        make = lambda x, y: Relabelled(x, y, target_transform=lambda t: (t + 3) % 10)  # noqa: E731
    else:
        make = lambda x, y: Relabelled(x, y, remap=shift)  # noqa: E731
    clients = _relabelled_clients(digits, make)
    sim = federate(clients, 10, out=False, threads=1)
    for i, ((_, y), (_, ty)) in enumerate(_splits(digits)):
        assert torch.equal(sim.setup.data[i].y.cpu(), (y + 3) % 10)  # training labels
        assert torch.equal(sim.setup.data[i].test_y.cpu(), (ty + 3) % 10)  # scoring labels
        assert sorted(sim.setup.states[i].classes.tolist()) == sorted(((y + 3) % 10).unique().tolist())


def test_torchvision_targets_fast_path_only_when_the_items_agree(digits):
    from fedproto.federation import LABEL_CHECKS, dataset_labels

    (x, y), _ = next(_splits(digits))
    ds = TorchvisionLike(x, y)
    assert np.array_equal(dataset_labels(ds), y.numpy())
    assert ds.reads <= LABEL_CHECKS < len(ds)  # targets used, checked on a sample of the items
    ds = TorchvisionLike(x, y, target_transform=lambda t: (t + 1) % 10)  # a transform: every item is read
    assert np.array_equal(dataset_labels(ds), ((y + 1) % 10).numpy()) and ds.reads == len(ds)
    ds = TorchvisionLike(x, y)
    ds.targets[-1] = (ds.targets[-1] + 1) % 10  # targets that disagree with a sampled item (the last): not used
    labels = dataset_labels(ds)
    assert np.array_equal(labels, y.numpy()) and not np.array_equal(labels, ds.targets)


class PILImages(torch.utils.data.Dataset):
    def __init__(self, n):
        from PIL import Image

        self.items = [(Image.new("L", (8, 8), i), i % 3) for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([(torch.zeros(1, 8, 8), 0)])


class StrLabels(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], "cat" if i == 4 else int(self.y[i])


def test_errors_users_hit_name_the_value_and_the_fix(digits):
    from fedproto.errors import DataError, ModelError

    (x, y), test = next(_splits(digits))

    def fails(exc, pattern, **change):
        c = {"model": SmallCNN(), "train": (x, y), "test": test, "head": "fc", **change}
        with pytest.raises(exc, match=pattern):
            federate([Client(**c)], 10, out=False)

    fails(DataError, r"client 0: train: item 0's input is a PIL image \(PIL.Image.Image\), not a tensor; give the "
                     r"Dataset a tensor transform, e.g. transform=torchvision.transforms.ToTensor\(\)",
          train=PILImages(12))
    fails(DataError, r"client 0: cannot read train labels as integers: label 'cat' \(item 4\) is a str, not an "
                     r"integer class id; map each class to an id 0..C-1", train=StrLabels(x, y))
    fails(DataError, r"label 'dog' \(item 0\) is a str", test=(test[0], ["dog"] * len(test[0])))
    fails(DataError, r"label 'b' \(item 0\) is a str", train=(x, np.array(["b"] * len(x))))
    fails(DataError, r"client 0: train is an IterableDataset \(Stream\).*give a map-style Dataset", train=Stream())
    with torch.device("meta"):
        meta = SmallCNN()
    fails(ModelError, r"client 0: the model's weights are on the meta device.*model.to_empty\(device='cpu'\)",
          model=meta)


def test_the_readme_own_models_snippet_runs_as_pasted(capsys):
    """The README's own-models snippet was pseudocode (a SyntaxError when pasted): it is now run as written,
    and its five clients, each on its own four digits, end far above chance (25 % on four classes)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "fedproto.federation" in b]
    assert len(blocks) == 1
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    acc = scope["summary"]["accuracy"]["acc"]
    assert scope["summary"]["clients"] == 5 and acc["mean"] > 0.6, acc
    assert str(acc) in capsys.readouterr().out


class DtypeProbe(nn.Module):
    """A user's model that records the dtype of every floating input it is called with (a dict's ``x`` too)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.out = nn.Linear(8, 3)
        self.seen: set = set()

    def forward(self, x):
        x = x["x"] if isinstance(x, dict) else x
        self.seen.add(x.dtype)
        h = self.body(x)
        return self.out(h), h


class Rows(torch.utils.data.Dataset):
    """A map-style Dataset of (x row, label) items, x rows as numpy arrays or tensors."""

    def __init__(self, x, y, as_numpy=False):
        self.x, self.y, self.as_numpy = x, y, as_numpy

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return (self.x[i].numpy() if self.as_numpy else self.x[i]), int(self.y[i])


def _rows(seed, n=24, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    return (torch.randn(n, 4, generator=g, dtype=torch.float64) + 3 * y[:, None]).to(dtype), y


def test_float64_inputs_train_in_float64_on_every_route(caplog):
    import logging

    def stack(items):  # a user's collate: numpy rows -> one tensor, their dtype kept
        return torch.stack([torch.as_tensor(a) for a in items])

    routes = {"tensors": lambda x, y: (x, y), "arrays": lambda x, y: (x.numpy(), y.numpy()),
              "dict": lambda x, y: ({"x": x}, y), "dataset": lambda x, y: Rows(x, y),
              "dataset+collate": lambda x, y: Rows(x, y, as_numpy=True)}
    clients = []
    for i, (route, make) in enumerate(routes.items()):
        torch.manual_seed(i)
        (x, y), (tx, ty) = _rows(i), _rows(100 + i)
        clients.append(Client(DtypeProbe().double(), make(x, y), make(tx, ty),
                              collate=stack if route == "dataset+collate" else None))
    with caplog.at_level(logging.INFO, logger="fedproto.federation.data"):
        sim = federate(clients, num_classes=3, rounds=2, lr=0.05, local_epochs=5, threads=1, eval_every=0, out=False)
        summary = sim.run()
    assert "cast to" not in caplog.text  # float64 inputs, float64 models: nothing cast
    for route, c in zip(routes, clients):
        assert c.model.seen == {torch.float64}, route  # training and evaluation, every batch
        assert {p.dtype for p in c.model.parameters()} == {torch.float64}, route
    assert summary["accuracy"]["acc"]["mean"] > 0.5  # classes 3 apart in every feature: learnt in two rounds

    # float16 and float64 inputs of a float32 model: cast to float32 on every route, logged once per client and split
    clients = []
    for i, (route, make) in enumerate(routes.items()):
        (x, y), (tx, ty) = _rows(i, dtype=torch.float16 if i % 2 else torch.float64), _rows(100 + i)
        clients.append(Client(DtypeProbe(), make(x, y), make(tx, ty), collate=stack if "collate" in route else None))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedproto.federation.data"):
        federate(clients, num_classes=3, rounds=1, threads=1, eval_every=0, out=False).run()
    for route, c in zip(routes, clients):
        assert c.model.seen == {torch.float32}, route
    casts = [r.getMessage() for r in caplog.records if "cast to" in r.getMessage()]
    assert len(casts) == 2 * len(routes)
    assert casts[0].startswith("client 0: its train inputs are float64, cast to float32, the dtype of its model")
    assert casts[2].startswith("client 1: its train inputs are float16, cast to float32")

    # a float64 model with a projection appended (Client(embedding_dim=...)): the projection is float64 too
    proj = DtypeProbe().double()
    federate([Client(proj, *[_rows(s) for s in (0, 1)], embedding_dim=5)], num_classes=3, rounds=1, threads=1,
             eval_every=0, out=False).run()
    assert proj.seen == {torch.float64}

    # a model whose layers differ in dtype: the mismatch is named as such, with both dtypes and the fix
    mixed = DtypeProbe().double()
    mixed.out.float()
    with pytest.raises(ModelError, match=r"client 0: dtype mismatch: its parameters mix float64 \('body.0.weight'\) "
                                         r"and float32 \('out.weight'\); .*model.double\(\)"):
        federate([Client(mixed, *[_rows(s) for s in (0, 1)])], num_classes=3, rounds=1, threads=1, out=False)


class LaterNaN(Rows):
    """Rows whose NaN shows only from an item's second read on (a transform gone wrong later): the
    set-up's label pass reads every item clean."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        self.read = getattr(self, "read", set())
        first = i not in self.read
        self.read.add(i)
        return (torch.nan_to_num(x) if first else x), y


class DictRows(Rows):
    """Rows whose input is a dict ``{"x": row}`` (a field named in messages)."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return {"x": x}, y


def test_a_nan_inside_a_dataset_is_named_before_training(monkeypatch, tmp_path):
    from conftest import csv_rows

    import fedproto.federation.data as fdata

    def clients(bad_split=None, bad_item=13, cid=1, kind=Rows):
        out = []
        for i in range(3):
            (x, y), (tx, ty) = _rows(i, dtype=torch.float32), _rows(100 + i, dtype=torch.float32)
            if i == cid and bad_split is not None:
                (x if bad_split == "train" else tx)[bad_item, 2] = float("nan")
            torch.manual_seed(i)
            out.append(Client(DtypeProbe(), kind(x, y), kind(tx, ty)))
        return out

    opts = dict(num_classes=3, rounds=1, threads=1, eval_every=0)
    # every item of a small Dataset is scanned before round 1: the client, the split, the item and the field
    with pytest.raises(DataError, match=r"^client 1: train item 13: its input\['x'\] holds NaN or infinite values; "
                                        r"clean or drop that item"):
        federate(clients("train", kind=DictRows), out=False, **opts)
    with pytest.raises(DataError, match=r"^client 1: test item 13: its input holds NaN or infinite values"):
        federate(clients("test"), out=False, **opts)
    # a large Dataset: still every item, in the pass that reads its labels (NAN_SCAN_ITEMS: torchvision's only)
    monkeypatch.setattr(fdata, "NAN_SCAN_ITEMS", 4)
    with pytest.raises(DataError, match=r"^client 1: train item 13: its input holds NaN or infinite values"):
        federate(clients("train"), out=False, **opts)
    # NaN only on a later read: the training batch that reads it stops the run
    sim = federate(clients("train", kind=LaterNaN), out=False, **opts)
    with pytest.raises(DataError, match=r"^client 1: train item 13: its input holds NaN or infinite values"):
        sim.run()
    # a test item read at evaluation: its client is left out of the headline, with the reason
    summary = federate(clients("test", kind=LaterNaN), out=tmp_path / "run", **opts).run()
    why = "its test data hold NaN or infinite values (1 item(s), first item 13's input); clean or drop them"
    assert summary["left_out"] == {"1": why} and summary["clients_in_accuracy"] == 2
    rows = csv_rows(tmp_path / "run" / "clients.csv")
    assert [r["left_out"] for r in rows] == ["", why, ""]
    accs = [float(r["acc"]) for r in rows]
    assert summary["accuracy"]["acc"]["mean"] == pytest.approx((accs[0] + accs[2]) / 2, abs=1e-6)


def test_a_nan_in_nested_in_memory_inputs_names_the_item_and_field():
    """Reported: x["a"]["b"] with a NaN said only "train inputs hold NaN"; now as the Dataset route words it."""
    clients = []
    for i in range(2):
        (x, y), (tx, ty) = _rows(i, dtype=torch.float32), _rows(100 + i, dtype=torch.float32)
        if i == 1:
            x = x.clone()
            x[7, 1] = float("inf")
        clients.append(Client(NestedDict(), ({"a": {"b": x}}, y), ({"a": {"b": tx}}, ty)))
    with pytest.raises(DataError, match=r"^client 1: train item 7: its input\['a'\]\['b'\] holds NaN or infinite "
                                        r"values; clean or drop that item \(its row\)"):
        federate(clients, num_classes=3, rounds=1, threads=1, eval_every=0, out=False)


class NestedDict(nn.Module):
    """DtypeProbe's layers on an input dict {"a": {"b": rows}}."""

    def __init__(self):
        super().__init__()
        self.inner = DtypeProbe()

    def forward(self, x):
        return self.inner(x["a"]["b"])


class Widths(nn.Module):
    """A user's model whose hidden width is a parameter (the embedding stays 8)."""

    def __init__(self, width):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 8))
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.body(x)
        return self.out(h), h


def test_fedavg_refuses_two_widths_with_a_fix_for_your_own_models():
    (x, y), (tx, ty) = _rows(0, dtype=torch.float32), _rows(1, dtype=torch.float32)
    with pytest.raises(ConfigError) as e:
        federate([Client(Widths(8), (x, y), (tx, ty)), Client(Widths(16), (x, y), (tx, ty))], num_classes=3,
                 algorithm="fedavg", out=False)
    msg = str(e.value)
    assert "(16, 4) vs (8, 4)" in msg and "model='cnn'" not in msg  # no zoo model to a user with their own
    assert "Give every client a model of one architecture (the same class and layer sizes)" in msg
    assert "algorithm='fedproto'" in msg  # a method that runs these models as they are


def test_a_list_of_variable_length_sequences_in_memory_trains_with_collate():
    from fedproto.data.inputs import pad_collate

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 8)
            self.out = nn.Linear(8, 3)

        def forward(self, x):
            ids, mask = x["input_ids"], x["attention_mask"].unsqueeze(-1).float()
            h = (self.emb(ids) * mask).sum(1) / mask.sum(1).clamp_min(1.0)  # mean over the tokens, padding left out
            return self.out(h), h

    g = torch.Generator().manual_seed(0)
    y = torch.arange(24) % 3
    seqs = [torch.randint(6 * int(c), 6 * int(c) + 6, (3 + i % 5,), generator=g) for i, c in enumerate(y)]
    clients = [Client(Bag(), (seqs, y), (seqs[:12], y[:12]), collate=pad_collate) for _ in range(2)]
    summary = federate(clients, num_classes=3, rounds=2, local_epochs=3, lr=0.1, threads=1, eval_every=0,
                       out=False).run()
    assert summary["accuracy"]["acc"]["mean"] > 0.6  # tokens of disjoint ranges per class: learnt
    with pytest.raises(DataError, match=r"client 0: cannot read its train inputs"):  # without collate: refused
        federate([Client(Bag(), (seqs, y), (seqs, y))], num_classes=3, out=False)


def test_the_own_federation_page_s_snippets_run_or_say_they_are_fragments():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "own-federation.md").read_text(encoding="utf-8")
    script = (root / "examples" / "own_federation.py").read_text(encoding="utf-8").rstrip()
    blocks = re.findall(r"```python\n(.*?)\n```", page, re.S)
    assert len(blocks) >= 3 and blocks.count(script) == 1
    fragments = [b for b in blocks if b != script]
    assert all(re.match(r"# (a fragment|fragments)\b", b) for b in fragments), [b.splitlines()[0] for b in fragments]


def test_a_model_vmap_cannot_batch_is_named_by_its_own_class(caplog):
    import logging

    class ItemGate(nn.Module):
        """A classifier whose forward reads a value in Python (.item()): torch.func.vmap cannot batch it."""

        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
            self.fc = nn.Linear(8, 3)

        def forward(self, x):
            h = self.features(x)
            return self.fc(h * (1.0 if h.sum().item() >= 0 else 0.5))

    clients = [Client(ItemGate(), _rows(i, dtype=torch.float32), _rows(10 + i, dtype=torch.float32), head="fc")
               for i in range(2)]
    with caplog.at_level(logging.INFO, logger="fedproto.engine.executors.batched"):
        federate(clients, num_classes=3, rounds=1, threads=1, eval_every=0, execution="batched", out=False).run()
    msgs = [r.getMessage() for r in caplog.records if "torch.func.vmap cannot batch them" in r.getMessage()]
    assert msgs and msgs[0].startswith("ItemGate models train one client after another")
