"""One training step, the parts every path shares (docs/architecture.md, "Layout"): the per-client
running totals of a round's local training (:class:`StepTotals`: losses, steps, the largest
embedding norm, the prototype sums of eq. 3), the optimizer step on stacked rows of many clients
(:func:`stacked_optimizer_step`, SGD as ``torch.optim.SGD``, Adam/AdamW as ``torch.optim.adam``, an
fp16 overflow skipping the client's step as ``GradScaler.step`` does) and the anchor's proximal term
(:func:`anchor_penalty`, FedProx's mu/2 ||w - w_ref||^2).

The sequential path (:func:`fedproto.training.sequential.train_client`, one client, G = 1), the
paper CNN's batched path (:func:`fedproto.training.stacked.train_stacked`) and the generic batched path
(:func:`fedproto.training.generic.train_group_generic`) all count with :class:`StepTotals`; the two
batched paths step with :func:`stacked_optimizer_step`, the sequential path with a torch optimizer
(DP-SGD needs Opacus's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from fedproto.training.devices import LossScale
from fedproto.training.objective import Objective, OptimConfig, adam_step_stacked
from fedproto.training.plans import TrainResult


def embedding_norm_max(h: torch.Tensor, dim: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Largest L2 norm along the sample axis of embeddings ``h`` (..., B, d) -> (...); a non-finite
    embedding counts as ``inf``. ``valid`` (..., B) masks out padding."""
    norms: torch.Tensor = h.detach().double().norm(dim=-1).nan_to_num(nan=float("inf"), posinf=float("inf"))
    if valid is not None:
        norms = torch.where(valid, norms, 0.0)
    return norms.amax(dim) if norms.numel() else norms.new_zeros(norms.shape[:-1])


class StepTotals:
    """Per-client totals of one round's local training, G clients of C classes, embeddings of size d.

    Sums are float64 (exact for float32 and float64 runs); the prototype sums are float32 or better
    whatever the model's dtype (``dtype`` is promoted), so a half-precision model's prototypes are
    computed in float32 (the paper's eq. 3 is a mean; summing bfloat16 loses it).

    Args:
        G: clients; C: classes; d: embedding size.
        dtype: the dtype of the embeddings (promoted to at least float32 for the prototype sums).
        device: where the totals live (the clients' device).
        collect: whether prototype sums and counts are kept (the objective's ``collect``).
    """

    def __init__(self, G: int, C: int, d: int, dtype: torch.dtype, device: torch.device, collect: bool) -> None:
        self.G, self.C, self.d = G, C, d
        self.sums: torch.Tensor | None = torch.zeros(G * C, d, dtype=torch.promote_types(dtype, torch.float32),
                                                     device=device) if collect else None
        self.counts: torch.Tensor | None = torch.zeros(G * C, dtype=torch.long, device=device) if collect else None
        self.ce = torch.zeros(G, dtype=torch.float64, device=device)
        self.lp = torch.zeros(G, dtype=torch.float64, device=device)
        self.extra = torch.zeros(G, dtype=torch.float64, device=device)
        self.steps = torch.zeros(G, device=device)
        self.norm_max = torch.zeros(G, dtype=torch.float64, device=device)

    @torch.no_grad()
    def add(self, ids: torch.Tensor, ce: torch.Tensor, lp: torch.Tensor, extra: torch.Tensor, h: torch.Tensor,
            valid: torch.Tensor | None = None) -> None:
        """One step of the clients ``ids`` (Gs,): their losses (Gs,), embeddings ``h`` (Gs, B, d) with
        ``valid`` (Gs, B) marking the real samples (None: all are)."""
        self.ce.index_add_(0, ids, ce.detach().double())
        self.lp.index_add_(0, ids, lp.detach().double())
        self.extra.index_add_(0, ids, extra.detach().double())
        self.steps[ids] += 1
        self.norm_max[ids] = torch.maximum(self.norm_max[ids], embedding_norm_max(h.detach(), -1, valid))

    @torch.no_grad()
    def collect(self, ids: torch.Tensor, y: torch.Tensor, h: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Add the embeddings ``h`` (Gs, B, d) of labels ``y`` (Gs, B) of the clients ``ids`` (Gs,) to
        their prototype sums (eq. 3's numerator) and counts; ``weight`` (Gs, B) of 0 or 1 leaves a
        sample out (padding, an epoch that is not the last)."""
        flat = (y + (ids * self.C).unsqueeze(1)).reshape(-1)
        hd = h.detach() if weight is None else h.detach() * weight.unsqueeze(-1)
        # called only when the totals collect (collect=True): sums and counts are tensors then
        sums, counts = cast(torch.Tensor, self.sums), cast(torch.Tensor, self.counts)
        sums.index_add_(0, flat, hd.reshape(-1, self.d).to(sums.dtype))
        counts.index_add_(0, flat, (torch.ones_like(y) if weight is None else weight).reshape(-1).long())

    def results(self) -> list[TrainResult]:
        """One :class:`TrainResult` per client: prototype sums (C, d) and counts (C,) on the CPU, the
        mean losses per step, the step count and the largest embedding norm."""
        out = []
        C = self.C
        for g in range(self.G):
            n = max(float(self.steps[g]), 1.0)
            out.append(TrainResult(
                self.sums[g * C : (g + 1) * C].cpu().clone() if self.sums is not None else None,
                self.counts[g * C : (g + 1) * C].cpu().clone() if self.counts is not None else None,
                float(self.ce[g]) / n, float(self.lp[g]) / n, int(self.steps[g]), float(self.norm_max[g]),
                float(self.extra[g]) / n))
        return out


def anchor_penalty(loss: torch.Tensor, obj: Objective, params: dict[str, torch.Tensor],
                   refs: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """``loss`` (Gs,) plus mu/2 ||w - w_ref||^2 per client over the parameters ``refs`` names (FedProx's
    proximal term, :class:`fedproto.training.terms.WeightAnchor`); ``params`` and ``refs``: name ->
    (Gs, *shape) stacked rows. ``refs`` None: ``loss`` unchanged."""
    if refs is None:
        return loss
    for k, r in refs.items():
        loss = loss + 0.5 * obj.anchor_mu * ((params[k] - r) ** 2).flatten(1).sum(1)
    return loss


@torch.no_grad()
def stacked_optimizer_step(opt: OptimConfig, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                           state: dict[tuple[str, str], torch.Tensor], names: Sequence[str],
                           adam_steps: dict[str, torch.Tensor], scaler: LossScale, ids: torch.Tensor) -> None:
    """One optimizer step of the stepping clients ``ids`` (Gs,) on their stacked rows, in place.

    Args:
        opt: the optimizer settings (SGD with momentum and weight decay as ``torch.optim.SGD``; Adam and
            AdamW as ``torch.optim.adam.adam``).
        params: the parameters that got a gradient, (Gs, *shape) each; grads: their gradients (changed
            in place under weight decay).
        state: (slot, name) -> (Gs, *shape): momentum (``"m"``), Adam's moments (``"m"``, ``"v"``).
        names: the names of ``params``, in order.
        adam_steps: name -> Adam's step count (a 0-d tensor, shared by the stepping clients).
        scaler: the fp16 loss scale (:class:`fedproto.training.devices.LossScale`, a no-op otherwise):
            a client whose gradients are not finite skips its step, its scale backs off.
        ids: the stepping clients (for the loss scale).
    """
    plist, glist = list(params), list(grads)
    ok = scaler.unscale(glist, ids)  # fp16: the clients whose gradients are finite (None otherwise)
    skipped = None if ok is None or bool(ok.all()) else ~ok
    held = [*plist, *state.values()]
    kept = [t[skipped].clone() for t in held] if skipped is not None else None
    if opt.optimizer != "sgd" and plist:  # Adam/AdamW: torch's own update on the stacked rows
        adam_step_stacked(opt, plist, glist, [state["m", k] for k in names], [state["v", k] for k in names],
                          [adam_steps[k] for k in names])
    elif plist:  # SGD as torch.optim.SGD (weight decay, momentum, step)
        blist = [state["m", k] for k in names]
        if opt.weight_decay:
            torch._foreach_add_(glist, plist, alpha=opt.weight_decay)
        if opt.momentum:
            torch._foreach_mul_(blist, opt.momentum)
            torch._foreach_add_(blist, glist)
        else:
            torch._foreach_copy_(blist, glist)
        torch._foreach_add_(plist, blist, alpha=-opt.round_lr)
    if kept is not None:  # fp16: a client with an overflow skips its step, as GradScaler.step does
        for t, v in zip(held, kept):
            t[skipped] = v
    scaler.update(ok, ids)
