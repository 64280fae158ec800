"""Local training: one client step as a function of (model, data, plan, objective).

Two execution paths share every definition in this module:

* :func:`train_client` — the reference: a plain ``nn.Module`` loop with a ``torch.optim`` optimizer
  (:func:`make_optimizer`: SGD, Adam or AdamW).
* :func:`train_group` — clients of one CNN architecture trained as one batched computation:
  their weights are stacked along a client axis, convolutions become grouped convolutions over
  clients stacked on the channel axis (channels-last), linear layers become batched matmuls,
  and the optimizer is applied per client (SGD with momentum as ``torch.optim.SGD``, Adam/AdamW with
  ``torch.optim.adam.adam`` on the stacked rows); clients whose data has run out leave the stacked
  computation (compaction), so their weights and optimizer state stay untouched.

* :func:`train_group_generic` — clients of any one architecture (equal :func:`generic_key`) trained
  as one batched computation with ``torch.func``: ``functional_call`` of one model under ``vmap``
  over the clients' stacked parameters and buffers (BatchNorm statistics per client, dropout
  masks replayed from each client's torch seed); for models without a hand-written batched forward.

All draw their randomness (batch order, dropout masks and, with ``OptimConfig.augment``, the
crop offsets and flips of :func:`augment_batch`) from the same per-client plan
(:func:`make_plan`), so they give the same weights up to float rounding.

Loss per step and client (eq. 7): mean cross-entropy over the batch + the method's loss terms
(:class:`LossTerm`; FedProto's: λ x :func:`fedproto.prototypes.proto_loss`) + ``mu``/2 x
||w - w_ref||² of a :class:`WeightAnchor` (FedProx, FeSEM) (:func:`step_terms`, :func:`anchor_loss`).
The optimizer is created anew at each call (official code: a fresh ``torch.optim.SGD`` per round,
so momentum, or Adam's moments, do not carry across rounds); its lr is the round's
(:meth:`OptimConfig.lr_of_round`, the ``lr_schedule`` option).

The package's modules: :mod:`~fedproto.training.objective` (what is minimised, with which
optimizer), :mod:`~fedproto.training.terms` (loss terms, the weight anchor, the step's loss),
:mod:`~fedproto.training.plans` (each client's randomness of a round),
:mod:`~fedproto.training.sequential` (the reference loop and inference),
:mod:`~fedproto.training.stacked` (the hand-written batched path) and
:mod:`~fedproto.training.generic` (the generic batched path, with the dropout replay of
:mod:`~fedproto.training.replay`); their public names are importable
from ``fedproto.training``.
"""

from __future__ import annotations

from fedproto.training.generic import (  # noqa: F401
    generic_batch_problem,
    generic_key,
    train_group_generic,
)
from fedproto.training.objective import (  # noqa: F401
    ADAM_BETAS,
    ADAM_EPS,
    AUGMENT_PAD,
    CROSS_ENTROPY,
    DPSGD,
    EMBED_NORM_LIMIT,
    EVAL_TRAIN_NORM_RATIO,
    LR_SCHEDULES,
    OPTIMIZERS,
    CrossEntropy,
    LossTerm,
    Objective,
    OptimConfig,
    Phase,
    WeightAnchor,
    adam_step_stacked,
    anchor_loss,
    frozen_batchnorms,
    frozen_params,
    has_batchnorm,
    make_optimizer,
    min_batch,
    on_device,
    respect_frozen,
    stacked_state,
    step_terms,
)
from fedproto.training.plans import (  # noqa: F401
    Plan,
    TrainResult,
    augment_batch,
    make_plan,
    poisson_plan,
)
from fedproto.training.sequential import (  # noqa: F401
    embed_all,
    embedding_norm_max,
    predict,
    train_client,
)
from fedproto.training.stacked import (  # noqa: F401
    StackedPhase,
    TrainsOnly,
    batch_key,
    can_batch,
    portable_objective,
    stack_plans,
    stacked_refs,
    train_group,
    train_stacked,
)

__all__ = [
    "ADAM_BETAS", "ADAM_EPS", "AUGMENT_PAD", "CROSS_ENTROPY", "CrossEntropy", "DPSGD", "EMBED_NORM_LIMIT",
    "EVAL_TRAIN_NORM_RATIO", "LR_SCHEDULES",
    "LossTerm", "OPTIMIZERS", "Objective", "OptimConfig", "Phase", "Plan", "StackedPhase", "TrainResult",
    "TrainsOnly", "WeightAnchor", "adam_step_stacked", "anchor_loss", "augment_batch", "batch_key", "can_batch",
    "embed_all", "frozen_batchnorms",
    "frozen_params", "generic_batch_problem", "generic_key", "has_batchnorm", "make_optimizer", "make_plan",
    "min_batch", "embedding_norm_max", "on_device", "poisson_plan", "portable_objective", "predict", "respect_frozen",
    "stack_plans", "stacked_refs", "stacked_state", "step_terms", "train_client", "train_group",
    "train_group_generic", "train_stacked",
]
