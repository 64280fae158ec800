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

The functions live in one module per family and are all importable from here:
:mod:`fedproto.algorithms.hetero_math.uploads` (:func:`class_centers`),
:mod:`fedproto.algorithms.hetero_math.fedtgp_math` (``tgp_*``),
:mod:`fedproto.algorithms.hetero_math.fd_math` (``class_mean_logits``, ``fd_*``) and
:mod:`fedproto.algorithms.hetero_math.heads_math` (``fedgh_train_head``, ``lg_aggregate``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from fedproto.algorithms.hetero_math.fd_math import FD_FORMS, class_mean_logits, fd_distill_loss, fd_global_logits
from fedproto.algorithms.hetero_math.fedtgp_math import (
           TGP_KEYS,
           tgp_generate,
           tgp_init,
           tgp_loss,
           tgp_margin,
           tgp_server_train,
)
from fedproto.algorithms.hetero_math.heads_math import fedgh_train_head, lg_aggregate
from fedproto.algorithms.hetero_math.uploads import FD_RULES, class_centers

__all__ = ["FD_FORMS", "FD_RULES", "TGP_KEYS", "class_centers", "class_mean_logits", "fd_distill_loss",
           "fd_global_logits", "fedgh_train_head", "lg_aggregate", "tgp_generate", "tgp_init", "tgp_loss",
           "tgp_margin", "tgp_server_train"]

_OLD_NAMES = {"common": "uploads", "fd": "fd_math", "fedtgp": "fedtgp_math", "heads": "heads_math"}
"""The submodules' names when this package was ``fedproto.htmath`` (before 0.2)."""


def __getattr__(name: str) -> ModuleType:
    """``fedproto.htmath.fd`` and the other old submodule names as attributes (a script of releases
    before 0.2 reaching ``htmath.fd.fd_distill_loss`` after ``import fedproto.htmath``)."""
    if name in _OLD_NAMES:
        return importlib.import_module(f"{__name__}.{_OLD_NAMES[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
