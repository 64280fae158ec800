"""Faults found by feeding fedproto bad and unusual input (the breaker session); one test each."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedproto.errors import DataError
from fedproto.federation import Client, federate


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


def test_load_models_of_an_empty_or_foreign_file(tmp_path):
    # Before: an empty models.pt raised IndexError (its EOFError has no message line), and a format-1
    # dict whose clients are not state dicts was returned as is.
    from fedproto.results import load_models

    (tmp_path / "models.pt").write_bytes(b"")
    with pytest.raises(DataError, match=r"cannot read '.*models.pt' \(EOFError: no message\); pass a models.pt"):
        load_models(tmp_path)
    torch.save({"format": 1, "clients": [1, 2]}, tmp_path / "other.pt")
    with pytest.raises(DataError, match=r"other.pt' is not a models.pt of fedproto \(format 1: one state_dict"):
        load_models(tmp_path / "other.pt")


def test_model_raising_an_exception_without_message_is_named():
    # Before: IndexError from the empty message of a bare `raise RuntimeError`.
    from fedproto.errors import ModelError

    class Broken(_Net):
        def forward(self, x):
            raise RuntimeError

    with pytest.raises(ModelError, match=r"client 0: the model failed on a training input of shape \(1, 4\) "
                                         r"\(RuntimeError: no message\)"):
        federate([Client(Broken(), _data(), _data(6, 1))], 3, out=False, rounds=1, threads=1)


def test_default_run_names_of_floats_that_differ_past_six_digits_differ():
    # Before: {v:g} wrote both lr values as lr0.123457 (one folder, the second run replacing the
    # first), and dp_noise=1.0000001 as dp_noise1, which reads as the default.
    from fedproto.config import build_config

    def name(**o):
        return build_config(overrides={"dataset": "digits", **o}).run_name()

    assert name(lr=0.1234567) == "fedproto-digits-n3-k10-s1234-lr0.1234567"
    assert name(lr=0.1234568) == "fedproto-digits-n3-k10-s1234-lr0.1234568"
    assert name(dp="prototypes", dp_noise=1.0000001) == "fedproto-digits-n3-k10-s1234-dpprototypes-dp_noise1.0000001"
    # short values keep their short spelling
    assert name(lr=0.05) == "fedproto-digits-n3-k10-s1234-lr0.05"
    assert name(dp="prototypes", dp_delta=1e-7) == "fedproto-digits-n3-k10-s1234-dpprototypes-dp_delta1e-07"


@pytest.mark.parametrize("clients, trim, hint", [
    (3, 0.45, "no trim below 0.5 cuts anything from 2 or fewer contributors"),  # was: "raise trim (below 0.5)"
    (12, 0.2, "raise trim to 0.333 or more (below 0.5) or use aggregation='median'"),
])
def test_trimmed_mean_warning_gives_a_fix_that_exists(caplog, clients, trim, hint):
    import logging

    from fedproto.config import build_config
    from fedproto.simulation import Simulation

    cfg = build_config(overrides={"dataset": "digits", "clients": clients, "rounds": 1, "threads": 1,
                                  "aggregation": "trimmed", "trim": trim})
    with caplog.at_level(logging.WARNING):
        Simulation(cfg, out=False).run()
    warned = [r.getMessage() for r in caplog.records if "cuts nothing" in r.getMessage()]
    assert len(warned) == 1 and hint in warned[0], warned
    assert "at most 1 clients" not in warned[0]


@pytest.mark.parametrize("args, named", [
    (["--dataset", "custom"], "--dataset custom"),  # was: "--dataset custom needs --classes", a hidden flag
    (["--dataset", "digits", "--classes", "3"], "--classes"),  # was: "applies to --dataset custom only"
    (["--dataset", "custom", "--classes", "3"], "--dataset custom"),
])
def test_cli_refuses_python_only_custom_and_classes_at_once(args, named, capsys, monkeypatch, tmp_path):
    from conftest import run_cli

    code, out = run_cli(["run", *args, "--threads", "1", "--out-dir", str(tmp_path)], capsys, monkeypatch)
    assert code == 2, out
    assert f"error: {named} is for your own clients, built from Python with fedproto.federation.federate(" in out
    assert "needs --classes" not in out and not any(tmp_path.iterdir())


@pytest.mark.parametrize("toml, named", [
    ('dataset = "custom"\nclasses = 3\n', 'dataset = "custom" in'),
    ('[run]\ndataset = "digits"\nclasses = 3\n', "classes in"),
])
def test_cli_refuses_python_only_options_from_the_config_file(toml, named, capsys, monkeypatch, tmp_path):
    """The breaker's note: a TOML file with dataset = "custom" still got "needs --classes"."""
    from conftest import run_cli

    f = tmp_path / "run.toml"
    f.write_text(toml)
    code, out = run_cli(["run", "--config", str(f), "--threads", "1", "--out-dir", str(tmp_path / "runs")], capsys,
                        monkeypatch)
    assert code == 2, out
    assert f"error: {named} '{f}' is for your own clients, built from Python with fedproto.federation.federate(" in out
    assert "needs --classes" not in out and not (tmp_path / "runs").exists()
