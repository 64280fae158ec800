"""A method's client hooks and the run's NaN policy are the same on every executor and front end:
sequential, batched, worker processes (float64) and Flower's ClientApp (:class:`LocalGrid` from
tests/flower/flower_helpers.py: the real ClientApp in this process)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower

from conftest import float64_sim  # noqa: E402
from flower_helpers import LocalGrid, flower_process  # noqa: E402  (the Flower tests' grid)

from fedproto import plugins  # noqa: E402
from fedproto.algorithms import FedProto, register_algorithm  # noqa: E402
from fedproto.config.run_config import build_config  # noqa: E402
from fedproto.engine.loop import Observer  # noqa: E402
from fedproto.errors import TrainingError  # noqa: E402
from fedproto.flower.records import run_config  # noqa: E402
from fedproto.flower.server_app import FlowerEngine  # noqa: E402
from fedproto.simulation import Simulation  # noqa: E402
from fedproto.training import LossTerm  # noqa: E402


@pytest.fixture(autouse=True)
def _flower_process(tmp_path, monkeypatch):
    """The ServerApp process's task identity and a node-state cache of this test's own
    (:func:`flower_helpers.flower_process`)."""
    yield from flower_process(tmp_path, monkeypatch)


BASE = dict(dataset="digits", clients=4, ways=3, shots=20, stdev=1, test_shots=10, rounds=2, model="cnn",
            eval_every=0, lr=0.05, threads=1)
ROUND_HOOKS = ("prepare", "objective", "local_objective", "plan", "finish")


class Shrink(LossTerm):
    """0.01 x the weighted batch mean of each embedding's mean square (module level: it is pickled)."""

    def __call__(self, logits, h, y, w):
        return 0.01 * ((h**2).mean(-1) * w).sum(-1) / w.sum(-1).clamp_min(1.0)


class NaNTerm(LossTerm):
    """A loss term that is NaN: the client's training diverges in its first step."""

    def __call__(self, logits, h, y, w):
        return (h[..., 0] * w).sum(-1) * float("nan")


class EveryHook(FedProto):
    """Overrides every client hook but the whole step: each one counts its calls in the client's
    state and changes what the client does (a loss term, halved prototypes, an extra score)."""

    name = "everyhook"

    @staticmethod
    def _count(state, hook):
        state.extra[f"n_{hook}"] = int(state.extra.get(f"n_{hook}", 0)) + 1

    def join_message(self, state):
        return dict(super().join_message(state))

    def prepare(self, state, message):
        self._count(state, "prepare")
        super().prepare(state, message)

    def objective(self, state, message):
        self._count(state, "objective")
        obj = super().objective(state, message)
        obj.terms = (*obj.terms, Shrink(),)
        return obj

    def local_objective(self, state, message):
        self._count(state, "local_objective")
        return super().local_objective(state, message)

    def plan(self, state, obj, n, rng):
        self._count(state, "plan")
        return super().plan(state, obj, n, rng)

    def finish(self, state, message, data, result):
        self._count(state, "finish")
        out = super().finish(state, message, data, result)
        return {**out, "protos": out["protos"] * 0.5}

    def evaluate(self, state, message, data):
        self._count(state, "evaluate")
        out = super().evaluate(state, message, data)
        return {**out, "acc_half": out["acc"] / 2}

    def client_report(self, state):
        return {k: float(v) for k, v in state.extra.items() if k.startswith("n_")}


class EveryHookStep(EveryHook):
    """:class:`EveryHook` that also replaces the whole client step (``client_update``)."""

    name = "everyhookstep"

    def client_update(self, state, message, data, round, rng, opt=None):
        self._count(state, "client_update")
        return super().client_update(state, message, data, round, rng, opt=opt)


class DivergingProto(FedProto):
    """FedProto whose clients add a NaN loss term."""

    name = "divergingproto"

    def objective(self, state, message):
        obj = super().objective(state, message)
        obj.terms = (*obj.terms, NaNTerm(),)
        return obj


class Keep(Observer):
    """A user's observer: keeps the final summary and per-client rows."""

    def finish(self, loop, summary, per_client):
        self.summary, self.per_client = summary, per_client


@pytest.fixture
def hook_plugins(monkeypatch):
    """The plug-ins registered; this folder on the worker processes' path (they import the plug-in's
    module to unpickle its loss term, as they would import an installed plug-in package), and the
    folders of what that module imports (tests/conftest.py, tests/flower/flower_helpers.py)."""
    here = Path(__file__).resolve().parent
    paths = (str(here), str(here.parent), str(here.parent / "flower"), os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    for cls in (EveryHook, EveryHookStep, DivergingProto):
        register_algorithm(cls)
    yield
    for cls in (EveryHook, EveryHookStep, DivergingProto):
        plugins.unregister(cls.name)


def _flower(over: dict, keep: Observer, out=False) -> FlowerEngine:
    uc = {k.replace("_", "-"): v for k, v in {**BASE, **over}.items()}
    return FlowerEngine(run_config(uc), LocalGrid(uc, [2, 0, 3, 1]), out=out, observers=[keep])


@pytest.mark.parametrize("algorithm", ["everyhook", "everyhookstep"])
def test_a_plugin_overriding_each_client_hook_runs_identically_on_every_executor(hook_plugins, algorithm, caplog):
    rounds, step = BASE["rounds"], algorithm == "everyhookstep"
    want_counts = {f"n_{h}": float(rounds) for h in ROUND_HOOKS} | {"n_evaluate": 1.0}
    if step:
        want_counts["n_client_update"] = float(rounds)
    runs = {}
    for name, over in (("sequential", {"execution": "sequential"}), ("batched", {"execution": "batched"}),
                       ("workers", {"execution": "batched", "workers": 2, "threads": 2})):
        keep = Keep()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fedproto"):
            sim = float64_sim(build_config(overrides={**BASE, **over, "algorithm": algorithm}), observers=[keep])
            sim.run()
        said = [r.getMessage() for r in caplog.records if "overrides client_update" in r.getMessage()]
        # the whole-step override sends every client down the one path that runs it, said once
        assert len(said) == (1 if step and name != "sequential" else 0), said
        runs[name] = (sim, keep)
    ref, ref_keep = runs["sequential"]
    for row in ref_keep.per_client:
        assert {k: v for k, v in row.items() if k.startswith("n_")} == want_counts
    assert ref.history[-1]["loss_terms"] > 0  # the term acted
    for name in ("batched", "workers"):
        sim, keep = runs[name]
        for a, b in zip(sim.history, ref.history):
            for k in ("loss_ce", "loss_proto", "loss_terms"):
                assert a[k] == pytest.approx(b[k], abs=1e-9), (name, k)
        for a, b in zip(keep.per_client, ref_keep.per_client):
            assert set(a) == set(b)
            for k in b:
                assert a[k] == pytest.approx(b[k], abs=1e-9, nan_ok=True), (name, k)
        np.testing.assert_allclose(sim.message["protos"], ref.message["protos"], atol=1e-9)
    # Flower's ClientApp (float32, as a node trains) against the sequential simulator in float32
    keep32 = Keep()
    ref32 = Simulation(build_config(overrides={**BASE, "execution": "sequential", "algorithm": algorithm}),
                       out=False, observers=[keep32])
    ref32.run()
    keep_fl = Keep()
    eng = _flower({"algorithm": algorithm}, keep_fl)
    eng.run()
    for a, b in zip(keep_fl.per_client, keep32.per_client):
        assert {k: v for k, v in a.items() if k.startswith("n_")} == want_counts
        for k in ("acc", "acc_proto", "acc_half"):
            assert a[k] == pytest.approx(b[k], abs=1e-9), k
    for a, b in zip(eng.history, ref32.history):
        assert a["loss_ce"] == pytest.approx(b["loss_ce"], rel=1e-6)
        assert a["loss_terms"] == pytest.approx(b["loss_terms"], rel=1e-5)


def test_flower_and_simulator_share_the_nan_policy(hook_plugins, tmp_path):
    over = {"algorithm": "divergingproto"}
    with pytest.raises(TrainingError) as sim_err:
        Simulation(build_config(overrides={**BASE, **over}), out=tmp_path / "sim").run()
    with pytest.raises(TrainingError) as fl_err:
        _flower(over, Keep(), out=tmp_path / "flower").run()
    want = ("training diverged in round 1: the loss of clients [0, 1, 2, 3] is not finite; check their data first "
            "for extreme values (unscaled features, e.g. raw pixels in 0..255, or huge outliers), then lower lr "
            "(now 0.05)")
    assert str(sim_err.value).startswith(want) and str(fl_err.value) == str(sim_err.value)
    failure = json.loads((tmp_path / "flower" / "failure.json").read_text())
    assert failure["round"] == 1 and failure["error"] == "TrainingError"
    assert not (tmp_path / "sim" / "summary.json").exists() and not (tmp_path / "flower" / "summary.json").exists()


def test_a_node_of_another_message_schema_is_refused(monkeypatch):
    from fedproto.flower import client_app, common

    assert common.schema_problem(common.SCHEMA, "node") == ""
    assert "the node speaks no message schema (an older fedproto)" in common.schema_problem(None, "node")
    monkeypatch.setattr(client_app, "SCHEMA", common.SCHEMA + 1)  # the nodes run another fedproto
    uc = {k.replace("_", "-"): v for k, v in BASE.items()}
    with pytest.raises(TrainingError, match="the node speaks message schema 2, this fedproto speaks schema 1"):
        FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2, 3]), out=False, wait_s=0)
