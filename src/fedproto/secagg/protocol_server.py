"""The server's side of one round of the protocol (:mod:`fedproto.secagg.protocol`): it routes
the clients' messages and rebuilds the masks from their shares."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from fedproto.errors import TrainingError
from fedproto.secagg.primitives import (
    SEED_BYTES,
    agree,
    as_bytes,
    combine,
    prg,
    self_mask,
    share_group,
    threshold,
)

Message = dict[str, np.ndarray]


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

    @staticmethod
    def _route(msgs: dict[int, Message], kind: str) -> dict[int, Message]:
        """Each ``<kind>.<dst>`` entry of each sender's message, delivered to dst as ``<kind>.<src>``."""
        out: dict[int, Message] = {i: {} for i in sorted(msgs)}
        for src, msg in msgs.items():
            for key, value in msg.items():
                dst = int(key.split(".")[1])
                if dst in out:
                    out[dst][f"{kind}.{src}"] = value
        return out

    def route(self, cts: dict[int, Message]) -> dict[int, Message]:
        """Step 3's ciphertexts for each client that completed step 2 (``ct.<src>``: from src)."""
        self.u2 = sorted(cts)
        return self._route(cts, "ct")

    def route_tags(self, tags: dict[int, Message]) -> dict[int, Message]:
        """Step 4's view tags to their members (``tag.<src>``: from src), for step 5."""
        return self._route(tags, "tag")

    def unmask_request(self, alive: Iterable[int]) -> tuple[list[int], list[int]]:
        """Step 4: (alive, dead) of the clients that completed step 2."""
        alive = sorted(int(i) for i in alive)
        return alive, [i for i in self.u2 if i not in alive]

    def _secret(self, kind: str, j: int, shares: dict[int, Message]) -> list[bytes]:
        got = [as_bytes(m[f"{kind}.{j}"]) for _, m in sorted(shares.items()) if f"{kind}.{j}" in m]
        if len(got) < self.t[j]:
            raise TrainingError(f"secure aggregation: {len(got)} shares of client {j}'s "
                                f"{'self-mask seeds' if kind == 's' else 'masking key'} arrived, fewer than the "
                                f"threshold {self.t[j]}: too many clients dropped out to rebuild the sum")
        return combine(got[:self.t[j]])

    def masks(self, alive: list[int], dead: list[int], shares: dict[int, Message], groups: np.ndarray) -> np.ndarray:
        """The (L,) uint64 total to subtract from the sum of the alive clients' masked vectors for
        their group-0 coordinates to decode: their group-0 self masks and the pairwise masks the
        dead clients' neighbours added (``shares``: the step-4 answers by client).

        Raises:
            TrainingError: fewer than t shares of a secret arrived (too many dropouts).
        """
        groups = np.asarray(groups, np.int64)
        total = np.zeros(len(groups), np.uint64)
        for i in alive:
            total = total + self_mask([self._secret("s", i, shares)[0]], groups, [0])
        for j in dead:
            sk2 = b"".join(self._secret("k", j, shares))
            for i in alive:
                if i in self.group[j]:
                    m = prg(agree(sk2, as_bytes(self.pks[i]["pk2"]), b"mask"), len(groups))
                    total = total + m if i < j else total - m
        return total

    def class_masks(self, alive: list[int], wanted: list[int], shares: dict[int, Message],
                    groups: np.ndarray) -> np.ndarray:
        """The (L,) uint64 self masks of the alive clients over the groups ``wanted`` (from the
        step-5 answers ``shares``, whose chunks follow ``wanted``'s order).

        Raises:
            TrainingError: fewer than t shares of a client's seeds arrived.
        """
        groups = np.asarray(groups, np.int64)
        total = np.zeros(len(groups), np.uint64)
        if not wanted:
            return total
        for i in alive:
            got = self._secret("s", i, shares)
            seeds = dict(zip(wanted, got, strict=True))
            full = [seeds.get(g, b"\0" * SEED_BYTES) for g in range(max(wanted) + 1)]
            total = total + self_mask(full, groups, wanted)
        return total
