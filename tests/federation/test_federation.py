"""Your own federation (fedproto.federation): user modules outside the zoo, map-style Datasets
with transforms, classifiers split at a named head; FedProto and FedAvg learn on each; bad input
is refused before training, naming the client. (Frozen layers: test_federation_frozen.py; the
Dataset's items, dtypes and NaNs: test_federation_inputs.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import digits_clients_partition, own_digits_clients
from torch import nn

from fedproto.errors import ConfigError, DataError, ModelError
from fedproto.federation import Client, federate, with_projection
from fedproto.prototypes.dp import epsilon


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
    return digits_clients_partition()


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
    from fedproto.engine.observers.checkpoints import checkpoint_state
    from fedproto.outputs.checkpoint import save_checkpoint

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

    root = Path(__file__).resolve().parents[2]
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
