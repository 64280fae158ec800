"""The generic batched path (:func:`train_group_generic`): clients of any one architecture as one
computation, through the grouped (fx-traced) layers where the model is made of standard layers,
else ``torch.func`` (``functional_call`` under ``vmap``), with BatchNorm statistics per client and
dropout masks replayed from each client's seed (:mod:`fedproto.training.replay`).

One path (its training loop and write-back), kept in one module so it reads top to bottom; its keys
and checks (:func:`generic_key`, :func:`generic_batch_problem`) live in
:mod:`fedproto.training.generic_checks` (re-exported here), the dropout replay it uses in
:mod:`fedproto.training.replay`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from fedproto.data.inputs import concat, move, tree_map
from fedproto.models.proto_model import ProtoModel
from fedproto.training.devices import LossScale, autocast_call
from fedproto.training.generic_checks import generic_batch_problem as generic_batch_problem  # re-exported
from fedproto.training.generic_checks import generic_key as generic_key
from fedproto.training.grouped_forward import grouped_call, grouped_forward, grouped_graph
from fedproto.training.objective import (
    Objective,
    OptimConfig,
    Phase,
    frozen_batchnorms,
    frozen_params,
    on_device,
    respect_frozen,
    stacked_state,
    step_terms,
)
from fedproto.training.plans import Plan, TrainResult, augment_batch
from fedproto.training.replay import (
    DropCall,
    Functional,
    dropout_calls,
    dropout_modules,
    replay_masks,
)
from fedproto.training.sequential import set_train_modes
from fedproto.training.stacked import StackedPhase, stack_plans, stacked_refs, train_stacked
from fedproto.training.step import StepTotals, anchor_penalty, stacked_optimizer_step

if TYPE_CHECKING:
    from torch import fx

# ----------------------------------------------------------------------------------------------
# Client-batched path for any model (torch.func): the same computation as train_client, G clients at once.

def train_group_generic(
    models: Sequence[ProtoModel],
    xs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    plans: Sequence[Plan],
    obj: Objective,
    opt: OptimConfig,
    objs: Sequence[Objective] | None = None,
    seeds: Sequence[int] | None = None,
) -> list[TrainResult]:
    """Train G clients of one architecture (equal :func:`generic_key`) as one batched computation,
    for any model: ``torch.func.functional_call`` of the first model under ``torch.func.vmap`` over
    the clients' stacked parameters and buffers (torch.func's model ensembling).

    The same computation as :func:`train_client` per client, so the same weights up to float rounding:

    * each step feeds every client exactly its valid samples of the plan (no padding): clients whose
      step holds another sample count (a trailing batch) run in a vmapped call of their own in the
      same step, so BatchNorm normalises each client's batch with that batch's own statistics;
    * BatchNorm running statistics are stacked buffers updated per client in place; BatchNorm
      layers whose parameters are all frozen (:func:`frozen_batchnorms`) or that a phase with
      ``frozen_eval`` does not train run in eval mode; frozen parameters (:func:`frozen_params`)
      are not updated and keep their flags;
    * dropout modules (``nn.Dropout``, ``nn.Dropout1d/2d/3d``) take per-client masks replayed from
      torch's CPU generator seeded with the client's ``seeds[g]`` (:func:`replay_masks`), the masks
      the sequential path draws after ``torch.manual_seed(seeds[g])``; explicit masks
      (:meth:`ProtoModel.noise_widths`) come from the plans as on every path;
    * SGD with momentum and weight decay as ``torch.optim.SGD``, Adam/AdamW with ``torch.optim.adam.adam``
      (a fresh optimizer per phase; parameters that get no gradient are skipped, as torch.optim skips a
      ``None`` gradient).

    Clients whose plan has run out of steps leave the stacked computation (compaction), as in
    :func:`train_stacked`. Models made only of the standard layers
    :func:`fedproto.training.grouped_forward.grouped_graph` accepts (no BatchNorm, no active dropout) run
    their forward as G-grouped operations on one channels-last layout
    (:func:`fedproto.training.grouped_forward.grouped_forward`) instead of under ``vmap``; on image inputs
    they train in :func:`train_stacked`'s loop, the paper CNN's: one grouped call per step, a
    trailing batch padded with samples of weight 0 (their samples do not interact without BatchNorm),
    one ``torch._foreach`` optimizer step for all parameters. The same computation, faster on CPU.
    ``opt.precision`` as in :func:`fedproto.training.train_stacked` (autocast forward, per-client loss
    scaling for ``fp16``).

    Args:
        models: G models with equal :func:`generic_key` that passed :func:`generic_batch_problem`;
            updated in place (parameters and buffers).
        xs: per client local inputs (n_g, ...): tensors of any dtype, or :class:`fedproto.data.inputs.Inputs`
            (dicts, tuples of tensors) of one structure, passed to the model as they are; ys: per client
            labels (n_g,).
        plans: per client plans with the same phase structure (:func:`make_plan`).
        obj: the shared objective; objs: optional per-client objectives (for their anchor's
            references only, :class:`WeightAnchor`).
        opt: optimizer settings (:class:`OptimConfig`).
        seeds: per client seed of torch's generator on the sequential path
            (:func:`fedproto.engine.seeding.client_seed`); needed when the models hold active dropout
            modules. On CUDA the sequential path's dropout draws from the fused CUDA kernel's
            generator instead, so there the two paths draw other (equally distributed) masks.
    Returns:
        One :class:`TrainResult` per client, as :func:`train_client` would give.
    Raises:
        ValueError: models with different :func:`generic_key`, per-client objectives that differ in
            anything but their anchor's references, or models with active dropout modules and no
            ``seeds``.
    """
    m0 = models[0]
    grp, offsets = _prepare_group(models, xs, ys, plans, obj, opt, objs, seeds)
    if grp.gm is not None and grp.X.dim() == 4:  # images: the hand-written batched path's loop (train_stacked)
        return _train_traced(models, grp, plans, offsets)
    user_frozen_bn = {id(m) for m in frozen_batchnorms(m0)}
    with Functional(m0) as fn:
        for pi, ph in enumerate(grp.obj.phases):
            for m in models:  # the modes the sequential path leaves each model in
                set_train_modes(m, ph, {id(b) for b in frozen_batchnorms(m)})
            set_train_modes(m0, ph, user_frozen_bn)
            _generic_phase(grp, fn, stack_plans(plans, pi, offsets, opt.batch_size), pi, ph)
    _copy_back(models, grp.P, grp.Bf)
    return grp.totals.results()


def _prepare_group(models: Sequence[ProtoModel], xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor],
                   plans: Sequence[Plan], obj: Objective, opt: OptimConfig, objs: Sequence[Objective] | None,
                   seeds: Sequence[int] | None) -> tuple[_Group, np.ndarray]:
    """The group's stacked weights, inputs, anchor references and dropout masks (:class:`_Group`) and
    each client's first row in the group's inputs, for :func:`train_group_generic` (its ValueErrors)."""
    G, m0 = len(models), models[0]
    key = generic_key(m0)
    for g, m in enumerate(models):
        if key is None or generic_key(m) != key:
            raise ValueError(f"client {g} of the group has another architecture, frozen set or module configuration "
                             "than the group's first (fedproto.training.generic_key); train it in another group")
    frozen = frozen_params(m0)
    names = [k for k, _ in m0.named_parameters()]
    bnames = [k for k, _ in m0.named_buffers()]
    obj = respect_frozen(obj, frozen)
    objs = [respect_frozen(o, frozen) for o in objs] if objs is not None else None
    ref = stacked_refs(obj, objs, names, G)
    dev = next(m0.parameters()).device
    obj = on_device(obj, dev)
    ref = {k: v.to(dev) for k, v in ref.items()} if ref is not None else None
    calls = dropout_calls(m0, move(xs[0][:1], dev)) if dropout_modules(m0) else []
    if calls and seeds is None:
        raise ValueError("models with dropout modules need the clients' torch seeds (seeds=) to draw the "
                         "sequential path's masks")
    # seeds: given wherever there are calls (checked above)
    masks = [replay_masks(calls, [(w > 0).sum(1) for w in pl.weight], cast(Sequence[int], seeds)[g]) if calls else None
             for g, pl in enumerate(plans)]
    P = {k: torch.stack([dict(m.named_parameters())[k].detach() for m in models]).clone() for k in names}
    Bf = {k: torch.stack([dict(m.named_buffers())[k] for m in models]).clone() for k in bnames}
    offsets = np.cumsum([0] + [len(x) for x in xs])[:-1]
    X = concat(xs, dev)  # a tensor, or fedproto.data.inputs.Inputs (dicts, tuples: leaf by leaf)
    Y = torch.cat([y.to(dev) for y in ys])
    floats = isinstance(X, torch.Tensor) and X.is_floating_point()  # token ids, structures: under vmap
    gm = None if calls or bnames or not floats else grouped_graph(m0)[0]  # standard layers only: grouped ops
    totals = StepTotals(G, m0.num_classes, m0.embedding_dim, P[names[0]].dtype, dev, obj.collect)
    scaler = LossScale(G, dev, opt.precision == "fp16")  # fp16: per-client loss scales (a no-op otherwise)
    return _Group(m0, names, bnames, P, Bf, X, Y, ref, calls, masks, obj, opt, gm, totals, scaler), offsets


def _train_traced(models: Sequence[ProtoModel], grp: _Group, plans: Sequence[Plan],
                  offsets: np.ndarray) -> list[TrainResult]:
    """Models of standard layers on image inputs: :func:`train_stacked`'s loop on the grouped graph."""
    for m in models:
        m.train()
    phases = [stack_plans(plans, pi, offsets, grp.opt.batch_size) for pi in range(len(grp.obj.phases))]
    out = train_stacked(_Traced(grp.gm, grp.m0, grp.names), grp.P, grp.X.contiguous(), grp.Y, phases, grp.obj,
                        grp.opt, grp.ref)
    _copy_back(models, grp.P, {})
    return out


@dataclass
class _Group:
    """What the phases and steps of :func:`train_group_generic` read: the group's template model,
    parameter and buffer names, stacked parameters and buffers (name -> (G, *shape)), all inputs
    and labels, the anchor's stacked references, the dropout calls and each client's replayed masks,
    the objective, the optimizer settings, the grouped graph (None: ``vmap``), the totals, the loss scale."""

    m0: ProtoModel
    names: list[str]
    bnames: list[str]
    P: dict[str, torch.Tensor]
    Bf: dict[str, torch.Tensor]
    X: Any
    Y: torch.Tensor
    ref: dict[str, torch.Tensor] | None
    calls: list[DropCall]
    masks: list[list[list[dict[str, torch.Tensor]]] | None]
    obj: Objective
    opt: OptimConfig
    gm: Any
    totals: StepTotals
    scaler: LossScale


def _copy_back(models: Sequence[ProtoModel], P: dict[str, torch.Tensor], Bf: dict[str, torch.Tensor]) -> None:
    """Each model's parameters (and buffers named in ``Bf``) from its row of the stacks."""
    with torch.no_grad():
        for g, m in enumerate(models):
            for k, p in m.named_parameters():
                p.copy_(P[k][g])
            for k, b in m.named_buffers():
                if k in Bf:
                    b.copy_(Bf[k][g])


def _generic_phase(grp: _Group, fn: Functional, sp: StackedPhase, pi: int, ph: Phase) -> None:
    """One phase of :func:`train_group_generic`: its steps, clients leaving as their data runs out."""
    dev = grp.Y.device
    train_names = [k for k in grp.names if ph.trains is None or ph.trains(k)]
    mom = stacked_state(grp.opt, grp.P, train_names)  # (slot, name): momentum, or Adam's moments
    adam_steps = {k: torch.tensor(0.0) for k in train_names}  # Adam's step count per parameter
    collect = grp.obj.collect and pi == len(grp.obj.phases) - 1
    view = _PhaseView(pi, sp.order.to(dev), (sp.weight > 0).sum(-1), {k: v.to(dev) for k, v in sp.noise.items()},
                      sp.aug.to(dev) if sp.aug is not None else None, sp.last, train_names, collect)
    cur: torch.Tensor | None = None
    Pc: dict[str, torch.Tensor] = {}  # the stepping clients' parameters, buffers and momentum, compacted
    Bc: dict[str, torch.Tensor] = {}
    momc: dict[tuple[str, str], torch.Tensor] = {}
    for s in range(view.order.shape[0]):
        act = torch.nonzero(sp.steps > s).flatten()
        if cur is None or len(act) != len(cur):
            if cur is not None:
                _write_back_generic(grp.P, grp.Bf, mom, Pc, Bc, momc, cur)
            cur = act
            Pc = {k: grp.P[k][cur.to(dev)].clone().requires_grad_(k in train_names) for k in grp.names}
            Bc = {k: grp.Bf[k][cur.to(dev)].clone() for k in grp.bnames}
            momc = {k: v[cur.to(dev)].clone() for k, v in mom.items()}
        cnt = view.valid_n[s][cur]
        grads: dict[str, torch.Tensor | None] = {}
        for c in torch.unique(cnt).tolist():
            _generic_subgroup(grp, fn, view, s, cur, torch.nonzero(cnt == c).flatten(), c, Pc, Bc, grads)
        stepped = [k for k in train_names if grads.get(k) is not None]  # torch.optim skips None grads
        # stepped: the names whose gradient is not None
        stacked_optimizer_step(grp.opt, [Pc[k] for k in stepped], [cast(torch.Tensor, grads[k]) for k in stepped],
                               momc, stepped, adam_steps, grp.scaler, cur.to(dev))
    if cur is not None:
        _write_back_generic(grp.P, grp.Bf, mom, Pc, Bc, momc, cur)


@dataclass
class _PhaseView:
    """One phase's stacked plans as the steps of :func:`train_group_generic` read them: order
    (Smax, B, G) rows of X, valid_n (Smax, G) samples per step, noise masks, augmentation, last
    (Smax, G) steps of the last epoch, the trained parameters' names, whether prototypes are summed."""

    pi: int
    order: torch.Tensor
    valid_n: torch.Tensor
    noise: dict[str, torch.Tensor]
    aug: torch.Tensor | None
    last: torch.Tensor
    train_names: list[str]
    collect: bool


def _generic_subgroup(grp: _Group, fn: Functional, view: _PhaseView, s: int, cur: torch.Tensor, pos: torch.Tensor,
                      c: int, Pc: dict[str, torch.Tensor], Bc: dict[str, torch.Tensor],
                      grads: dict[str, torch.Tensor | None]) -> None:
    """Step ``s`` of the stepping clients ``cur[pos]``, those with ``c`` samples in it: forward (vmapped or
    grouped), losses, gradients into ``grads`` (rows ``pos``), totals; BatchNorm statistics into ``Bc``."""
    dev, train_names = grp.Y.device, view.train_names
    whole = len(pos) == len(cur)
    pos_d = pos.to(dev)
    ids = cur[pos]
    idd = ids.to(dev)
    # another sample count than the rest of the step: the clients' own leaves, their gradients
    # copied into the step's (every stepping client is in exactly one sub-group)
    pin = Pc if whole else {k: v[pos_d].detach().requires_grad_(k in train_names) for k, v in Pc.items()}
    bin_ = Bc if whole else {k: v[pos_d].clone() for k, v in Bc.items()}
    idx = view.order[s][:c, idd].t()  # (Gs, c) rows of X
    xb = grp.X[idx.reshape(-1)]
    if view.aug is not None:
        xb = augment_batch(xb, view.aug[s][:c, idd].transpose(0, 1).reshape(-1, 3))

    def split(t: torch.Tensor, n: int = len(ids), c: int = c) -> torch.Tensor:  # (n*c, ...) -> (n, c, ...)
        return t.reshape(n, c, *t.shape[1:])

    xb = tree_map(split, xb)
    yb = grp.Y[idx]
    mk = {d_.name: torch.stack([grp.masks[g][view.pi][s][d_.name] for g in ids.tolist()]).to(dev)
          for d_ in grp.calls}
    nz = {k: v[s][idd, :c] for k, v in view.noise.items()}
    # the forward under autocast (opt.precision), its outputs back in float32 for the losses
    logits, h = (autocast_call(grp.opt.precision, dev, grouped_call, grp.gm, pin, xb) if grp.gm is not None
                 else autocast_call(grp.opt.precision, dev, fn, pin, bin_, xb, mk, nz))
    if not whole:
        with torch.no_grad():
            for k in grp.bnames:
                Bc[k][pos_d] = bin_[k]
    w = torch.ones(yb.shape, dtype=logits.dtype, device=dev)
    ce, lp, extra, loss_g = step_terms(logits, h, yb, w, grp.obj)
    refs = {k: grp.ref[k][idd] for k in train_names if k in grp.ref} if grp.ref is not None else None
    loss_g = anchor_penalty(loss_g, grp.obj, pin, refs)
    if train_names:
        gs = torch.autograd.grad(grp.scaler.scale(loss_g, idd).sum(), [pin[k] for k in train_names],
                                 allow_unused=True)
        for k, gr in zip(train_names, gs):
            if whole or gr is None:
                grads[k] = gr
            else:
                if k not in grads:
                    grads[k] = torch.empty_like(Pc[k])
                # a tensor: made above or by an earlier sub-group (a parameter gets a gradient in all or none)
                cast(torch.Tensor, grads[k]).index_copy_(0, pos_d, gr)
    grp.totals.add(idd, ce, lp, extra, h)
    if view.collect:
        grp.totals.collect(idd, yb, h, view.last[s][ids].to(dev).to(h.dtype).unsqueeze(1) * w)


class _Traced:
    """A model traced for the grouped forward (:func:`fedproto.training.grouped_forward.grouped_graph`) in the role
    :func:`train_stacked` gives a model with a hand-written batched forward."""

    def __init__(self, gm: fx.GraphModule, m0: ProtoModel, names: Sequence[str]) -> None:
        self.gm, self.batch_params = gm, tuple(names)
        self.num_classes, self.embedding_dim = m0.num_classes, m0.embedding_dim

    def grouped_forward(self, P: dict[str, torch.Tensor], xb: torch.Tensor, G: int,
                        noise: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_forward(self.gm, P, xb, G)


@torch.no_grad()
def _write_back_generic(P: dict[str, torch.Tensor], Bf: dict[str, torch.Tensor],
                        mom: dict[tuple[str, str], torch.Tensor], Pc: dict[str, torch.Tensor],
                        Bc: dict[str, torch.Tensor], momc: dict[tuple[str, str], torch.Tensor],
                        cur: torch.Tensor) -> None:
    """Copy the compacted parameters, buffers and optimizer state of clients ``cur`` back into the full stacks."""
    ids = cur.to(next(iter(P.values())).device)
    for k in P:
        P[k][ids] = Pc[k].detach()
    for k in Bf:
        Bf[k][ids] = Bc[k]
    for slot in mom:
        mom[slot][ids] = momc[slot]
