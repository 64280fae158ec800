"""The protocol's primitives (:mod:`fedproto.secagg.protocol`), each a maintained library's:
X25519 key agreement with HKDF-SHA256 and the ChaCha20 key stream of ``cryptography``, Shamir
secret sharing over GF(2^128) of pycryptodome (``Crypto.Protocol.SecretSharing``, the scheme
Flower's ``create_shares`` wraps). Only the reuse of one set of Lagrange coefficients across the
secrets the same holders share (:func:`combine`) is written here, on pycryptodome's own field
arithmetic; ``tests/secagg/test_secagg.py`` checks it against ``Shamir.combine``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from fedproto.errors import TrainingError

NONCE = b"fedproto-secagg1"
"""The ChaCha20 nonce (16 bytes) of every mask stream: each key is used for one stream (fresh keys
and seeds every round)."""
SEED_BYTES = 16
"""Bytes of a self-mask seed (one Shamir chunk); the mask stream's 32-byte key is its SHA-256."""
KEY_BYTES = 32
"""Bytes of an X25519 private key (two Shamir chunks)."""


def as_bytes(a: np.ndarray) -> bytes:
    """A uint8 array of a message as bytes."""
    return np.asarray(a, np.uint8).tobytes()


def as_u8(b: bytes) -> np.ndarray:
    """Bytes as a (len,) uint8 array (the message form)."""
    return np.frombuffer(b, np.uint8).copy()


def prg(key: bytes, length: int) -> np.ndarray:
    """The mask of a 32-byte ``key``: ``length`` uint64 words of the ChaCha20 key stream (RFC 8439
    with a 128-bit counter-and-nonce, as ``cryptography`` implements it)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    enc = Cipher(algorithms.ChaCha20(key, NONCE), mode=None).encryptor()
    return np.frombuffer(enc.update(bytes(8 * length)), np.uint64).copy()


def self_key(seed: bytes) -> bytes:
    """The 32-byte mask key of a 16-byte self-mask seed (SHA-256, domain-separated)."""
    return hashlib.sha256(b"fedproto-secagg-self" + seed).digest()


def self_mask(seeds: list[bytes], groups: np.ndarray, which: Iterable[int] | None = None) -> np.ndarray:
    """The (L,) uint64 self mask of ``seeds`` (one per group) over a vector whose coordinate k
    belongs to group ``groups[k]``; only the groups in ``which`` (default all) are filled."""
    groups = np.asarray(groups, np.int64)
    out = np.zeros(len(groups), np.uint64)
    for g in (range(len(seeds)) if which is None else which):
        pos = np.flatnonzero(groups == g)
        if len(pos):
            out[pos] = prg(self_key(seeds[g]), len(pos))
    return out


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


def agree(sk: bytes, pk: bytes, info: bytes) -> bytes:
    """A 32-byte key two clients agree: X25519 of a raw private and a raw public key, then
    HKDF-SHA256 with ``info`` (``b"enc"``: the share encryption key, ``b"mask"``: the pairwise mask key)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    shared = X25519PrivateKey.from_private_bytes(sk).exchange(X25519PublicKey.from_public_bytes(pk))
    return HKDF(hashes.SHA256(), 32, salt=None, info=b"fedproto-secagg " + info).derive(shared)


def keypair() -> tuple[bytes, bytes]:
    """A fresh X25519 key pair: (raw private key, raw public key), 32 bytes each."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    sk = X25519PrivateKey.generate()
    return sk.private_bytes_raw(), sk.public_key().public_bytes_raw()


def aad(src: int, dst: int, round: int) -> bytes:
    """The associated data that binds an encrypted share to its sender, receiver and round."""
    return np.array([src, dst, round], np.int64).tobytes()


def split(secret: bytes, t: int, n: int) -> list[bytes]:
    """Shamir shares of ``secret`` (a multiple of 16 bytes) for holders 1..n, threshold t: share k
    is its 4-byte index (k + 1) and one 16-byte share per 16-byte chunk (pycryptodome's
    ``Shamir.split``, chunk by chunk)."""
    from Crypto.Protocol.SecretSharing import Shamir

    per_chunk = [Shamir.split(t, n, secret[a:a + 16], ssss=False) for a in range(0, len(secret), 16)]
    return [int(k + 1).to_bytes(4, "little") + b"".join(c[k][1] for c in per_chunk) for k in range(n)]


_LAGRANGE: dict[tuple[int, ...], list] = {}


def combine(shares: list[bytes]) -> list[bytes]:
    """The 16-byte chunks of a secret from ``shares``: exactly t of :func:`split`'s shares, each
    its 4-byte index then 16 bytes per chunk (all of a share's chunks, or the same selection of
    them from every holder).

    Lagrange interpolation at 0 in GF(2^128), as pycryptodome's ``Shamir.combine``, with the
    coefficients of one set of holders computed once and reused for every chunk and every secret
    those holders share (pycryptodome's field arithmetic, ``_Element``).
    """
    from Crypto.Protocol.SecretSharing import _Element

    xs = tuple(int.from_bytes(s[:4], "little") for s in shares)
    lam = _LAGRANGE.get(xs)
    if lam is None:
        if len(set(xs)) != len(xs):
            raise TrainingError(f"secure aggregation: duplicate share holders {sorted(xs)}")
        ex = [_Element(x) for x in xs]
        lam = []
        for j, xj in enumerate(ex):
            num, den = _Element(1), _Element(1)
            for m, xm in enumerate(ex):
                if m != j:
                    num, den = num * xm, den * (xj + xm)
            lam.append(num * den.inverse())
        if len(_LAGRANGE) > 4096:
            _LAGRANGE.clear()
        _LAGRANGE[xs] = lam
    out = []
    for k in range((len(shares[0]) - 4) // 16):
        acc = _Element(0)
        for s, lj in zip(shares, lam, strict=True):
            acc = acc + lj * _Element(s[4 + 16 * k:20 + 16 * k])
        out.append(acc.encode())
    return out
