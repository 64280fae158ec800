"""FD (FedDistill): per-class mean logits and logit distillation (Jeong et al., arXiv 1811.11479;
PFLlib's ``clientdistill`` / ``serverdistill``). Conventions: :mod:`fedproto.algorithms.hetero_math`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fedproto.algorithms.hetero_math.uploads import class_centers

FD_FORMS: tuple[str, ...] = ("ce", "kl")


def class_mean_logits(
    logits: torch.Tensor, y: torch.Tensor, num_classes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A client's per-class mean logits (FD's local-average logit vectors): for each class j it
    holds, (1/n_j) sum_{b: y_b = j} z_b.

    The paper averages the logits the model produced during local training (alg. 1); PFLlib's
    ``clientdistill`` does too (the outputs of every local step, detached). Pass those outputs, or
    the outputs of an evaluation pass after training, as the algorithm chooses.

    Args:
        logits: (N, C) float. y: (N,) int64 labels in [0, num_classes). num_classes: C.
    Returns:
        classes (K,) int64 of the classes present, means (K, C) in the logits' dtype, counts (K,) int64.
    Raises:
        ValueError: shapes other than (N, C) and (N,), or a label outside 0..C-1.
    """
    if logits.ndim != 2 or y.shape != (logits.shape[0],) or logits.shape[1] != num_classes:
        raise ValueError(f"class_mean_logits needs logits (N, {num_classes}) and labels (N,): "
                         f"got {tuple(logits.shape)} and {tuple(y.shape)}")
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ValueError(f"label {int(y.max()) if int(y.max()) >= num_classes else int(y.min())} is outside "
                         f"0..{num_classes - 1}")
    z = logits.detach()
    sums = torch.zeros(num_classes, num_classes, dtype=z.dtype, device=z.device).index_add_(0, y, z)
    counts = torch.bincount(y, minlength=num_classes)
    present = torch.nonzero(counts > 0).flatten()
    means = sums[present] / counts[present].unsqueeze(1).to(z.dtype)
    return (present.cpu().numpy().astype(np.int64), means.cpu().numpy(),
            counts[present].cpu().numpy().astype(np.int64))


def fd_global_logits(
    classes: Sequence[np.ndarray],
    logits: Sequence[np.ndarray],
    counts: Sequence[np.ndarray] | None,
    num_classes: int,
    rule: str = "mean",
    leave_out: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FD's server: the global-average logit vector of each class over the clients that sent it
    (:func:`class_centers` on (K_i, C) mean logits).

    PFLlib (``serverdistill.logit_aggregation``) takes the unweighted mean over all clients and
    sends every client the same table (``rule="mean"``, ``leave_out=None``). The paper's alg. 1
    gives device i the average of the other devices' logits (``leave_out=i``): a device then
    never distils toward its own upload.

    Returns:
        classes (K,) int64, global logits (K, C), contributors (K,) int64.
    Raises:
        ValueError: as :func:`class_centers`, and rows whose width is not C.
    """
    for i, z in enumerate(logits):
        z = np.asarray(z)
        if z.ndim == 2 and len(z) and z.shape[1] != num_classes:
            raise ValueError(f"client {i} sends logits of width {z.shape[1]}; "
                             f"FD needs one logit per class ({num_classes})")
    return class_centers(classes, logits, counts, num_classes, rule, leave_out)


def fd_distill_loss(
    logits: torch.Tensor,
    y: torch.Tensor,
    table: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    form: str = "ce",
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """FD's distillation term of the client loss, between each sample's logits z_b and the global
    logits t = table[y_b] of its class:

    * ``ce`` (paper and PFLlib): the cross-entropy with the soft target softmax(t / T),
      -sum_c softmax(t/T)_c log softmax(z/T)_c. The paper writes the regulariser as the
      cross-entropy ϕ between the model's output and the global-average logit of the label
      (alg. 1) with no temperature (T = 1); PFLlib adds ``CrossEntropyLoss(output,
      global_logit.softmax(1)) * lamda`` (T = 1, lamda 1 by default).
    * ``kl``: KL(softmax(t/T) || softmax(z/T)), the same gradient in z as ``ce``, zero at a match.

    Both are multiplied by T² (Hinton et al.'s scaling, so the gradient size does not shrink with
    T; T = 1 changes nothing). Averaged over the (valid) batch; a sample whose class has no
    global logits adds 0 but counts in the denominator. (PFLlib gives such a sample its own
    detached output as target: the same zero gradient, but the loss *value* then also includes
    that sample's prediction entropy.)

    Args:
        logits: (..., B, C) the model's logits. y: (..., B) labels. table: (C, C) global logits,
            row j for class j. mask: (C,) bool, rows that exist. temperature: T > 0.
        form: ``ce`` or ``kl``. weight: (..., B) 0/1 sample validity (padding), None for all valid.
    Returns:
        (...) loss in the logits' dtype.
    Raises:
        ValueError: T not above 0, an unknown form, or a table that is not (C, C).
    """
    if not temperature > 0:
        raise ValueError(f"distillation temperature {temperature}: give T > 0 (the paper and PFLlib use 1)")
    if form not in FD_FORMS:
        raise ValueError(f"unknown distillation form {form!r}; choose one of {FD_FORMS}")
    C = logits.shape[-1]
    if table.shape != (C, C) or mask.shape != (C,):
        raise ValueError(f"fd_distill_loss needs a ({C}, {C}) table and a ({C},) mask for logits of width {C}: "
                         f"got {tuple(table.shape)} and {tuple(mask.shape)}")
    if weight is None:
        weight = torch.ones(y.shape, dtype=logits.dtype, device=logits.device)
    target = torch.softmax(table.to(logits.dtype)[y] / temperature, dim=-1)
    logq = torch.log_softmax(logits / temperature, dim=-1)
    per = -(target * logq).sum(-1)
    if form == "kl":
        per = per + (target * torch.log(target.clamp_min(torch.finfo(target.dtype).tiny))).sum(-1)
    covered = mask.to(logits.device)[y].to(logits.dtype) * weight
    return (per * covered).sum(-1) / weight.sum(-1).clamp_min(1.0) * temperature**2
