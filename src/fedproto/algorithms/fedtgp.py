"""FedTGP (Zhang et al., "FedTGP: Trainable Global Prototypes with Adaptive-Margin-Enhanced
Contrastive Learning for Data and Model Heterogeneity in Federated Learning", AAAI 2024,
arXiv 2401.03230).

Client: as FedProto (cross-entropy + λ · distance to the global prototype of the sample's class,
local prototypes sent up; :class:`~fedproto.algorithms.fedproto.FedProto`'s core options
``lambda_proto``, ``distance``, ``proto_source``, ``proto_classes``; its practitioner, robustness
and privacy options are not used). Server: instead of averaging, train a generator of global
prototypes (an embedding per class and a two-layer MLP, :func:`fedproto.algorithms.hetero_math.tgp_init`) for
``server_epochs`` passes over the uploaded prototypes with the adaptive-margin contrastive loss
(margin min(max_c min_c' ||Q_c - Q_c'||, ``tgp_margin``); :func:`fedproto.algorithms.hetero_math.tgp_server_train`)
and broadcast the generated prototype of every class. The generator persists across rounds
(server state), initialised from the run's seed at the first aggregation.

Where we follow the paper: the generator (a trainable embedding per class and a two-layer MLP),
the adaptive-margin contrastive loss with every class a negative, the margin from the unweighted
class centers capped at τ, every uploaded prototype counted once whatever its sample count, and
the generator kept across rounds. Where the reference implementation (HtFLlib ``serverFedTGP`` /
``clientFedTGP``) fixes what the paper leaves open, we follow it: plain SGD (no momentum) over
shuffled mini-batches of the uploaded prototypes, ``server_epochs`` 100 and ``server_batch_size``
10, and the client's distance as MSE (``distance="mse"``, the default here; ``--distance`` picks
another). Differences from the reference: its server learning
rate and τ are command-line options whose defaults we do not restate (ours: 0.1, 100); its shuffling
uses torch's global generator, ours one seeded from the run's seed and the round, so a run
reproduces and a resumed run continues exactly (the generator is server state, ``tgp_state`` in
the :class:`~fedproto.algorithms.server_state.ServerState`, saved in checkpoints). Round 1 has no global
prototypes (cross-entropy only), as FedProto.

Evaluation: ``acc`` (the client's classifier) and ``acc_proto`` (nearest generated prototype,
FedProto's eq. 4): the paper reports the classifier; there is no global model.

Messages: down ``classes`` (C,) int64 (every class), ``protos`` (C, d) float32; up as FedProto.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from fedproto.algorithms.algorithm import Message, optim_config
from fedproto.algorithms.fedproto import FedProto
from fedproto.algorithms.hetero_math import tgp_init, tgp_server_train
from fedproto.algorithms.method_options import FedTGPOptions
from fedproto.algorithms.proto_steps import prototype_files
from fedproto.algorithms.server_state import ServerState
from fedproto.prototypes import lambda_at
from fedproto.training import OptimConfig

T = TypeVar("T")


class FedTGP(FedProto):
    """FedTGP: FedProto's client, a trained generator of global prototypes on the server.

    Args:
        num_classes, opt, local_epochs, lambda_proto, distance, proto_source, proto_classes,
            embedding_dim: as :class:`FedProto`.
        server_epochs: passes of the generator's training per round (>= 0).
        server_lr: its SGD step size (> 0). server_batch_size: prototypes per step (>= 1).
        margin_threshold: τ > 0, the cap of the adaptive margin.
        seed: the run's seed (the generator's initialisation and the shuffling).
    """

    name = "fedtgp"
    Options = FedTGPOptions
    secure_sum = None
    """Its server trains on each client's prototypes (not a function of their sum)."""

    def __init__(self, num_classes: int, opt: OptimConfig, local_epochs: int = 1, lambda_proto: float = 1.0,
                 distance: str = "mse", proto_source: str = "last_epoch", proto_classes: str = "own",
                 embedding_dim: int = 50, server_epochs: int = 100, server_lr: float = 0.1,
                 server_batch_size: int = 10, margin_threshold: float = 100.0, seed: int = 0, *,
                 freeze_after: int = 0) -> None:
        super().__init__(num_classes, opt, local_epochs, lambda_proto, distance, proto_source, "mean",
                         proto_classes, embedding_dim, freeze_after=freeze_after)
        self.server_epochs, self.server_lr, self.server_batch_size = server_epochs, server_lr, server_batch_size
        self.margin_threshold, self.seed = margin_threshold, seed

    @classmethod
    def from_config(cls, cfg: Any, embedding_dim: int) -> FedTGP:
        def given(value: T | None, default: T) -> T:
            return default if value is None else value

        return cls(cfg.num_classes, optim_config(cfg), cfg.local_epochs, cfg.lam, cfg.distance, cfg.proto_source,
                   cfg.proto_classes, embedding_dim, given(cfg.server_epochs, 100), given(cfg.server_lr, 0.1),
                   given(cfg.server_batch_size, 10), cfg.tgp_margin, cfg.seed, freeze_after=cfg.freeze_after)

    def aggregate(self, round: int, messages: dict[int, Message], state: ServerState | None = None) -> ServerState:
        """Train the generator (``state.checkpoint["tgp_state"]``; from the run's seed at the first
        aggregation) on the round's prototypes and broadcast every class's prototype. Metrics:
        FedProto's ``lambda``, ``tgp_margin`` and ``server_loss`` of this training."""
        msgs = [m for m in messages.values() if m]
        previous = state.message if state is not None else {}
        tgp = (state.checkpoint.get("tgp_state") if state is not None else None) or \
            tgp_init(self.num_classes, self.embedding_dim, seed=self.seed)
        G, tgp, info = tgp_server_train(
            [m["classes"] for m in msgs], [m["protos"] for m in msgs], [m["counts"] for m in msgs], tgp,
            self.num_classes, self.server_epochs, self.server_lr, self.margin_threshold, self.server_batch_size,
            seed=self.seed * 100_003 + round)
        message: Message = {"classes": np.arange(self.num_classes, dtype=np.int64), "protos": G.astype(np.float32)}
        metrics = {"lambda": lambda_at(round, self.lambda_proto, self.lambda_warmup, self.lambda_schedule)
                   if "protos" in previous else 0.0}
        if info:
            metrics.update(tgp_margin=info["margin"], server_loss=info["loss"])
        return ServerState(message, metrics, checkpoint={"tgp_state": tgp}, files=prototype_files(message, None))
