"""fedproto.config.run_config: RunConfig, build_config, run names and result fields, the options' checks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import DATA, SMALL, digits_config

from fedproto.config.run_config import ADDED_FIELDS, build_config, result_fields
from fedproto.errors import ConfigError
from fedproto.simulation import Simulation


def test_default_run_names_of_floats_that_differ_past_six_digits_differ():
    # Before: {v:g} wrote both lr values as lr0.123457 (one folder, the second run replacing the
    # first), and dp_noise=1.0000001 as dp_noise1, which reads as the default.
    from fedproto.config.run_config import build_config

    def name(**o):
        return build_config(overrides={"dataset": "digits", **o}).run_name()

    assert name(lr=0.1234567) == "fedproto-digits-n3-k10-s1234-lr0.1234567"
    assert name(lr=0.1234568) == "fedproto-digits-n3-k10-s1234-lr0.1234568"
    assert name(dp="prototypes", dp_noise=1.0000001) == "fedproto-digits-n3-k10-s1234-dpprototypes-dp_noise1.0000001"
    # short values keep their short spelling
    assert name(lr=0.05) == "fedproto-digits-n3-k10-s1234-lr0.05"
    assert name(dp="prototypes", dp_delta=1e-7) == "fedproto-digits-n3-k10-s1234-dpprototypes-dp_delta1e-07"


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


def test_freeze_after_refused_where_it_cannot_work():
    with pytest.raises(ConfigError, match="fedrep"):
        digits_config(algorithm="fedrep", freeze_after=2)


def test_seeded_dp_noise_option_is_result_relevant_only_under_dp():
    assert "dp_reproducible_noise" not in digits_config().result_fields()
    assert digits_config(dp="prototypes").result_fields()["dp_reproducible_noise"] is False
    # results stored before the option existed had seeded noise
    assert result_fields({**ADDED_FIELDS, "dp": "prototypes"})["dp_reproducible_noise"] is True


@pytest.mark.parametrize("kw,match", [
    (dict(dp="prototypes", algorithm="fedavg"), "sends model weights"),
    (dict(dp="full", execution="batched"), "sequential"),
    (dict(dp="full", distance="l2"), "per-sample"),
    (dict(attack="scale"), "give both"),
    (dict(attackers=2), "give both"),
    (dict(attack="nan", attackers=7), "attackers=7 is more than clients=6"),
    (dict(aggregation="trimmed", trim=0.5), "trim"),
    (dict(class_check=-1), "class_check"),
    (dict(dp="full", dp_noise=-1.0), "dp_noise"),
])
def test_bad_options_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        digits_config(**kw)


@pytest.fixture(scope="module")
def femnist():
    from fedproto.data.datasets import load_dataset

    return load_dataset("femnist", DATA, download=False)


@pytest.mark.usefixtures("one_thread")
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


@pytest.mark.usefixtures("one_thread")
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


@pytest.mark.usefixtures("one_thread")
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


def test_options_the_run_ignores_are_recorded_as_ignored(tmp_path):
    cfg = digits_config(algorithm="fedavg", rounds=1, trim=0.3, prox_mu=0.5, lr_gamma=0.5, lr=0.05)
    # another method's options, one FedProto's aggregation would read, a schedule's without the schedule
    assert cfg.ignored_options() == ["lr_gamma", "prox_mu", "trim"]
    used = digits_config(algorithm="fedproto", lambda_proto=2.0, aggregation="trimmed", trim=0.3)
    assert used.ignored_options() == []
    Simulation(cfg, out=tmp_path / "run").run()
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert stored["ignored_options"] == ["lr_gamma", "prox_mu", "trim"] and stored["trim"] == 0.3


def test_a_name_chosen_from_a_list_gets_did_you_mean(tmp_path):
    with pytest.raises(ConfigError) as e:
        build_config(overrides={"distance": "msee"})
    assert str(e.value).endswith("distance='msee': Input should be 'mse', 'squared_l2' or 'l2'; did you mean "
                                 "distance='mse'?")
    f = tmp_path / "run.toml"
    f.write_text('aggregation = "median2"\n')
    with pytest.raises(ConfigError) as e:  # a value from a file: the fix is the line to write
        build_config(f)
    assert 'did you mean aggregation = "median"?' in str(e.value)
    with pytest.raises(ConfigError) as e:  # nothing near: no guess
        build_config(overrides={"distance": "zzz"})
    assert "did you mean" not in str(e.value)


def test_numpy_scalars_are_read_as_python_numbers():
    import numpy as np

    cfg = build_config(overrides={"rounds": np.int64(3), "lr": np.float32(0.25), "clients": np.int32(4),
                                  "lambda_proto": np.float64(2.0)})
    assert (cfg.rounds, cfg.lr, cfg.clients, cfg.lambda_proto) == (3, 0.25, 4, 2.0)
    assert type(cfg.rounds) is int and type(cfg.lr) is float
    with pytest.raises(ConfigError) as e:  # still checked: the bound, with the value as a plain number
        build_config(overrides={"rounds": np.int64(0)})
    assert "rounds=0: Input should be greater than or equal to 1; use rounds=1 or more" in str(e.value)


@pytest.mark.parametrize("overrides, expect", [
    ({"lr": "0.1"}, "lr='0.1': Input should be a valid number; write it without quotes: lr=0.1"),
    ({"lambda_proto": "2"}, "lambda_proto='2': Input should be a valid number; write it without quotes: "
                            "lambda_proto=2"),
    ({"rounds": "3"}, "rounds='3': Input should be a valid integer; write it without quotes: rounds=3"),
    ({"lr": "abc"}, "lr='abc': Input should be a valid number; give lr a number"),
    ({"device": "gpu"}, "device='gpu': should be one of auto, cpu, cuda, cuda:N, mps; did you mean device='cuda'?"),
    ({"device": "xyz"}, "device='xyz': should be one of auto, cpu, cuda, cuda:N, mps; give one of those, e.g. "
                        "device='auto'"),
    ({"distance": "cosine"}, "distance='cosine': Input should be 'mse', 'squared_l2' or 'l2'; give one of those, "
                             "e.g. distance='mse'"),
])
def test_a_refused_value_comes_with_its_fix(overrides, expect, tmp_path):
    with pytest.raises(ConfigError) as e:
        build_config(overrides=overrides)
    assert str(e.value) == "invalid configuration: " + expect
    assert "^(" not in str(e.value)  # no regular expression
    f = tmp_path / "run.toml"
    f.write_text('lr = "0.1"\n')
    with pytest.raises(ConfigError) as e:  # from a file: the line to write
        build_config(f)
    assert str(e.value).endswith(f"""lr = "0.1" in '{f}': Input should be a valid number; write it without """
                                 "quotes: lr = 0.1")
