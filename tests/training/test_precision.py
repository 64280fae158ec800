"""--precision fp32|bf16|fp16|auto (issue 45, item 1): bf16 autocast on a CPU with native bf16
instructions on every executor, the prototypes and the aggregation in float32, fp16 refused off a
GPU, and a CPU without bf16 that says so and trains in fp32."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from conftest import digits_config, flat_weights, own_digits_clients, run_cli

import fedproto.training.devices as devices
from fedproto.errors import ConfigError
from fedproto.federation import federate
from fedproto.simulation import Simulation
from fedproto.training import OptimConfig
from fedproto.training.devices import LossScale, autocast_call, cpu_bf16_capability, resolve_precision

needs_bf16 = pytest.mark.skipif(cpu_bf16_capability() is None,
                                reason="this CPU has no native bf16 instructions (avx512_bf16, amx_bf16)")


def _run(precision: str, record: list | None = None, **kw):
    """A small digits run (6 clients, 4 rounds) in ``precision``; ``record`` collects the messages
    the server aggregates (the clients' prototypes) and the global message of each round."""
    sim = Simulation(digits_config(precision=precision, **kw), out=False)
    if record is not None:
        alg = sim.setup.algorithm
        aggregate = alg.aggregate

        def recording(round, messages, state=None):
            out = aggregate(round, messages, state)
            record.append((messages, out.message))
            return out

        alg.aggregate = recording
    summary = sim.run()
    return sim, summary


def _acc(summary) -> float:
    return summary["accuracy"]["acc"]["mean"]


@needs_bf16
def test_bf16_on_cpu_gives_float32_prototypes_and_a_close_result():
    """Sent and global prototypes are float32 under bf16; the weights differ from fp32's (autocast
    ran) but stay close, and so does the accuracy."""
    rec: list = []
    s32, sum32 = _run("fp32", execution="sequential")
    s16, sum16 = _run("bf16", rec, execution="sequential")
    assert sum16["precision"] == "bf16" and sum32["precision"] == "fp32"
    assert s16.executor.config_record()["precision_in_use"] == "bf16"
    assert s16.setup.algorithm.opt.precision == "bf16"
    assert len(rec) == 4
    for messages, glob in rec:
        assert messages and all(np.asarray(m["protos"]).dtype == np.float32 for m in messages.values())
        assert np.asarray(glob["protos"]).dtype == np.float32
        assert np.isfinite(glob["protos"]).all()
    final = s16.loop.message["protos"]
    assert np.asarray(final).dtype == np.float32
    w32, w16 = flat_weights(s32), flat_weights(s16)
    assert all(p.dtype == torch.float32 for p in s16.setup.states[0].model.parameters())  # master weights
    rel = [float((a - b).norm() / a.norm()) for a, b in zip(w32, w16)]
    assert max(rel) > 1e-4  # bf16 changed the numbers: autocast was in force
    assert max(rel) < 0.1   # ... by bfloat16 rounding, not by a different computation
    assert abs(_acc(sum16) - _acc(sum32)) < 0.1


def test_fp16_on_cpu_is_refused_with_the_fix(capsys, monkeypatch):
    with pytest.raises(ConfigError, match=r"precision='fp16'.*CUDA GPUs only.*trains on cpu") as e:
        resolve_precision("fp16", "cpu")
    assert "bf16" in str(e.value.hint) and "cuda" in str(e.value.hint)
    with pytest.raises(ConfigError, match="fp16"):
        Simulation(digits_config(precision="fp16"), out=False)
    code, out = run_cli(["run", "--dataset", "digits", "--clients", "4", "--rounds", "1", "--threads", "1",
                         "--precision", "fp16", "--out-dir", "runs"], capsys, monkeypatch)
    assert code == 2 and "fp16" in out and "CUDA GPUs only" in out


def test_bad_precision_values_are_refused():
    with pytest.raises(ConfigError, match="precision"):
        digits_config(precision="bfloat16")
    with pytest.raises(ConfigError, match=r"precision='half' is not a precision"):
        resolve_precision("half", "cpu")
    with pytest.raises(ValueError, match=r"precision='auto' is not a resolved precision"):
        OptimConfig(precision="auto")
    with pytest.raises(ValueError, match="not a resolved precision"):
        autocast_call("bf8", "cpu", torch.ones, 1)


def test_a_cpu_without_bf16_warns_and_trains_in_fp32(monkeypatch, caplog):
    """The fallback: the capability check says no; bf16 warns (naming the CPU capability and fp32),
    reports fp32, and gives fp32's numbers exactly; auto falls back without a word."""
    monkeypatch.setattr(devices, "cpu_bf16_capability", lambda: None)
    assert resolve_precision("auto", "cpu") == "fp32"
    s32, sum32 = _run("fp32")
    with caplog.at_level(logging.WARNING, logger="fedproto"):
        s16, sum16 = _run("bf16")
    said = [r.getMessage() for r in caplog.records if "precision=bf16" in r.getMessage()]
    assert len(said) == 1
    assert "no native bfloat16 instructions" in said[0] and "avx512_bf16" in said[0] and "fp32" in said[0]
    assert sum16["precision"] == "fp32"
    assert s16.executor.config_record()["precision_in_use"] == "fp32"
    assert all(torch.equal(a, b) for a, b in zip(flat_weights(s32), flat_weights(s16)))
    assert _acc(sum16) == _acc(sum32)


@needs_bf16
def test_auto_is_bf16_on_this_cpu_and_fp32_stays_the_default():
    assert cpu_bf16_capability() in ("amx_bf16", "avx512_bf16")
    assert resolve_precision("auto", "cpu") == "bf16"
    assert digits_config().precision == "fp32"
    assert "precision" in digits_config().result_fields()  # another precision is another result
    assert digits_config(precision="bf16").run_name().endswith("-precisionbf16")


@needs_bf16
@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_every_executor_reports_bf16_and_gives_finite_results(execution):
    """Both executors (the batched one through the hand-written grouped path of the paper CNN) train
    in bf16: reported, finite, float32 prototypes, and other numbers than fp32's."""
    rec: list = []
    s32, _ = _run("fp32", execution=execution, model="cnn")
    s16, summary = _run("bf16", rec, execution=execution, model="cnn")
    assert summary["precision"] == "bf16" and summary["execution"] == execution
    assert 0.0 < _acc(summary) <= 1.0
    assert all(np.isfinite(w.numpy()).all() for w in flat_weights(s16))
    assert all(np.asarray(m["protos"]).dtype == np.float32 for m in rec[-1][0].values())
    assert not all(torch.equal(a, b) for a, b in zip(flat_weights(s32), flat_weights(s16)))


@needs_bf16
def test_worker_processes_train_in_bf16():
    """The parallel workers get the precision with the round's optimizer settings: 2 workers give the
    one-process bf16 run's weights (the same autocast computation, split over processes)."""
    base = dict(model="cnn", execution="batched", lr=0.05, threads=2, rounds=2)
    one, s1 = _run("bf16", **base, workers=1)
    two, s2 = _run("bf16", **base, workers=2)
    assert s2["processes"] == 2 and s2["precision"] == "bf16"
    f32, _ = _run("fp32", **base, workers=2)
    for a, b, c in zip(flat_weights(one), flat_weights(two), flat_weights(f32)):
        # the same bf16 computation (other thread counts may round a few sums otherwise), far from fp32's
        assert float((a - b).norm()) <= 0.2 * float((b - c).norm())
        assert not torch.equal(b, c)


@needs_bf16
def test_your_own_models_train_in_bf16_on_the_generic_path():
    """The generic batched path (your own models) and the sequential one under bf16: reported, finite."""
    for execution in ("batched", "sequential"):
        sim = federate(own_digits_clients(), num_classes=10, rounds=2, threads=1, out=False, precision="bf16",
                       execution=execution)
        summary = sim.run()
        assert summary["precision"] == "bf16"
        assert np.isfinite(_acc(summary))
        assert np.asarray(sim.loop.message["protos"]).dtype == np.float32


def test_autocast_call_gives_float32_outputs_and_leaves_fp32_alone():
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    if cpu_bf16_capability() is not None:
        seen = []
        lin.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        out, same = autocast_call("bf16", "cpu", lambda t: (lin(t), t), x)
        assert seen == [torch.bfloat16] and out.dtype == torch.float32 and same is x
    lin64 = torch.nn.Linear(4, 3).double()
    assert autocast_call("fp32", "cpu", lin64, x.double()).dtype == torch.float64


def test_loss_scale_skips_overflowing_clients_and_unscales_the_others():
    """fp16's per-client loss scaling (the batched paths): a client with an inf gradient has its rows
    zeroed and its scale halved; the others' gradients come back divided by their scale."""
    sc = LossScale(3, "cpu", enabled=True, init=8.0, growth_interval=2)
    cur = torch.tensor([0, 2])
    loss = sc.scale(torch.tensor([1.0, 2.0]), cur)
    assert loss.tolist() == [8.0, 16.0]
    g = torch.tensor([[8.0, 16.0], [float("inf"), 1.0]])
    ok = sc.unscale([g, None], cur)
    assert ok.tolist() == [True, False]
    assert g.tolist() == [[1.0, 2.0], [0.0, 0.0]]
    sc.update(ok, cur)
    assert sc.scales.tolist() == [8.0, 8.0, 4.0]
    sc.update(torch.tensor([True, True]), cur)  # client 0: 2 finite steps in a row -> doubled
    assert sc.scales.tolist() == [16.0, 8.0, 4.0]
    off = LossScale(2, "cpu", enabled=False)
    t = torch.tensor([1.0, 2.0])
    assert off.scale(t, torch.tensor([0, 1])) is t and off.unscale([t], torch.tensor([0, 1])) is None


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run benchmarks/gpu_check.sh)")


@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_cuda_trains_in_reduced_precision_with_float32_prototypes(precision, execution):
    """On a GPU: bf16, and fp16 with loss scaling, on both executors; reported, finite, float32
    prototypes sent and aggregated, accuracy near the GPU's fp32 run."""
    assert resolve_precision("auto", "cuda") == "bf16"
    rec: list = []
    _, s32 = _run("fp32", device="cuda", execution=execution, model="cnn")
    sim, summary = _run(precision, rec, device="cuda", execution=execution, model="cnn")
    assert summary["precision"] == precision
    assert all(np.isfinite(w.cpu().numpy()).all() for w in flat_weights(sim))
    for messages, glob in rec:
        assert all(np.asarray(m["protos"]).dtype == np.float32 for m in messages.values())
        assert np.asarray(glob["protos"]).dtype == np.float32
    assert abs(_acc(summary) - _acc(s32)) < 0.15
