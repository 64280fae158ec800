"""--device: cpu and auto here; CUDA paths run only where torch sees a GPU (benchmarks/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch
from conftest import flat_weights

from fedproto.config.run_config import build_config
from fedproto.engine.setup import prepare
from fedproto.errors import ConfigError
from fedproto.simulation import Simulation
from fedproto.training.devices import resolve_device

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run benchmarks/gpu_check.sh)")


def _cfg(**kw):
    base = dict(dataset="digits", clients=4, ways=3, shots=15, test_shots=8, rounds=2, eval_every=0)
    return build_config(overrides={**base, **kw})


def test_cpu_and_auto_resolve_and_give_the_cpu_numbers():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu"))
    a = Simulation(_cfg(device="cpu"), out=False)
    b = Simulation(_cfg(), out=False)
    assert a.setup.device == torch.device("cpu") and a.setup.data[0].x.device.type == "cpu"
    sa, sb = a.run(), b.run()
    assert sa["accuracy"] == sb["accuracy"]


def test_bad_and_unavailable_devices_are_refused_before_training():
    assert build_config(overrides={"device": " CUDA "}).device == "cuda"  # case and spaces: spelled as meant
    for bad in ("gpu", "cuda:x", "tpu", ""):
        with pytest.raises(ConfigError, match="device"):
            build_config(overrides={"device": bad})
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"device='cuda:1' but torch sees no CUDA GPU.*device='cpu'"):
            prepare(_cfg(device="cuda:1"))
    mps = getattr(torch.backends, "mps", None)
    if mps is None or not mps.is_available():
        with pytest.raises(ConfigError, match="device='mps'"):
            resolve_device("mps")


def test_device_is_not_a_result_field():
    """A run checkpointed on one device resumes on another (numbers differ in the last bits only)."""
    assert "device" not in _cfg(device="cpu").result_fields()


@needs_cuda
@pytest.mark.parametrize("algorithm", ["fedproto", "fedavg", "fedprox", "fedrep", "fesem"])
@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_cuda_runs_match_the_cpu(algorithm, execution):
    """On a GPU, float64: both execution paths give the CPU's weights within 1e-9 relative."""
    out = {}
    for dev in ("cpu", "cuda"):
        cfg = _cfg(device=dev, algorithm=algorithm, execution=execution)
        sim = Simulation(cfg, setup=prepare(cfg, progress=False).to_dtype(torch.float64), out=False)
        assert sim.setup.states[0].model.fc1.weight.device.type == dev
        sim.run()
        out[dev] = [w.cpu() for w in flat_weights(sim)]
        msg = sim.message
        assert all(not isinstance(v, torch.Tensor) for v in msg.values())  # messages leave as arrays
    for a, b in zip(out["cpu"], out["cuda"]):
        assert ((a - b).norm() / a.norm()).item() < 1e-9


@needs_cuda
def test_cuda_resnet18_and_own_federation_run(tmp_path):
    cfg = build_config(overrides=dict(dataset="digits", model="resnet18", clients=2, ways=2, shots=9, stdev=0,
                                      test_shots=5, rounds=1, device="cuda"))
    s = Simulation(cfg, out=tmp_path / "r").run()
    assert 0.0 <= s["accuracy"]["acc"]["mean"] <= 1.0
