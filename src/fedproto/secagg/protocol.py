"""The SecAgg+ protocol (Bell et al., CCS 2020; SecAgg: Bonawitz et al., CCS 2017) on maintained
primitives, with self masks per class so that the server decodes a class's sum only over enough
contributors (``docs/secure-aggregation.md``, "Guarantees").

Six exchanges per round between the server and the round's clients, each a message of
``dict[str, numpy.ndarray]`` (the project's message form, so the same code runs in the simulator
and over Flower):

1. **keys** (:meth:`Client.keys`): each client checks the share group and threshold the server
   gives it, makes two fresh X25519 key pairs, one to encrypt the shares it sends its neighbours,
   one to agree the pairwise mask seeds, and sends the public keys.
2. **shares** (:meth:`Client.shares`): given its neighbours' public keys, a client draws one
   16-byte self-mask seed per *group* of its vector (group 0: what is always decoded, e.g. the
   per-class contributor counts; group 1 + c: class c's sum and count), splits each seed and its
   masking secret key into Shamir shares (threshold t over its share group: itself and its
   neighbours) and sends each neighbour its shares encrypted under the key they agreed
   (AES-256-GCM, bound to sender, receiver and round).
3. **masked input** (:meth:`Client.masked`, once per round): the client adds to its fixed-point
   vector, group by group, the self mask of that group's seed and, per neighbour j that completed
   step 2, +PRG(s_ij) if i < j else -PRG(s_ij), all modulo 2^64 (s_ij: the agreed key).
4. **consistency** (:meth:`Client.view`): told which clients sent a masked vector (alive) and
   which did not (dead), a client checks the claim against the shares it holds and sends each
   alive member of its group the hash of that view, encrypted for it (SecAgg's consistency round,
   with the agreed keys in place of signatures).
5. **unmask** (:meth:`Client.unmask`): when at least t members of its group confirmed the same
   view and none another, a client returns its shares of each alive member's group-0 seed and of
   each dead member's masking key, never both for one client, **once per round**.
6. **reveal** (:meth:`Client.reveal`): told the per-class contributor counts the server decoded
   from group 0, a client returns its shares of the alive clients' seeds of the classes with at
   least ``minimum`` contributors, once per round. A class with fewer contributors stays masked:
   the server never holds the seeds that unmask it.

The server (:class:`Server`) routes the messages and, from at least t shares per secret, rebuilds
the self masks and the pairwise masks the dead clients left in their neighbours' vectors.

Primitives, all from maintained libraries: X25519 key agreement, HKDF-SHA256, AES-256-GCM and the
ChaCha20 key stream of ``cryptography``; Shamir secret sharing over GF(2^128) of pycryptodome
(``Crypto.Protocol.SecretSharing.Shamir``, the scheme Flower's ``create_shares`` wraps). The server
interpolates many secrets shared by the same holders with the Lagrange coefficients computed once
(:func:`combine`, on pycryptodome's own field arithmetic; a test checks it against
``Shamir.combine``).

Threat model: an honest-but-curious server and up to t - 1 colluding clients of a share group
learn nothing about an honest client's vector beyond the sums of the classes with at least
``minimum`` contributors (and the group-0 totals); the sum is recovered while at least t of each
share group answer. A server that shows different clients different dropouts is caught by the
consistency step (a client answers only when t members of its group saw its view), and t more
than half the group (``secagg_threshold`` >= 0.5) keeps two halves of a group from each reaching t.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable

import numpy as np

from fedproto.errors import TrainingError
from fedproto.secagg.primitives import (
    KEY_BYTES,
    SEED_BYTES,
    aad,
    agree,
    as_bytes,
    as_u8,
    keypair,
    prg,
    self_mask,
    share_group,
    split,
    threshold,
)
from fedproto.secagg.protocol_server import Server  # the server's side, re-exported here

log = logging.getLogger(__name__)

Message = dict[str, np.ndarray]

class Client:
    """A client's side of one round of the protocol; its state is a message (``state``: numpy
    arrays only, so a Flower node keeps it in its context between the steps). The state records
    the round's unmask and reveal answers, so a second request of either is refused.

    Args:
        state: the state of earlier steps (None: a new round).
    """

    def __init__(self, state: Message | None = None):
        self.state: Message = dict(state or {})

    def _int(self, key: str) -> int:
        return int(self.state[key][0])

    def _seeds(self) -> list[bytes]:
        raw = as_bytes(self.state["seeds"])
        return [raw[a:a + SEED_BYTES] for a in range(0, len(raw), SEED_BYTES)]

    def keys(self, cid: int, round: int, group: Iterable[int], t: int, fraction: float = 0.5) -> Message:
        """Step 1: fresh key pairs; returns the raw public keys (``pk1``: encryption, ``pk2``: masking).

        ``group`` and ``t`` come from the server; the client checks them against its own
        ``fraction`` (``secagg_threshold``): it is in the group, the group has another member, and t
        is at least :func:`threshold` of the group (a server that sends t = 1 would get a seed from
        one share).

        Raises:
            TrainingError: (logged on the client) a group or threshold that fails those checks.
        """
        group = sorted({int(j) for j in group})
        self.state = {"cid": np.array([cid], np.int64), "round": np.array([round], np.int64)}
        if int(cid) not in group or len(group) < 2 or int(t) < threshold(len(group), fraction) or int(t) > len(group):
            raise self._refuse(f"share group {group[:20]} with threshold {t}: it must hold this client and another, "
                               f"and the threshold must be at least {threshold(len(group), fraction)} of "
                               f"{len(group)} (secagg_threshold {fraction})")
        sk1, pk1 = keypair()
        sk2, pk2 = keypair()
        self.state.update({"group": np.asarray(group, np.int64), "t": np.array([t], np.int64),
                           "sk1": as_u8(sk1), "sk2": as_u8(sk2)})
        return {"pk1": as_u8(pk1), "pk2": as_u8(pk2)}

    def shares(self, keys: Message, groups: int = 1) -> Message:
        """Step 2: ``keys`` holds ``pk1.<j>`` and ``pk2.<j>`` of the group members that sent them
        (this client's too). Draws ``groups`` self-mask seeds; returns ``ct.<j>``: for each other
        member j, its shares of the seeds and of the masking key, encrypted for j.

        Raises:
            TrainingError: fewer than t members sent keys (the sum could not be rebuilt), or
                ``groups`` < 1.
        """
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        me, t, rnd = self._int("cid"), self._int("t"), self._int("round")
        members = [int(j) for j in self.state["group"] if f"pk1.{int(j)}" in keys]
        if me not in members or len(members) < t or groups < 1:
            raise TrainingError(f"secure aggregation: {len(members)} of client {me}'s share group sent keys, fewer "
                                f"than the threshold {t}")
        seeds = os.urandom(SEED_BYTES * int(groups))
        shares = split(seeds + as_bytes(self.state["sk2"]), t, len(members))
        out = {}
        for k, j in enumerate(members):
            self.state[f"pk1.{j}"], self.state[f"pk2.{j}"] = keys[f"pk1.{j}"], keys[f"pk2.{j}"]
            if j == me:
                self.state[f"sh.{me}"] = as_u8(shares[k])
                continue
            self.state[f"k1.{j}"] = as_u8(agree(as_bytes(self.state["sk1"]), as_bytes(keys[f"pk1.{j}"]), b"enc"))
            nonce = os.urandom(12)
            ct = AESGCM(as_bytes(self.state[f"k1.{j}"])).encrypt(nonce, shares[k], aad(me, j, rnd))
            out[f"ct.{j}"] = as_u8(nonce + ct)
        self.state["seeds"] = as_u8(seeds)
        return out

    def masked(self, vector: np.ndarray, cts: Message, groups: np.ndarray | None = None) -> np.ndarray:
        """Step 3: ``vector`` (L,) uint64 (:func:`fedproto.secagg.codec.encode`) plus, group by
        group (``groups``: (L,) ints in 0..G-1, default all 0), its self mask, and the pairwise
        masks of the members whose shares arrived (``ct.<j>``, sent by j).

        Raises:
            TrainingError: a ciphertext that does not decrypt (forged, damaged, or not from j to
                this client in this round), ``groups`` that name more groups than seeds were
                drawn, fewer than t members left, or a second call in the round.
        """
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        me, t, rnd = self._int("cid"), self._int("t"), self._int("round")
        if "u2" in self.state:  # a second masked vector under the same masks would give the server their difference
            raise self._refuse(f"a second masked vector in round {rnd}; it masks once per round")
        groups = np.zeros(len(vector), np.int64) if groups is None else np.asarray(groups, np.int64)
        seeds = self._seeds()
        if len(groups) != len(vector) or (len(groups) and int(groups.max()) >= len(seeds)):
            raise TrainingError(f"secure aggregation: client {me} drew {len(seeds)} self-mask seeds but its vector "
                                f"has groups up to {int(groups.max()) if len(groups) else 0}")
        alive = [me]
        for key in sorted(cts, key=lambda k: int(k.split(".")[1])):
            j = int(key.split(".")[1])
            raw = as_bytes(cts[key])
            try:
                plain = AESGCM(as_bytes(self.state[f"k1.{j}"])).decrypt(raw[:12], raw[12:], aad(j, me, rnd))
            except Exception as e:  # a wrong key, a forged, damaged or replayed ciphertext
                raise TrainingError(f"secure aggregation: client {me} could not decrypt the shares of client {j}: "
                                    f"{type(e).__name__}") from None
            self.state[f"sh.{j}"] = as_u8(plain)
            alive.append(j)
        if len(alive) < t:
            raise TrainingError(f"secure aggregation: shares of {len(alive)} members reached client {me}, fewer than "
                                f"the threshold {t}")
        self.state["u2"] = np.asarray(sorted(alive), np.int64)
        out = np.asarray(vector, np.uint64) + self_mask(seeds, groups)
        for j in alive:
            if j != me:
                m = prg(agree(as_bytes(self.state["sk2"]), as_bytes(self.state[f"pk2.{j}"]), b"mask"), len(vector))
                out = out + m if me < j else out - m
        return out

    def _refuse(self, why: str) -> TrainingError:
        log.warning("secure aggregation: client %d refuses: %s", self._int("cid"), why)
        return TrainingError(f"secure aggregation: client {self._int('cid')} refuses: {why}")

    def _chunks(self, j: int, which: list[int]) -> np.ndarray:
        """Member j's share held here: its index and the 16-byte chunks ``which``."""
        s = as_bytes(self.state[f"sh.{j}"])
        return as_u8(s[:4] + b"".join(s[4 + 16 * c:20 + 16 * c] for c in which))

    def _view_hash(self) -> bytes:
        return hashlib.sha256(b"fedproto-secagg-view" + self.state["round"].tobytes() + self.state["a_alive"].tobytes()
                              + b"|" + self.state["a_dead"].tobytes()).digest()

    def view(self, alive: Iterable[int], dead: Iterable[int], minimum: int = 1) -> Message:
        """Step 4 (consistency): told who sent a masked vector (``alive``) and who did not
        (``dead``), the client checks the claim against what it saw and returns, for each alive
        member j of its share group, ``tag.<j>``: the hash of this view encrypted for j (AES-GCM
        under the key they agreed, so the server can neither read nor forge it). Once per round.

        Raises:
            TrainingError: (logged on the client) a second request in the round, this client not
                alive, a client named both, a member whose shares reached this client named
                neither or an alive member whose shares did not, fewer than t alive members of its
                group, fewer than ``minimum`` alive clients, or no shares of the round held (a
                restarted node).
        """
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if "u2" not in self.state:
            raise TrainingError("secure aggregation: this client holds no shares of the round (it did not mask a "
                                "vector, or restarted since): nothing to unmask")
        me, t, rnd = self._int("cid"), self._int("t"), self._int("round")
        alive, dead = sorted({int(j) for j in alive}), sorted({int(j) for j in dead})
        if "a_alive" in self.state:
            raise self._refuse(f"a second unmask request in round {rnd} (answered for alive "
                               f"{self.state['a_alive'].tolist()}, now asked for alive {alive}, dead {dead}); it "
                               "answers once per round")
        group, held = set(self.state["group"].tolist()), set(self.state["u2"].tolist())
        if set(alive) & set(dead) or me not in alive:
            raise self._refuse(f"asked for both shares of clients {sorted(set(alive) & set(dead)) or [me]}; it "
                               "answers for each client one or the other, and only while alive itself")
        if held - set(alive) - set(dead) or (set(alive) & group) - held:
            raise self._refuse(f"told alive {alive}, dead {dead}, which does not match the members whose shares "
                               f"reached it ({sorted(held)})")
        if len(set(alive) & group) < t or len(alive) < minimum:
            raise self._refuse(f"{len(set(alive) & group)} alive members of its share group (threshold {t}) and "
                               f"{len(alive)} alive clients (minimum of contributors {minimum}): too few to unmask")
        self.state["a_alive"], self.state["a_dead"] = np.asarray(alive, np.int64), np.asarray(dead, np.int64)
        digest, out = self._view_hash(), {}
        for j in sorted((set(alive) & group) - {me}):
            nonce = os.urandom(12)
            out[f"tag.{j}"] = as_u8(nonce + AESGCM(as_bytes(self.state[f"k1.{j}"])).encrypt(
                nonce, digest, aad(me, j, rnd) + b"view"))
        return out

    def unmask(self, tags: Message) -> Message:
        """Step 5: with the view tags its group's alive members sent it (``tag.<j>``, from j),
        the client checks that at least t members of its group (itself included) saw the same alive
        and dead clients, and that none saw others; then it returns its shares of the alive
        members' group-0 seeds (``s.<j>``) and of the dead members' masking keys (``k.<j>``). So
        the server cannot show two halves of a group two different dropouts. Once per round.

        Raises:
            TrainingError: (logged on the client) no view this round, a second request, a tag that
                does not decrypt or names another view, fewer than t matching views.
        """
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if "a_alive" not in self.state:
            raise self._refuse("an unmask request before the round's consistency step")
        if "a_done" in self.state:
            raise self._refuse(f"a second unmask request in round {self._int('round')}; it answers once per round")
        me, t, rnd = self._int("cid"), self._int("t"), self._int("round")
        digest, group = self._view_hash(), set(self.state["group"].tolist())
        alive = set(self.state["a_alive"].tolist())
        same = {me}
        for key in tags:
            j = int(key.split(".")[1])
            raw = as_bytes(tags[key])
            try:
                got = AESGCM(as_bytes(self.state[f"k1.{j}"])).decrypt(raw[:12], raw[12:], aad(j, me, rnd) + b"view")
            except Exception:  # forged, from another round or client, or j unknown
                raise self._refuse(f"the view of client {j} does not authenticate") from None
            if got != digest or j not in alive or j not in group:
                raise self._refuse(f"client {j} saw other clients alive or dead than it was told: the server showed "
                                   "different dropouts to different clients")
            same.add(j)
        if len(same) < t:
            raise self._refuse(f"{len(same)} members of its share group confirmed its view, fewer than the "
                               f"threshold {t}")
        self.state["a_done"] = np.array([1], np.int64)
        held = set(self.state["u2"].tolist())
        n_seeds = len(self.state["seeds"]) // SEED_BYTES
        key_chunks = list(range(n_seeds, n_seeds + KEY_BYTES // 16))
        out = {f"s.{j}": self._chunks(j, [0]) for j in self.state["a_alive"].tolist() if j in held}
        out.update({f"k.{j}": self._chunks(j, key_chunks) for j in self.state["a_dead"].tolist() if j in held})
        return out

    def reveal(self, groups: Iterable[int], counts: np.ndarray, minimum: int = 1) -> Message:
        """Step 5: this client's shares of the seeds of ``groups`` (each 1 + a class) of the alive
        members of step 4 (``s.<j>``: the index, then one chunk per group in the order given).
        ``counts``: the (G - 1,) per-class contributor counts the server decoded. Answered once
        per round.

        Raises:
            TrainingError: (logged on the client) no step 4 answer this round, a second request, a
                group that is not a class, repeated, or whose count is under ``minimum``.
        """
        groups = [int(g) for g in groups]
        counts = np.asarray(counts, np.int64).reshape(-1)
        if "a_done" not in self.state:
            raise self._refuse("a reveal request before the round's unmask step")
        if "b_groups" in self.state:
            raise self._refuse(f"a second reveal request in round {self._int('round')}; it answers once per round")
        n_seeds = len(self.state["seeds"]) // SEED_BYTES
        bad = [g for g in groups if not 1 <= g < n_seeds or g - 1 >= len(counts) or counts[g - 1] < minimum]
        if bad or len(set(groups)) != len(groups) or len(counts) != n_seeds - 1:
            raise self._refuse(f"asked to reveal groups {groups} with contributor counts {counts.tolist()}: a class "
                               f"sum is revealed only with at least {minimum} contributors, once")
        self.state["b_groups"] = np.asarray(groups, np.int64)
        held = {int(j) for j in self.state["u2"]}
        return {f"s.{j}": self._chunks(j, groups) for j in self.state["a_alive"].tolist() if j in held}


__all__ = ["Client", "Server", "share_group", "threshold"]
