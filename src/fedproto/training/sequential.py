"""The reference path: one client's local training as a plain ``nn.Module`` loop with a
``torch.optim`` optimizer (:func:`train_client`), and inference (:func:`embed_all`, :func:`predict`)."""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from torch import nn

from fedproto.data.inputs import move
from fedproto.models.proto_model import ProtoModel
from fedproto.training.devices import autocast_call
from fedproto.training.objective import (
    Objective,
    OptimConfig,
    Phase,
    WeightAnchor,
    anchor_loss,
    frozen_batchnorms,
    frozen_params,
    make_optimizer,
    on_device,
    respect_frozen,
    step_terms,
)
from fedproto.training.plans import Plan, TrainResult, augment_batch
from fedproto.training.step import StepTotals
from fedproto.training.step import embedding_norm_max as embedding_norm_max  # re-exported: its old place


def set_train_modes(model: nn.Module, ph: Phase, user_frozen_bn: set[int]) -> None:
    """Train mode, with the BatchNorm layers the sequential path runs in eval mode in phase ``ph``."""
    model.train()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            frozen = id(mod) in user_frozen_bn or (
                ph.frozen_eval and not any(ph.trains is None or ph.trains(f"{mod_name}.{n_}")
                                           for n_, _ in mod.named_parameters()))
            mod.train(not frozen)


def train_client(
    model: ProtoModel, x: torch.Tensor, y: torch.Tensor, plan: Plan, obj: Objective, opt: OptimConfig
) -> TrainResult:
    """Reference local training of one client (sequential path).

    Parameters with ``requires_grad=False`` (:func:`frozen_params`) are not trained and keep their
    flag; BatchNorm layers whose parameters are all frozen run in eval mode (:func:`frozen_batchnorms`).
    With ``opt.precision`` ``bf16``/``fp16`` the forward passes run under
    :func:`fedproto.training.devices.autocast_call` (``fp16`` with ``torch.amp.GradScaler``); the weights, the
    losses and the prototype sums (``TrainResult.sums``, float32 or better) keep their dtypes.

    Args:
        model: the client's model (trained in place). x: (n, C, H, W) local inputs, or any inputs the
            model takes (token ids, :class:`fedproto.data.inputs.Inputs`, passed as they are); y: (n,) labels.
        plan: from :func:`make_plan`. obj: the round's objective. opt: optimizer settings.
    Returns:
        :class:`TrainResult`.
    """
    named = dict(model.named_parameters())
    flags = {n_: p.requires_grad for n_, p in named.items()}
    try:
        return _train_client(model, x, y, plan, respect_frozen(obj, frozen_params(model)), opt)
    finally:
        for n_, p in named.items():
            p.requires_grad_(flags[n_])


def _dp_sgd_module(model: ProtoModel, obj: Objective) -> Any:  # opacus's GradSampleModule (opacus is untyped)
    """The model wrapped for DP-SGD (Opacus's ``GradSampleModule``: per-sample gradients).

    Raises:
        ValueError: a loss that is not a mean of per-sample terms (an anchor, a batch-level term).
    """
    from opacus import GradSampleModule

    batch_terms = [type(t).__name__ for t in (*obj.terms, obj.classification) if t is not None and not t.per_sample]
    if obj.anchor_mu > 0 or batch_terms:
        raise ValueError("DP-SGD needs a loss that is a mean of per-sample terms: not a pull toward reference "
                         f"weights (anchor mu={obj.anchor_mu}) nor loss terms that are not per sample "
                         f"({', '.join(batch_terms) or 'none'}; e.g. FedProto's 'l2' distance, a batch prototype)")
    # Opacus's backward hooks on the first layer fire with respect to its outputs (inputs need no gradient)
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
    return GradSampleModule(model, loss_reduction="mean")


def _phase_optimizer(params: list[torch.Tensor], obj: Objective, opt: OptimConfig, seed: int,
                     dev: torch.device) -> torch.optim.Optimizer | None:
    """A fresh optimizer for one phase (the official code's: one per local round), Opacus's
    ``DPOptimizer`` around it under DP-SGD (noise from a generator seeded ``seed``); None when the
    phase trains nothing (all its parameters frozen: it still runs its passes, without steps)."""
    optim = make_optimizer(params, opt) if params else None
    if obj.dp_sgd is not None and optim is not None:
        from opacus.optimizers import DPOptimizer

        dp = obj.dp_sgd
        gen = torch.Generator(device=dev).manual_seed(seed)
        optim = DPOptimizer(optim, noise_multiplier=dp.noise_multiplier, max_grad_norm=dp.max_grad_norm,
                            expected_batch_size=dp.expected_batch_size, loss_reduction="mean", generator=gen)
    return optim


def _train_client(
    model: ProtoModel, x: torch.Tensor, y: torch.Tensor, plan: Plan, obj: Objective, opt: OptimConfig
) -> TrainResult:
    """The body of :func:`train_client` (``obj`` already leaves the frozen parameters alone)."""
    model.train()
    user_frozen_bn = {id(m) for m in frozen_batchnorms(model)}
    p0 = next(model.parameters())
    dev = p0.device
    obj = on_device(obj, dev)
    totals = StepTotals(1, model.num_classes, model.embedding_dim, p0.dtype, dev, obj.collect)
    one = torch.zeros(1, dtype=torch.long, device=dev)  # the client's row in the totals
    named = dict(model.named_parameters())
    gsm = _dp_sgd_module(model, obj) if obj.dp_sgd is not None else None
    net = gsm if gsm is not None else model
    # fp16: torch's loss scaler, one per client and round (as the optimizer); bf16 needs none
    scaler = torch.amp.GradScaler(dev.type) if opt.precision == "fp16" else None
    for pi, ph in enumerate(obj.phases):
        params: list[torch.Tensor] = [p for n_, p in named.items() if ph.trains is None or ph.trains(n_)]
        for n_, p in named.items():
            p.requires_grad_(ph.trains is None or ph.trains(n_))
        set_train_modes(model, ph, user_frozen_bn)
        optim = _phase_optimizer(params, obj, opt, plan.seed + pi, dev)
        order, weight, last = plan.order[pi], plan.weight[pi], plan.last_epoch[pi]
        noise = plan.noise[pi] if plan.noise else {}
        aug = plan.aug[pi] if plan.aug else None
        collect = obj.collect and pi == len(obj.phases) - 1
        for s in range(order.shape[0]):
            valid = weight[s] > 0
            idx = order[s][valid]
            xb, yb = move(x[idx], dev, non_blocking=True), y[idx].to(dev, non_blocking=True)
            if aug is not None:
                xb = augment_batch(xb, aug[s][valid])
            nb = {k: v[s][valid].to(dev) for k, v in noise.items()} if noise else None
            with torch.set_grad_enabled(optim is not None):
                # the forward under autocast (opt.precision), its outputs back in float32 for the losses
                logits, h = autocast_call(opt.precision, dev, net if optim is not None else model, xb, nb)
                ce, lp, extra, loss = step_terms(logits, h, yb, torch.ones(len(yb), device=dev), obj)
                # anchor_mu > 0: there is an anchor
                if obj.anchor_mu > 0 and cast(WeightAnchor, obj.anchor).ref is not None:
                    loss = loss + anchor_loss(obj, named)
            if optim is not None:
                _step(optim, loss, scaler)
            totals.add(one, ce.reshape(1), lp.reshape(1), extra.reshape(1), h.unsqueeze(0))
            if collect and bool(last[s]):
                totals.collect(one, yb.unsqueeze(0), h.unsqueeze(0))
    if gsm is not None:
        gsm.to_standard_module()  # hooks off, per-sample gradients gone: the plain model again
    return totals.results()[0]


def _step(optim: torch.optim.Optimizer, loss: torch.Tensor, scaler: torch.amp.GradScaler | None) -> None:
    """Backward and one optimizer step (through torch's loss scaler under fp16)."""
    optim.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()  # type: ignore[no-untyped-call]  # torch: Tensor.backward has no annotations
        scaler.step(optim)
        scaler.update()
    else:
        loss.backward()  # type: ignore[no-untyped-call]  # torch: Tensor.backward has no annotations
        optim.step()


@torch.no_grad()
def embed_all(model: ProtoModel, x: torch.Tensor, batch: int = 512) -> torch.Tensor:
    """Embeddings (n, d) of ``x`` in eval mode (used for eq. 3 after training and for inference), in
    the model's own dtype whatever the run's ``precision`` (evaluation and the prototypes computed
    from these embeddings are not autocast)."""
    model.eval()
    dev = next(model.parameters()).device
    out = [model.embed(move(x[i : i + batch], dev)) for i in range(0, len(x), batch)]
    return torch.cat(out) if out else torch.zeros(0, model.embedding_dim, device=next(model.parameters()).device)


@torch.no_grad()
def predict(model: ProtoModel, x: torch.Tensor, batch: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (n, C) and embeddings (n, d) in eval mode, in the model's own dtype (not autocast)."""
    model.eval()
    dev = next(model.parameters()).device
    logits, hs = [], []
    for i in range(0, len(x), batch):
        lo, h = model(move(x[i : i + batch], dev))
        logits.append(lo)
        hs.append(h)
    if not logits:
        return torch.zeros(0, model.num_classes, device=dev), torch.zeros(0, model.embedding_dim, device=dev)
    return torch.cat(logits), torch.cat(hs)
