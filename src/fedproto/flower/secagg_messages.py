"""Secure aggregation over Flower (option ``secagg``): the protocol's six steps as Flower messages.

Server (:class:`SecAggFlowerExecutor`, around :class:`fedproto.flower.flower_executor.FlowerExecutor`),
per round, to the sampled clients:

1. ``query.secagg`` stage 1: each node's share group and threshold; reply: its public keys.
2. ``query.secagg`` stage 2: its group's public keys and the number of self-mask groups; reply:
   its encrypted shares, per member.
3. ``train``: the round's downlink message plus the shares addressed to the node (``secagg.ct.<j>``,
   counted in ``secagg_bytes``); the node trains, checks its reply, encodes and masks it (:func:`masked_reply`);
   reply: ``{"secagg": (L,) uint64}`` and the losses.
4. ``query.secagg`` stage 4: who sent a masked vector; reply: the node's view of it, encrypted for
   each alive member of its group (the consistency step).
5. ``query.secagg`` stage 5: the members' view tags; reply, when t of them confirm the node's view:
   the shares that rebuild the group-0 and the dropped nodes' masks (once per round: the node's
   state records the answer).
6. ``query.secagg`` stage 6: the per-class contributor counts decoded from group 0 and the classes
   with at least ``secagg_min_contributors``; reply: the shares of those classes' seeds (once per round).

Why not Flower's ``SecAggPlusWorkflow`` and ``secaggplus_mod``: the workflow runs a whole round of
a Flower ``Strategy`` (``configure_fit`` samples, ``aggregate_fit`` aggregates, a ``LegacyContext``
holds the parameters), while fedproto's round loop samples, checks, retries and aggregates itself;
the mod takes one weight per client (``num_examples / max_weight``) where a prototype sum needs one
count per class, rounds stochastically with numpy's global generator (runs would not reproduce) and
draws masks from a 32-bit seed. ``docs/secure-aggregation.md`` gives the lines. The primitives
under ``flwr.common.secure_aggregation`` are used as they are (:mod:`fedproto.secagg.protocol`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from flwr.app import Context

from fedproto.engine.executors.executor import RoundReplies
from fedproto.errors import TrainingError
from fedproto.flower.records import MESSAGE, from_record, to_record
from fedproto.secagg import codec as codecs
from fedproto.secagg.masked_round import KEY, Session, nbytes, unmask_round
from fedproto.secagg.protocol import Client, Server

log = logging.getLogger(__name__)

QUERY = "query.secagg"
"""The message type of the protocol's steps 1, 2 and 4."""
STATE = "fedproto.secagg"
"""The node's protocol state in its context (its secret keys of the round; never sent)."""
PREFIX = "secagg."
"""The downlink keys of step 3 (the shares addressed to the node)."""


def _state(context: Context) -> dict:
    return from_record(context.state[STATE]) if STATE in context.state else {}


def step(n: Any, m: dict, context: Context) -> dict:
    """Steps 1, 2, 4, 5 and 6 of the protocol on node ``n`` (:class:`fedproto.secagg.protocol.Client`)
    for the server's message ``m`` (``stage``); returns the reply. The node's secrets and its
    answers of the round stay in ``context.state``, so a second consistency, unmask or reveal
    request of a round is refused (and logged on the node), and so is a new key step for a round
    not after the last one it keyed. The threshold fraction and the minimum of contributors are
    the run config's, raised to the node's own floors (:func:`floors`).

    Raises:
        TrainingError: a refused request, or an unknown stage.
    """
    stage = int(m["stage"][0])
    fraction, minimum = floors(n, context)
    if stage == 1:
        last = _state(context).get("round")
        r = int(m["round"][0])
        if last is not None and r <= int(last[0]):
            raise TrainingError(f"secure aggregation: client {n.cid} refuses new keys for round {r}: it keyed round "
                                f"{int(last[0])} already (a repeated round would let the server compare its answers)")
        c = Client()
        out = c.keys(n.cid, r, m["group"].tolist(), int(m["t"][0]), fraction)
        c.state["parties"] = m["parties"]
    else:
        c = Client(_state(context))
        if stage == 2:
            out = c.shares({k: v for k, v in m.items() if k not in ("stage", "groups")}, int(m["groups"][0]))
        elif stage == 4:
            out = c.view(m["alive"].tolist(), m["dead"].tolist(), minimum)
        elif stage == 5:
            out = c.unmask({k: v for k, v in m.items() if k.startswith("tag.")})
        elif stage == 6:
            out = c.reveal(m["groups"].tolist(), m["counts"], minimum)
        else:
            raise TrainingError(f"secure aggregation: unknown step {stage} (1, 2, 4, 5 or 6)")
    context.state[STATE] = to_record(c.state)
    return out


NODE_FLOORS = {"secagg-threshold": "secagg_threshold", "secagg-min-contributors": "secagg_min_contributors"}
"""Node-config keys a site sets (``flower-supernode --node-config``) so that the server's run config
cannot lower them: the node uses the larger of the two."""


def floors(n: Any, context: Context) -> tuple[float, int]:
    """(threshold fraction, minimum of contributors) this node enforces: the run config's
    ``secagg_threshold`` and ``secagg_min_contributors``, raised to the node config's
    ``secagg-threshold`` and ``secagg-min-contributors`` where the site set them (the run config
    comes from whoever submits the run: a site that does not trust the server sets its floors).

    Raises:
        ConfigError: a node-config floor that is not a number in range.
    """
    from fedproto.errors import ConfigError

    got = {}
    for key, field in NODE_FLOORS.items():
        v = context.node_config.get(key)
        if v is None:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (
            0 <= v < 1 if field == "secagg_threshold" else (float(v).is_integer() and v >= 1))
        if not ok:
            want = "a fraction in [0, 1)" if field == "secagg_threshold" else "a whole number of 1 or more"
            raise ConfigError(f"node config {key}={v!r}: use {want}")
        got[field] = v
    return (max(float(n.cfg.secagg_threshold), float(got.get("secagg_threshold", 0.0))),
            max(int(n.cfg.secagg_min_contributors), int(got.get("secagg_min_contributors", 1))))


def masked_reply(n: Any, down: dict, context: Context, round: int):
    """Step 3 on a node: (the downlink message without the shares, a function that turns the
    node's reply into its masked vector). The reply is checked on the node first
    (:meth:`fedproto.secagg.codec.Codec.checked`: the rows the server's check would drop are left
    out of the sum).

    Raises:
        TrainingError: the message carries no shares (a node must not send its reply in the clear).
    """
    cts = {k[len(PREFIX):]: v for k, v in down.items() if k.startswith(PREFIX)}
    c = Client(_state(context))
    if "round" not in c.state or int(c.state["round"][0]) != round or "seeds" not in c.state:
        raise TrainingError(f"secagg is on but this node holds no secure-aggregation keys of round {round} (it did "
                            "not take part in the round's key and share steps): it does not send its reply in the "
                            "clear")
    if "u2" in c.state:
        raise TrainingError(f"secure aggregation: client {n.cid} masked its vector of round {round} already: it masks "
                            "once per round (a second masked vector under the same masks reveals their difference)")
    plain = {k: v for k, v in down.items() if not k.startswith(PREFIX)}
    codec = codecs.codec_of(n.algorithm, floors(n, context)[1])

    def finish(reply: dict) -> dict:
        vec = codecs.encode(codec.vector(n.cid, reply, plain, (n.state, n.data)), int(c.state["parties"][0]))
        out = {KEY: c.masked(vec, cts, codec.groups(plain))}
        context.state[STATE] = to_record(c.state)
        return out

    return plain, finish


class SecAggFlowerExecutor:
    """The Flower executor under secure aggregation (see the module); every other attribute is the
    wrapped executor's.

    Args:
        executor: the run's :class:`~fedproto.flower.flower_executor.FlowerExecutor`.
        algorithm: the run's algorithm (its codec gives the vector length). session: the run's
            :class:`~fedproto.secagg.masked_round.Session`.
    """

    def __init__(self, executor: Any, algorithm: Any, session: Session):
        self.__dict__.update(_ex=executor, _codec=codecs.codec_of(algorithm, session.minimum),
                             _session=session)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ex, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._ex, name, value)

    def _step(self, ids: list[int], msgs: dict[int, dict]) -> tuple[dict[int, dict], int, int]:
        ex = self._ex
        replies, *_ = ex._send(QUERY, ids, msgs)
        got = {i: from_record(r.content[MESSAGE]) for i, r in replies.items()}
        return got, sum(nbytes(msgs[i]) for i in ids), sum(nbytes(m) for m in got.values())

    def train(self, round: int, sent: dict, downlink=None) -> RoundReplies:
        """The protocol's six steps around the wrapped executor's ``train`` (see the module)."""
        ex = self._ex
        ex.round = round
        ids = [i for i in sorted(sent) if i in ex.nodes]
        t0 = time.perf_counter()
        srv = Server(ids, self._session.fraction, self._session.neighbours)
        first = {i: {"stage": np.array([1]), "round": np.array([round]), "parties": np.array([len(ids)]),
                     "group": np.asarray(srv.setup(i)["group"], np.int64), "t": np.array([srv.setup(i)["t"]])}
                 for i in ids}
        pks, down, up = self._step(ids, first)
        ref = sent[ids[0]] if ids else {}
        n_groups = np.array([self._codec.n_groups(ref)]) if ids else np.array([1])
        keys = {i: {"stage": np.array([2]), "groups": n_groups, **srv.keys_for(i, pks)} for i in sorted(pks)}
        cts, d2, u2 = self._step(sorted(pks), keys)
        routed = srv.route(cts)
        seconds = time.perf_counter() - t0
        msgs = {i: {**sent[i], **{PREFIX + k: v for k, v in routed[i].items()}} for i in srv.u2}
        got = ex.train(round, msgs, None)  # no retry with other clients: they hold no shares of this round
        t1 = time.perf_counter()
        length = self._codec.length(ref) if ids else 0
        ok = {i: r for i, r in got.replies.items() if i in srv.u2
              and set(r[0]) == {KEY} and r[0][KEY].dtype == np.uint64 and r[0][KEY].shape == (length,)}

        def ask(stage: int, extra: dict, each: dict[int, dict] | None = None) -> dict[int, dict]:
            to = sorted(ok) if each is None else sorted(each)
            return self._step(to, {i: {"stage": np.array([stage]), **extra, **(each or {}).get(i, {})}
                                   for i in to})[0]

        rnd, d45, u45 = unmask_round(
            srv, self._codec, ref, {i: r[0][KEY] for i, r in ok.items()}, self._session.minimum,
            lambda alive, dead: ask(4, {"alive": np.asarray(alive, np.int64), "dead": np.asarray(dead, np.int64)}),
            lambda tags: ask(5, {}, tags),
            lambda wanted, counts: ask(6, {"groups": np.asarray(wanted, np.int64), "counts": np.asarray(counts)}))
        alive, dead = rnd.alive, rnd.dead
        if dead:
            log.warning("round %d: secure aggregation: clients %s shared keys but sent no masked vector; their masks "
                        "are rebuilt from the others' shares", round, dead)
        routed_bytes = sum(nbytes(m) for m in routed.values())  # the shares in the train messages
        rnd.bytes_up, rnd.bytes_down = up + u2 + u45, down + d2 + d45 + routed_bytes
        rnd.seconds = seconds + time.perf_counter() - t1
        self._session.record(rnd)
        status = {**got.status, **({"secagg_dropped": dead} if dead else {})}
        # the round's downlink as the loop counts it: the server's messages; the shares are in secagg_bytes
        return RoundReplies({i: ok[i] for i in alive}, {i: sent.get(i, m) for i, m in got.sent.items()}, status)


def install(cfg: Any, algorithm: Any, executor: Any) -> tuple[Any, Any]:
    """(the algorithm's server part, the executor) under ``cfg.secagg`` (unchanged when off); binds
    the server part to the executor (its reply check decides retries).

    Raises:
        ConfigError: :func:`fedproto.secagg.check`.
    """
    from fedproto.secagg import install as install_secagg

    server, _ = install_secagg(cfg, algorithm)
    if server is not algorithm:
        executor = SecAggFlowerExecutor(executor, algorithm, server._session)
    executor.bind(server)
    return server, executor
