"""The math of the model-heterogeneous methods: FedTGP, FD (FedDistill), FedGH
and LG-FedAvg. Pure functions on tensors and arrays, no state beyond what they take and return;
the algorithm classes (client part, server part) call them.

Conventions as in :mod:`fedproto.prototypes`: ``C`` is the number of classes of the dataset, ``d``
the embedding size; a client's upload is sparse, ``classes`` (K_i,) int with ``values`` (K_i, ...)
for the classes it holds only (absent classes are never filled with zeros). Functions keep the
floating dtype they are given (float64 in, float64 out), so float64 runs compare exactly.

Sources (the papers; the reference implementations PFLlib / HtFLlib, by TsingZ0, as far as we
know them; where they differ from the paper the docstring says so):

* FedTGP: Zhang, Liu, Hua, Cao, "FedTGP: Trainable Global Prototypes with Adaptive-Margin-Enhanced
  Contrastive Learning for Data and Model Heterogeneity in Federated Learning", AAAI 2024,
  arXiv 2401.03230.
* FD: Jeong, Oh, Kim, Park, Bennis, Kim, "Communication-Efficient On-Device Machine Learning:
  Federated Distillation and Augmentation under Non-IID Private Data", arXiv 1811.11479.
* FedGH: Yi, Wang, Liu, Yu, Yu, "FedGH: Heterogeneous Federated Learning with Generalized Global
  Header", ACM MM 2023, arXiv 2303.13137.
* LG-FedAvg: Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency, "Think Locally,
  Act Globally: Federated Learning with Local and Global Representations", arXiv 2001.01523.

Size: about 570 lines of pure functions, the math of four methods, most of it docstrings stating
where the paper and the reference implementations differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

TGP_KEYS: tuple[str, ...] = ("embedding", "w1", "b1", "w2", "b2")
"""The parameters of FedTGP's generator of global prototypes, in this order (:func:`tgp_init`)."""

FD_FORMS: tuple[str, ...] = ("ce", "kl")
FD_RULES: tuple[str, ...] = ("mean", "weighted")


# ----------------------------------------------------------------------------------------------
# shared functions
# ----------------------------------------------------------------------------------------------


def _stack_uploads(
    classes: Sequence[np.ndarray], values: Sequence[np.ndarray], num_classes: int, what: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Concatenate per-client sparse uploads: (n,) class ids, (n, k) rows, (n,) client index.

    Raises:
        ValueError: a different number of clients in ``classes`` and ``values``, rows that do not
            match their class ids, rows of different sizes, or a class id outside 0..C-1.
    """
    if len(classes) != len(values):
        raise ValueError(f"{what}: {len(classes)} clients' class ids but {len(values)} clients' rows")
    cls, rows, owner = [], [], []
    for i, (c, v) in enumerate(zip(classes, values)):
        c = np.asarray(c, np.int64).reshape(-1)
        v = np.asarray(v)
        if v.ndim != 2 or v.shape[0] != len(c):
            raise ValueError(f"{what}: client {i} sends {len(c)} class ids with rows of shape {v.shape}; "
                             f"give one row per class id, shape ({len(c)}, k)")
        cls.append(c)
        rows.append(v)
        owner.append(np.full(len(c), i, np.int64))
    if not cls:
        return np.zeros(0, np.int64), np.zeros((0, 0)), np.zeros(0, np.int64)
    widths = sorted({r.shape[1] for r in rows if len(r)})
    if len(widths) > 1:
        raise ValueError(f"{what}: clients send rows of sizes {widths}; every client must use one size")
    c = np.concatenate(cls)
    if len(c) and (c.min() < 0 or c.max() >= num_classes):
        bad = int(c.max() if c.max() >= num_classes else c.min())
        raise ValueError(f"{what}: class id {bad} is outside 0..{num_classes - 1} (num_classes={num_classes})")
    dtype = np.result_type(*[r.dtype for r in rows])
    width = widths[0] if widths else 0
    out = np.concatenate([r.reshape(len(r), width) for r in rows]).astype(dtype, copy=False)
    return c, out, np.concatenate(owner)


def class_centers(
    classes: Sequence[np.ndarray],
    values: Sequence[np.ndarray],
    counts: Sequence[np.ndarray] | None,
    num_classes: int,
    rule: str = "mean",
    leave_out: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-class average over clients of sparse per-class rows (prototypes or mean logits).

    ``mean``: (1/|N_j|) sum_{i in N_j} v_i^j over the clients N_j that sent class j (FedTGP's
    cluster centers Q^j; FD's global-average logits; PFLlib's ``proto_cluster`` /
    ``logit_aggregation``: unweighted). ``weighted``: sum_i n_ij v_i^j / sum_i n_ij with the
    sample counts n_ij. With ``leave_out = i`` client i's rows are left out (FD's paper: each
    device distils toward the average of the *other* devices, alg. 1 of arXiv 1811.11479).

    Args:
        classes: per client (K_i,) int class ids. values: per client (K_i, k) rows.
        counts: per client (K_i,) sample counts; needed for ``weighted`` only (None otherwise).
        num_classes: C. rule: ``mean`` or ``weighted``. leave_out: a client index to leave out, or None.
    Returns:
        classes (K,) int64 sorted (the classes at least one counted client sent), centers (K, k)
        in the rows' dtype, contributors (K,) int64.
    Raises:
        ValueError: an unknown rule, ``weighted`` without counts, counts that do not match the
            class ids or are negative, and the shape errors of the uploads.
    """
    if rule not in FD_RULES:
        raise ValueError(f"unknown averaging rule {rule!r}; choose one of {FD_RULES}")
    cls, rows, owner = _stack_uploads(classes, values, num_classes, "class_centers")
    if rule == "weighted":
        if counts is None:
            raise ValueError("rule='weighted' needs the per-class sample counts; pass counts or use rule='mean'")
        n = np.concatenate([np.asarray(c, np.float64).reshape(-1) for c in counts]) if len(counts) else np.zeros(0)
        if n.shape != cls.shape:
            raise ValueError(f"counts give {n.shape[0]} numbers for {cls.shape[0]} class rows; give one per row")
        if (n < 0).any():
            raise ValueError(f"negative sample count {n.min()}: counts are numbers of samples")
    else:
        n = np.ones(len(cls))
    keep = owner != leave_out if leave_out is not None else np.ones(len(cls), bool)
    cls, rows, n = cls[keep], rows[keep], n[keep]
    dtype = rows.dtype if rows.dtype.kind == "f" else np.float64
    width = rows.shape[1] if rows.ndim == 2 else 0
    acc = np.zeros((num_classes, width), np.float64)
    np.add.at(acc, cls, rows.astype(np.float64) * n[:, None])
    wsum = np.bincount(cls, weights=n, minlength=num_classes)
    contributors = np.bincount(cls, minlength=num_classes)
    present = np.nonzero((contributors > 0) & (wsum > 0))[0]
    out = acc[present] / wsum[present, None]
    return present.astype(np.int64), out.astype(dtype), contributors[present].astype(np.int64)


# ----------------------------------------------------------------------------------------------
# FedTGP: trainable global prototypes, adaptive-margin contrastive loss (arXiv 2401.03230)
# ----------------------------------------------------------------------------------------------


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

    def uniform(shape, fan_in):
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
    if epochs < 0:
        raise ValueError(f"server epochs {epochs}: give 0 or more")
    if not lr > 0:
        raise ValueError(f"server lr {lr}: give a positive step size")
    if batch_size < 1:
        raise ValueError(f"server batch size {batch_size}: give 1 or more")
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
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        last = total / len(order)
    with torch.no_grad():
        out = tgp_generate(params)
    new_state = {k: v.detach().numpy().copy() for k, v in params.items()}
    return out.numpy().copy(), new_state, {"margin": margin, "loss": last}


# ----------------------------------------------------------------------------------------------
# FD / FedDistill: per-class mean logits and logit distillation (arXiv 1811.11479)
# ----------------------------------------------------------------------------------------------


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
    if epochs < 0:
        raise ValueError(f"server epochs {epochs}: give 0 or more")
    if not lr > 0:
        raise ValueError(f"server lr {lr}: give a positive step size")
    if batch_size < 1:
        raise ValueError(f"server batch size {batch_size}: give 1 or more")
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
            loss.backward()
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
