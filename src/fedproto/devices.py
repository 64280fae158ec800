"""Where clients train: ``--device auto|cpu|cuda|cuda:N|mps``.

The models, training batches, global prototypes in use and the batched engine's stacks live on
the device; messages leave as CPU arrays (numpy), so the server, the run directory, checkpoints
and Flower records never see a device tensor. Data held in memory is moved once at set-up; data
read from a ``Dataset`` is moved batch by batch.

Numbers on a GPU differ from the CPU's in the last float32 bits (other kernels), like those of
another CPU (docs/results.md, "Reproducibility").
"""

from __future__ import annotations

import torch

from fedproto.errors import ConfigError, opt


def resolve_device(spec: str) -> torch.device:
    """The torch device for a ``device`` option value.

    ``auto``: the first CUDA GPU when torch sees one, else the CPU (never MPS, whose float64 and
    some kernels are missing: ask for ``mps`` by name). ``cuda`` is ``cuda:0``.

    Raises:
        ConfigError: an unknown spelling, or a device this machine's torch cannot use (names the
            value and what is available).
    """
    spec = str(spec).strip().lower()
    if spec == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ConfigError(f"{opt('device', 'mps')} but this torch build or machine has no Apple MPS backend",
                              option="device", value=spec, hint=f"use {opt('device', 'cpu')} (or auto)")
        return torch.device("mps")
    if spec == "cuda" or spec.startswith("cuda:"):
        index = int(spec.partition(":")[2] or 0)
        if not torch.cuda.is_available():
            raise ConfigError(f"{opt('device', spec)} but torch sees no CUDA GPU (torch {torch.__version__}, CUDA "
                              f"build: {torch.version.cuda or 'no'})", option="device", value=spec,
                              hint=f"use {opt('device', 'cpu')}, or auto to take a GPU when there is one")
        count = torch.cuda.device_count()
        if index >= count:
            raise ConfigError(f"device={spec!r} but torch sees {count} CUDA GPU(s) (cuda:0..cuda:{count - 1}); pick "
                              "one of those")
        return torch.device(f"cuda:{index}")
    raise ConfigError(f"device={spec!r} is not a device; use auto, cpu, cuda, cuda:N or mps")
