"""What secure aggregation sums, per method, and its fixed-point encoding.

A method takes part when its server needs only sums of the clients' replies. Each client turns
its reply into one float64 vector (:meth:`Codec.vector`, after the reply checks that still apply,
run on the client), the vector is encoded in fixed point (:func:`encode`), masked and summed
(:mod:`fedproto.secagg.protocol`); the server decodes the sum (:func:`decode`) and makes the next
message from it (:meth:`Codec.aggregate`).

* FedProto (``aggregation`` ``mean`` or ``weighted``, eq. 6): per class c the sum of the
  prototypes (``mean``) or of count x prototype (``weighted``), the sum of the counts and the number
  of contributors; the global prototype is sum / contributors or sum / counts.
* FedAvg, FedProx, FedPer, FedRep (sample-weighted means of the shared weights): the sums of
  n_i x w_i and of n_i; the average is their quotient.

Refused (:func:`check`): what needs one client's reply (``median``, ``trimmed``,
``exclude_outliers``, ``class_check``), DP but ``dp = "prototypes"`` with ``aggregation = "weighted"``
(:mod:`fedproto.secagg.epsilon`: distributed noise) and the methods whose server step uses each client's reply
(FedTGP's and FedGH's server training, FeSEM's clustering, LG-FedAvg, FD's per-client logits
exclusion).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from fedproto.errors import ConfigError, TrainingError, opt

log = logging.getLogger(__name__)

Message = dict[str, np.ndarray]

FRAC_BITS = 32
"""Fractional bits of the fixed-point encoding: a value x is sent as round(x * 2^32) modulo 2^64
(two's complement), so each client's value is off by at most 2^-33 and a sum of n clients' by at
most n * 2^-33; a sum must stay below 2^30 in magnitude."""

LIMIT = 2.0 ** (62 - FRAC_BITS)


def encode(x: np.ndarray, parties: int = 1) -> np.ndarray:
    """Fixed point: (L,) float -> (L,) uint64, round(x * 2^FRAC_BITS) modulo 2^64.

    Args:
        x: the client's (L,) vector. parties: the clients whose vectors are summed (the range
            check leaves room for their sum).
    Raises:
        TrainingError: a value is not finite or so large that the sum of ``parties`` such values
            would overflow.
    """
    x = np.asarray(x, np.float64)
    bound = LIMIT / max(1, parties)
    if not np.isfinite(x).all() or (len(x) and float(np.abs(x).max()) >= bound):
        raise TrainingError(f"secure aggregation: a value to sum is not finite or too large for the fixed-point "
                            f"encoding (largest {float(np.abs(x).max()) if len(x) else 0:.4g}, limit {bound:.4g} for "
                            f"{parties} clients)")
    return np.rint(x * 2.0**FRAC_BITS).astype(np.int64).view(np.uint64)


def decode(total: np.ndarray) -> np.ndarray:
    """The sum back to float64: (L,) uint64 -> (L,) float64 (two's complement / 2^FRAC_BITS)."""
    return np.asarray(total, np.uint64).view(np.int64).astype(np.float64) / 2.0**FRAC_BITS


def check(cfg: Any, alg: Any) -> None:
    """Refuse ``secagg`` with a method or an option that needs individual replies.

    Raises:
        ConfigError: naming the conflict and the fix.
    """
    name = alg.name
    if secure_sum_of(alg) == "prototypes":
        why = [(opt("aggregation", cfg.aggregation), "needs each client's prototype (a coordinate-wise median or "
                f"trimmed mean is not a function of sums); use {opt('aggregation', 'mean')} or "
                f"{opt('aggregation', 'weighted')}")
               ] if cfg.aggregation not in ("mean", "weighted") else []
        if cfg.exclude_outliers:
            why.append((opt("exclude_outliers", cfg.exclude_outliers), "scores each client's prototypes against the "
                        f"others; use {opt('exclude_outliers', 0)}"))
        if cfg.class_check:
            why.append((opt("class_check", cfg.class_check), "checks each client's prototype rows against the last "
                        f"global prototypes; use {opt('class_check', 0)}"))
        if why:
            raise ConfigError(f"{opt('secagg', True)} gives the server the sums of the clients' replies only, but "
                              + "; ".join(f"{o} {w}" for o, w in why), option="secagg", value=True)
        from fedproto.secagg.epsilon import check as check_dp

        check_dp(cfg)
        return
    if codec_of(alg) is None:
        raise ConfigError(f"{opt('secagg', True)} gives the server the sums of the clients' replies only, but "
                          f"{opt('algorithm', name)} aggregates each client's reply on its own (its server step needs "
                          "them one by one); secure aggregation serves the methods whose server step is a "
                          "function of the sums (Algorithm.secure_sum: fedproto with aggregation mean or weighted, "
                          "fedavg, fedprox, fedper, fedrep)", option="secagg", value=True)


def secure_sum_of(alg: Any) -> str | None:
    """What ``alg`` declares secure aggregation sums (``Algorithm.secure_sum``: ``"prototypes"``,
    ``"weights"`` or None), None when its class no longer has the declaring class's ``aggregate``
    (a subclass with a server step of its own needs the individual replies)."""
    cls = type(alg)
    for k in cls.__mro__:
        if "secure_sum" in k.__dict__:
            same_step = getattr(cls, "aggregate", None) is getattr(k, "aggregate", None)
            return k.__dict__["secure_sum"] if same_step else None
    return None


def codec_of(alg: Any, minimum: int = 2) -> Codec | None:
    """The codec of a method, or None when its server needs individual replies; ``minimum``:
    ``secagg_min_contributors`` (with 1 nothing is withheld and FedProto's vector is one group)."""
    sums = secure_sum_of(alg)  # asked of the method (the engine imports no method module)
    if sums == "prototypes":
        return ProtoCodec(alg, minimum)
    if sums == "weights":  # the sample-weighted mean of fedproto.algorithms.fedavg
        return WeightsCodec(alg)
    return None


class Codec:
    """A method's sum: the client's vector (:meth:`vector`) and the server's message from the sum
    (:meth:`aggregate`)."""

    def __init__(self, alg: Any, minimum: int = 2):
        self.alg, self.minimum = alg, minimum

    def checked(self, cid: int, reply: Message, sent: Message) -> Message:
        """The reply after the algorithm's own reply checks (against ``sent``, the downlink message
        the client received), run on the client ({} when nothing is usable)."""
        why = self.alg.reply_problem(reply, sent, getattr(self.alg, "embedding_dim", 0)) if reply else ""
        if why:
            log.warning("secure aggregation: client %d leaves its reply out of the sum: %s", cid, why)
            return {}
        clean, parts = self.alg.reply_problems(cid, reply)
        for p in parts:
            log.warning("secure aggregation: client %d leaves out of the sum %s", cid, p)
        return clean

    def length(self, sent: Message) -> int:
        """L, the vector length, from the round's downlink message."""
        raise NotImplementedError

    def groups(self, sent: Message) -> np.ndarray:
        """(L,) int64: each coordinate's self-mask group. Group 0 is always decoded (for every
        method here: over at least ``secagg_min_contributors`` clients); group 1 + c is class c's,
        decoded only when :meth:`reveal` names it. Default: one group, all of the vector."""
        return np.zeros(self.length(sent), np.int64)

    def n_groups(self, sent: Message) -> int:
        """G, the self-mask seeds each client draws: 1 + the largest group of :meth:`groups`."""
        return 1

    def reveal(self, opened: np.ndarray, minimum: int) -> tuple[list[int], np.ndarray, list[int]]:
        """What to unmask beyond group 0, from ``opened`` (the decoded (L,) float64 sum, exact on
        group 0's coordinates): (the groups to reveal, the (G - 1,) contributor counts the clients
        check, the classes withheld: held by fewer than ``minimum`` clients). Default: nothing more."""
        return [], np.zeros(0, np.int64), []

    def withhold(self, total: np.ndarray, classes: list[int]) -> np.ndarray:
        """``total`` with ``classes`` marked as held by nobody this round (their coordinates are
        already zero: never decoded). Default: no classes."""
        return total

    def all_classes(self) -> list[int]:
        """The classes whose sums the vector carries (none for weights)."""
        return []

    def vector(self, cid: int, reply: Message, sent: Message, client: tuple | None = None) -> np.ndarray:
        """The client's (L,) float64 vector of ``reply`` (zeros: nothing to add); ``client``: its
        (state, data), which distributed DP noise needs (:func:`fedproto.secagg.epsilon.noisy_sums`)."""
        raise NotImplementedError

    def aggregate(self, round: int, total: np.ndarray, cids: list[int], sent: Message, state: Any = None) -> Any:
        """The next server message (or :class:`~fedproto.algorithms.server_state.ServerState`) from the
        decoded (L,) float64 sum of clients ``cids``, given the previous server state ``state``."""
        raise NotImplementedError


class ProtoCodec(Codec):
    """FedProto: [sums (C*d), counts (C), contributors (C)]; sums of prototypes (``mean``) or of
    count x prototype (``weighted``); rows under ``min_proto_samples`` are left out on the client."""

    def length(self, sent: Message) -> int:
        a = self.alg
        return a.num_classes * (a.embedding_dim + 2)

    def groups(self, sent: Message) -> np.ndarray:
        """Class c's sum row and count in group 1 + c; the contributor counts in group 0. With a
        minimum of 1 contributor nothing is ever withheld: one group (one seed to share, no reveal step)."""
        C, d = self.alg.num_classes, self.alg.embedding_dim
        if self.minimum <= 1:
            return np.zeros(C * (d + 2), np.int64)
        return np.concatenate([np.repeat(np.arange(1, C + 1), d), np.arange(1, C + 1), np.zeros(C, np.int64)])

    def n_groups(self, sent: Message) -> int:
        return 1 if self.minimum <= 1 else self.alg.num_classes + 1

    def reveal(self, opened: np.ndarray, minimum: int) -> tuple[list[int], np.ndarray, list[int]]:
        """The classes with at least ``minimum`` (and at least 1) contributors are revealed; those
        held by fewer (but some) are withheld."""
        C, d = self.alg.num_classes, self.alg.embedding_dim
        contrib = np.rint(opened[C * (d + 1):]).astype(np.int64)
        if self.minimum <= 1:  # one group: all of the vector is decoded already
            return [], contrib, []
        ok = [c for c in range(C) if contrib[c] >= max(1, minimum)]
        return [1 + c for c in ok], contrib, [c for c in range(C) if 0 < contrib[c] < minimum]

    def all_classes(self) -> list[int]:
        return list(range(self.alg.num_classes))

    def withhold(self, total: np.ndarray, classes: list[int]) -> np.ndarray:
        """Zero the contributor counts of ``classes``: the server's steps then keep their last global
        prototype, as for a class nobody holds."""
        C, d = self.alg.num_classes, self.alg.embedding_dim
        out = total.copy()
        out[C * (d + 1) + np.asarray(classes, np.int64)] = 0.0
        return out

    def vector(self, cid: int, reply: Message, sent: Message, client: tuple | None = None) -> np.ndarray:
        a = self.alg
        if a.dp != "off":  # the client's own release with its share of the noise (fedproto.secagg.epsilon)
            from fedproto.secagg.epsilon import noisy_sums

            return noisy_sums(a, *client)
        C, d = a.num_classes, a.embedding_dim
        out = np.zeros(C * (d + 2), np.float64)
        reply = self.checked(cid, reply, sent)
        if not reply:
            return out
        c = np.asarray(reply["classes"], np.int64)
        p = np.asarray(reply["protos"], np.float64)
        n = np.asarray(reply["counts"], np.float64)
        keep = n >= a.min_proto_samples
        c, p, n = c[keep], p[keep], n[keep]
        sums = out[:C * d].reshape(C, d)
        sums[c] = p * n[:, None] if a.aggregation == "weighted" else p
        out[C * d + c] = n
        out[C * (d + 1) + c] = 1.0
        return out

    def aggregate(self, round: int, total: np.ndarray, cids: list[int], sent: Message,
                  state: Any = None) -> Any:
        """FedProto's :class:`~fedproto.algorithms.server_state.ServerState` from the sums: the class means
        go through FedProto's own server steps as one pseudo-reply (its momentum against
        ``state``, the classes kept from before, the λ warm-up; ``min_contributors`` is applied
        here, on the summed contributor counts); the contributors per class come from the sums;
        no per-client distances exist (no ``proto_dist`` metrics, no alerts)."""
        from dataclasses import replace

        from fedproto.algorithms.proto_steps import AggregationRule, prototype_files

        a = self.alg
        C, d = a.num_classes, a.embedding_dim
        sums, counts = total[:C * d].reshape(C, d), total[C * d:C * (d + 1)]
        counts = counts if a.dp != "off" else np.rint(counts)
        contrib = np.rint(total[C * (d + 1):]).astype(np.int64)
        classes = np.nonzero((contrib >= a.min_contributors) & (contrib > 0))[0]
        # weighted: the (under DP noised) counts, at least 1 as fedproto.prototypes.dp.noisy_prototypes divides
        div = np.maximum(counts[classes], 1.0) if a.aggregation == "weighted" else contrib[classes].astype(np.float64)
        protos = sums[classes] / div[:, None]
        steps = replace(a.server_steps(), rule=AggregationRule(C, a.aggregation, a.trim, 1))
        pseudo = ({-1: {"classes": classes, "protos": protos,
                        "counts": np.maximum(1, counts[classes]).astype(np.int64)}} if len(classes) else {})
        out = a.run_steps(steps, round, pseudo, state)
        now = set(classes.tolist())
        kept = np.asarray(out.message.get("classes", np.zeros(0, np.int64))).tolist()
        per_class = np.array([contrib[c] if c in now else 0 for c in kept], np.int64)
        metrics = {k: v for k, v in out.metrics.items() if not k.startswith("proto_dist")}
        checkpoint = {**out.checkpoint, "last_contributors": per_class, "last_distances": None,
                      "last_cids": np.asarray(cids, np.int64)}
        return replace(out, metrics=metrics, alerts=[], checkpoint=checkpoint,
                       files=prototype_files(out.message, per_class))


class WeightsCodec(Codec):
    """Sample-weighted means of shared weights: [n_i x w_i for each ``w/`` tensor in key order, n_i]."""

    def _keys(self, sent: Message) -> list[str]:
        return sorted(k for k in sent if k.startswith("w/"))

    def length(self, sent: Message) -> int:
        return sum(int(np.asarray(sent[k]).size) for k in self._keys(sent)) + 1

    def vector(self, cid: int, reply: Message, sent: Message, client: tuple | None = None) -> np.ndarray:
        keys = self._keys(sent)
        reply = self.checked(cid, reply, sent)
        if not reply:
            return np.zeros(self.length(sent), np.float64)
        n = float(np.asarray(reply["n"]).reshape(-1)[0])
        return np.concatenate([n * np.asarray(reply[k], np.float64).reshape(-1) for k in keys] + [np.array([n])])

    def aggregate(self, round: int, total: np.ndarray, cids: list[int], sent: Message, state: Any = None) -> Message:
        keys, n = self._keys(sent), total[-1]
        if not n > 0:
            return {k: np.asarray(sent[k], np.float32) for k in keys}
        out, at = {}, 0
        for k in keys:
            shape = np.asarray(sent[k]).shape
            size = int(np.prod(shape))
            out[k] = (total[at:at + size] / n).reshape(shape).astype(np.float32)
            at += size
        return out
