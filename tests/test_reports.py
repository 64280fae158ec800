"""Reported numbers that mislead, and the one set-up path (issue #21 items 5 and 6)."""

from __future__ import annotations

import csv
import json
import logging
import math
from dataclasses import asdict

import numpy as np
import pytest
import torch
from torch import nn

from fedproto.config import build_config
from fedproto.engine.seeding import sample_clients
from fedproto.engine.setup import prepare
from fedproto.errors import TrainingError
from fedproto.federation import Client, federate
from fedproto.results import atomic_write_json
from fedproto.simulation import Simulation

SMALL = {"dataset": "digits", "threads": 1, "eval_every": 0}


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


class TwoOut(nn.Module):
    """A user's module returning (logits, 64-d embedding) for 8x8 digits."""

    def __init__(self, d=64):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, d), nn.ReLU())
        self.out = nn.Linear(d, 10)

    def forward(self, x):
        h = self.body(x)
        return self.out(h), h


def _own_clients(n=3, seed=0):
    """``n`` clients of your own (digits, Dirichlet-like skew by hand), 64-d models."""
    from fedproto.data.datasets import load_dataset

    ds = load_dataset("digits")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        classes = np.sort(rng.choice(10, size=4, replace=False))
        tr = np.flatnonzero(np.isin(ds.train_y.numpy(), classes))[i::n][:40]
        te = np.flatnonzero(np.isin(ds.test_y.numpy(), classes))[:20]
        torch.manual_seed(i)
        out.append(Client(TwoOut(), (ds.train_x[tr], ds.train_y[tr]), (ds.test_x[te], ds.test_y[te])))
    return out


def test_sampled_clients_record_rounds_trained_and_the_mean_over_those_that_trained(tmp_path, caplog):
    cfg = build_config(overrides={**SMALL, "clients": 10, "participation": 0.1, "rounds": 3, "algorithm": "fedavg"})
    with caplog.at_level(logging.WARNING, logger="fedproto"):
        summary = Simulation(cfg, out=tmp_path / "run").run()
    expected = np.zeros(10, int)
    for r in (1, 2, 3):
        expected[sample_clients(cfg.seed, r, 10, 0.1)] += 1
    rows = _rows(tmp_path / "run" / "clients.csv")
    trained = [int(r["rounds_trained"]) for r in rows]
    assert trained == expected.tolist() and sum(trained) == 3
    never = [i for i, n in enumerate(trained) if n == 0]
    assert len(never) >= 7  # 1 client a round, 3 rounds
    did = [float(r["acc"]) for r in rows if int(r["rounds_trained"]) > 0]
    assert summary["clients_trained"] == 10 - len(never)
    assert summary["accuracy_trained"]["acc"]["mean"] == pytest.approx(np.mean(did), abs=1e-6)
    assert summary["accuracy"]["acc"]["mean"] == pytest.approx(np.mean([float(r["acc"]) for r in rows]), abs=1e-6)
    stored = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert stored["accuracy_trained"]["acc"]["mean"] == pytest.approx(np.mean(did), abs=1e-6)
    warned = [r.getMessage() for r in caplog.records if "never trained" in r.getMessage()]
    assert len(warned) == 1 and f"{len(never)} of 10 clients never trained" in warned[0]
    assert str(never[:10]) in warned[0]


def test_full_participation_reports_every_round_trained_and_no_second_mean(tmp_path, caplog):
    cfg = build_config(overrides={**SMALL, "clients": 3, "rounds": 2, "algorithm": "fedavg"})
    with caplog.at_level(logging.WARNING):
        summary = Simulation(cfg, out=tmp_path / "run").run()
    assert [int(r["rounds_trained"]) for r in _rows(tmp_path / "run" / "clients.csv")] == [2, 2, 2]
    assert "accuracy_trained" not in summary and "clients_trained" not in summary
    assert not any("never trained" in r.getMessage() for r in caplog.records)


def test_own_clients_config_records_what_the_run_used(tmp_path):
    sim = federate(_own_clients(), num_classes=10, rounds=1, threads=1, out=tmp_path / "run", batch_size=10000)
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


def test_default_run_names_tell_result_changing_options_apart():
    name = lambda **kw: build_config(overrides=kw).run_name()  # noqa: E731
    assert name() == "fedproto-mnist-n3-k100-s1234"  # the README's default run
    assert name(lambda_proto=1.0, threads=1, workers=1, checkpoint_every=5) == name()  # defaults, neutral options
    assert name(lr=0.05) == "fedproto-mnist-n3-k100-s1234-lr0.05"
    variants = [name(), name(lr=0.05), name(lambda_proto=2.0), name(aggregation="median"),
                name(aggregation="trimmed"), name(aggregation="trimmed", trim=0.3), name(rounds=3),
                name(attack="scale", attackers=2), name(attack="scale", attackers=2, attack_scale=10.0),
                name(dp="prototypes"), name(dp="prototypes", dp_noise=2.0), name(participation=0.5),
                name(clients=10), name(stdev=1), name(drop_last=True)]
    assert len(set(variants)) == len(variants), variants
    assert name(trim=0.3) == name()  # trim acts only with aggregation trimmed
    assert name(algorithm="fedavg", lambda_proto=5.0) == name(algorithm="fedavg")  # fedavg has no λ
    many = dict(lr=0.001, momentum=0.9, weight_decay=1e-5, local_epochs=3, batch_size=32, rounds=7, distance="l2",
                proto_source="after_training", aggregation="trimmed", participation=0.5, test_shots=7,
                lambda_warmup=3, lambda_schedule="cosine", proto_momentum=0.5)
    long_a, long_b = name(**many), name(**{**many, "test_shots": 8})
    assert long_a != long_b and len(long_a) <= 170 and "-h" in long_a
    assert build_config(overrides=many).model_copy(update={"name": long_a}).run_name() == long_a


def test_two_runs_differing_only_in_lr_get_two_folders(tmp_path):
    base = {**SMALL, "clients": 3, "rounds": 1, "out_dir": str(tmp_path / "runs")}
    for lr in (0.01, 0.05):
        Simulation(build_config(overrides={**base, "lr": lr})).run()
    folders = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(folders) == 2 and folders[1] == folders[0].replace("-r1-", "-r1-lr0.05-"), folders
    assert {json.loads((tmp_path / "runs" / f / "config.json").read_text())["lr"] for f in folders} == {0.01, 0.05}


def test_trimmed_mean_that_cuts_nothing_is_reported_once(caplog):
    cfg = build_config(overrides={**SMALL, "clients": 3, "rounds": 2, "aggregation": "trimmed", "trim": 0.2})
    with caplog.at_level(logging.WARNING):
        Simulation(cfg, out=False).run()
    warned = [r.getMessage() for r in caplog.records if "cuts nothing" in r.getMessage()]
    assert len(warned) == 1, warned  # 2 rounds, one warning
    assert "trim=0.2" in warned[0] and "fewer than 5 contributors" in warned[0] and "round 1" in warned[0]


def test_divergence_under_an_attack_names_the_attack():
    cfg = build_config(overrides={**SMALL, "clients": 4, "rounds": 4, "algorithm": "fedavg", "attack": "scale",
                                  "attackers": 1, "attack_scale": 1e12})
    with pytest.raises(TrainingError) as e:
        Simulation(cfg, out=False).run()
    text = e.value.render()
    assert "1 simulated misbehaving client (attack='scale' x1e+12)" in text and "attack_scale" in text, text


def test_exploding_embeddings_under_dp_blame_the_dp_noise():
    sim = Simulation(build_config(overrides={**SMALL, "clients": 3, "rounds": 1, "dp": "prototypes",
                                             "dp_noise": 1000.0}), out=False)
    causes = sim.health.blowup_causes()
    assert causes.startswith("check the DP noise (dp_noise=1000, dp_clip=5") and "BatchNorm" in causes
    plain = Simulation(build_config(overrides={**SMALL, "clients": 3, "rounds": 1}), out=False).health.blowup_causes()
    assert "DP" not in plain and "lr (now 0.01)" in plain


def test_infinite_epsilon_has_one_spelling(tmp_path):
    atomic_write_json(tmp_path / "x.json", {"privacy": {"epsilon_max": math.inf, "delta": 1e-5},
                                            "loss": math.inf, "acc": {"dp_epsilon": {"mean": math.inf,
                                                                                      "std": math.nan}}})
    back = json.loads((tmp_path / "x.json").read_text())
    assert back == {"privacy": {"epsilon_max": "inf", "delta": 1e-5}, "loss": None,
                    "acc": {"dp_epsilon": {"mean": "inf", "std": None}}}
    cfg = build_config(overrides={**SMALL, "clients": 3, "rounds": 1, "dp": "prototypes", "dp_noise": 0.0})
    summary = Simulation(cfg, out=tmp_path / "run").run()
    assert summary["privacy"]["epsilon_max"] == math.inf
    stored = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert stored["privacy"]["epsilon_max"] == "inf" and stored["privacy"]["epsilon_mean"] == "inf"
    assert {r["dp_epsilon"] for r in _rows(tmp_path / "run" / "clients.csv")} == {"inf"}
    assert float(stored["privacy"]["epsilon_max"]) == math.inf  # Python reads the spelling back


def test_test_classes_absent_from_training_are_named(caplog):
    clients = _own_clients()
    x, y = clients[1].train
    keep = y != y[0]  # client 1 loses every training sample of one of its classes
    gone = int(y[0])
    clients[1] = Client(clients[1].model, (x[keep], y[keep]), clients[1].test)
    with caplog.at_level(logging.WARNING):
        federate(clients, num_classes=10, rounds=1, threads=1, out=False)
    warned = [r.getMessage() for r in caplog.records if "absent from their training data" in r.getMessage()]
    assert len(warned) == 1 and f"client 1: [{gone}]" in warned[0] and "client 0" not in warned[0]


def test_cli_and_api_set_up_resolve_the_same_configuration():
    opts = {**SMALL, "clients": 4, "rounds": 1, "batch_size": 10000, "lr": 0.05}
    cli = prepare(build_config(overrides=opts), progress=False)
    clients = [Client(s.model, (d.x, d.y), (d.test_x, d.test_y)) for s, d in zip(cli.states, cli.data)]
    api = federate(clients, 10, False, **{k: v for k, v in opts.items() if k not in ("dataset", "clients")}).setup
    largest = max(len(d.y) for d in cli.data)
    assert asdict(cli.algorithm.opt) == asdict(api.algorithm.opt)
    assert api.algorithm.opt.batch_size == largest < 10000  # capped by both front ends
    assert (cli.embedding_dim, type(cli.algorithm)) == (api.embedding_dim, type(api.algorithm))
    assert [list(s.classes) for s in cli.states] == [list(s.classes) for s in api.states]
