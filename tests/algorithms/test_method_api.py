"""The method API's contracts, checked with plug-ins written as a user would: options declared once
per method (run names, the resume check, no option used in secret), server state returned by
``aggregate`` (metrics, run-folder files, alerts), client hooks honoured by every executor and one
NaN policy for the simulator and Flower."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Optional

import numpy as np
import pytest
import torch
from pydantic import Field

from fedproto import plugins
from fedproto.algorithms import FedProto, register_algorithm
from fedproto.algorithms.method_options import FedProtoOptions
from fedproto.algorithms.proto_steps import Rows
from fedproto.config.run_config import build_config
from fedproto.engine.observers.checkpoints import check_options
from fedproto.engine.setup import prepare
from fedproto.errors import CheckpointMismatch
from fedproto.prototypes import prototype_table
from fedproto.simulation import Simulation
from fedproto.training import LossTerm

SMALL = dict(dataset="digits", clients=4, ways=3, shots=20, stdev=1, test_shots=10, rounds=3, eval_every=0,
             lr=0.05, threads=1)


class PullOptions(plugins.AlgorithmOptions):
    pull_weight: float = Field(0.5, ge=0.0, le=100.0, description="Weight of the pull toward the global prototype")


class PullTerm(LossTerm):
    """weight x squared L2 distance of each embedding to its class's global prototype."""

    def __init__(self, weight: float, table: torch.Tensor, mask: torch.Tensor):
        self.weight, self.table, self.mask = weight, table, mask

    def __call__(self, logits, h, y, w):
        per = ((h - self.table.to(h.dtype)[y]) ** 2).sum(-1) * self.mask[y].to(h.dtype)
        return self.weight * (per * w).sum(-1) / w.sum(-1).clamp_min(1.0)


class PullProto(FedProto):
    """FedProto plus a pull term; its Options subclass AlgorithmOptions alone (not FedProto's)."""

    name = "pullproto"
    Options = PullOptions

    def objective(self, state, message):
        obj = super().objective(state, message)
        if "protos" in message and len(message["classes"]) and self.options.pull_weight > 0:
            table, mask = prototype_table(message["classes"], message["protos"], self.num_classes,
                                          message["protos"].shape[1])
            obj.terms = (*obj.terms, PullTerm(self.options.pull_weight, table, mask),)
        return obj


@pytest.fixture
def pullproto():
    register_algorithm(PullProto)
    yield PullProto
    plugins.unregister("pullproto")


def test_plugin_options_are_in_the_run_name_and_checked_on_resume(pullproto, caplog):
    one = build_config(overrides={**SMALL, "algorithm": "pullproto", "lambda_proto": 1.0})
    fifty = build_config(overrides={**SMALL, "algorithm": "pullproto", "lambda_proto": 50.0})
    # λ is an option of the method (inherited from FedProto with the code that reads it): two folders
    assert one.run_name() != fifty.run_name()
    assert fifty.run_name().endswith("-lambda50") and "lambda" not in one.run_name()  # 1.0: digits' default
    assert fifty.result_fields()["lambda_proto"] == 50.0 and "pull_weight" in fifty.result_fields()
    # the λ=50 resume of a λ=1 checkpoint is refused, naming λ
    with pytest.raises(CheckpointMismatch, match=r"lambda_proto: 1\.0 there, 50\.0 now"):
        check_options(fifty, {"config": one.model_dump(mode="json")}, "checkpoint.pt")
    check_options(one, {"config": one.model_dump(mode="json")}, "checkpoint.pt")  # the same options resume
    # nothing is logged "ignored" and used: the method reads λ from its own options
    with caplog.at_level(logging.WARNING):
        setup = prepare(fifty, progress=False)
    assert "ignores" not in caplog.text and "ignored" not in caplog.text
    alg = setup.algorithm
    assert alg.options.lambda_proto == 50.0 and alg.options.pull_weight == 0.5 and alg.lambda_proto == 50.0
    # an option another method owns is still reported as ignored when set
    caplog.clear()
    other = build_config(overrides={**SMALL, "algorithm": "fedavg", "pull_weight": 0.3})
    with caplog.at_level(logging.WARNING):
        prepare(other, progress=False)
    assert "fedavg ignores pull_weight: pull_weight acts on pullproto only" in caplog.text


class FiftyOptions(FedProtoOptions):
    """FedProto's options with other defaults for two it inherits."""

    lambda_proto: Optional[float] = Field(50.0, ge=0.0, le=1e6, description="λ (this method: 50)")
    proto_momentum: float = Field(0.5, ge=0.0, lt=1.0, description="server prototype momentum (this method: 0.5)")


class FiftyProto(FedProto):
    name = "fiftyproto"
    Options = FiftyOptions


def test_a_plugin_default_for_an_inherited_option_is_used(tmp_path, capsys, monkeypatch):
    from conftest import run_cli

    from fedproto.config.run_options import help_text

    register_algorithm(FiftyProto)
    try:
        cfg = build_config(overrides={**SMALL, "algorithm": "fiftyproto", "rounds": 2})
        given = build_config(overrides={**SMALL, "algorithm": "fiftyproto", "rounds": 2, "lambda_proto": 1.0})
        plain = build_config(overrides={**SMALL, "algorithm": "fedproto", "rounds": 2})
        assert (cfg.lambda_proto, cfg.lam, cfg.proto_momentum) == (50.0, 50.0, 0.5)
        assert (given.lambda_proto, given.proto_momentum) == (1.0, 0.5)  # a given value still wins
        assert (plain.lambda_proto, plain.lam, plain.proto_momentum) == (None, 1.0, 0.0)  # FedProto keeps its own
        # the method's defaults keep the short name; λ = 1 given is another run, in another folder
        assert cfg.run_name() == "fiftyproto-digits-n3-k20-s1234-m4-r2-lr0.05-eval_every0"
        assert given.run_name() == cfg.run_name() + "-lambda1"
        assert cfg.result_fields()["lambda_proto"] == 50.0 and cfg.result_fields()["proto_momentum"] == 0.5
        # a checkpoint written with λ at FedProto's default (as before this fix) is refused, naming λ
        old = {**cfg.model_dump(mode="json"), "lambda_proto": None, "proto_momentum": 0.0}
        with pytest.raises(CheckpointMismatch, match=r"lambda_proto: None there, 50\.0 now"):
            check_options(cfg, {"config": old}, "checkpoint.pt")
        assert help_text("lambda_proto").endswith("(default: per dataset: mnist 1, femnist 1, cifar10 0.1, digits 1; "
                                                  "fiftyproto 50)")
        assert help_text("proto_momentum").endswith("(default: 0; fiftyproto 0.5)")
        code, out = run_cli(["run", "--help"], capsys, monkeypatch)
        assert code == 0 and "fiftyproto 0.5" in " ".join(out.split())
        sim = Simulation(cfg, out=tmp_path / "run")
        assert sim.setup.algorithm.options.lambda_proto == 50.0 and sim.setup.algorithm.lambda_proto == 50.0
        sim.run()
    finally:
        plugins.unregister("fiftyproto")
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert stored["lambda_proto"] == 50.0 and stored["proto_momentum"] == 0.5
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lambda"] for r in rows] == [0.0, 50.0]  # no global prototype in round 1, then the method's λ


class CountPowerOptions(plugins.AlgorithmOptions):
    count_power: float = Field(2.0, ge=0.0, le=10.0, description="p: a prototype weighs count**p in its class's mean")


class CountPowerRule:
    """Global prototype of a class: the mean of its prototypes weighted by count**p."""

    def __init__(self, num_classes: int, p: float):
        self.num_classes, self.p = num_classes, p

    def __call__(self, round, rows):
        c = np.concatenate(rows.classes).astype(np.int64)
        P = np.concatenate(rows.protos).astype(np.float64)
        w = np.concatenate(rows.counts).astype(np.float64) ** self.p
        cls = np.unique(c)
        protos = np.stack([(w[c == k, None] * P[c == k]).sum(0) / w[c == k].sum() for k in cls])
        return cls, protos.astype(np.float32), np.array([(c == k).sum() for k in cls], np.int64)


class CountPowerProto(FedProto):
    """FedProto whose aggregate weighs each prototype by count**p (one part swapped)."""

    name = "countpower"
    Options = CountPowerOptions

    def aggregate(self, round, messages, state=None):
        steps = replace(self.server_steps(), rule=CountPowerRule(self.num_classes, self.options.count_power))
        return self.run_steps(steps, round, messages, state)


def test_a_plugin_aggregate_keeps_metrics_prototypes_and_alerts(tmp_path, caplog):
    rows = Rows([0, 1], [np.array([0]), np.array([0])], [np.array([[0.0]]), np.array([[3.0]])],
                [np.array([1]), np.array([2])])
    cls, protos, contrib = CountPowerRule(1, 2.0)(1, rows)  # weights 1 and 4: (0 + 4 * 3) / 5
    assert cls.tolist() == [0] and protos[0, 0] == pytest.approx(2.4) and contrib.tolist() == [2]
    register_algorithm(CountPowerProto)
    try:
        runs = {}
        for algorithm in ("fedproto", "countpower"):
            cfg = build_config(overrides={**SMALL, "stdev": 2, "algorithm": algorithm, "proto_dist_alert": 1.0})
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                Simulation(cfg, out=tmp_path / algorithm).run()
            rows = [json.loads(line) for line in (tmp_path / algorithm / "metrics.jsonl").read_text().splitlines()]
            with np.load(tmp_path / algorithm / "prototypes.npz") as z:
                npz = {k: z[k] for k in z.files}
            runs[algorithm] = rows, npz, [r.getMessage() for r in caplog.records if "prototypes lie" in r.getMessage()]
    finally:
        plugins.unregister("countpower")
    (rows_a, npz_a, alerts_a), (rows_b, npz_b, alerts_b) = runs["fedproto"], runs["countpower"]
    assert [set(r) for r in rows_b] == [set(r) for r in rows_a]  # λ and proto_dist* stay in metrics.jsonl
    assert {"lambda", "proto_dist", "proto_dist_max", "proto_dist_argmax"} <= set(rows_b[-1])
    assert [r["lambda"] for r in rows_b] == [0.0, 1.0, 1.0]  # no global prototype in round 1
    assert set(npz_b) == set(npz_a) == {"classes", "protos", "contributors"}
    for npz in (npz_a, npz_b):  # one count per class, each class sent by somebody in the last round
        assert npz["contributors"].shape == npz["classes"].shape and (npz["contributors"] >= 1).all()
    assert not np.allclose(npz_a["protos"], npz_b["protos"])  # the rule acted
    assert alerts_a and alerts_b  # the distance alerts of both (proto_dist_alert=1: above the median)
    assert all("check its data (proto_dist_alert=1)" in a for a in alerts_b)


class _Installed(FedProto):
    """A plug-in as an installed package declares it (an entry point of the fedproto.algorithms group)."""

    name = "installedproto"

    class Options(plugins.AlgorithmOptions):
        installed_x: float = Field(1.0, description="x")


class _EntryPoint:
    name, value, group = "installedproto", "somepackage:InstalledProto", plugins.GROUP

    def load(self):
        return _Installed


def test_an_installed_plugin_package_stays_out_of_the_library_scope(monkeypatch):
    import importlib.metadata

    from fedproto.config.run_config import RunConfig, config_model

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [_EntryPoint()] if group ==
                        plugins.GROUP else [])
    monkeypatch.delenv(plugins.NO_ENTRY_POINTS, raising=False)  # as in a user's process
    with plugins.scope():  # the library's scope: the installed package is not loaded
        assert plugins.algorithm_names() == list(plugins.BUILTIN) and config_model() is RunConfig
        with plugins.scope(entry_points=True):  # a user's process: it is
            assert plugins.algorithm_names() == [*plugins.BUILTIN, "installedproto"]
            assert "installed_x" in config_model().model_fields
        assert plugins.algorithm_names() == list(plugins.BUILTIN) and config_model() is RunConfig


class MeanMetricProto(FedProto):
    """FedProto whose server step reports a round metric whose name ends in ``_mean``."""

    name = "meanmetric"

    def aggregate(self, round, messages, state=None):
        out = super().aggregate(round, messages, state)
        out.metrics["spread_mean"] = 1.5  # a method's own number, not an accuracy
        return out


def test_a_plugin_metric_ending_in_mean_is_not_taken_for_an_accuracy(tmp_path):
    register_algorithm(MeanMetricProto)
    try:
        cfg = build_config(overrides={**SMALL, "algorithm": "meanmetric"})
        Simulation(cfg, out=tmp_path / "run").run()
    finally:
        plugins.unregister("meanmetric")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["spread_mean"] for r in rows] == [1.5, 1.5, 1.5]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert list(summary["accuracy"]) == ["acc", "acc_proto"]  # the evaluated keys, nothing else
    assert summary["accuracy"]["acc"]["mean"] == rows[-1]["acc_mean"]


class HandCE(LossTerm):
    """Cross-entropy written out by hand (a method's own classification loss, weighted batch mean)."""

    per_sample = True

    def __call__(self, logits, h, y, w):
        nll = -torch.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        return (nll * w).sum(-1) / w.sum(-1).clamp_min(1.0)


class NoHeadLossProto(FedProto):
    """A prototype-as-classifier method's client: no classification loss, only λ's prototype term."""

    name = "noheadloss"

    def objective(self, state, message):
        obj = super().objective(state, message)
        obj.classification = None
        return obj

    def aggregate(self, round, messages, state=None):
        out = super().aggregate(round, messages, state)
        out.metrics["draw"] = float(self.generator(round).random())  # the run's seeded generator
        return out


class HandCEProto(FedProto):
    """FedProto whose classification loss is its own term (the same cross-entropy, written out)."""

    name = "handce"

    def objective(self, state, message):
        obj = super().objective(state, message)
        obj.classification = HandCE()
        return obj


def test_a_plugin_can_replace_the_classification_loss(tmp_path):
    def run(algorithm, execution):
        cfg = build_config(overrides={**SMALL, "algorithm": algorithm, "execution": execution, "rounds": 2})
        out = tmp_path / f"{algorithm}-{execution}"
        sim = Simulation(cfg, out=out)
        heads = [{k: v.clone() for k, v in s.model.named_parameters() if s.model.is_head_param(k)}
                 for s in sim.setup.states]
        sim.run()
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return sim, heads, rows

    register_algorithm(NoHeadLossProto)
    register_algorithm(HandCEProto)
    try:
        ref = {e: run("fedproto", e)[2] for e in ("sequential", "batched")}
        for execution in ("sequential", "batched"):
            sim, heads, rows = run("noheadloss", execution)
            assert sim.setup.algorithm.seed == 1234  # the run's seed, for the method's own draws
            # switched off: loss_ce reads 0 (not ln 10), the head gets no gradient, the body trains on λ's term
            assert [r["loss_ce"] for r in rows] == [0.0, 0.0], execution
            assert rows[1]["loss_proto"] > 0 and rows[0]["loss_proto"] == 0.0
            for s, head in zip(sim.setup.states, heads):
                assert head and all(torch.equal(p, head[k]) for k, p in s.model.named_parameters() if k in head)
            assert [r["draw"] for r in rows] == [np.random.default_rng([1234, r]).random() for r in (1, 2)]
            # replaced: the method's own term is what trains and what loss_ce reports
            _, _, own = run("handce", execution)
            for a, b in zip(own, ref[execution]):
                assert a["loss_ce"] == pytest.approx(b["loss_ce"], rel=1e-5) and a["loss_ce"] > 0.1, execution
            assert own[-1]["acc_mean"] == pytest.approx(ref[execution][-1]["acc_mean"], abs=0.02)
    finally:
        plugins.unregister("noheadloss")
        plugins.unregister("handce")


class NoLossAvg(FedProto):
    """A plug-in whose objective has no loss at all: no classification loss and no term."""

    name = "nolossavg"

    def objective(self, state, message):
        obj = super().objective(state, message)
        obj.classification, obj.terms = None, ()
        return obj


class StrLossProto(FedProto):
    """A plug-in that puts a name where a LossTerm belongs."""

    name = "strloss"

    def objective(self, state, message):
        obj = super().objective(state, message)
        obj.classification = "cross_entropy"
        return obj


@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_an_objective_with_no_loss_is_said_and_a_bad_term_refused_on_every_path(execution, caplog):
    """A breaker's plug-ins: one switched every loss off (it trained nothing and reported a normal
    run: now said once), one gave a string as the classification loss (a different raw error on
    each path: now one ConfigError naming the method and the value)."""
    from fedproto.errors import ConfigError

    for plugin in (NoLossAvg, StrLossProto):
        register_algorithm(plugin)
    try:
        cfg = build_config(overrides={**SMALL, "algorithm": "strloss", "execution": execution, "rounds": 1})
        with pytest.raises(ConfigError, match=r"method 'strloss': Objective.classification must be a LossTerm or "
                                              r"None, got 'cross_entropy' \(str\)"):
            Simulation(cfg, out=False).run()
        cfg = build_config(overrides={**SMALL, "algorithm": "nolossavg", "execution": execution, "rounds": 2})
        sim = Simulation(cfg, out=False)
        before = [torch.cat([p.flatten() for p in s.model.parameters()]).clone() for s in sim.setup.states]
        with caplog.at_level("WARNING"):
            sim.run()
        assert caplog.text.count("objective has no loss this round") == 1
        for s, b in zip(sim.setup.states, before):
            assert torch.equal(torch.cat([p.flatten() for p in s.model.parameters()]), b)  # indeed untrained
    finally:
        plugins.unregister("nolossavg")
        plugins.unregister("strloss")


def test_the_fednh_example_plugin_learns_on_every_executor(monkeypatch, tmp_path):
    """examples/fednh (FedNH as a plug-in package: server prototypes on the unit sphere as the
    classifier, cosine logits through Objective.classification): a few rounds on digits, the same
    numbers on the sequential and the batched path, its options run options."""
    from pathlib import Path

    from fedproto.config.run_config import config_model

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples" / "fednh"))
    from fedproto_fednh import FedNH, sphere_prototypes

    p = sphere_prototypes(np.random.default_rng(0), 10, 50)
    assert p.shape == (10, 50) and np.allclose(np.linalg.norm(p, axis=1), 1.0, atol=1e-6)
    register_algorithm(FedNH)
    try:
        assert config_model().model_fields["fednh_smoothing"].default == 0.9
        runs = {}
        for execution in ("sequential", "batched"):
            cfg = build_config(overrides={**SMALL, "algorithm": "fednh", "execution": execution, "rounds": 4})
            summary = Simulation(cfg, out=tmp_path / execution).run()
            rows = [json.loads(line) for line in (tmp_path / execution / "metrics.jsonl").read_text().splitlines()]
            runs[execution] = summary["accuracy"]["acc"]["mean"], [r["loss_ce"] for r in rows]
            assert all(0 < r["proto_shift"] < 0.1 for r in rows)  # smoothed: the prototypes move a little
    finally:
        plugins.unregister("fednh")
    (acc, losses), (acc_b, losses_b) = runs["sequential"], runs["batched"]
    assert acc > 0.8 and acc == pytest.approx(acc_b, abs=1e-9)
    assert losses == pytest.approx(losses_b, rel=1e-5) and losses[-1] < losses[0] / 2  # its cosine CE is loss_ce


def test_a_builtin_reads_its_options_object_one_way():
    """Issue 43, item 2: a built-in's options reach it through ``self.options`` only: the default
    ``from_config`` fills it from the run config, a direct constructor builds it from its keywords
    and the options model checks them (no second, hand-written range check)."""
    from fedproto.algorithms import FedGH, FedProto, FedProx, FedRep, get_algorithm
    from fedproto.algorithms.method_options import FedProxOptions
    from fedproto.training import OptimConfig

    alg = FedProx(10, OptimConfig(), prox_mu=0.25)
    assert isinstance(alg.options, FedProxOptions) and alg.prox_mu == 0.25
    for make, name in ((lambda: FedProx(10, OptimConfig(), prox_mu=-1.0), "prox_mu"),
                       (lambda: FedRep(10, OptimConfig(), rep_head_epochs=0), "rep_head_epochs"),
                       (lambda: FedGH(10, OptimConfig(), server_lr=0.0), "server_lr"),
                       (lambda: FedProto(10, OptimConfig(), trim=0.5), "trim")):
        with pytest.raises(ValueError, match=f"^{name}="):
            make()
    for method in ("fedprox", "fedper", "fedrep", "fesem", "fd", "fedgh"):
        assert "from_config" not in vars(get_algorithm(method)), method


def test_secure_aggregation_asks_the_method_what_it_sums():
    """secagg's codec reads ``Algorithm.secure_sum`` (no list of names); a subclass with a server
    step of its own sums nothing."""
    from fedproto.algorithms import FedAvg, FedProto, FedProx, FedTGP, LGFedAvg
    from fedproto.secagg.codec import secure_sum_of
    from fedproto.training import OptimConfig

    class OwnStep(FedAvg):
        name = "ownstep"

        def aggregate(self, round, messages, state=None):
            return super().aggregate(round, messages, state)

    methods = (FedProto, FedTGP, FedAvg, FedProx, LGFedAvg, OwnStep)
    got = {c.__name__: secure_sum_of(c(10, OptimConfig())) for c in methods}
    assert got == {"FedProto": "prototypes", "FedTGP": None, "FedAvg": "weights", "FedProx": "weights",
                   "LGFedAvg": None, "OwnStep": None}
