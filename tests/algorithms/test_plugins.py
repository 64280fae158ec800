"""Algorithm plug-ins: a prototype method defined here, with its own option and its own
loss term, registered without any library file changed for it, runs through ``fedproto run``
(flag and TOML key), ``federate``, the batched executor and the Flower app."""

from __future__ import annotations

import json
from typing import Optional

import pytest
import torch
from conftest import flat_weights, float64_sim, run_cli
from pydantic import BaseModel, ConfigDict, Field

from fedproto import plugins
from fedproto.algorithms import FedProto, get_algorithm, register_algorithm
from fedproto.config.run_config import RunConfig, build_config, config_model
from fedproto.errors import ConfigError
from fedproto.prototypes import prototype_table
from fedproto.simulation import Simulation
from fedproto.training import LossTerm

SMALL = dict(dataset="digits", clients=4, ways=3, shots=20, stdev=1, test_shots=10, rounds=3, eval_every=0,
             lr=0.05, threads=1)


class CenterOptions(plugins.AlgorithmOptions):
    center_weight: float = Field(0.5, ge=0.0, le=100.0, description="Weight of the pull toward the global prototype")


class CenterTerm(LossTerm):
    """weight x squared L2 distance of each embedding to its class's global prototype (no mean over d:
    not FedProto's mse), for samples whose class has one."""

    def __init__(self, weight: float, table: torch.Tensor, mask: torch.Tensor):
        self.weight, self.table, self.mask = weight, table, mask

    def __call__(self, logits, h, y, w):
        per = ((h - self.table.to(h.dtype)[y]) ** 2).sum(-1) * self.mask[y].to(h.dtype)
        return self.weight * (per * w).sum(-1) / w.sum(-1).clamp_min(1.0)


class CenterProto(FedProto):
    """FedProto's messages and server, plus :class:`CenterTerm` in the client's loss."""

    name = "centerproto"
    Options = CenterOptions

    def objective(self, state, message):
        obj = super().objective(state, message)
        if "protos" not in message or not len(message["classes"]) or self.options.center_weight == 0:
            return obj
        table, mask = prototype_table(message["classes"], message["protos"], self.num_classes,
                                      message["protos"].shape[1])
        obj.terms = (*obj.terms, CenterTerm(self.options.center_weight, table, mask),)
        return obj


@pytest.fixture
def centerproto():
    register_algorithm(CenterProto)
    yield CenterProto
    plugins.unregister("centerproto")


def test_a_registered_algorithm_gets_its_option_and_leaves_again(centerproto):
    cfg = build_config(overrides={**SMALL, "algorithm": "centerproto", "center_weight": 0.25})
    assert cfg.center_weight == 0.25 and isinstance(cfg, config_model())
    assert get_algorithm("centerproto") is CenterProto
    with pytest.raises(ConfigError, match=r"center_weight.*less than or equal to 100"):
        build_config(overrides={**SMALL, "algorithm": "centerproto", "center_weight": 1000.0})
    with pytest.raises(ConfigError, match="unknown option 'centre_weight'; did you mean 'center_weight'"):
        build_config(overrides={**SMALL, "algorithm": "centerproto", "centre_weight": 0.25})  # a plug-in's too
    # another algorithm's run ignores it, and says so only when it is set
    assert "center_weight" not in build_config(overrides=SMALL).result_fields()
    assert "center_weight" in cfg.result_fields() and "center_weight0.25" in cfg.run_name()
    plugins.unregister("centerproto")
    with pytest.raises(ConfigError, match="unknown algorithm 'centerproto'"):
        build_config(overrides={**SMALL, "algorithm": "centerproto"})
    with pytest.raises(ConfigError, match="unknown option 'center_weight'"):
        build_config(overrides={**SMALL, "center_weight": 0.25})


def test_plugins_cannot_take_a_builtin_name_or_an_existing_option():
    class Clash(FedProto):
        name = "clash"

        class Options(plugins.AlgorithmOptions):
            lr: float = 0.1

    class Builtin(FedProto):
        name = "fedavg"

    with pytest.raises(ConfigError, match="one of fedproto's own methods"):
        register_algorithm(Builtin)
    with pytest.raises(ConfigError, match="algorithm 'clash' declares the option 'lr', which is a fedproto option"):
        register_algorithm(Clash)
    assert "clash" not in plugins.PLUGINS and config_model() is RunConfig


def _plugin(name: str, options: object = None) -> type:
    attrs = {"name": name} if options is None else {"name": name, "Options": options}
    return type(f"P_{name}", (FedProto,), attrs)


class _Own(plugins.AlgorithmOptions):
    own_x: float = Field(1.0, description="x")


class _Loose(plugins.AlgorithmOptions):
    model_config = ConfigDict(extra="allow")
    loose_x: float = Field(1.0, description="x")


class _Plain(BaseModel):
    plain_x: float = Field(1.0, description="x")


class _NoDefault(plugins.AlgorithmOptions):
    need_x: float = Field(description="x")


class _BadDefault(plugins.AlgorithmOptions):
    weird_weight: float = Field("notafloat", description="x")  # pydantic does not check defaults itself


class _ProxClash(plugins.AlgorithmOptions):
    prox_mu: float = Field(0.1, description="x")


def _named_option(name: str) -> type:
    return type("NamedOptions", (plugins.AlgorithmOptions,),
                {"__annotations__": {name: float}, name: Field(0.5, description="x")})


@pytest.mark.parametrize("cls, match", [
    (_plugin("nodef", _NoDefault), "option 'need_x' of algorithm 'nodef' has no default"),
    (_plugin("baddef", _BadDefault), "option 'weird_weight' of algorithm 'baddef' has the default 'notafloat': "
                                     "Input should be a valid number"),
    # these were accepted and then: --config took the TOML file's place, lambda set lambda_proto, round-timeout
    # was the Flower server's, --quiet / --resume stopped `fedproto run` with a usage error
    (_plugin("pconfig", _named_option("config")), r"option 'config', which is a flag of fedproto run \(--config\)"),
    (_plugin("presume", _named_option("resume")), r"option 'resume', which is a flag of fedproto run"),
    (_plugin("plambda", _named_option("lambda")), "option 'lambda', which is another spelling of fedproto's option "
                                                  "'lambda_proto'"),
    (_plugin("ptimeout", _named_option("round_timeout")), "option 'round_timeout', which is a key of the Flower run"),
    (_plugin("pnoaug", _named_option("no_augment")), "option 'no_augment', which is the off switch of fedproto's "
                                                     r"option 'augment' \(--no-augment\)"),
    (_plugin("proxclash", _ProxClash), "algorithm 'proxclash' declares the option 'prox_mu', which is a fedproto"),
    (_plugin("loose", _Loose), r"loose.Options sets model_config extra='allow'.*extra='forbid'"),
    (_plugin("plain", _Plain), "plain.Options is .*_Plain.*must be a fedproto.plugins.AlgorithmOptions subclass"),
    (_plugin("dc", dict), "dc.Options is <class 'dict'>: it must be"),
    (_plugin("My Algo"), "algorithm name 'My Algo' must be lowercase letters.*e.g. 'my_algo'"),
    (_plugin("2fast"), "algorithm name '2fast' must be lowercase"),
])
def test_options_that_would_break_every_run_are_refused_at_registration(cls, match):
    """Each of these was accepted and then made every run (of any algorithm) fail, or (extra=allow)
    accept misspelt options silently: a required field, a name clash, a config override."""
    with pytest.raises(ConfigError, match=match):
        register_algorithm(cls)
    assert cls.name not in plugins.PLUGINS
    assert build_config(overrides={**SMALL, "algorithm": "fedprox"}).prox_mu == 0.01
    with pytest.raises(ConfigError, match="unknown option 'lrr'"):
        build_config(overrides={**SMALL, "lrr": 0.1})


def test_two_plugins_cannot_declare_one_option_but_one_can_be_registered_again():
    first, second = _plugin("ownone", _Own), _plugin("owntwo", _Own)
    register_algorithm(first)
    try:
        with pytest.raises(ConfigError, match="'owntwo' declares the option 'own_x', which algorithm 'ownone'"):
            register_algorithm(second)
        register_algorithm(first)  # a notebook cell run again
        assert build_config(overrides={**SMALL, "algorithm": "ownone", "own_x": 2.0}).own_x == 2.0
    finally:
        plugins.unregister("ownone")


def test_a_subclass_of_a_library_method_shares_its_options():
    """``class MyProto(FedProto): name = "myproto"`` inherits FedProto's options: they were taken
    for a clash with themselves and broke every run; now it runs with FedProto's numbers, and takes
    lambda_proto (two such plug-ins at once too)."""
    register_algorithm(_plugin("myproto"))
    register_algorithm(_plugin("myproto2"))
    try:
        cfg = build_config(overrides={**SMALL, "rounds": 2, "algorithm": "myproto", "lambda_proto": 0.5})
        assert cfg.lambda_proto == 0.5 and "lambda_proto" in cfg.result_fields() and "lambda0.5" in cfg.run_name()
        assert build_config(overrides={**SMALL, "algorithm": "myproto2"}).algorithm == "myproto2"
        mine = Simulation(cfg, out=False).run()
        ref = Simulation(build_config(overrides={**SMALL, "rounds": 2, "lambda_proto": 0.5}), out=False).run()
        assert mine["algorithm"] == "myproto"
        assert mine["accuracy"]["acc"]["mean"] == ref["accuracy"]["acc"]["mean"]
    finally:
        plugins.unregister("myproto")
        plugins.unregister("myproto2")


def test_a_plugin_that_fails_to_load_is_skipped_with_a_warning(monkeypatch, caplog):
    class EP:
        def __init__(self, name, load):
            self.name, self.value, self.load = name, f"pkg.{name}:X", load

    def broken():
        raise ImportError("No module named 'pkg'")

    eps = [EP("broken", broken), EP("clash", lambda: _plugin("clash", _ProxClash)), EP("fine", lambda: _plugin("fine"))]
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: eps if group == plugins.GROUP else [])
    monkeypatch.setattr(plugins, "_loaded", False)
    monkeypatch.setattr(plugins, "BROKEN", {})
    monkeypatch.delenv(plugins.NO_ENTRY_POINTS, raising=False)  # this test is about loading installed plug-ins
    try:
        with caplog.at_level("WARNING", logger="fedproto.plugins"):
            names = plugins.algorithm_names()
        assert "fine" in names and "broken" not in names and "clash" not in names
        assert "'broken' (pkg.broken:X) could not be loaded: ImportError: No module named 'pkg'" in caplog.text
        assert "'clash' (pkg.clash:X) could not be loaded: ConfigError: algorithm 'clash' declares the option " \
               "'prox_mu'" in caplog.text
        assert build_config(overrides={**SMALL, "algorithm": "fedprox"}).prox_mu == 0.01
        # asked for by name: not "unknown algorithm" but what went wrong (it was called unknown)
        for ask in (lambda: build_config(overrides={**SMALL, "algorithm": "broken"}), lambda: get_algorithm("broken")):
            with pytest.raises(ConfigError, match=r"algorithm 'broken' is an installed plug-in that could not be "
                                                  r"loaded \(pkg.broken:X: ImportError: No module named 'pkg'\)") as e:
                ask()
            assert "fix or reinstall the package that declares it" in e.value.hint
        with pytest.raises(ConfigError, match=r"unknown algorithm 'brokn'"):
            build_config(overrides={**SMALL, "algorithm": "brokn"})
        with pytest.raises(ConfigError, match=r"unknown algorithm 'fedprot'; did you mean 'fedproto'\? choose one"):
            build_config(overrides={**SMALL, "algorithm": "fedprot"})
    finally:
        plugins.unregister("fine")


def test_its_loss_term_trains_alike_sequential_and_batched_float64(centerproto):
    """The batched executor (PaperCNN's grouped path) runs the plug-in's own term: float64 weights
    equal to the sequential reference's; the term acts (weight 0 gives other weights)."""
    runs = {}
    for mode, weight in (("sequential", 0.5), ("batched", 0.5), ("sequential", 0.0)):
        cfg = build_config(overrides={**SMALL, "algorithm": "centerproto", "center_weight": weight, "execution": mode})
        sim = float64_sim(cfg)
        sim.run()
        runs[mode, weight] = (flat_weights(sim), sim.history)
    (seq, hs), (bat, hb), (off, _) = runs["sequential", 0.5], runs["batched", 0.5], runs["sequential", 0.0]
    assert max(float((a - b).abs().max()) for a, b in zip(seq, bat)) < 1e-9
    assert min(float((a - b).abs().max()) for a, b in zip(seq, off)) > 1e-4
    assert [r["loss_ce"] for r in hs] == pytest.approx([r["loss_ce"] for r in hb], rel=1e-9)
    # the term is reported (metrics.jsonl: loss_terms) from round 2 on, once global prototypes exist
    assert "loss_terms" not in hs[0] and all(r["loss_terms"] > 0 for r in hs[1:])
    assert [r["loss_terms"] for r in hs[1:]] == pytest.approx([r["loss_terms"] for r in hb[1:]], rel=1e-9)


def test_it_runs_from_the_command_line_by_flag_and_by_toml_key(centerproto, tmp_path, capsys, monkeypatch):
    code, out = run_cli(["run", "--help"], capsys, monkeypatch)
    assert code == 0 and "--center-weight" in out and "Algorithm plug-ins" in out
    flags = ["--dataset", "digits", "--clients", "4", "--ways", "3", "--shots", "20", "--stdev", "1",
             "--test-shots", "10", "--rounds", "2", "--threads", "1", "--algorithm", "centerproto", "-q"]
    code, out = run_cli(["run", *flags, "--center-weight", "0.3", "--out-dir", str(tmp_path / "a"), "--name", "a"],
                        capsys, monkeypatch)
    assert code == 0, out
    assert json.loads((tmp_path / "a" / "a" / "config.json").read_text())["center_weight"] == 0.3
    toml = tmp_path / "run.toml"
    toml.write_text('algorithm = "centerproto"\ncenter_weight = 0.3\n')
    flags = [f for f in flags if f not in ("--algorithm", "centerproto")]
    code, out = run_cli(["run", "--config", str(toml), *flags, "--out-dir", str(tmp_path / "b"), "--name", "b"],
                        capsys, monkeypatch)
    assert code == 0, out
    a = json.loads((tmp_path / "a" / "a" / "summary.json").read_text())
    b = json.loads((tmp_path / "b" / "b" / "summary.json").read_text())
    assert a["algorithm"] == b["algorithm"] == "centerproto" and a["accuracy"] == b["accuracy"]
    toml.write_text('algorithm = "centerproto"\ncenter_weight = -1.0\n')
    code, out = run_cli(["run", "--config", str(toml), *flags], capsys, monkeypatch)
    assert code == 2 and "center_weight = -1.0 in" in out and "greater than or equal to 0" in out


def test_it_runs_with_your_own_clients_through_federate(centerproto):
    from conftest import client_splits, digits_fewshot

    from fedproto.federation import Client, federate
    from fedproto.models.cnn import PaperCNN

    clients = [Client(model=PaperCNN(1, 10, input_size=8), train=train, test=test)
               for train, test in client_splits(*digits_fewshot(stdev=1))]
    runs = [federate(clients, 10, out=False, algorithm="centerproto", rounds=2, center_weight=w, threads=1).run()
            for w in (0.0, 2.0)]
    assert all(r["algorithm"] == "centerproto" for r in runs)
    assert runs[0]["accuracy"] != runs[1]["accuracy"]  # the option reached the clients' loss


@pytest.mark.flower
def test_it_runs_on_the_flower_app_with_the_simulators_numbers(centerproto, monkeypatch, tmp_path):
    pytest.importorskip("flwr")
    from flower_helpers import LocalGrid, _user_config
    from flwr.supercore.task_identity import TaskIdentity

    for k, v in {"_run_id": 1, "_node_id": 0, "_task_id": 0}.items():  # as flower_helpers.flower_process
        monkeypatch.setattr(TaskIdentity, k, v)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    from fedproto.flower.records import run_config
    from fedproto.flower.server_app import FlowerEngine
    from fedproto.simulation import Simulation

    opts = {"algorithm": "centerproto", "center_weight": 0.5}
    want = Simulation(build_config(overrides={**SMALL, **opts, "execution": "sequential", "model": "cnn"}),
                      out=False).run()
    uc = {**_user_config(**opts), "rounds": SMALL["rounds"]}
    got = FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2, 3]), out=False).run()
    for key in want["accuracy"]:
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)


class PerSampleTerm(LossTerm):
    """Forgets the batch mean: one value per sample."""

    def __call__(self, logits, h, y, w):
        return 1e-3 * (h ** 2).sum(-1)


class AllMeanTerm(LossTerm):
    """One mean over everything: right for one client, mixes a batched group's clients."""

    def __call__(self, logits, h, y, w):
        return 1e-3 * (h ** 2).sum(-1).mean()


@pytest.mark.parametrize("term, mode, want", [
    (PerSampleTerm, "sequential", r"PerSampleTerm returned shape \(8,\) .*must return shape \(\)"),
    (PerSampleTerm, "batched", r"PerSampleTerm returned shape \(4, 8\) .*must return shape \(4,\)"),
    (AllMeanTerm, "batched", r"AllMeanTerm returned shape \(\) .*must return shape \(4,\)"),
])
def test_a_loss_term_of_the_wrong_shape_is_named(term, mode, want):
    """Was a bare torch error (sequential: 'grad can be implicitly created only for scalar outputs')
    or, for a scalar on the batched path, silently accepted."""
    class WrongTerm(FedProto):
        name = "wrongterm"

        def objective(self, state, message):
            obj = super().objective(state, message)
            obj.terms = (*obj.terms, term(),)
            return obj

    register_algorithm(WrongTerm)
    try:
        cfg = build_config(overrides={**SMALL, "rounds": 1, "algorithm": "wrongterm", "execution": mode})
        with pytest.raises(ValueError, match=want):
            Simulation(cfg, out=False).run()
    finally:
        plugins.unregister("wrongterm")


def test_the_run_commands_own_parameters_are_the_reserved_names():
    """plugins.CLI_NAMES must list every `fedproto run` parameter that is no run option."""
    from fedproto.cli.app import run_command

    own = {p.name for p in run_command().params} - set(RunConfig.model_fields)
    assert own | {"help"} == set(plugins.CLI_NAMES)  # --help: click adds it to every command


def test_a_plugin_with_hooks_of_the_old_server_api_is_refused_at_registration():
    """An aggregate returning its message alone beside round_metrics/server_state_keys would lose
    its metrics and checkpoint: refused when registered, before any run folder exists."""

    class OldServer(FedProto):
        name = "oldserver"
        server_state_keys = ("head",)

        def round_metrics(self):
            return {}

    with pytest.raises(ConfigError, match="'oldserver' defines round_metrics, server_state_keys, which fedproto "
                                          "no longer reads"):
        register_algorithm(OldServer)
    assert "oldserver" not in plugins.PLUGINS


def _proto_options(annotation: object, default: object, **bounds: object) -> type:
    """A FedProto subclass's Options that redeclares the inherited lambda_proto."""
    from fedproto.algorithms.method_options import FedProtoOptions

    return type("ProtoOptions", (FedProtoOptions,), {"__annotations__": {"lambda_proto": annotation},
                                                     "lambda_proto": Field(default, **bounds)})


@pytest.mark.parametrize("options, match", [
    (_proto_options(Optional[float], -3.0, ge=0), "option 'lambda_proto' of algorithm 'redecl' has the default -3.0: "
                                                  "Input should be greater than or equal to 0; fix its Field default"),
    (_proto_options(Optional[float], "big"), "option 'lambda_proto' of algorithm 'redecl' has the default 'big': "
                                             "Input should be a valid number"),
    (_proto_options(int, 3), r"algorithm 'redecl' redeclares the option 'lambda_proto' as int, but FedProtoOptions "
                             r"declares it as Optional\[float\].*keep its type: lambda_proto: Optional\[float\]"),
])
def test_an_inherited_option_redeclared_with_a_broken_default_or_another_type_is_refused(options, match):
    """These were accepted and then blamed the user for a flag never typed (--lambda-proto -3.0), or
    failed at set-up with a raw pydantic ValidationError (lambda_proto=0.5 for an int)."""
    cls = type("Redecl", (FedProto,), {"name": "redecl", "Options": options})
    with pytest.raises(ConfigError, match=match):
        register_algorithm(cls)
    assert "redecl" not in plugins.PLUGINS
    ok = type("Redecl", (FedProto,), {"name": "redecl", "Options": _proto_options(Optional[float], 3.0, ge=0)})
    register_algorithm(ok)  # a new default within the bounds, same type: accepted
    plugins.unregister("redecl")


def test_an_option_whose_bounds_a_plugin_narrows_is_refused_as_a_config_error():
    """A FedProto subclass with lambda_proto >= 1: a run value of 0.5 was a raw pydantic ValidationError
    from set-up; now a ConfigError naming the option, the value, the algorithm and the fix."""
    from fedproto.engine.setup import build_algorithm

    register_algorithm(type("Narrow", (FedProto,), {"name": "narrow", "Options": _proto_options(Optional[float], 3.0,
                                                                                                 ge=1)}))
    try:
        cfg = build_config(overrides={**SMALL, "algorithm": "narrow", "lambda_proto": 0.5})
        with pytest.raises(ConfigError) as e:
            build_algorithm(cfg, 8)
        assert str(e.value) == ("lambda_proto=0.5: algorithm 'narrow' (its Options narrow 'lambda_proto') refuses it: "
                                "Input should be greater than or equal to 1; use lambda_proto=1 or more")
    finally:
        plugins.unregister("narrow")
