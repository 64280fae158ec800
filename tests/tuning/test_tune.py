"""``fedproto tune`` (fedproto.tuning, fedproto.cli.tune_command): validation splits, never the test data,
studies that resume, parallel trials in one study, the best settings as a run TOML, the space's
errors. Needs the ``tune`` extra (Optuna); each test runs tiny digits federations on one thread."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

optuna = pytest.importorskip("optuna")

from conftest import run_cli  # noqa: E402

from fedproto.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.extras  # CI runs them where the tune extra is installed

TINY = {"clients": 4, "rounds": 2, "shots": 20, "test_shots": 10}
"""4 digits clients, 2 rounds: a trial takes about a second on one thread."""


def _tune(tmp_path, name="t", **kw):
    from fedproto.tuning import tune

    args = {"dataset": "digits", "options": dict(TINY), "trials": 3, "out": tmp_path / name, "threads": 1,
            "final_seeds": 0, "plots": False, "space": ["lambda_proto=log:0.01:10", "lr=log:0.005:0.1"], **kw}
    return tune(**args)


def _trials(study):
    return [(t.number, t.state.name, t.params, t.value) for t in study.get_trials()]


def test_validation_split_is_per_class_seeded_and_disjoint():
    from fedproto.tuning.split import validation_split

    labels = np.array([0] * 10 + [1] * 5 + [2] * 1)
    rows = [np.arange(16)]
    fit, val = validation_split(rows, labels, 0.2, seed=7)
    assert sorted(np.bincount(labels[val[0]], minlength=3)) == [0, 1, 2]  # 2 of class 0, 1 of class 1, none of 2
    assert np.bincount(labels[val[0]], minlength=3).tolist() == [2, 1, 0]
    assert set(fit[0]).isdisjoint(val[0]) and len(fit[0]) + len(val[0]) == 16
    again = validation_split(rows, labels, 0.2, seed=7)
    assert again[1][0].tolist() == val[0].tolist()
    assert validation_split(rows, labels, 0.2, seed=8)[1][0].tolist() != val[0].tolist()
    with pytest.raises(ConfigError, match="between 0 and 1"):
        validation_split(rows, labels, 1.0, seed=7)


def test_space_from_a_toml_file_and_the_command_line(tmp_path):
    from fedproto.tuning import read_config
    from fedproto.tuning.space import for_method, parse_space

    f = tmp_path / "tune.toml"
    f.write_text('rounds = 2\n[run]\ndataset = "digits"\n[space]\n'
                 'lambda = {type = "float", low = 0.01, high = 10, log = true}\n'
                 'distance = {type = "categorical", choices = ["mse", "l2"]}\n'
                 'local_epochs = "int:1:3"\nproto_normalize = "bool"\n')
    run, table = read_config(f)
    assert run == {"rounds": 2, "dataset": "digits"}
    space = parse_space(["local_epochs=intlog:1:8"], table)
    assert {k: d.spec() for k, d in space.items()} == {
        "lambda_proto": "log:0.01:10", "distance": "cat:mse,l2", "local_epochs": "intlog:1:8",
        "proto_normalize": "cat:false,true"}
    assert set(for_method(space, "local")) == {"local_epochs"}  # λ, the distance, normalising: FedProto's own
    with pytest.raises(ConfigError, match="given twice"):
        parse_space(["lr=log:0.01:1", "lr=log:0.01:2"])
    with pytest.raises(ConfigError, match="unknown kind 'logg'"):
        parse_space(["lr=logg:0.01:1"])


def test_tune_never_reads_the_test_data(tmp_path, monkeypatch):
    """The same study with the test split replaced by noise (inputs and labels); a run that reads
    the test split does change with that noise."""
    import torch

    import fedproto.data.datasets as datasets
    import fedproto.engine.setup as engine_setup
    import fedproto.tuning.split as split

    clean = _tune(tmp_path, "clean").studies["fedproto"]
    real = datasets.load_dataset

    def noisy(*a, **k):
        ds = real(*a, **k)
        g = torch.Generator().manual_seed(0)
        return replace(ds, test_x=torch.randn(ds.test_x.shape, generator=g),
                       test_y=torch.randint(0, ds.num_classes, ds.test_y.shape, generator=g))

    for module in (datasets, engine_setup, split):
        monkeypatch.setattr(module, "load_dataset", noisy)
    noise = _tune(tmp_path, "noise").studies["fedproto"]
    assert [t[1] for t in _trials(clean)] == ["COMPLETE"] * 3
    assert _trials(noise) == _trials(clean)

    from fedproto.config.run_config import build_config
    from fedproto.simulation import Simulation

    cfg = build_config(None, {**TINY, "dataset": "digits", "threads": 1})
    with_noise = Simulation(cfg, out=False).run()["accuracy"]["acc"]["mean"]
    monkeypatch.setattr(engine_setup, "load_dataset", real)
    assert Simulation(cfg, out=False).run()["accuracy"]["acc"]["mean"] != with_noise


def test_tune_resumes_a_stopped_study_from_its_database(tmp_path, monkeypatch):
    """Stopped after 2 trials, then Ctrl-C in the third: the same call with --trials 4 runs only
    the missing trials, and the study is the one an uninterrupted search gives."""
    import fedproto.tuning.study as st

    whole = _trials(_tune(tmp_path, "whole", trials=4).studies["fedproto"])
    _tune(tmp_path, "stopped", trials=2)
    real = st.run_trial

    def interrupted(spec, trial):
        raise KeyboardInterrupt

    monkeypatch.setattr(st, "run_trial", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _tune(tmp_path, "stopped", trials=4)
    monkeypatch.setattr(st, "run_trial", real)
    resumed = _tune(tmp_path, "stopped", trials=4).studies["fedproto"]
    got = _trials(resumed)
    assert [t[1] for t in got] == ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    assert resumed.trials[2].user_attrs["interrupted"] is True
    kept = [t[1:] for t in got if t[1] == "COMPLETE"]
    assert kept == [t[1:] for t in whole]
    assert (tmp_path / "stopped" / "study.db").is_file()
    # another space on the same study is refused, naming what differs
    with pytest.raises(ConfigError, match="made with other space"):
        _tune(tmp_path, "stopped", trials=4, space=["lr=log:0.001:0.1"])


def test_tune_trials_in_parallel_fill_one_study(tmp_path):
    res = _tune(tmp_path, "par", trials=4, jobs=2, threads=2)
    study = res.studies["fedproto"]
    trials = study.get_trials()
    assert len(trials) == 4 and all(t.state.name == "COMPLETE" for t in trials)
    assert len({t.user_attrs["pid"] for t in trials}) == 2  # two processes, one study
    assert len({tuple(sorted(t.params.items())) for t in trials}) == 4
    assert res.best["fedproto"] == study.best_trial.params


def test_tune_best_config_runs_with_fedproto_run(tmp_path, capsys, monkeypatch):
    """best.toml, run with ``fedproto run --config``, gives the final run's test accuracy."""
    res = _tune(tmp_path, "best", trials=2, final_seeds=1, plots=True)
    best = tmp_path / "best" / "best.toml"
    assert best.is_file() and {p.name for p in res.files["plots"]} >= {
        "fedproto-optimization_history.png", "fedproto-slice_lambda_proto.png"}
    row = res.rows[0]
    assert row["seeds"] == 1 and 0 < row["test_mean"] <= 1
    code, out = run_cli(["run", "--config", str(best), "--threads", "1", "--out-dir", str(tmp_path / "runs"),
                         "--name", "again", "-q"], capsys, monkeypatch)
    assert code == 0, out
    config = json.loads((tmp_path / "runs" / "again" / "config.json").read_text())
    assert config["lambda_proto"] == pytest.approx(res.best["fedproto"]["lambda_proto"])
    summary = json.loads((tmp_path / "runs" / "again" / "summary.json").read_text())
    assert summary["accuracy"]["acc"]["mean"] == pytest.approx(row["test_mean"], abs=1e-9)
    table = (tmp_path / "best" / "table.md").read_text()
    assert f"{100 * row['test_mean']:.1f}" in table


def test_tune_refuses_an_unknown_option_in_the_space(tmp_path, capsys, monkeypatch):
    code, out = run_cli(["tune", "--dataset", "digits", "--out", str(tmp_path / "x"),
                         "--space", "lamda_proto=log:0.01:10"], capsys, monkeypatch)
    assert code == 2
    assert "unknown option 'lamda_proto' in the search space" in out and "did you mean 'lambda_proto'?" in out
    assert not (tmp_path / "x" / "study.db").exists()
    with pytest.raises(ConfigError, match=r"low 0 .*log scale|log scale needs low > 0"):
        _tune(tmp_path, space=["lr=log:0:1"])
    with pytest.raises(ConfigError, match=r"'seed' cannot be searched"):
        _tune(tmp_path, space=["seed=int:1:5"])
    with pytest.raises(ConfigError, match=r"lr=log:0.01:1000: the value 1000"):
        _tune(tmp_path, space=["lr=log:0.01:1000"])


def _net():
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(64, 16), nn.ReLU())
            self.fc = nn.Linear(16, 10)

        def forward(self, x):
            return self.fc(self.body(x))

    return Net()


def make_clients(seed: int, noisy_test: bool = False):
    """3 clients of scikit-learn's digits (flattened), 60 training and 30 test samples each."""
    import torch
    from sklearn.datasets import load_digits

    from fedproto.federation import Client

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    clients, g = [], torch.Generator().manual_seed(99)  # the noise from its own stream: the models' weights stay
    for i in range(3):
        tr, te = order[i * 90: i * 90 + 60], order[i * 90 + 60: i * 90 + 90]
        test = (torch.randn(30, 64, generator=g), torch.randint(0, 10, (30,), generator=g)) if noisy_test else (
            x[te], y[te])
        clients.append(Client(_net(), (x[tr], y[tr]), test, head="fc"))
    return clients


def make_noisy_clients(seed: int):
    return make_clients(seed, noisy_test=True)


def test_tune_your_own_federation_never_reads_its_test_data(tmp_path):
    """fedproto.tune(clients=make_clients): trials on a validation share of each client's training
    data (the same study with the clients' test data replaced by noise); the final runs on the
    test data, which the noise then does change."""
    from fedproto.tuning import tune

    kw = {"options": {"rounds": 2}, "num_classes": 10, "trials": 3, "threads": 1, "final_seeds": 1, "plots": False,
          "space": {"lr": "log:0.005:0.1"}}
    clean = tune(clients=make_clients, out=tmp_path / "clean", **kw)
    noisy = tune(clients=make_noisy_clients, out=tmp_path / "noisy", **kw)
    assert _trials(noisy.studies["fedproto"]) == _trials(clean.studies["fedproto"])
    assert [t[1] for t in _trials(clean.studies["fedproto"])] == ["COMPLETE"] * 3
    assert clean.rows[0]["seeds"] == 1 and clean.rows[0]["test_mean"] != noisy.rows[0]["test_mean"]
    assert (tmp_path / "clean" / "final" / "runs" / "fedproto-s1234" / "summary.json").is_file()
    with pytest.raises(ConfigError, match="make_clients"):
        tune(clients=make_clients(1), out=tmp_path / "x", **kw)


def test_a_time_budget_starts_no_trial_after_it(tmp_path):
    res = _tune(tmp_path, "time", trials=None, timeout=3.0)
    trials = res.studies["fedproto"].get_trials()
    assert len(trials) >= 2 and all(t.state.name == "COMPLETE" for t in trials)
    first = trials[0].datetime_start
    assert max((t.datetime_start - first).total_seconds() for t in trials) <= 3.0  # none starts after the budget
    assert (trials[-1].datetime_complete - first).total_seconds() > 3.0 - trials[-1].user_attrs["wall_s"] - 1.0
    assert res.rows[0]["trials_complete"] == len(trials)
    with pytest.raises(ConfigError, match="--timeout 0"):
        _tune(tmp_path, "time", trials=None, timeout=0)


def test_the_table_states_each_methods_trials_and_warns_when_they_differ(tmp_path):
    """Tuned with 2 trials, then again into the same folder with 1 and a baseline (given as a
    string, one name): the caption names each method's real count and warns."""
    _tune(tmp_path, "fair", trials=2)
    res = _tune(tmp_path, "fair", trials=1, baselines="local")
    assert list(res.studies) == ["fedproto", "local"]
    assert [r["trials_complete"] + r["trials_pruned"] + r["trials_failed"] for r in res.rows] == [2, 1]
    caption = (tmp_path / "fair" / "table.md").read_text().splitlines()[0]
    assert "trials per method: fedproto 2, local 1" in caption
    assert "WARNING: the methods were tuned with different budgets" in caption and "--trials 2" in caption


def test_best_toml_holds_the_seed_of_the_search(tmp_path):
    from fedproto.config.run_options import tomllib

    _tune(tmp_path, "seed", trials=1, seed=7)
    best = tomllib.loads((tmp_path / "seed" / "best.toml").read_text())
    assert best["seed"] == 7 and best["algorithm"] == "fedproto" and best["rounds"] == 2


def test_an_option_fixed_and_searched_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"lambda_proto=0.5 is fixed and also searched \(the search space's "
                                          r"lambda_proto=log:0.01:10\)"):
        _tune(tmp_path, "both", options={**TINY, "lambda_proto": 0.5})
    assert not (tmp_path / "both").exists()


def test_output_folder_problems_are_refused_before_any_trial(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out in (afile, afile / "sub"):
        with pytest.raises(ConfigError, match=rf"--out '{out}': '{afile}' is a file, not a folder"):
            _tune(tmp_path, out=out)
    (tmp_path / "o1" / "best.toml").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"best.toml' is a folder where fedproto tune writes a file"):
        _tune(tmp_path, "o1")
    (tmp_path / "o2").mkdir()
    (tmp_path / "o2" / "plots").write_text("x")
    with pytest.raises(ConfigError, match=r"plots' is a file where fedproto tune writes a folder"):
        _tune(tmp_path, "o2", plots=True)
    for name in ("o1", "o2"):
        assert not (tmp_path / name / "study.db").exists()
    code, out = run_cli(["tune", "--dataset", "digits", "--set", "clients=4", "--out", str(tmp_path / "new" / "o"),
                         "--storage", "nosuchdb://x", "--threads", "1"], capsys, monkeypatch)
    assert code == 2 and "--storage 'nosuchdb://x'" in out
    assert not (tmp_path / "new").exists()


def test_metric_and_space_a_method_does_not_use_are_refused_before_any_study(tmp_path):
    with pytest.raises(ConfigError, match=r"--metric acc_proto: local does not report it \(it reports acc\)"):
        _tune(tmp_path, "m", method="local", metric="acc_proto")
    with pytest.raises(ConfigError, match=r"--metric acc_proto: local does not report it"):
        _tune(tmp_path, "m", metric="acc_proto", baselines=["local"])
    with pytest.raises(ConfigError, match=r"fedproto uses none of the search space's options \(fd_lambda is an "
                                          r"option of fd\)"):
        _tune(tmp_path, "m", space=["fd_lambda=log:0.1:1"])
    assert not (tmp_path / "m").exists()


def test_no_complete_trial_exits_1(tmp_path, capsys, monkeypatch):
    import fedproto.tuning.study as st

    def fails(spec, trial):
        raise ConfigError("diverged")

    monkeypatch.setattr(st, "run_trial", fails)
    code, out = run_cli(["tune", "--dataset", "digits", "--set", "clients=4", "--rounds", "1", "--trials", "1",
                         "--final-seeds", "0", "--threads", "1", "--out", str(tmp_path / "f")], capsys, monkeypatch)
    assert code == 1 and "no trial of fedproto completed" in out and "diverged" in out


def test_small_refusals_of_the_space_and_the_options(tmp_path):
    from fedproto.tuning.space import parse_space

    with pytest.raises(ConfigError, match=r"bool takes no arguments.*--set proto_normalize=true"):
        parse_space(["proto_normalize=bool:true"])
    with pytest.raises(ConfigError, match=r"a single choice \(mse\) searches nothing.*--set distance=mse"):
        parse_space(["distance=cat:mse"])
    with pytest.raises(ConfigError, match=r"log = 'no' is not a bool"):
        parse_space(table={"lr": {"type": "float", "low": 0.01, "high": 1, "log": "no"}})
    with pytest.raises(ConfigError, match=r"--threads -2: give a whole number, 1 or more"):
        _tune(tmp_path, threads=-2)
    for key in ("out_dir", "name", "threads"):
        with pytest.raises(ConfigError, match=rf"--set: {key} = .* is set by fedproto tune itself"):
            _tune(tmp_path, options={**TINY, key: "x" if key != "threads" else 2})
    f = tmp_path / "t.toml"
    f.write_text('dataset = "digits"\ntrials = 5\n')
    with pytest.raises(ConfigError, match=r"trials = 5 is an option of fedproto tune, not a run option; give "
                                          r"--trials 5"):
        _tune(tmp_path, config=f)
