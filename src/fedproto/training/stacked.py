"""Clients of one architecture trained as one batched computation (:func:`train_group`,
:func:`train_stacked`): stacked weights, grouped convolutions and batched matmuls over clients,
the optimizer applied per client, clients leaving the computation when their data runs out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, cast

import numpy as np
import torch

from fedproto.models.proto_model import ProtoModel
from fedproto.training.devices import LossScale, autocast_call
from fedproto.training.objective import (
    Objective,
    OptimConfig,
    Phase,
    WeightAnchor,
    frozen_params,
    on_device,
    respect_frozen,
    same_term,
    stacked_state,
    step_terms,
)
from fedproto.training.plans import Plan, TrainResult, augment_batch
from fedproto.training.step import StepTotals, anchor_penalty, stacked_optimizer_step

# ----------------------------------------------------------------------------------------------
# Client-batched path for the paper CNN family.


class GroupedModel(Protocol):
    """What :func:`train_stacked` reads of its model: a :class:`ProtoModel` with a hand-written batched
    forward, or the generic path's traced one (:mod:`fedproto.training.generic`)."""

    batch_params: tuple[str, ...]
    num_classes: int
    embedding_dim: int

    def grouped_forward(self, P: dict[str, torch.Tensor], xb: torch.Tensor, G: int,
                        noise: dict[str, torch.Tensor] | None = None) -> Any: ...


def batch_key(model: ProtoModel) -> tuple[object, ...] | None:
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
    # what each phase trains, by parameter name (the predicates are new functions each round)
    def phases(o: Objective) -> list[tuple[int, tuple[bool, ...] | None]]:
        return [(p.epochs, None if p.trains is None else tuple(p.trains(k) for k in names)) for p in o.phases]

    return (phases(a) == phases(b) and a.anchor_mu == b.anchor_mu and a.collect == b.collect
            and len(a.terms) == len(b.terms) and all(t.same_as(u) for t, u in zip(a.terms, b.terms))
            and same_term(a.classification, b.classification))


@torch.no_grad()
def _write_back(P: dict[str, torch.Tensor], bufs: dict[tuple[str, str], torch.Tensor], Pc: dict[str, torch.Tensor],
                bufc: dict[tuple[str, str], torch.Tensor], ids: torch.Tensor) -> None:
    """Copy the compacted parameters and optimizer state of clients ``ids`` back into the full stacks."""
    for k in P:
        P[k][ids] = Pc[k].detach()
    for slot in bufs:
        bufs[slot][ids] = bufc[slot]


class TrainsOnly:
    """A picklable :attr:`Phase.trains` predicate: true for the parameter names in ``names``
    (the worker processes of :mod:`fedproto.engine.executors.worker_pool` get phases in this form)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)

    def __call__(self, name: str) -> bool:
        return name in self.names

    def __eq__(self, other: object) -> bool:
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


def stack_plans(plans: Sequence[Plan], pi: int, offsets: Sequence[int] | np.ndarray, batch_size: int) -> StackedPhase:
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


def stacked_refs(obj: Objective, objs: Sequence[Objective] | None, names: Sequence[str],
                 G: int) -> dict[str, torch.Tensor] | None:
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
    return {k: torch.stack([_anchor_ref(o)[k] for o in src]) for k in names if k in _anchor_ref(src[0])}


def _anchor_ref(o: Objective) -> dict[str, torch.Tensor]:
    """The anchor's references of an objective with an anchor (anchor_mu > 0) that carries them: the
    per-client objectives the batched paths are given do (a missing one fails here as it did before)."""
    return cast(dict[str, torch.Tensor], cast(WeightAnchor, o.anchor).ref)


def train_stacked(
    m0: GroupedModel,
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
    :func:`fedproto.training.devices.autocast_call`; ``fp16`` scales each client's loss
    (:class:`fedproto.training.devices.LossScale`) and skips the step of a client whose gradients overflow.
    """
    names = m0.batch_params
    G = next(iter(P.values())).shape[0]
    dev = P[names[0]].device
    obj = on_device(obj, dev)
    ref = {k: v.to(dev) for k, v in ref.items()} if ref is not None else None
    X, Y = X.to(dev), Y.to(dev)
    totals = StepTotals(G, m0.num_classes, m0.embedding_dim, X.dtype, dev, obj.collect)
    scaler = LossScale(G, dev, opt.precision == "fp16")  # fp16: per-client loss scales (a no-op otherwise)
    for pi, ph in enumerate(obj.phases):
        train_names = [k for k in names if ph.trains is None or ph.trains(k)]
        for k in names:
            P[k].requires_grad_(k in train_names)
        _stacked_phase(m0, P, X, Y, phases[pi], obj, opt, ref, train_names, totals, scaler,
                       collect=obj.collect and pi == len(obj.phases) - 1)
    for k in names:
        P[k].requires_grad_(False)
    return totals.results()


def _stacked_phase(m0: GroupedModel, P: dict[str, torch.Tensor], X: torch.Tensor, Y: torch.Tensor,
                   sp: StackedPhase, obj: Objective, opt: OptimConfig, ref: dict[str, torch.Tensor] | None,
                   train_names: list[str], totals: StepTotals, scaler: LossScale, collect: bool) -> None:
    """One phase of :func:`train_stacked`: its steps, clients leaving as their data runs out."""
    names = m0.batch_params
    dev = P[names[0]].device
    bufs = stacked_state(opt, P, train_names)  # (slot, name) -> (G, *shape): momentum, or Adam's moments
    adam_steps = {k: torch.tensor(0.0) for k in train_names}  # Adam's step count (shared by stepping clients)
    sp = StackedPhase(steps=sp.steps, order=sp.order.to(dev), weight=sp.weight.to(dev), last=sp.last.to(dev),
                      noise={k: v.to(dev) for k, v in sp.noise.items()},
                      aug=sp.aug.to(dev) if sp.aug is not None else None)
    cur: torch.Tensor | None = None  # ids of the clients still stepping (the set only shrinks)
    Pc: dict[str, torch.Tensor] = {}  # their parameters and momentum, compacted
    bufc: dict[tuple[str, str], torch.Tensor] = {}
    refc: dict[str, torch.Tensor] | None = None
    for s in range(sp.order.shape[0]):
        act = torch.nonzero(sp.steps > s).flatten().to(dev)
        if cur is None or len(act) != len(cur):
            # compaction: clients whose data ran out leave the batched computation, so their
            # weights and momentum stay untouched and no compute is spent on padding
            if cur is not None:
                _write_back(P, bufs, Pc, bufc, cur)
            cur = act
            Pc = {k: P[k][cur].clone().requires_grad_(k in train_names) for k in names}
            bufc = {k: v[cur].clone() for k, v in bufs.items()}
            refc = {k: ref[k][cur] for k in train_names if k in ref} if ref is not None else None
        _stacked_step(m0, Pc, bufc, refc, X, Y, sp, s, cur, obj, opt, train_names, adam_steps, totals, scaler,
                      collect)
    if cur is not None:
        _write_back(P, bufs, Pc, bufc, cur)


def _stacked_step(m0: GroupedModel, Pc: dict[str, torch.Tensor], bufc: dict[tuple[str, str], torch.Tensor],
                  refc: dict[str, torch.Tensor] | None,
                  X: torch.Tensor, Y: torch.Tensor, sp: StackedPhase, s: int, cur: torch.Tensor, obj: Objective,
                  opt: OptimConfig, train_names: list[str], adam_steps: dict[str, torch.Tensor],
                  totals: StepTotals, scaler: LossScale, collect: bool) -> None:
    """Step ``s`` of the stepping clients ``cur`` (Gc,): one grouped forward, one backward, one
    optimizer step for all (:func:`fedproto.training.step.stacked_optimizer_step`)."""
    Gc, B, Cin = len(cur), sp.order.shape[1], X.shape[1]
    idx = sp.order[s][:, cur].reshape(-1)
    xb = X[idx] if sp.aug is None else augment_batch(X[idx], sp.aug[s][:, cur].reshape(-1, 3))
    xb = xb.reshape(B, Gc * Cin, *X.shape[2:]).contiguous(memory_format=torch.channels_last)
    yb = Y[idx].reshape(B, Gc).t()
    w = sp.weight[s][cur]
    nz = {k: v[s][cur] for k, v in sp.noise.items()} if sp.noise else None
    # the forward under autocast (opt.precision), its outputs back in float32 for the losses and sums
    logits, h = autocast_call(opt.precision, X.device, m0.grouped_forward, Pc, xb, Gc, nz)
    ce, lp, extra, loss_g = step_terms(logits, h, yb, w, obj)
    loss_g = anchor_penalty(loss_g, obj, Pc, refc)
    gs = torch.autograd.grad(scaler.scale(loss_g, cur).sum(), [Pc[k] for k in train_names],
                             allow_unused=True) if train_names else ()  # () : all frozen
    stepped = [k for k, g in zip(train_names, gs) if g is not None]  # torch.optim skips a None gradient
    stacked_optimizer_step(opt, [Pc[k] for k in stepped], [g for g in gs if g is not None], bufc, stepped,
                           adam_steps, scaler, cur)
    totals.add(cur, ce, lp, extra, h, w > 0)
    if collect:
        totals.collect(cur, yb, h, sp.last[s][cur].to(h.dtype).unsqueeze(1) * w)  # (Gc, B)
