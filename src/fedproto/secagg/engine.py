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

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedproto.engine.executors.base import RoundReplies
from fedproto.errors import TrainingError
from fedproto.secagg import codec as codecs
from fedproto.secagg.protocol import Client, Server

KEY = "secagg"
"""The reply key of a masked vector."""


def nbytes(msg: dict) -> int:
    """Bytes of a message of arrays."""
    return sum(int(np.asarray(v).nbytes) for v in msg.values())


@dataclass
class Round:
    """One round's protocol record: the masks to remove, who took part, the bytes and seconds of
    the key and share exchanges (the masked vectors are counted by the round loop as ``up_bytes``)."""

    alive: list[int]
    dead: list[int]
    masks: np.ndarray
    sent: dict
    bytes_up: int = 0
    bytes_down: int = 0
    seconds: float = 0.0


@dataclass
class Session:
    """The secure aggregation of a run: its options and the last round's record.

    Args:
        fraction: ``secagg_threshold``. neighbours: ``secagg_neighbours``.
    """

    fraction: float = 0.5
    neighbours: int = 0
    last: Round | None = None
    totals: dict = field(default_factory=lambda: {"bytes_up": 0, "bytes_down": 0, "seconds": 0.0, "dropouts": 0})

    def record(self, rnd: Round) -> None:
        """Keep ``rnd`` as the last round's record and add its bytes, seconds and dropouts to the totals."""
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
        self.__dict__["_codec"] = codecs.codec_of(algorithm)

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
        method's next :class:`~fedproto.algorithms.state.ServerState` from it
        (:meth:`fedproto.secagg.codec.Codec.aggregate`, given the previous ``state``), with the
        protocol's metrics added (:meth:`secagg_metrics`).

        Raises:
            TrainingError: the replies are not those the unmask step rebuilt the masks of.
        """
        from dataclasses import replace

        from fedproto.algorithms.state import as_state

        rnd = self._session.last
        cids = sorted(messages)
        if rnd is None or cids != rnd.alive:
            raise TrainingError(f"round {round}: secure aggregation rebuilt the masks of clients "
                                f"{rnd.alive if rnd else []} but the loop aggregates {cids}; a masked vector "
                                "cannot be left out after the unmask step")
        total = np.zeros(len(rnd.masks), np.uint64)
        for i in cids:
            total = total + messages[i][KEY]
        total = codecs.decode(total - rnd.masks)
        out = self._codec.aggregate(round, total, cids, rnd.sent, state)
        out = as_state(self._alg, out)  # a method whose aggregate returns its message alone
        return replace(out, metrics={**out.metrics, **self.secagg_metrics()})

    def secagg_metrics(self) -> dict:
        """The protocol's metrics of the last round: ``secagg_bytes`` (keys, shares and unmask
        messages, up and down), ``secagg_s`` (seconds in the protocol's steps), ``secagg_dropped``
        (clients that shared keys but sent no masked vector)."""
        rnd = self._session.last
        if rnd is None:
            return {}
        return {"secagg_bytes": rnd.bytes_up + rnd.bytes_down, "secagg_s": rnd.seconds,
                "secagg_dropped": list(rnd.dead)}

    def summary_entries(self, cfg: Any, per_client: list[dict]) -> dict:
        """The algorithm's entries plus ``secure_aggregation``: protocol, options, threat model and totals."""
        s = self._session
        entry = {
            "protocol": "SecAgg+ (pairwise masks from ECDH P-384 key agreement, self masks, Shamir shares of the "
                        "mask seeds and masking keys, ChaCha20 mask streams)",
            "fixed_point_bits": codecs.FRAC_BITS, "threshold_fraction": s.fraction,
            "neighbours": s.neighbours or "all",
            "threat_model": "honest-but-curious server; up to t-1 colluding clients per share group; the sum is "
                            "rebuilt while at least t of each share group answer the unmask step",
            "server_sees": "per round the sum of the clients' vectors and who took part; no client's reply",
            "extra_bytes": int(s.totals["bytes_up"] + s.totals["bytes_down"]),
            "protocol_seconds": float(s.totals["seconds"]), "dropouts": int(s.totals["dropouts"]),
        }
        if getattr(cfg, "dp", "off") != "off":
            from fedproto.secagg.dp import summary

            entry["dp"] = summary(cfg, per_client)
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
        self.__dict__.update(_ex=executor, _alg=algorithm, _session=session, _codec=codecs.codec_of(algorithm),
                             drop={})

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
        up = down = 0
        pks = {}
        for i in ids:
            pks[i] = clients[i].keys(i, round, **srv.setup(i))
            up += nbytes(pks[i])
        cts = {}
        for i in ids:
            keys = srv.keys_for(i, pks)
            down += nbytes(keys)
            cts[i] = clients[i].shares(keys)
            up += nbytes(cts[i])
        routed = srv.route(cts)
        gone = set(self.drop.get(round, ()))
        ref = sent[ids[0]]
        length = self._codec.length(ref)
        masked = {}
        for i in ids:
            down += nbytes(routed[i])
            if i in gone:
                continue
            setup = self._ex.setup
            vec = codecs.encode(self._codec.vector(i, got.replies[i][0], sent[i], (setup.states[i], setup.data[i])),
                                len(ids))
            masked[i] = clients[i].masked(vec, routed[i])
        alive, dead = srv.unmask_request(sorted(masked))
        shares = {}
        for i in alive:
            shares[i] = clients[i].unmask(alive, dead)
            down += 8 * (len(alive) + len(dead))
            up += nbytes(shares[i])
        masks = srv.masks(alive, dead, shares, length)
        self._session.record(Round(alive, dead, masks, ref, up, down, time.perf_counter() - t0))
        replies = {i: ({KEY: masked[i]}, got.replies[i][1]) for i in alive}
        status = {**got.status, **({"secagg_dropped": dead} if dead else {})}
        return RoundReplies(replies, got.sent, status)
