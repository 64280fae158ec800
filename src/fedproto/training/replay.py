"""Dropout replay for the generic batched path: which dropout calls a model's forward pass makes
(:func:`dropout_calls`), the masks torch's generator gives the sequential path for them
(:func:`replay_masks`), and the model run as a function of stacked weights under ``torch.func.vmap``
with those masks (:class:`Functional`). See :mod:`fedproto.training.generic` and
docs/architecture.md (the seams: ProtoModel)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

FEATURE_DROPOUT = {nn.Dropout1d: 3, nn.Dropout2d: 4, nn.Dropout3d: 5}
"""Dropout modules that zero whole channels, with the input rank they are replayed for (torch's
``make_feature_noise``: a mask of shape (N, C, 1, ...))."""


def dropout_modules(model: nn.Module) -> list[tuple[str, nn.modules.dropout._DropoutNd]]:
    """The torch dropout modules of ``model`` that are active in training (p > 0), by name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]


@dataclass
class DropCall:
    """One dropout module's call in a forward pass: its name, p, the shape of one sample's mask
    ((*sample_shape) or (C, 1, ...) for channel dropout) and the dtype it draws in."""

    name: str
    p: float
    shape: tuple[int, ...]
    dtype: torch.dtype


def dropout_calls(model: nn.Module, x1: torch.Tensor) -> list[DropCall]:
    """The dropout calls of one forward pass of ``model`` on one sample ``x1`` (1, ...), in call order
    (eval mode, no gradient; the model's flags and state are left as they were).

    Raises:
        ValueError: a dropout module called more than once per pass, or a channel dropout given an
            input of another rank than it is meant for (its masks could not be replayed).
    """
    calls: list[DropCall] = []
    handles: list[torch.utils.hooks.RemovableHandle] = []
    for name, m in dropout_modules(model):
        def hook(mod: nn.modules.dropout._DropoutNd, args: tuple[Any, ...], _name: str = name) -> None:
            x = args[0]
            if any(c.name == _name for c in calls):
                raise ValueError(f"dropout {_name!r} is called more than once per forward pass")
            rank = FEATURE_DROPOUT.get(type(mod))
            if rank is not None and x.dim() != rank:
                raise ValueError(f"{type(mod).__name__} {_name!r} got a {x.dim()}-d input")
            shape = tuple(x.shape[1:]) if rank is None else (x.shape[1],) + (1,) * (x.dim() - 2)
            calls.append(DropCall(_name, float(mod.p), shape, x.dtype))
        handles.append(m.register_forward_pre_hook(hook))
    flags = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            model(x1)
    finally:
        for h in handles:
            h.remove()
        for mod, f in flags.items():
            mod.training = f
    return calls


def replay_masks(calls: Sequence[DropCall], counts: Sequence[torch.Tensor],
                 seed: int) -> list[list[dict[str, torch.Tensor]]]:
    """Per phase and step, the dropout masks (name -> (c, *shape), scaled by 1/(1-p)) that torch's
    CPU generator seeded with ``seed`` gives the sequential path (:func:`train_client` after
    :func:`fedproto.engine.executors.in_process.client_step`): torch's CPU dropout draws
    ``empty(shape).bernoulli_(1 - p)`` per call, in call order, for the c samples of the step.
    ``counts[p]``: (S,) samples per step of phase p. p = 1 zeroes without a draw."""
    gen = torch.Generator().manual_seed(int(seed))
    out: list[list[dict[str, torch.Tensor]]] = []
    for cnt in counts:
        steps: list[dict[str, torch.Tensor]] = []
        for c in cnt.tolist():
            masks: dict[str, torch.Tensor] = {}
            for call in calls:
                if call.p >= 1.0:
                    masks[call.name] = torch.zeros((c, *call.shape), dtype=call.dtype)
                    continue
                m = torch.empty((c, *call.shape), dtype=call.dtype).bernoulli_(1.0 - call.p, generator=gen)
                masks[call.name] = m.div_(1.0 - call.p)
            steps.append(masks)
        out.append(steps)
    return out


class Functional:
    """``model`` run as a function of stacked weights under ``torch.func.vmap``: ``functional_call``
    with a client's parameters and buffers, its dropout modules reading the client's masks from
    :attr:`masks` (set inside the vmapped function) instead of drawing from torch's generator.
    Use as a context manager: the dropout modules' ``forward`` is replaced on the instance meanwhile."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.masks: dict[str, torch.Tensor] = {}
        self._drops = dropout_modules(model)

    def __enter__(self) -> Functional:
        for name, m in self._drops:
            m.forward = (lambda x, _n=name: x * self.masks[_n])
        return self

    def __exit__(self, *exc: object) -> None:
        for _, m in self._drops:
            del m.forward

    def forward(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: Any,
                masks: dict[str, torch.Tensor], noise: dict[str, torch.Tensor]) -> Any:
        self.masks = masks
        try:
            return torch.func.functional_call(self.model, {**params, **buffers}, (x, noise or None))
        finally:
            self.masks = {}

    def __call__(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: Any,
                 masks: dict[str, torch.Tensor], noise: dict[str, torch.Tensor]) -> Any:
        return torch.func.vmap(self.forward, in_dims=(0, 0, 0, 0, 0))(params, buffers, x, masks, noise)
