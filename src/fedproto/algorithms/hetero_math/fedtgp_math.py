"""FedTGP: trainable global prototypes and the adaptive-margin contrastive loss (Zhang et al.,
AAAI 2024, arXiv 2401.03230; HtFLlib's ``serverFedTGP``). Conventions: :mod:`fedproto.algorithms.hetero_math`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fedproto.algorithms.hetero_math.uploads import _stack_uploads, check_server_training, class_centers

TGP_KEYS: tuple[str, ...] = ("embedding", "w1", "b1", "w2", "b2")
"""The parameters of FedTGP's generator of global prototypes, in this order (:func:`tgp_init`)."""


def tgp_init(num_classes: int, dim: int, hidden: int | None = None, seed: int = 0,
             dtype: torch.dtype = torch.float32) -> dict[str, np.ndarray]:
    """The initial state of FedTGP's generator of global prototypes (TGP).

    The generator maps a class id to its global prototype: ``P̂_c = W2 relu(W1 e_c + b1) + b2``,
    ``e_c`` a trainable embedding row (HtFLlib ``Trainable_prototypes``: ``nn.Embedding(C, d)``,
    ``Linear(d, hidden)``, ``ReLU``, ``Linear(hidden, d)``; hidden defaults to d there, as here).
    Initialised as PyTorch initialises those layers (embedding N(0, 1); linear weights and biases
    uniform in ±1/sqrt(fan_in)), from a generator seeded with ``seed``.

    Args:
        num_classes: C. dim: d, the embedding size of the clients' prototypes.
        hidden: the hidden width (default d). seed: the initialisation seed. dtype: the float dtype.
    Returns:
        ``{"embedding": (C, d), "w1": (hidden, d), "b1": (hidden,), "w2": (d, hidden), "b2": (d,)}``.
    Raises:
        ValueError: a non-positive C, d or hidden.
    """
    hidden = dim if hidden is None else hidden
    if num_classes < 1 or dim < 1 or hidden < 1:
        raise ValueError(f"tgp_init needs num_classes, dim and hidden >= 1; got {num_classes}, {dim}, {hidden}")
    g = torch.Generator().manual_seed(int(seed))

    def uniform(shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
        bound = 1.0 / float(np.sqrt(fan_in))
        return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * bound

    state = {
        "embedding": torch.randn(num_classes, dim, generator=g, dtype=torch.float64),
        "w1": uniform((hidden, dim), dim), "b1": uniform((hidden,), dim),
        "w2": uniform((dim, hidden), hidden), "b2": uniform((dim,), hidden),
    }
    return {k: v.to(dtype).numpy() for k, v in state.items()}


def tgp_generate(state: Mapping[str, torch.Tensor | np.ndarray]) -> torch.Tensor:
    """The global prototypes of every class from the generator's state: (C, d), differentiable in
    the state's tensors (``P̂_c = W2 relu(W1 e_c + b1) + b2``, see :func:`tgp_init`).

    Raises:
        KeyError: a state without one of :data:`TGP_KEYS`.
    """
    t = {k: torch.as_tensor(state[k]) for k in TGP_KEYS}
    mid = torch.relu(t["embedding"] @ t["w1"].T + t["b1"])
    return mid @ t["w2"].T + t["b2"]


def tgp_margin(
    classes: Sequence[np.ndarray], protos: Sequence[np.ndarray], num_classes: int, threshold: float
) -> tuple[float, np.ndarray]:
    """FedTGP's adaptive margin: δ = min(max_c min_{c' != c} ||Q_c - Q_c'||₂, τ).

    Q_c is the unweighted mean of the clients' prototypes of class c (the cluster center; HtFLlib
    ``proto_cluster``). For each class the distance to its nearest other class center is its gap;
    the margin is the largest gap, capped at the threshold τ. (Not the largest distance between any
    two class prototypes: the paper and HtFLlib take the max over classes of the *nearest* other
    class's distance, as here.) A round with fewer than two classes has no gap: δ = 0.

    Args:
        classes: per client (K_i,) class ids. protos: per client (K_i, d). num_classes: C.
        threshold: τ > 0 (HtFLlib's ``margin_threthold``, 100 by default as far as we know).
    Returns:
        (δ, gaps): the margin as a float and the (K,) per-class gaps of the classes present, in
        class order (float64; ``inf`` where alone).
    Raises:
        ValueError: τ not above 0, and the shape errors of the uploads.
    """
    if not threshold > 0:
        raise ValueError(f"margin threshold tau={threshold}: give a positive number (FedTGP's default 100)")
    _, Q, _ = class_centers(classes, protos, None, num_classes, "mean")
    Q = Q.astype(np.float64)
    if len(Q) < 2:
        return 0.0, np.full(len(Q), np.inf)
    dist = np.sqrt(((Q[:, None, :] - Q[None, :, :]) ** 2).sum(-1))
    np.fill_diagonal(dist, np.inf)
    gaps = dist.min(1)
    return float(min(gaps.max(), threshold)), gaps


def tgp_loss(protos: torch.Tensor, labels: torch.Tensor, global_protos: torch.Tensor, margin: float) -> torch.Tensor:
    """FedTGP's adaptive-margin-enhanced contrastive loss on the server, averaged over the rows:

        L = (1/n) sum_r -log( exp(-(φ(p_r, P̂_{y_r}) + δ)) / (exp(-(φ(p_r, P̂_{y_r}) + δ))
                                                              + sum_{c != y_r} exp(-φ(p_r, P̂_c))) )

    with φ the Euclidean distance, i.e. the cross-entropy of the logits ``-(dist + δ onehot)``
    (HtFLlib ``serverFedTGP.update_Gen``). Every class of ``global_protos`` is a negative, also a
    class no client sent. Distances come from differences (HtFLlib expands ||a||² - 2ab + ||b||²,
    which can go slightly negative and give NaN under the square root); the squared distance is
    clamped at 1e-30 so the gradient stays finite where a prototype meets its target exactly.

    Args:
        protos: (n, d) client prototypes. labels: (n,) int64 their classes. global_protos: (C, d).
        margin: δ ≥ 0 (:func:`tgp_margin`).
    Returns:
        () loss in the prototypes' dtype.
    Raises:
        ValueError: mismatched shapes or a negative margin.
    """
    if protos.ndim != 2 or global_protos.ndim != 2 or protos.shape[1] != global_protos.shape[1] \
            or labels.shape != (protos.shape[0],):
        raise ValueError(f"tgp_loss needs protos (n, d), labels (n,), global_protos (C, d): got "
                         f"{tuple(protos.shape)}, {tuple(labels.shape)}, {tuple(global_protos.shape)}")
    if margin < 0:
        raise ValueError(f"margin {margin} is negative; FedTGP's margin is min(largest class gap, tau) >= 0")
    sq = ((protos[:, None, :] - global_protos[None, :, :]) ** 2).sum(-1)
    dist = sq.clamp_min(1e-30).sqrt()
    onehot = F.one_hot(labels, global_protos.shape[0]).to(dist.dtype)
    return F.cross_entropy(-(dist + margin * onehot), labels)


def tgp_server_train(
    classes: Sequence[np.ndarray],
    protos: Sequence[np.ndarray],
    counts: Sequence[np.ndarray] | None,
    state: Mapping[str, np.ndarray],
    num_classes: int,
    epochs: int = 100,
    lr: float = 0.1,
    margin_threshold: float = 100.0,
    batch_size: int = 10,
    seed: int = 0,
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
    """FedTGP's server step: train the generator of global prototypes on the clients' prototypes
    with the adaptive-margin contrastive loss (:func:`tgp_loss`, margin :func:`tgp_margin`), then
    generate the new global prototypes.

    Each epoch shuffles the uploaded (prototype, class) rows (a generator seeded with ``seed`` and
    the epoch, so a call reproduces) and takes one plain SGD step (no momentum, as HtFLlib's
    ``torch.optim.SGD(PROTO.parameters(), lr)``) per mini-batch of ``batch_size`` rows (the last
    one may be smaller, ``drop_last=False``). Every row counts once whatever its sample count
    (paper and HtFLlib); ``counts`` is checked against the rows and otherwise unused. The state
    persists across rounds (HtFLlib saves and reloads the generator): pass the returned one next
    round. The paper's other defaults (server epochs, server lr) are HtFLlib command-line options;
    we do not restate their values here.

    Args:
        classes: per client (K_i,) int class ids. protos: per client (K_i, d) prototypes.
        counts: per client (K_i,) sample counts, or None.
        state: the generator's state (:func:`tgp_init`), numpy arrays; its dtype is the training dtype.
        num_classes: C. epochs: passes over the uploaded rows (0 only generates).
        lr: SGD step size > 0. margin_threshold: τ > 0. batch_size: rows per SGD step >= 1.
        seed: the shuffling seed (derive it from the run's seed and round).
    Returns:
        (global_protos (C, d), new state, info) with info ``{"margin": δ, "loss": the mean loss of
        the last epoch (NaN without rows or epochs)}``. Global prototypes and state keep the
        state's dtype.
    Raises:
        ValueError: epochs < 0, lr or τ not above 0, batch_size < 1, prototypes whose size is
            not the generator's d, counts that do not match the rows, and the upload shape errors.
    """
    check_server_training(epochs, lr, batch_size)
    cls, rows, _ = _stack_uploads(classes, protos, num_classes, "tgp_server_train")
    if counts is not None:
        n = sum(len(np.asarray(c).reshape(-1)) for c in counts)
        if n != len(cls):
            raise ValueError(f"counts give {n} numbers for {len(cls)} prototypes; give one per prototype")
    params = {k: torch.tensor(np.asarray(state[k])).requires_grad_(True) for k in TGP_KEYS}
    dtype = params["embedding"].dtype
    d = params["embedding"].shape[1]
    if params["embedding"].shape[0] != num_classes:
        raise ValueError(f"the generator has {params['embedding'].shape[0]} classes, the run {num_classes}")
    if len(cls) and rows.shape[1] != d:
        raise ValueError(f"prototypes of size {rows.shape[1]} for a generator of size {d}: "
                         f"the clients' embedding size must be the generator's")
    margin, _ = tgp_margin(classes, protos, num_classes, margin_threshold) if len(cls) else (0.0, None)
    P = torch.as_tensor(rows, dtype=dtype) if len(cls) else torch.zeros(0, d, dtype=dtype)
    Y = torch.as_tensor(cls, dtype=torch.long)
    opt = torch.optim.SGD(list(params.values()), lr=lr)
    last = float("nan")
    for epoch in range(epochs if len(cls) else 0):
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + epoch)
        order = torch.randperm(len(Y), generator=g)
        total = 0.0
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            loss = tgp_loss(P[idx], Y[idx], tgp_generate(params), margin)
            opt.zero_grad()
            torch.autograd.backward(loss)  # loss.backward(): the same call, typed (Tensor.backward has no annotations)
            opt.step()
            total += float(loss.detach()) * len(idx)
        last = total / len(order)
    with torch.no_grad():
        out = tgp_generate(params)
    new_state = {k: v.detach().numpy().copy() for k, v in params.items()}
    return out.numpy().copy(), new_state, {"margin": margin, "loss": last}
