"""What the generic batched path (:func:`fedproto.training.generic.train_group_generic`) checks before
it trains a model: :func:`generic_key` (what the clients trained together share: modules, their
configuration, parameters, buffers) and :func:`generic_batch_problem` (why a model cannot train under
``torch.func.vmap``, from one trial step). Re-exported by :mod:`fedproto.training.generic` and
:mod:`fedproto.training`; the batched executor groups and routes clients with them."""

from __future__ import annotations

import torch
from torch import nn

from fedproto.data.inputs import tree_map
from fedproto.models.proto_model import ProtoModel
from fedproto.training.replay import FEATURE_DROPOUT, Functional, dropout_calls


def _plain(v: object) -> bool:
    """True for values that describe a module's configuration in :func:`generic_key` (numbers,
    strings, None, and tuples of them)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    return isinstance(v, tuple) and all(_plain(x) for x in v)


def generic_key(model: nn.Module) -> tuple[object, ...] | None:
    """What clients trained together on the generic batched path (:func:`train_group_generic`) share.

    The key holds, for every submodule in order: its name, type, configuration (its attributes that
    are numbers, strings or tuples of them: a convolution's stride and padding, a dropout's p, a
    BatchNorm's momentum, the train/eval flag) and the number of hooks it carries; and every
    parameter's name, shape, dtype, device and ``requires_grad`` flag (so the frozen set), and every
    buffer's name, shape and dtype. Models with equal keys compute the same function of their
    weights, so one of them can serve as the template of the group's ``functional_call``.

    Returns:
        The key, or None where the model cannot join the generic path: a model with a hand-written
        batched forward (:attr:`ProtoModel.batch_params`: :func:`train_group` is faster), a module
        whose ``forward`` was replaced on the instance, or a dropout kind whose masks the batched
        path cannot draw as the sequential path does (``AlphaDropout``, ``FeatureAlphaDropout``, p > 0).
    """
    if getattr(model, "batch_params", ()):
        return None
    mods = []
    for name, m in model.named_modules():
        if "forward" in vars(m):
            return None
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and type(m) not in (nn.Dropout, *FEATURE_DROPOUT):
            return None
        attrs = tuple(sorted((k, v) for k, v in vars(m).items() if _plain(v)))
        hooks = tuple(len(getattr(m, h, ())) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                                       "_backward_pre_hooks"))
        mods.append((name, type(m), attrs, hooks))
    params = tuple((n, tuple(p.shape), p.dtype, str(p.device), p.requires_grad) for n, p in model.named_parameters())
    bufs = tuple((n, tuple(b.shape), b.dtype) for n, b in model.named_buffers())
    return ("generic", tuple(mods), params, bufs)


def generic_batch_problem(model: ProtoModel, x: torch.Tensor) -> str | None:
    """Why ``model`` cannot train on the generic batched path, or None if it can.

    Runs the vmapped training computation once on two stacked copies of the model's weights and
    two samples of ``x`` (n, ...) each (train mode, a backward pass; the model's weights, buffers
    and flags are left as they were). It fails for forward passes that ``torch.func.vmap`` cannot
    batch: random ops other than dropout modules (``torch.rand``, ``F.dropout`` called directly),
    ``.item()`` or data-dependent Python control flow, in-place changes of inputs.
    """
    if generic_key(model) is None:
        return "no generic batched key (see fedproto.training.generic_key)"
    if len(x) == 0:
        return "no training samples"
    flags = {m: m.training for m in model.modules()}
    try:
        calls = dropout_calls(model, x[:1])
        params = {k: torch.stack([p.detach()] * 2).requires_grad_(True) for k, p in model.named_parameters()}
        buffers = {k: torch.stack([b.detach()] * 2) for k, b in model.named_buffers()}
        p0 = next(model.parameters())
        xb = tree_map(lambda t: torch.stack([t] * 2).to(p0.device), x[:2])  # inputs of any structure, dtypes kept
        c = min(2, len(x))
        masks = {d.name: torch.ones((2, c, *d.shape), dtype=d.dtype, device=p0.device) for d in calls}
        noise = {k: torch.ones(2, c, w, dtype=p0.dtype, device=p0.device) for k, w in model.noise_widths().items()}
        model.train()
        with Functional(model) as f:
            logits, h = f(params, buffers, xb, masks, noise)
        loss = logits.sum() + h.sum()
        torch.autograd.grad(loss, [p for p in params.values()], allow_unused=True)
        return None
    except Exception as e:  # noqa: BLE001 - any failure means: train this model sequentially
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        for m, f_ in flags.items():
            m.training = f_
