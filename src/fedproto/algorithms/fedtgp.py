"""FedTGP (Zhang et al., "FedTGP: Trainable Global Prototypes with Adaptive-Margin-Enhanced
Contrastive Learning for Data and Model Heterogeneity in Federated Learning", AAAI 2024,
arXiv 2401.03230).

Client: as FedProto (cross-entropy + λ · distance to the global prototype of the sample's class,
local prototypes sent up; :class:`~fedproto.algorithms.fedproto.FedProto`'s core options
``lambda_proto``, ``distance``, ``proto_source``, ``proto_classes``; its practitioner, robustness
and privacy options are not used). Server: instead of averaging, train a generator of global
prototypes (an embedding per class and a two-layer MLP, :func:`fedproto.htmath.tgp_init`) for
``server_epochs`` passes over the uploaded prototypes with the adaptive-margin contrastive loss
(margin min(max_c min_c' ||Q_c - Q_c'||, ``tgp_margin``); :func:`fedproto.htmath.tgp_server_train`)
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
reproduces and a resumed run continues exactly (the generator is server state,
:attr:`FedTGP.server_state_keys`, saved in checkpoints). Round 1 has no global prototypes
(cross-entropy only), as FedProto.

Evaluation: ``acc`` (the client's classifier) and ``acc_proto`` (nearest generated prototype,
FedProto's eq. 4): the paper reports the classifier; there is no global model.

Messages: down ``classes`` (C,) int64 (every class), ``protos`` (C, d) float32; up as FedProto.
"""

from __future__ import annotations

import numpy as np

from fedproto.algorithms.base import Message, optim_config
from fedproto.algorithms.fedproto import FedProto
from fedproto.algorithms.options import FedTGPOptions
from fedproto.htmath import tgp_init, tgp_server_train


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
    server_state_keys = FedProto.server_state_keys + ("tgp_state",)

    def __init__(self, num_classes, opt, local_epochs=1, lambda_proto=1.0, distance="mse",
                 proto_source="last_epoch", proto_classes="own", embedding_dim=50, server_epochs=100,
                 server_lr=0.1, server_batch_size=10, margin_threshold=100.0, seed=0):
        super().__init__(num_classes, opt, local_epochs, lambda_proto, distance, proto_source, "mean",
                         proto_classes, embedding_dim)
        self.server_epochs, self.server_lr, self.server_batch_size = server_epochs, server_lr, server_batch_size
        self.margin_threshold, self.seed = margin_threshold, seed
        self.tgp_state: dict[str, np.ndarray] | None = None
        self.last_info: dict[str, float] = {}

    @classmethod
    def from_config(cls, cfg, embedding_dim: int) -> FedTGP:
        def given(value, default):
            return default if value is None else value

        return cls(cfg.num_classes, optim_config(cfg), cfg.local_epochs, cfg.lam, cfg.distance, cfg.proto_source,
                   cfg.proto_classes, embedding_dim, given(cfg.server_epochs, 100), given(cfg.server_lr, 0.1),
                   given(cfg.server_batch_size, 10), cfg.tgp_margin, cfg.seed)

    def aggregate(self, round: int, messages: dict[int, Message]) -> Message:
        """Train the generator on the round's prototypes and broadcast every class's prototype."""
        msgs = [m for m in messages.values() if m]
        self.last_round = round
        self._had_protos = self.global_classes is not None
        if self.tgp_state is None:
            self.tgp_state = tgp_init(self.num_classes, self.embedding_dim, seed=self.seed)
        G, self.tgp_state, self.last_info = tgp_server_train(
            [m["classes"] for m in msgs], [m["protos"] for m in msgs], [m["counts"] for m in msgs], self.tgp_state,
            self.num_classes, self.server_epochs, self.server_lr, self.margin_threshold, self.server_batch_size,
            seed=self.seed * 100_003 + round)
        self.global_classes = np.arange(self.num_classes, dtype=np.int64)
        self.global_protos = G.astype(np.float32)
        return {"classes": self.global_classes, "protos": self.global_protos}

    def round_metrics(self) -> dict[str, float]:
        """FedProto's λ entry plus ``tgp_margin`` and ``server_loss`` of the last aggregation."""
        out = {k: v for k, v in super().round_metrics().items() if k == "lambda"}
        if self.last_info:
            out.update(tgp_margin=self.last_info["margin"], server_loss=self.last_info["loss"])
        return out
