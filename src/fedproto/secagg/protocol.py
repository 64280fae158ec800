"""The SecAgg+ protocol (Bell et al., CCS 2020; SecAgg: Bonawitz et al., CCS 2017) on maintained primitives.

Four exchanges per round between the server and the round's clients, each a message of
``dict[str, numpy.ndarray]`` (the project's message form, so the same code runs in the simulator
and over Flower):

1. **keys** (:meth:`Client.keys`): each client makes two fresh ECDH key pairs (P-384), one to
   encrypt the shares it sends its neighbours, one to agree the pairwise mask seeds; it sends the
   public keys.
2. **shares** (:meth:`Client.shares`): given its neighbours' public keys, a client draws its
   self-mask seed, splits that seed and its masking secret key into Shamir shares (threshold t
   over its share group: itself and its neighbours) and sends each neighbour's share encrypted
   under the key it agreed with that neighbour (Fernet: AES-128-CBC + HMAC-SHA256).
3. **masked input** (:meth:`Client.masked`): with the encrypted shares of the neighbours that
   completed step 2, the client adds to its fixed-point vector its self mask and, per such
   neighbour j, +PRG(s_ij) if i < j else -PRG(s_ij), all modulo 2^64 (s_ij: the agreed key).
4. **unmask** (:meth:`Client.unmask`): told which clients sent a masked vector (alive) and which
   did not (dead), a client returns its share of each alive neighbour's self-mask seed and of
   each dead neighbour's masking key, never both for one client.

The server (:class:`Server`) routes the messages, and from at least t shares per client rebuilds
the alive clients' self masks and the pairwise masks the dead clients left in their neighbours'
vectors; the sum of the alive clients' vectors is what is left after subtracting them.

Primitives: key pairs and their serialisation (``flwr.supercore.primitives.asymmetric``), ECDH +
HKDF-SHA256 key agreement and Fernet encryption
(``flwr.common.secure_aggregation.crypto.symmetric_encryption``), Shamir secret sharing over
GF(2^128) (``flwr.common.secure_aggregation.crypto.shamir``, pycryptodome's), all from Flower 1.42;
the mask generator is the ChaCha20 key stream of ``cryptography`` keyed by a 32-byte seed (Flower's
own ``pseudo_rand_gen`` folds its seed to 32 bits for numpy's Mersenne twister: see
``docs/secure-aggregation.md``).

Threat model: an honest-but-curious server and up to t - 1 colluding clients of a share group
learn nothing about an honest client's vector beyond the sum; the sum is recovered while at least
t of each share group answer the unmask step (dropouts below the reconstruction threshold).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

from fedproto.errors import TrainingError

Message = dict[str, np.ndarray]

NONCE = b"fedproto-secagg1"
"""The ChaCha20 nonce (16 bytes) of every mask stream: each key is used for one stream (fresh keys
and seeds every round)."""


def _b(a: np.ndarray) -> bytes:
    return np.asarray(a, np.uint8).tobytes()


def _u8(b: bytes) -> np.ndarray:
    return np.frombuffer(b, np.uint8).copy()


def prg(seed: bytes, length: int) -> np.ndarray:
    """The mask of a 32-byte ``seed``: ``length`` uint64 words of the ChaCha20 key stream (RFC 8439
    with a 128-bit counter-and-nonce, as ``cryptography`` implements it)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    enc = Cipher(algorithms.ChaCha20(seed, NONCE), mode=None).encryptor()
    return np.frombuffer(enc.update(bytes(8 * length)), np.uint64).copy()


def share_group(participants: Iterable[int], cid: int, neighbours: int = 0) -> list[int]:
    """Client ``cid``'s share group (itself and its neighbours), sorted: all ``participants``
    with ``neighbours = 0`` or when there are at most ``neighbours + 1`` of them (SecAgg's complete
    graph), else the ``neighbours // 2`` nearest on each side in the ring of the sorted participants
    (SecAgg+'s sparse graph; symmetric: j is in i's group iff i is in j's)."""
    p = sorted(int(i) for i in participants)
    h = neighbours // 2
    if neighbours <= 0 or len(p) <= 2 * h + 1:
        return p
    at = p.index(int(cid))
    return sorted({p[(at + k) % len(p)] for k in range(-h, h + 1)})


def threshold(group_size: int, fraction: float) -> int:
    """t, the shares needed to rebuild a secret of a share group of ``group_size``: more than
    ``fraction`` of the group, ``floor(fraction * size) + 1`` capped at the size."""
    return max(1, min(group_size, int(np.floor(fraction * group_size)) + 1))


def _raw(sk) -> bytes:
    """A P-384 private key as its 48-byte scalar (what is shared: 4 Shamir chunks, not a PEM's 12)."""
    return sk.private_numbers().private_value.to_bytes(48, "big")


def _shared(sk: bytes, pk: bytes) -> bytes:
    """The key two clients agree (ECDH + HKDF-SHA256, Flower's ``generate_shared_key``) from a raw
    private scalar and a PEM public key: base64 of 32 bytes."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.supercore.primitives.asymmetric import bytes_to_public_key

    key = ec.derive_private_key(int.from_bytes(sk, "big"), ec.SECP384R1())
    return generate_shared_key(key, bytes_to_public_key(pk))


def _seed(shared_key: bytes) -> bytes:
    import base64

    return base64.urlsafe_b64decode(shared_key)


class Client:
    """A client's side of one round of the protocol; its state is a message (``state``: numpy
    arrays only, so a Flower node keeps it in its context between the steps).

    Args:
        state: the state of earlier steps (None: a new round).
    """

    def __init__(self, state: Message | None = None):
        self.state: Message = dict(state or {})

    def _int(self, key: str) -> int:
        return int(self.state[key][0])

    def keys(self, cid: int, round: int, group: Iterable[int], t: int) -> Message:
        """Step 1: fresh key pairs; returns the public keys (``pk1``: encryption, ``pk2``: masking)."""
        from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes

        sk1, pk1 = generate_key_pairs()
        sk2, pk2 = generate_key_pairs()
        self.state = {"cid": np.array([cid], np.int64), "round": np.array([round], np.int64),
                      "group": np.asarray(sorted(group), np.int64), "t": np.array([t], np.int64),
                      "sk1": _u8(_raw(sk1)), "sk2": _u8(_raw(sk2))}
        return {"pk1": _u8(public_key_to_bytes(pk1)), "pk2": _u8(public_key_to_bytes(pk2))}

    def shares(self, keys: Message) -> Message:
        """Step 2: ``keys`` holds ``pk1.<j>`` and ``pk2.<j>`` of the group members that sent them
        (this client's too). Returns ``ct.<j>``: for each other member j, its shares of this client's
        self-mask seed and masking key, encrypted for j.

        Raises:
            TrainingError: fewer than t members sent keys (the sum could not be rebuilt).
        """
        from flwr.common.secure_aggregation.crypto.shamir import create_shares
        from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt

        me, t = self._int("cid"), self._int("t")
        members = [int(j) for j in self.state["group"] if f"pk1.{int(j)}" in keys]
        if me not in members or len(members) < t:
            raise TrainingError(f"secure aggregation: {len(members)} of client {me}'s share group sent keys, fewer "
                                f"than the threshold {t}")
        rd = os.urandom(32)
        rs = create_shares(rd, t, len(members))
        ks = create_shares(_b(self.state["sk2"]), t, len(members))
        out = {}
        for k, j in enumerate(members):
            self.state[f"pk1.{j}"], self.state[f"pk2.{j}"] = keys[f"pk1.{j}"], keys[f"pk2.{j}"]
            if j == me:
                self.state[f"rs.{me}"], self.state[f"ks.{me}"] = _u8(rs[k]), _u8(ks[k])
                continue
            plain = np.array([me, j, len(rs[k])], np.int64).tobytes() + rs[k] + ks[k]
            self.state[f"k1.{j}"] = _u8(_shared(_b(self.state["sk1"]), _b(keys[f"pk1.{j}"])))
            out[f"ct.{j}"] = _u8(encrypt(_b(self.state[f"k1.{j}"]), plain))
        self.state["rd"] = _u8(rd)
        return out

    def masked(self, vector: np.ndarray, cts: Message) -> np.ndarray:
        """Step 3: ``vector`` (L,) uint64 (:func:`fedproto.secagg.codec.encode`) plus the self mask
        and the pairwise masks of the members whose shares arrived (``ct.<j>``, sent by j).

        Raises:
            TrainingError: a ciphertext that does not decrypt or names other clients, or fewer
                than t members left.
        """
        from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt

        me, t = self._int("cid"), self._int("t")
        alive = [me]
        for key in sorted(cts, key=lambda k: int(k.split(".")[1])):
            j = int(key.split(".")[1])
            try:
                plain = decrypt(_b(self.state[f"k1.{j}"]), _b(cts[key]))
            except Exception as e:  # a wrong key, a forged or damaged ciphertext
                raise TrainingError(f"secure aggregation: client {me} could not decrypt the shares of client {j}: "
                                    f"{type(e).__name__}") from None
            src, dst, n = np.frombuffer(plain[:24], np.int64)
            if (int(src), int(dst)) != (j, me):
                raise TrainingError(f"secure aggregation: the shares client {me} got as client {j}'s name clients "
                                    f"{int(src)} -> {int(dst)}")
            self.state[f"rs.{j}"], self.state[f"ks.{j}"] = _u8(plain[24:24 + int(n)]), _u8(plain[24 + int(n):])
            alive.append(j)
        if len(alive) < t:
            raise TrainingError(f"secure aggregation: shares of {len(alive)} members reached client {me}, fewer than "
                                f"the threshold {t}")
        self.state["u2"] = np.asarray(sorted(alive), np.int64)
        out = np.asarray(vector, np.uint64) + prg(_b(self.state["rd"]), len(vector))
        for j in alive:
            if j != me:
                m = prg(_seed(_shared(_b(self.state["sk2"]), _b(self.state[f"pk2.{j}"]))), len(vector))
                out = out + m if me < j else out - m
        return out

    def unmask(self, alive: Iterable[int], dead: Iterable[int]) -> Message:
        """Step 4: this client's shares of the alive members' self-mask seeds (``rs.<j>``) and of the
        dead members' masking keys (``ks.<j>``).

        Raises:
            TrainingError: a client named both alive and dead, or this client named dead.
        """
        me = self._int("cid")
        alive, dead = {int(j) for j in alive}, {int(j) for j in dead}
        if alive & dead or me in dead:
            raise TrainingError(f"secure aggregation: client {me} was asked for both shares of clients "
                                f"{sorted(alive & dead) or [me]}; it answers for each client one or the other")
        held = {int(j) for j in self.state.get("u2", [])}
        out = {f"rs.{j}": self.state[f"rs.{j}"] for j in sorted(alive & held)}
        out.update({f"ks.{j}": self.state[f"ks.{j}"] for j in sorted(dead & held)})
        return out


class Server:
    """The server's side of one round: it routes the clients' messages and rebuilds the masks.

    Args:
        participants: the round's client ids. fraction: the threshold fraction (:func:`threshold`).
        neighbours: the share graph (:func:`share_group`).
    """

    def __init__(self, participants: Iterable[int], fraction: float = 0.5, neighbours: int = 0):
        self.participants = sorted(int(i) for i in participants)
        self.fraction, self.neighbours = fraction, neighbours
        self.group = {i: share_group(self.participants, i, neighbours) for i in self.participants}
        self.t = {i: threshold(len(g), fraction) for i, g in self.group.items()}
        self.pks: dict[int, Message] = {}
        self.u2: list[int] = []

    def setup(self, cid: int) -> dict:
        """Step 1's arguments for client ``cid``: its share group and threshold."""
        return {"group": self.group[cid], "t": self.t[cid]}

    def keys_for(self, cid: int, pks: dict[int, Message]) -> Message:
        """Step 2's message to ``cid``: the public keys of its group members that sent theirs."""
        self.pks = pks
        return {f"{k}.{j}": pks[j][k] for j in self.group[cid] if j in pks for k in ("pk1", "pk2")}

    def route(self, cts: dict[int, Message]) -> dict[int, Message]:
        """Step 3's ciphertexts for each client that completed step 2 (``ct.<src>``: from src)."""
        self.u2 = sorted(cts)
        out: dict[int, Message] = {i: {} for i in self.u2}
        for src, msg in cts.items():
            for key, ct in msg.items():
                dst = int(key.split(".")[1])
                if dst in out:
                    out[dst][f"ct.{src}"] = ct
        return out

    def unmask_request(self, alive: Iterable[int]) -> tuple[list[int], list[int]]:
        """Step 4: (alive, dead) of the clients that completed step 2."""
        alive = sorted(int(i) for i in alive)
        return alive, [i for i in self.u2 if i not in alive]

    def masks(self, alive: list[int], dead: list[int], shares: dict[int, Message], length: int) -> np.ndarray:
        """The (length,) uint64 total to subtract from the sum of the alive clients' masked vectors:
        their self masks and the pairwise masks the dead clients' neighbours added.

        Raises:
            TrainingError: fewer than t shares of a secret arrived (too many dropouts).
        """
        from flwr.common.secure_aggregation.crypto.shamir import combine_shares

        total = np.zeros(length, np.uint64)

        def secret(kind: str, j: int) -> bytes:
            got = [_b(m[f"{kind}.{j}"]) for m in shares.values() if f"{kind}.{j}" in m]
            if len(got) < self.t[j]:
                raise TrainingError(f"secure aggregation: {len(got)} shares of client {j}'s "
                                    f"{'self-mask seed' if kind == 'rs' else 'masking key'} arrived, fewer than the "
                                    f"threshold {self.t[j]}: too many clients dropped out to rebuild the sum")
            return combine_shares(got[:self.t[j]])

        for i in alive:
            total = total + prg(secret("rs", i), length)
        for j in dead:
            sk2 = secret("ks", j)
            for i in alive:
                if i in self.group[j]:
                    m = prg(_seed(_shared(sk2, _b(self.pks[i]["pk2"]))), length)
                    total = total + m if i < j else total - m
        return total
