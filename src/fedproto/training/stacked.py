"""Clients of one architecture trained as one batched computation (:func:`train_group`,
:func:`train_stacked`): stacked weights, grouped convolutions and batched matmuls over clients,
the optimizer applied per client, clients leaving the computation when their data runs out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from fedproto.devices import LossScale, autocast_call
from fedproto.models.base import ProtoModel
from fedproto.training.objective import (
    Objective,
    OptimConfig,
    Phase,
    WeightAnchor,
    adam_step_stacked,
    frozen_params,
    on_device,
    respect_frozen,
    same_term,
    stacked_state,
    step_terms,
)
from fedproto.training.plans import Plan, TrainResult, augment_batch
from fedproto.training.sequential import embedding_norm_max

# ----------------------------------------------------------------------------------------------
# Client-batched path for the paper CNN family.


def batch_key(model: ProtoModel) -> tuple | None:
    """What clients trained as one batched computation share: the architecture
    (:meth:`ProtoModel.arch_key`) and the frozen parameters (:func:`frozen_params`); None: the
    model trains on the sequential path only."""
    key = model.arch_key()
    return None if key is None else (key, tuple(sorted(frozen_params(model))))


def can_batch(models: Sequence[ProtoModel]) -> bool:
    """True when all models share one architecture and the same frozen parameters
    (:func:`batch_key`) that can be trained as one batched computation
    (:attr:`ProtoModel.batch_params` and :meth:`ProtoModel.grouped_forward`)."""
    keys = {batch_key(m) for m in models}
    return len(keys) == 1 and None not in keys and bool(models[0].batch_params)


def _same_objective(a: Objective, b: Objective, names: Sequence[str]) -> bool:
    """True if two objectives agree in all but their anchors' references (see :func:`train_group`);
    phases are compared by what they train among ``names``, terms with :meth:`LossTerm.same_as`."""
    def phases(o):  # what each phase trains, by parameter name (the predicates are new functions each round)
        return [(p.epochs, None if p.trains is None else tuple(p.trains(k) for k in names)) for p in o.phases]

    return (phases(a) == phases(b) and a.anchor_mu == b.anchor_mu and a.collect == b.collect
            and len(a.terms) == len(b.terms) and all(t.same_as(u) for t, u in zip(a.terms, b.terms))
            and same_term(a.classification, b.classification))


@torch.no_grad()
def _write_back(P, bufs, Pc, bufc, ids) -> None:
    """Copy the compacted parameters and optimizer state of clients ``ids`` back into the full stacks."""
    for k in P:
        P[k][ids] = Pc[k].detach()
    for k in bufs:
        bufs[k][ids] = bufc[k]


class TrainsOnly:
    """A picklable :attr:`Phase.trains` predicate: true for the parameter names in ``names``
    (the worker processes of :mod:`fedproto.parallel` get phases in this form)."""

    def __init__(self, names):
        self.names = frozenset(names)

    def __call__(self, name: str) -> bool:
        return name in self.names

    def __eq__(self, other) -> bool:
        return isinstance(other, TrainsOnly) and self.names == other.names

    def __hash__(self) -> int:
        return hash(self.names)


def portable_objective(obj: Objective, names: Sequence[str]) -> Objective:
    """``obj`` with each phase's ``trains`` predicate replaced by a :class:`TrainsOnly` over
    ``names`` (what the batched engine asks it), so that it pickles (FedRep's predicates are
    closures); the anchor's references dropped (the batched engine takes them stacked)."""
    phases = [Phase(p.epochs, None if p.trains is None else TrainsOnly(k for k in names if p.trains(k)),
                    p.frozen_eval) for p in obj.phases]
    return replace(obj, phases=phases, anchor=None if obj.anchor is None else WeightAnchor(obj.anchor.mu))


@dataclass
class StackedPhase:
    """The plans of G clients for one phase, stacked for :func:`train_stacked`.

    steps: (G,) int64 steps of each client; order: (Smax, B, G) int64 rows of the group's input
    tensor X (padding points at the client's first sample); weight: (Smax, G, B) float32, 0 on
    padding; last: (Smax, G) bool, steps of the last epoch; noise: name -> (Smax, G, B, width)
    dropout masks (ones on padding); aug: (Smax, B, G, 3) int64 augmentation or None.
    B is the widest batch of the group (batch size, or more where a trailing batch was folded).
    """

    steps: torch.Tensor
    order: torch.Tensor
    weight: torch.Tensor
    last: torch.Tensor
    noise: dict[str, torch.Tensor]
    aug: torch.Tensor | None


def stack_plans(plans: Sequence[Plan], pi: int, offsets: Sequence[int], batch_size: int) -> StackedPhase:
    """Stack phase ``pi`` of G clients' plans (:class:`Plan`) into a :class:`StackedPhase`;
    client g's sample j is row ``offsets[g] + j`` of the group's input tensor."""
    G = len(plans)
    off = torch.as_tensor(np.asarray(offsets, np.int64))
    S = [pl.order[pi].shape[0] for pl in plans]
    Smax = max(S) if S else 0
    Wd = [pl.order[pi].shape[1] for pl in plans]
    B = max(Wd, default=batch_size)
    order = off.view(1, 1, G).repeat(Smax, B, 1)  # padding points at the client's own first sample
    weight = torch.zeros(Smax, G, B)
    last = torch.zeros(Smax, G, dtype=torch.bool)
    aug = torch.zeros(Smax, B, G, 3, dtype=torch.long) if plans[0].aug else None
    for g, pl in enumerate(plans):
        order[: S[g], : Wd[g], g] = pl.order[pi] + off[g]
        weight[: S[g], g, : Wd[g]] = pl.weight[pi]
        last[: S[g], g] = pl.last_epoch[pi]
        if aug is not None:
            aug[: S[g], : Wd[g], g] = pl.aug[pi]
    noise = {}
    if plans[0].noise and plans[0].noise[pi]:
        for name in plans[0].noise[pi]:
            width = plans[0].noise[pi][name].shape[-1]
            t = torch.ones(Smax, G, B, width)
            for g, pl in enumerate(plans):
                t[: S[g], g, : Wd[g]] = pl.noise[pi][name]
            noise[name] = t
    return StackedPhase(torch.as_tensor(S, dtype=torch.long), order, weight, last, noise, aug)


def train_group(
    models: Sequence[ProtoModel],
    xs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    plans: Sequence[Plan],
    obj: Objective,
    opt: OptimConfig,
    objs: Sequence[Objective] | None = None,
) -> list[TrainResult]:
    """Train G clients with one architecture as one batched computation (see module docstring).

    Args:
        models: G models with equal :meth:`arch_key` (checked by :func:`can_batch`); updated in place.
        xs: per client local inputs (n_g, Cin, H, W).
        ys: per client local labels (n_g,).
        plans: per client plans with the same phase structure.
        obj: the shared objective (global prototypes are the same for all clients of a round).
        opt: optimizer settings (:class:`OptimConfig`).
        objs: optional per-client objectives, used only for their anchor's references
            (:class:`WeightAnchor`: FeSEM/FedProx reference weights may differ per client);
            everything else must equal ``obj``'s.
    Returns:
        One :class:`TrainResult` per client, as :func:`train_client` would give.
    Raises:
        ValueError: per-client objectives that differ from ``obj`` in anything but their anchor's
            references, or models whose frozen parameters (:func:`frozen_params`) differ (they cannot share one
            batched computation).
    """
    names = models[0].batch_params
    G = len(models)
    frozen = frozen_params(models[0])
    for g, m in enumerate(models):
        if frozen_params(m) != frozen:
            raise ValueError(f"client {g} of the group has other frozen parameters (requires_grad=False) than the "
                             "group's first; train it in another group")
    obj = respect_frozen(obj, frozen)
    objs = [respect_frozen(o, frozen) for o in objs] if objs is not None else None
    P = {k: torch.stack([dict(m.named_parameters())[k].detach() for m in models]).clone() for k in names}
    ref = stacked_refs(obj, objs, names, G)
    offsets = np.cumsum([0] + [len(x) for x in xs])[:-1]
    X = torch.cat(list(xs)).contiguous()
    Y = torch.cat(list(ys))
    phases = [stack_plans(plans, pi, offsets, opt.batch_size) for pi in range(len(obj.phases))]
    out = train_stacked(models[0], P, X, Y, phases, obj, opt, ref)
    with torch.no_grad():
        for g, m in enumerate(models):
            named = dict(m.named_parameters())
            for k in names:
                named[k].copy_(P[k][g])
    return out


def stacked_refs(obj: Objective, objs: Sequence[Objective] | None, names: Sequence[str], G: int):
    """The anchor's reference weights (:class:`WeightAnchor`) of G clients stacked per name
    ((G, *shape); None without an anchor), after checking that the per-client objectives ``objs`` agree with ``obj`` in
    all else (:func:`train_group`'s ValueError)."""
    for g, o in enumerate(objs or ()):
        if not _same_objective(o, obj, names):
            raise ValueError(f"client {g} of the group has another objective than the group's (phases, loss "
                             "terms such as the global prototypes and λ, or the anchor's mu differ); train it in "
                             "another group")
    if obj.anchor_mu <= 0:
        return None
    src = objs if objs is not None else [obj] * G
    # frozen parameters (never trained, never sent) have no reference
    return {k: torch.stack([o.anchor.ref[k] for o in src]) for k in names if k in src[0].anchor.ref}


def train_stacked(
    m0: ProtoModel,
    P: dict[str, torch.Tensor],
    X: torch.Tensor,
    Y: torch.Tensor,
    phases: Sequence[StackedPhase],
    obj: Objective,
    opt: OptimConfig,
    ref: dict[str, torch.Tensor] | None = None,
) -> list[TrainResult]:
    """The core of :func:`train_group` on stacked weights: trains G clients, updating ``P`` in place.

    Args:
        m0: a model of the group's architecture (its :meth:`grouped_forward` is used, not its weights).
        P: name -> (G, *shape) stacked parameters (:attr:`ProtoModel.batch_params`).
        X: (N, Cin, H, W) inputs holding every client's samples; Y: (N,) labels.
        phases: one :class:`StackedPhase` per phase of ``obj`` (:func:`stack_plans`).
        obj: the objective (its anchor's references are not used: ``ref`` holds them stacked).
        ref: name -> (G, *shape) reference weights of the anchor (:class:`WeightAnchor`), or None.
    Returns:
        One :class:`TrainResult` per client.

    With ``opt.precision`` ``bf16``/``fp16`` the grouped forward runs under
    :func:`fedproto.devices.autocast_call`; ``fp16`` scales each client's loss
    (:class:`fedproto.devices.LossScale`) and skips the step of a client whose gradients overflow.
    """
    names = m0.batch_params
    G = next(iter(P.values())).shape[0]
    C, d = m0.num_classes, m0.embedding_dim
    dev = P[names[0]].device
    obj = on_device(obj, dev)
    ref = {k: v.to(dev) for k, v in ref.items()} if ref is not None else None
    X, Y = X.to(dev), Y.to(dev)
    Cin = X.shape[1]
    # prototype sums in float32 or better whatever the model's dtype (a half-precision model's too)
    sums = torch.zeros(G * C, d, dtype=torch.promote_types(X.dtype, torch.float32), device=dev) if obj.collect else None
    counts = torch.zeros(G * C, dtype=torch.long, device=dev) if obj.collect else None
    ce_tot = torch.zeros(G, dtype=torch.float64, device=dev)  # float64 sums: exact for float32 and float64 runs
    lp_tot = torch.zeros(G, dtype=torch.float64, device=dev)
    ex_tot = torch.zeros(G, dtype=torch.float64, device=dev)
    nsteps = torch.zeros(G, device=dev)
    norm_max = torch.zeros(G, dtype=torch.float64, device=dev)
    scaler = LossScale(G, dev, opt.precision == "fp16")  # fp16: per-client loss scales (a no-op otherwise)
    for pi, ph in enumerate(obj.phases):
        sp = phases[pi]
        train_names = [k for k in names if ph.trains is None or ph.trains(k)]
        for k in names:
            P[k].requires_grad_(k in train_names)
        bufs = stacked_state(opt, P, train_names)  # (slot, name) -> (G, *shape): momentum, or Adam's moments
        adam_steps = {k: torch.tensor(0.0) for k in train_names}  # Adam's step count (shared by stepping clients)
        Smax, B = sp.order.shape[0], sp.order.shape[1]
        order, weight, last = sp.order.to(dev), sp.weight.to(dev), sp.last.to(dev)
        noise = {k: v.to(dev) for k, v in sp.noise.items()}
        aug = sp.aug.to(dev) if sp.aug is not None else None
        is_last_phase = pi == len(obj.phases) - 1
        S_t = sp.steps
        cur: torch.Tensor | None = None  # ids of the clients still stepping (the set only shrinks)
        Pc: dict[str, torch.Tensor] = {}  # their parameters and momentum, compacted
        bufc: dict[str, torch.Tensor] = {}
        for s in range(Smax):
            act = torch.nonzero(S_t > s).flatten().to(dev)
            if cur is None or len(act) != len(cur):
                # compaction: clients whose data ran out leave the batched computation, so their
                # weights and momentum stay untouched and no compute is spent on padding
                if cur is not None:
                    _write_back(P, bufs, Pc, bufc, cur)
                cur, Gc = act, len(act)
                Pc = {k: P[k][cur].clone().requires_grad_(k in train_names) for k in names}
                bufc = {k: v[cur].clone() for k, v in bufs.items()}
                refc = {k: ref[k][cur] for k in train_names if k in ref} if ref is not None else None
                ids_C = (cur * C).unsqueeze(1)
            idx = order[s][:, cur].reshape(-1)
            xb = X[idx] if aug is None else augment_batch(X[idx], aug[s][:, cur].reshape(-1, 3))
            xb = xb.reshape(B, Gc * Cin, *X.shape[2:]).contiguous(memory_format=torch.channels_last)
            yb = Y[idx].reshape(B, Gc).t()
            w = weight[s][cur]
            nz = {k: v[s][cur] for k, v in noise.items()} if noise else None
            # the forward under autocast (opt.precision), its outputs back in float32 for the losses and sums
            logits, h = autocast_call(opt.precision, dev, m0.grouped_forward, Pc, xb, Gc, nz)
            ce, lp, extra, loss_g = step_terms(logits, h, yb, w, obj)
            if refc is not None:
                for k in refc:
                    loss_g = loss_g + 0.5 * obj.anchor_mu * ((Pc[k] - refc[k]) ** 2).flatten(1).sum(1)
            gs = torch.autograd.grad(scaler.scale(loss_g, cur).sum(), [Pc[k] for k in train_names],
                                     allow_unused=True) if train_names else ()  # () : all frozen
            stepped = [k for k, g in zip(train_names, gs) if g is not None]  # torch.optim skips a None gradient
            plist = [Pc[k] for k in stepped]
            grads = [g for g in gs if g is not None]
            with torch.no_grad():
                blist = [bufc["m", k] for k in stepped]
                ok = scaler.unscale(grads, cur)  # fp16: the clients whose gradients are finite (None otherwise)
                skipped = None if ok is None or bool(ok.all()) else ~ok
                kept = [t[skipped].clone() for t in (*plist, *bufc.values())] if skipped is not None else None
                if opt.optimizer != "sgd" and plist:  # Adam/AdamW: torch's own update on the stacked rows
                    adam_step_stacked(opt, plist, grads, blist, [bufc["v", k] for k in stepped],
                                      [adam_steps[k] for k in stepped])
                elif plist:  # SGD as torch.optim.SGD (weight decay, momentum, step)
                    if opt.weight_decay:
                        torch._foreach_add_(grads, plist, alpha=opt.weight_decay)
                    if opt.momentum:
                        torch._foreach_mul_(blist, opt.momentum)
                        torch._foreach_add_(blist, grads)
                    else:
                        torch._foreach_copy_(blist, grads)
                    torch._foreach_add_(plist, blist, alpha=-opt.round_lr)
                if kept is not None:  # fp16: a client with an overflow skips its step, as GradScaler.step does
                    for t, v in zip((*plist, *bufc.values()), kept):
                        t[skipped] = v
                scaler.update(ok, cur)
                ce_tot.index_add_(0, cur, ce.detach().double())
                lp_tot.index_add_(0, cur, lp.detach().double())
                ex_tot.index_add_(0, cur, extra.detach().double())
                nsteps[cur] += 1
                norm_max[cur] = torch.maximum(norm_max[cur], embedding_norm_max(h.detach(), -1, w > 0))
                if obj.collect and is_last_phase:
                    sel = last[s][cur].to(h.dtype).unsqueeze(1) * w  # (Gc, B)
                    flat = (yb + ids_C).reshape(-1)
                    sums.index_add_(0, flat, (h.detach() * sel.unsqueeze(-1)).reshape(-1, d).to(sums.dtype))
                    counts.index_add_(0, flat, sel.reshape(-1).long())
        if cur is not None:
            _write_back(P, bufs, Pc, bufc, cur)
    for k in names:
        P[k].requires_grad_(False)
    out = []
    for g in range(G):
        n = max(float(nsteps[g]), 1.0)
        out.append(
            TrainResult(
                sums[g * C : (g + 1) * C].cpu().clone() if obj.collect else None,
                counts[g * C : (g + 1) * C].cpu().clone() if obj.collect else None,
                float(ce_tot[g]) / n,
                float(lp_tot[g]) / n,
                int(nsteps[g]),
                float(norm_max[g]),
                float(ex_tot[g]) / n,
            )
        )
    return out
