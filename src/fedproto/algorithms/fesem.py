"""FeSEM (Xie et al., "Multi-center federated learning", arXiv 2005.01026), a baseline of tab. 1.

Federated stochastic expectation maximization over K cluster centres in weight space
(``fesem_clusters``, default 3). Each round:

* client: load the centre of its cluster, train with cross-entropy for ``local_epochs`` epochs,
  upload all its weights (``w/<name>``) and its sample count ``n`` (as FedAvg);
* server, E-step: assign each uploading client to the nearest centre by the L2 distance between
  its full weight vector (all shared tensors concatenated) and each centre (ties: lowest index);
* server, M-step: each centre becomes the sample-weighted average of its members' weights; a
  centre with no members keeps its weights.

Initialisation: the centres are the initial weights of K distinct clients drawn with the run seed
(deterministic), and every client starts in the cluster of its nearest centre (the K drawn clients
in their own).

What is sent: up, per client, ``w/<name>`` for all weights + ``n`` (as FedAvg). Down, the server
message holds all centres stacked, ``w/<name>``: (K, *shape), plus ``assign``: (m,) int64 cluster
ids, and :meth:`FeSEM.prepare` picks row ``assign[cid]``. A client needs only its own centre, so the
downlink cost per client is one model (:meth:`FeSEM.downlink` gives that per-client view, which
:meth:`prepare` also accepts as is — as a per-client transport would deliver it).

Evaluation: ``acc`` (personal), the client's model after the last round's local training, on its
own test set; ``acc_global``, the centre of the client's cluster after the last round's E- and
M-step (what the client would load next), on its own test set.
"""

from __future__ import annotations

import numpy as np

from fedproto.algorithms.algorithm import ClientState, Message
from fedproto.algorithms.fedavg import WEIGHT_PREFIX, FedAvg, load_weights, weighted_average
from fedproto.algorithms.method_options import FeSEMOptions, checked_options
from fedproto.algorithms.server_state import ServerState
from fedproto.errors import ConfigError
from fedproto.training import OptimConfig

ASSIGN_KEY = "assign"


def centre_distances(messages: list[Message], centres: dict[str, np.ndarray]) -> np.ndarray:
    """Squared L2 distances (n_messages, K) between each message's full weight vector (its ``w/``
    arrays concatenated) and each centre (``centres[key]``: (K, *shape)), in float64."""
    K = len(next(iter(centres.values()))) if centres else 0
    d = np.zeros((len(messages), K), np.float64)
    for key, c in centres.items():
        c64 = c.reshape(K, -1).astype(np.float64)
        for i, m in enumerate(messages):
            diff = c64 - np.asarray(m[key], np.float64).reshape(1, -1)
            d[i] += np.einsum("kp,kp->k", diff, diff)
    return d


class FeSEM(FedAvg):
    """K weight-space centres, nearest-centre assignment, per-cluster weighted averages.

    Args:
        num_classes, opt, local_epochs: as :class:`FedAvg`. clusters: K >= 1.
        seed: draws the K clients whose initial weights seed the centres.
    Server state (:class:`~fedproto.algorithms.server_state.ServerState`): the message holds the centres,
    ``w/<name>`` -> (K, *shape) float32, and ``assign`` (m,) int64, the cluster of each client; the
    checkpoint adds ``last_distances`` (m, K), the squared distances of the latest E-step.
    """

    name = "fesem"
    Options = FeSEMOptions
    global_protocol = ("global: the centre of the client's cluster after the last round's aggregation (E- and "
                       "M-step), before any local training, on the client's own test set")

    def __init__(self, num_classes: int, opt: OptimConfig, local_epochs: int = 1, clusters: int = 3, seed: int = 0, *,
                 freeze_after: int = 0) -> None:
        super().__init__(num_classes, opt, local_epochs, freeze_after=freeze_after)
        self.options = checked_options(FeSEMOptions, fesem_clusters=clusters)
        self.seed = int(seed)

    @property
    def clusters(self) -> int:
        """K, ``self.options.fesem_clusters`` (the run's, set by :meth:`Algorithm.from_config`)."""
        return int(self.options.fesem_clusters)

    # -- server ---------------------------------------------------------------------------------
    def initial_message_from(self, joins: dict[int, Message]) -> Message:
        """K distinct joining clients (drawn with ``seed``) seed the centres; every client starts in
        the cluster of its nearest centre. ``joins``: each client's initial weights, by client id."""
        from fedproto.algorithms.fedavg import check_message_shapes

        check_message_shapes(joins, self.name)
        cids = sorted(joins)
        m, K = len(cids), self.clusters
        if K > m:
            raise ConfigError(f"fesem_clusters={K} is more than the {m} clients; use fesem_clusters <= {m}")
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0xFE5E]))
        seeds = sorted(int(i) for i in rng.choice(m, K, replace=False))
        msgs = [joins[c] for c in cids]
        centres = {k: np.stack([msgs[i][k] for i in seeds]) for k in msgs[0] if k.startswith(WEIGHT_PREFIX)}
        assign = np.zeros(max(cids) + 1, np.int64)
        assign[cids] = centre_distances(msgs, centres).argmin(1)
        return {**centres, ASSIGN_KEY: assign}

    def aggregate(self, round: int, messages: dict[int, Message], state: ServerState | None = None) -> ServerState:
        """E-step (nearest centre) then M-step (sample-weighted average per cluster), from the
        centres and assignment of the previous ``state``'s message; clients not heard from this
        round keep their assignment (a client id not seen before starts in cluster 0).

        Returns:
            The new centres and assignment as the message; ``last_distances`` (m, K) in the checkpoint.

        Raises:
            ValueError: ``state`` is None (no centres to start from).
        """
        if state is None:
            raise ValueError("FeSEM.aggregate needs the previous ServerState (its centres); pass the initial "
                             "message's: ServerState(initial_message)")
        centres = {k: v for k, v in state.message.items() if k.startswith(WEIGHT_PREFIX)}
        assign = np.asarray(state.message[ASSIGN_KEY], np.int64).copy()
        cids = list(messages)
        replies = list(messages.values())
        if cids and max(cids) >= len(assign):
            assign = np.concatenate([assign, np.zeros(max(cids) + 1 - len(assign), np.int64)])
        d = centre_distances(replies, centres)
        a = d.argmin(1)
        assign[cids] = a
        new = {k: np.array(v, copy=True) for k, v in centres.items()}
        for k in range(self.clusters):
            members = [replies[j] for j in np.flatnonzero(a == k)]
            if not members:
                continue  # empty cluster: keep its centre
            avg = weighted_average(members)
            for key in new:
                new[key][k] = avg[key]
        return ServerState({**new, ASSIGN_KEY: assign}, checkpoint={"last_distances": d})

    def downlink(self, message: Message, cid: int) -> Message:
        """The part of the server message client ``cid`` needs: its centre, ``w/<name>``: shape."""
        if ASSIGN_KEY not in message:
            return message
        k = int(message[ASSIGN_KEY][cid]) if cid < len(message[ASSIGN_KEY]) else 0
        return {key: v[k] for key, v in message.items() if key.startswith(WEIGHT_PREFIX)}

    # -- client ---------------------------------------------------------------------------------
    def prepare(self, state: ClientState, message: Message) -> None:
        """Load the centre of the client's cluster (full server message or per-client view)."""
        if ASSIGN_KEY in message and state.cid < len(message[ASSIGN_KEY]):
            state.extra["cluster"] = int(message[ASSIGN_KEY][state.cid])
        self.load_global(state, message)

    def load_global(self, state: ClientState, message: Message) -> None:
        """Load the centre of the client's cluster (full server message or per-client view)."""
        load_weights(state.model, self.downlink(message, state.cid))
