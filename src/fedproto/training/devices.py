"""Where clients train: ``--device auto|cpu|cuda|cuda:N|mps``.

The models, training batches, global prototypes in use and the batched engine's stacks live on
the device; messages leave as CPU arrays (numpy), so the server, the run directory, checkpoints
and Flower records never see a device tensor. Data held in memory is moved once at set-up; data
read from a ``Dataset`` is moved batch by batch.

Numbers on a GPU differ from the CPU's in the last float32 bits (other kernels), like those of
another CPU (docs/results.md, "Reproducibility").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

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


# ----------------------------------------------------------------------------------------------
# Reduced precision: ``--precision fp32|bf16|fp16|auto``.

PRECISIONS = ("fp32", "bf16", "fp16", "auto")
"""The ``precision`` option's values: ``fp32`` (no autocast), ``bf16`` (``torch.autocast`` to
bfloat16 on a CPU with native bf16 instructions or a CUDA GPU), ``fp16`` (autocast to float16 with
loss scaling, CUDA GPUs only), ``auto`` (bf16 where it is native, else fp32)."""

_AUTOCAST_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_bf16_capability() -> str | None:
    """The name of this CPU's native bfloat16 instructions (``avx512_bf16`` or ``amx_bf16``, as
    ``/proc/cpuinfo`` and ``torch.cpu.get_capabilities()`` spell them), or None where it has none
    (bf16 matmuls and convolutions would then be emulated, slower than float32)."""
    try:
        caps = torch.cpu.get_capabilities()
    except Exception:  # noqa: BLE001 - an older torch: ask its feature probes
        caps = {"avx512_bf16": bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()),
                "amx_bf16": bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())}
    for name in ("amx_bf16", "avx512_bf16"):
        if caps.get(name):
            return name
    return None


def resolve_precision(spec: str, device: torch.device | str) -> str:
    """The precision a run trains in on ``device``, for a ``precision`` option value.

    ``fp32`` -> ``fp32``. ``bf16`` -> ``bf16`` on a CUDA GPU and on a CPU with native bf16
    instructions (:func:`cpu_bf16_capability`); elsewhere (a CPU without them, MPS) a warning names
    the missing capability and ``fp32`` is used. ``fp16`` -> ``fp16`` on a CUDA GPU. ``auto`` -> bf16
    where it is native, else fp32 (no warning). What it returns is what the run reports as used
    (``summary.json``'s ``precision``, ``config.json``'s ``precision_in_use``).

    Raises:
        ConfigError: an unknown value, or ``fp16`` on a device other than a CUDA GPU (float16 needs
            loss scaling and a GPU's float16 units; the message names the device and the fix).
    """
    spec = str(spec).strip().lower()
    device = torch.device(device)
    if spec not in PRECISIONS:
        raise ConfigError(f"precision={spec!r} is not a precision; use one of {', '.join(PRECISIONS)}",
                          option="precision", value=spec, hint="use fp32 (the default), bf16, fp16 or auto")
    if spec == "fp32":
        return "fp32"
    if spec == "fp16":
        if device.type != "cuda":
            raise ConfigError(f"{opt('precision', 'fp16')} trains in float16 with loss scaling, on CUDA GPUs only, and "
                              f"this run trains on {device.type}", option="precision", value=spec,
                              hint=f"use {opt('precision', 'bf16')} (or auto) on a CPU, or {opt('device', 'cuda')}")
        return "fp16"
    native = device.type == "cuda" or (device.type == "cpu" and cpu_bf16_capability() is not None)
    if native:
        return "bf16"
    if spec == "bf16":
        import logging

        what = ("this CPU has no native bfloat16 instructions (neither avx512_bf16 nor amx_bf16 in its "
                "capabilities)" if device.type == "cpu" else f"device {device.type} has no bfloat16 autocast here")
        logging.getLogger("fedproto").warning("precision=bf16: %s; training in fp32 (float32) instead", what)
    return "fp32"


def autocast_for(precision: str, device: torch.device | str) -> AbstractContextManager[None]:
    """The context a training forward pass runs in: ``torch.autocast`` to bfloat16 (``bf16``) or
    float16 (``fp16``) on ``device``'s type, a no-op context for ``fp32``.

    Only the forward pass belongs inside: the losses, prototype sums (float32) and optimizer steps on
    the float32 weights run outside it. ``precision`` is a resolved value (:func:`resolve_precision`).

    Raises:
        ValueError: an unknown precision (the message names it and the values).
    """
    import contextlib

    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in _AUTOCAST_DTYPE:
        raise ValueError(f"precision={precision!r} is not a resolved precision; use fp32, bf16 or fp16 "
                         "(fedproto.training.devices.resolve_precision)")
    return torch.autocast(device_type=torch.device(device).type, dtype=_AUTOCAST_DTYPE[precision])


def autocast_call(precision: str, device: torch.device | str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (a model's forward) under :func:`autocast_for`, its outputs (a tensor
    or a tuple of tensors, e.g. ``(logits, h)``) returned in float32 where autocast made them bfloat16
    or float16, so that the losses, the λ distance term to the float32 global prototypes and the
    prototype sums are computed in float32. With ``fp32``: ``fn(*args, **kwargs)`` as it is (a
    float64 model's outputs stay float64).

    Raises:
        ValueError: an unknown precision (:func:`autocast_for`).
    """
    if precision == "fp32":
        return fn(*args, **kwargs)
    with autocast_for(precision, device):
        out = fn(*args, **kwargs)

    def up(t: Any) -> Any:  # an output of fn: a tensor or anything else, passed through
        return t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16) else t

    return tuple(up(t) for t in out) if isinstance(out, tuple) else up(out)


class LossScale:
    """Dynamic loss scaling for ``fp16`` on the batched paths, one scale per client (as
    ``torch.amp.GradScaler``, whose defaults it takes: scale 2**16, halved on a non-finite gradient,
    doubled after 2000 finite steps), for gradients taken with ``torch.autograd.grad`` rather than an
    optimizer. Disabled (every method a pass-through) unless ``enabled``.

    Usage per step: ``loss = scale.scale(loss_g, cur)`` (loss_g: (Gc,) per-client losses),
    ``grads``, then ``ok = scale.unscale(grads, cur)`` ((Gc,) bool: the clients whose gradients are finite,
    their rows divided by their scale, the others' rows zeroed), step only the ``ok`` clients, then
    ``scale.update(ok, cur)``.
    """

    def __init__(self, G: int, device: torch.device | str, enabled: bool, init: float = 2.0 ** 16,
                 growth_interval: int = 2000):
        self.enabled = enabled
        self.scales = torch.full((G,), init, dtype=torch.float32, device=device)
        self.good = torch.zeros(G, dtype=torch.long, device=device)
        self.growth_interval = growth_interval

    def scale(self, loss_g: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
        """``loss_g`` (Gc,) times the scales of clients ``cur`` (unchanged when disabled)."""
        return loss_g * self.scales[cur].to(loss_g.dtype) if self.enabled else loss_g

    @torch.no_grad()
    def unscale(self, grads: Sequence[torch.Tensor | None], cur: torch.Tensor) -> torch.Tensor | None:
        """Divide each gradient's client rows (Gc, ...) by their scale in place; None when disabled,
        else (Gc,) bool: the clients whose gradients are all finite (the others' rows are set to 0)."""
        if not self.enabled:
            return None
        inv = (1.0 / self.scales[cur]).float()
        ok = torch.ones(len(cur), dtype=torch.bool, device=inv.device)
        for g in grads:
            if g is not None:
                g.mul_(inv.view(-1, *[1] * (g.dim() - 1)).to(g.dtype))
                ok &= torch.isfinite(g.flatten(1)).all(1)
        for g in grads:
            if g is not None:
                g.masked_fill_(~ok.view(-1, *[1] * (g.dim() - 1)), 0)
        return ok

    @torch.no_grad()
    def update(self, ok: torch.Tensor | None, cur: torch.Tensor) -> None:
        """Halve the scales of clients whose step was skipped, double those of clients with
        ``growth_interval`` finite steps in a row."""
        if ok is None:
            return
        good = torch.where(ok, self.good[cur] + 1, 0)
        grow = good >= self.growth_interval
        self.scales[cur] = torch.where(ok, torch.where(grow, self.scales[cur] * 2, self.scales[cur]),
                                       self.scales[cur] * 0.5)
        self.good[cur] = torch.where(grow, 0, good)
