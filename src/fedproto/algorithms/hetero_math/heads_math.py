"""The heads of FedGH and LG-FedAvg: FedGH's global head trained on the server on the clients'
prototypes (Yi et al., ACM MM 2023, arXiv 2303.13137) and LG-FedAvg's averaged head (Liang et al.,
arXiv 2001.01523). Conventions: :mod:`fedproto.algorithms.hetero_math`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fedproto.algorithms.hetero_math.uploads import _stack_uploads, check_server_training

# ----------------------------------------------------------------------------------------------
# FedGH: a global head trained on the server on the clients' prototypes (arXiv 2303.13137)
# ----------------------------------------------------------------------------------------------


def fedgh_train_head(
    classes: Sequence[np.ndarray],
    protos: Sequence[np.ndarray],
    weight: np.ndarray,
    bias: np.ndarray,
    epochs: int = 1,
    lr: float = 0.01,
    batch_size: int = 1,
    shuffle: bool = False,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """FedGH's server step: train the global (generalised) head, a linear layer z = W p + b, with
    cross-entropy on the uploaded prototypes p as inputs and their classes as labels, by plain SGD.

    The paper (alg. 1, as we read it) takes one SGD step per uploaded (prototype, class) pair, client
    by client and class by class, once per round: ``epochs=1, batch_size=1, shuffle=False`` (the
    defaults here). PFLlib/HtFLlib (``serverGH.train_head``) run ``server_epochs`` passes over
    shuffled mini-batches of the pairs with ``torch.optim.SGD(head.parameters(), lr)``: pass
    ``shuffle=True`` and their epochs and batch size. The mean cross-entropy of a mini-batch of
    size B gives ``W <- W - lr/B sum_b (softmax(z_b) - onehot(y_b)) p_bᵀ`` (and b alike).

    Args:
        classes: per client (K_i,) class ids. protos: per client (K_i, d) prototypes.
        weight: (C, d) the current head weight. bias: (C,) its bias. The head's dtype is the
            training dtype and the result's.
        epochs: passes over the pairs (>= 0). lr: SGD step size > 0. batch_size: pairs per step >= 1.
        shuffle: shuffle the pairs each epoch (seeded by ``seed`` and the epoch) or keep the
            client-then-class order of the uploads.
        seed: the shuffling seed.
    Returns:
        (weight (C, d), bias (C,), info) with info ``{"loss": the mean loss of the last epoch (NaN
        without pairs or epochs)}``.
    Raises:
        ValueError: epochs < 0, lr not above 0, batch_size < 1, a head that is not (C, d) and
            (C,), prototypes of another size than d, and the upload shape errors.
    """
    check_server_training(epochs, lr, batch_size)
    W = torch.tensor(np.asarray(weight)).requires_grad_(True)
    b = torch.tensor(np.asarray(bias)).requires_grad_(True)
    if W.ndim != 2 or b.shape != (W.shape[0],):
        raise ValueError(f"the head must be weight (C, d) and bias (C,): got {tuple(W.shape)} and {tuple(b.shape)}")
    C, d = W.shape
    cls, rows, _ = _stack_uploads(classes, protos, C, "fedgh_train_head")
    if len(cls) and rows.shape[1] != d:
        raise ValueError(f"prototypes of size {rows.shape[1]} for a head of input size {d}")
    P = torch.as_tensor(rows, dtype=W.dtype) if len(cls) else torch.zeros(0, d, dtype=W.dtype)
    Y = torch.as_tensor(cls, dtype=torch.long)
    opt = torch.optim.SGD([W, b], lr=lr)
    last = float("nan")
    for epoch in range(epochs if len(cls) else 0):
        if shuffle:
            order = torch.randperm(len(Y), generator=torch.Generator().manual_seed(int(seed) * 1_000_003 + epoch))
        else:
            order = torch.arange(len(Y))
        total = 0.0
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            loss = F.cross_entropy(P[idx] @ W.T + b, Y[idx])
            opt.zero_grad()
            torch.autograd.backward(loss)  # loss.backward(): the same call, typed (Tensor.backward has no annotations)
            opt.step()
            total += float(loss.detach()) * len(idx)
        last = total / len(order)
    return W.detach().numpy().copy(), b.detach().numpy().copy(), {"loss": last}


# ----------------------------------------------------------------------------------------------
# LG-FedAvg: the head is averaged, the body stays local (arXiv 2001.01523)
# ----------------------------------------------------------------------------------------------


def lg_aggregate(heads: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """LG-FedAvg's server: the weighted average of the clients' global (head) parameters,
    theta_g = sum_i w_i theta_g^i / sum_i w_i, with w_i the client's number of training samples
    (the paper's FedAvg weights n_i / n; PFLlib ``serverlg`` alike). The local representation
    (the body) is never sent. In the paper the "global" part is the top layers of the model; here
    it is whatever entries the client sends (the algorithm sends its head).

    Args:
        heads: per client, ``{name: array}`` with the same names and shapes for every client.
        weights: per client, a weight >= 0 (sample counts); they need not sum to 1.
    Returns:
        ``{name: array}``, each in the dtype of the clients' arrays (computed in float64; integer
        arrays give float64).
    Raises:
        ValueError: no client, a different number of weights, a negative or non-finite weight,
            weights summing to 0, or heads whose names or shapes differ (naming the client).
    """
    if not heads:
        raise ValueError("lg_aggregate needs at least one client's head")
    w = np.asarray(weights, np.float64).reshape(-1)
    if len(w) != len(heads):
        raise ValueError(f"{len(heads)} heads but {len(w)} weights; give one weight per client")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError(f"weights {w.tolist()}: give finite sample counts >= 0")
    if w.sum() <= 0:
        raise ValueError("the weights sum to 0: at least one client must have a positive sample count")
    ref = {k: np.asarray(v).shape for k, v in heads[0].items()}
    for i, h in enumerate(heads):
        got = {k: np.asarray(v).shape for k, v in h.items()}
        if got != ref:
            raise ValueError(f"client {i}'s head {got} differs from client 0's {ref}: LG-FedAvg needs one head "
                             f"shape for all clients (equal embedding size and classes)")
    out = {}
    for k in ref:
        acc = sum(wi * np.asarray(h[k], np.float64) for wi, h in zip(w, heads))
        dtype = np.result_type(*[np.asarray(h[k]).dtype for h in heads])
        out[k] = (acc / w.sum()).astype(dtype if dtype.kind == "f" else np.float64)
    return out
