"""Secure aggregation in the round loop: the server side (:class:`SecureServer`), the simulator's
clients (:class:`SimulatedSecAgg`) and what a round cost (:class:`Session`).

The round loop (:class:`fedproto.engine.loop.RoundLoop`) runs unchanged: the executor returns
each client's masked vector as its reply (``{"secagg": (L,) uint64}``), so the loop, its reply
check, its observers and its communication count see only masked vectors; :class:`SecureServer`
wraps the algorithm's server part, sums the masked vectors it is given, removes the masks the
executor's unmask step rebuilt and makes the next message from the sum
(:meth:`fedproto.secagg.codec.Codec.aggregate`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedproto.engine.executors.executor import RoundReplies
from fedproto.errors import TrainingError
from fedproto.secagg import codec as codecs
from fedproto.secagg.protocol import Client, Server

log = logging.getLogger(__name__)

KEY = "secagg"
"""The reply key of a masked vector."""


def nbytes(msg: dict) -> int:
    """Bytes of a message of arrays."""
    return sum(int(np.asarray(v).nbytes) for v in msg.values())


@dataclass
class Round:
    """One round's protocol record: the masks to remove, who took part, the bytes and seconds of
    the key and share exchanges (the masked vectors are counted by the round loop as ``up_bytes``).

    Attributes:
        masks: (L,) uint64, the masks of the decoded coordinates; None when nothing was decoded
            (fewer alive clients than the minimum).
        decoded: (L,) bool, the coordinates the server could unmask (group 0 and the revealed classes).
        contributors: (C,) int64 contributor counts per class (FedProto; empty for weights).
        withheld: the classes held by fewer than ``secagg_min_contributors`` alive clients, left masked
            (every class when the round was skipped).
        skipped: fewer alive clients than the minimum: nothing was decoded, the server keeps its state.
    """

    alive: list[int]
    dead: list[int]
    masks: np.ndarray | None
    sent: dict
    bytes_up: int = 0
    bytes_down: int = 0
    seconds: float = 0.0
    decoded: np.ndarray | None = None
    contributors: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    withheld: list[int] = field(default_factory=list)
    skipped: bool = False


def unmask_round(srv: Server, codec: Any, sent: dict, masked: dict[int, np.ndarray], minimum: int,
                 ask_view: Any, ask_unmask: Any, ask_reveal: Any) -> tuple[Round, int, int]:
    """The server's steps 4 to 6 (:mod:`fedproto.secagg.protocol`), shared by the simulator and
    Flower: tell the alive clients who is alive and dead and route their view tags (consistency),
    ask them for the group-0 and dropped clients' shares, decode group 0 (the per-class
    contributor counts), ask for the seeds of the classes with at least ``minimum`` contributors
    and rebuild their masks; a class with fewer stays masked. With fewer than ``minimum`` alive
    clients nothing is asked and nothing decoded (the clients would refuse).

    Args:
        srv: the round's protocol server. codec: the method's codec. sent: a downlink message of the
            round (the vector layout). masked: (L,) uint64 masked vector by alive client.
        minimum: ``secagg_min_contributors``. ask_view: (alive, dead) -> step-4 tags by client.
        ask_unmask: routed tags by client -> step-5 answers by client. ask_reveal: (groups, counts)
            -> step-6 answers by client.
    Returns:
        (the round's record without bytes and seconds, bytes down, bytes up) of steps 4 to 6.
    Raises:
        TrainingError: too few shares arrived (too many dropouts).
    """
    alive, dead = srv.unmask_request(sorted(masked))
    groups = codec.groups(sent)
    if len(alive) < minimum:  # nothing may be decoded: the clients would refuse
        return Round(alive, dead, None, sent, withheld=codec.all_classes(), skipped=True), 0, 0
    tags = ask_view(alive, dead)
    routed = srv.route_tags(tags)
    down = 8 * (len(alive) + len(dead)) * len(alive) + sum(nbytes(m) for m in routed.values())
    up = sum(nbytes(m) for m in tags.values())
    answers = ask_unmask(routed)
    up += sum(nbytes(m) for m in answers.values())
    masks = srv.masks(alive, dead, answers, groups)
    total = np.zeros(len(groups), np.uint64)
    for i in alive:
        total = total + masked[i]
    opened = codecs.decode(total - masks) * (groups == 0)
    wanted, counts, withheld = codec.reveal(opened, minimum)
    if wanted:
        answers = ask_reveal(wanted, counts)
        down += (8 * len(wanted) + 8 * len(counts)) * len(alive)
        up += sum(nbytes(m) for m in answers.values())
        masks = masks + srv.class_masks(alive, wanted, answers, groups)
    decoded = (groups == 0) | np.isin(groups, wanted)
    return Round(alive, dead, masks, sent, decoded=decoded, contributors=counts, withheld=withheld), down, up


@dataclass
class Session:
    """The secure aggregation of a run: its options and the last round's record.

    Args:
        fraction: ``secagg_threshold``. neighbours: ``secagg_neighbours``.
        minimum: ``secagg_min_contributors``.
    """

    fraction: float = 0.5
    neighbours: int = 0
    minimum: int = 2
    last: Round | None = None
    history: np.ndarray | None = None
    totals: dict = field(default_factory=lambda: {"bytes_up": 0, "bytes_down": 0, "seconds": 0.0, "dropouts": 0})

    def record(self, rnd: Round) -> None:
        """Keep ``rnd`` as the last round's record and add its bytes, seconds and dropouts to the totals."""
        if rnd.skipped:
            log.warning("secure aggregation: %d client(s) sent a masked vector, fewer than secagg_min_contributors=%d: "
                        "nothing is decoded this round and the server keeps its last message", len(rnd.alive),
                        self.minimum)
        elif rnd.withheld:
            log.warning("secure aggregation: classes %s withheld this round (fewer than %d contributors among the "
                        "clients that sent a masked vector): they stay masked and the clients keep their last global "
                        "prototype", rnd.withheld, self.minimum)
        self.last = rnd
        self.totals["bytes_up"] += rnd.bytes_up
        self.totals["bytes_down"] += rnd.bytes_down
        self.totals["seconds"] += rnd.seconds
        self.totals["dropouts"] += len(rnd.dead)


class SecureServer:
    """The algorithm's server part under secure aggregation; every other attribute is the
    algorithm's (its client part, broadcast, downlink, checkpoint state).

    Args:
        algorithm: the run's algorithm (checked by :func:`fedproto.secagg.codec.check`).
        session: the run's :class:`Session`, filled by the executor's unmask step.
    """

    def __init__(self, algorithm: Any, session: Session):
        self.__dict__["_alg"] = algorithm
        self.__dict__["_session"] = session
        self.__dict__["_codec"] = codecs.codec_of(algorithm, session.minimum)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._alg, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._alg, name, value)

    def reply_problem(self, reply: dict, sent: dict, embedding_dim: int) -> str:
        """A reply is one (L,) uint64 masked vector, L the codec's length for this round."""
        v = reply.get(KEY)
        if set(reply) != {KEY} or v is None or v.dtype != np.uint64 or v.ndim != 1:
            return f"is not a masked vector (entries {sorted(reply)[:5]}): under secagg a reply is {{'{KEY}': uint64}}"
        want = self._codec.length(sent)
        return f"masked vector of length {len(v)}, expected {want}" if len(v) != want else ""

    def reply_problems(self, cid: int, message: dict) -> tuple[dict, list[str]]:
        """Nothing to drop row by row: the rows are masked (the client checked its reply before masking)."""
        return message, []

    def aggregate(self, round: int, messages: dict[int, dict], state: Any = None) -> Any:
        """The sum of the masked vectors of ``messages`` less the rebuilt masks, decoded, and the
        method's next :class:`~fedproto.algorithms.server_state.ServerState` from it
        (:meth:`fedproto.secagg.codec.Codec.aggregate`, given the previous ``state``), with the
        protocol's metrics added (:meth:`secagg_metrics`).

        Raises:
            TrainingError: the replies are not those the unmask step rebuilt the masks of.
        """
        from dataclasses import replace

        from fedproto.algorithms.server_state import as_state

        rnd = self._session.last
        cids = sorted(messages)
        if rnd is None or cids != rnd.alive:
            raise TrainingError(f"round {round}: secure aggregation rebuilt the masks of clients "
                                f"{rnd.alive if rnd else []} but the loop aggregates {cids}; a masked vector "
                                "cannot be left out after the unmask step")
        length = self._codec.length(rnd.sent)
        total = np.zeros(length, np.float64)
        if rnd.masks is not None:
            summed = np.zeros(length, np.uint64)
            for i in cids:
                summed = summed + messages[i][KEY]
            total = codecs.decode(summed - rnd.masks) * rnd.decoded  # a withheld class stays masked: never decoded
            total = self._codec.withhold(total, rnd.withheld)
        out = self._codec.aggregate(round, total, cids, rnd.sent, state)
        out = as_state(self._alg, out)  # a method whose aggregate returns its message alone
        checkpoint = dict(out.checkpoint)
        if self._codec.all_classes():  # the contributors of each decoded class, per round (the DP accountant's)
            checkpoint["secagg_contributors"] = self._history(state, rnd)
        return replace(out, metrics={**out.metrics, **self.secagg_metrics()}, checkpoint=checkpoint)

    def _history(self, state: Any, rnd: Round) -> np.ndarray:
        """(rounds, C) int64: per round so far, each class's contributors where it was decoded, minus
        them where it was withheld, 0 where nobody held it; the previous rounds' from ``state``'s
        checkpoint (a resume keeps them)."""
        C = len(self._codec.all_classes())
        prev = (state.checkpoint or {}).get("secagg_contributors") if state is not None else None
        prev = np.zeros((0, C), np.int64) if prev is None else np.asarray(prev, np.int64).reshape(-1, C)
        row = np.full(C, -1, np.int64) if rnd.skipped else rnd.contributors.copy()
        if not rnd.skipped:
            row[rnd.withheld] *= -1
        self._session.history = np.vstack([prev, row[None]])
        return self._session.history

    def _withheld_summary(self) -> dict:
        """``withheld_rounds``: round -> the classes left masked (from the run's contributor history)."""
        h = self._session.history
        if h is None:
            return {}
        return {"withheld_rounds": {str(r + 1): np.flatnonzero(row < 0).tolist() for r, row in enumerate(h)
                                    if (row < 0).any()}}

    def secagg_metrics(self) -> dict:
        """The protocol's metrics of the last round: ``secagg_bytes`` (keys, shares and unmask
        messages, up and down), ``secagg_s`` (seconds in the protocol's steps), ``secagg_dropped``
        (clients that shared keys but sent no masked vector)."""
        rnd = self._session.last
        if rnd is None:
            return {}
        return {"secagg_bytes": rnd.bytes_up + rnd.bytes_down, "secagg_s": rnd.seconds,
                "secagg_dropped": list(rnd.dead), "secagg_withheld": list(rnd.withheld),
                **({"secagg_skipped": True} if rnd.skipped else {})}

    def summary_entries(self, cfg: Any, per_client: list[dict]) -> dict:
        """The algorithm's entries plus ``secure_aggregation``: protocol, options, threat model and totals."""
        s = self._session
        entry = {
            "protocol": "SecAgg+ (pairwise masks from X25519 key agreement, self masks per class, Shamir shares of "
                        "the mask seeds and masking keys, ChaCha20 mask streams)",
            "fixed_point_bits": codecs.FRAC_BITS, "threshold_fraction": s.fraction,
            "neighbours": s.neighbours or "all", "min_contributors": s.minimum,
            "label_sets": "hidden" if getattr(cfg, "secagg_hide_labels", True) else "sent",
            "threat_model": "honest-but-curious server; up to t-1 colluding clients per share group; the sum is "
                            "rebuilt while at least t of each share group answer the unmask step; each client "
                            "answers the unmask and the reveal step once per round",
            "server_sees": "per round who took part, the number of contributors per class, and the sums of the classes "
                           f"with at least {s.minimum} contributors; no client's reply, no class sum over fewer",
            **self._withheld_summary(),
            "extra_bytes": int(s.totals["bytes_up"] + s.totals["bytes_down"]),
            "protocol_seconds": float(s.totals["seconds"]), "dropouts": int(s.totals["dropouts"]),
        }
        if getattr(cfg, "dp", "off") != "off":
            from fedproto.secagg.epsilon import summary

            entry["dp"] = summary(cfg, per_client, s.history)
        return {**self._alg.summary_entries(cfg, per_client), "secure_aggregation": entry}


class SimulatedSecAgg:
    """The simulator's executor under secure aggregation: the wrapped executor trains the clients,
    then each client's reply runs the client side of :mod:`fedproto.secagg.protocol` (the same code
    a Flower node runs) and only its masked vector is returned; the plain replies are let go.

    Args:
        executor: the in-process executor. algorithm: the run's algorithm (its client part encodes).
        session: the run's :class:`Session`.
    Attributes:
        drop: test hook, round -> client ids that drop out after the share step (their masked
            vector never arrives; the round goes on without them).
    """

    def __init__(self, executor: Any, algorithm: Any, session: Session):
        self.__dict__.update(_ex=executor, _alg=algorithm, _session=session,
                             _codec=codecs.codec_of(algorithm, session.minimum), drop={})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ex, name)

    def train(self, round: int, sent: dict, downlink=None) -> RoundReplies:
        """The wrapped executor's round, each reply masked on its client (see the class)."""
        got = self._ex.train(round, sent, downlink)
        ids = sorted(got.replies)
        if not ids:
            return got
        t0 = time.perf_counter()
        srv = Server(ids, self._session.fraction, self._session.neighbours)
        clients = {i: Client() for i in ids}
        ref = sent[ids[0]]
        up = down = 0
        pks = {}
        for i in ids:
            pks[i] = clients[i].keys(i, round, **srv.setup(i), fraction=self._session.fraction)
            up += nbytes(pks[i])
        cts = {}
        for i in ids:
            keys = srv.keys_for(i, pks)
            down += nbytes(keys)
            cts[i] = clients[i].shares(keys, self._codec.n_groups(ref))
            up += nbytes(cts[i])
        routed = srv.route(cts)
        gone = set(self.drop.get(round, ()))
        groups = self._codec.groups(ref)
        masked = {}
        for i in ids:
            down += nbytes(routed[i])
            if i in gone:
                continue
            setup = self._ex.setup
            vec = codecs.encode(self._codec.vector(i, got.replies[i][0], sent[i], (setup.states[i], setup.data[i])),
                                len(ids))
            masked[i] = clients[i].masked(vec, routed[i], groups)
        m = self._session.minimum
        rnd, d45, u45 = unmask_round(
            srv, self._codec, ref, masked, m,
            lambda alive, dead: {i: clients[i].view(alive, dead, m) for i in alive},
            lambda tags: {i: clients[i].unmask(tags[i]) for i in tags},
            lambda wanted, counts: {i: clients[i].reveal(wanted, counts, m) for i in sorted(masked)})
        rnd.bytes_up, rnd.bytes_down, rnd.seconds = up + u45, down + d45, time.perf_counter() - t0
        self._session.record(rnd)
        alive, dead = rnd.alive, rnd.dead
        replies = {i: ({KEY: masked[i]}, got.replies[i][1]) for i in alive}
        status = {**got.status, **({"secagg_dropped": dead} if dead else {})}
        return RoundReplies(replies, got.sent, status)
