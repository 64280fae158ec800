"""Where a run's randomness comes from (docs/architecture.md, "Randomness").

Training randomness derives from (seed, round, client), so results do not depend on the
executor (sequential, batched, worker processes, Flower) or on the order clients are trained in:
each client's numpy generator (batch order, dropout masks) is :func:`client_rng`, torch's global
generator is seeded with :func:`client_seed` before its step, and the clients of a round are
drawn by :func:`sample_clients` from (seed, round) alone. DP noise never comes from here
(:func:`fedproto.prototypes.dp.secure_rng`).
"""

from __future__ import annotations

import numpy as np


def client_rng(seed: int, round: int, cid: int) -> np.random.Generator:
    """The generator of client ``cid`` in ``round`` (independent of order and execution mode)."""
    return np.random.default_rng(np.random.SeedSequence([seed, round, cid, 0xC1]))


def client_seed(seed: int, round: int, cid: int) -> int:
    """The torch seed set before client ``cid``'s step in ``round`` on the sequential path (weight
    noise of heterogeneous layers, anything drawn from torch's global generator)."""
    return int(np.random.SeedSequence([seed, round, cid]).generate_state(1)[0])


def sample_clients(seed: int, round: int, num_clients: int, participation: float) -> list[int]:
    """The clients that take part in ``round``: all when ``participation`` is 1 (paper); for a
    fraction in (0, 1), ``max(1, round(participation * num_clients))`` of them; for a whole number
    above 1, that many. They are drawn without replacement from a generator of (seed, round)
    alone, so the draw is the same in every engine and on resume.

    Returns:
        Sorted client ids.
    Raises:
        ValueError: ``participation`` <= 0, or above 1 and not a whole number <= ``num_clients``.
    """
    if not participation > 0 or (participation > 1 and (participation != int(participation)
                                                          or participation > num_clients)):
        if participation > num_clients and participation == int(participation):
            raise ValueError(f"participation={participation:g} is more than the {num_clients} clients")
        raise ValueError(f"participation={participation} is neither a fraction in (0, 1] nor a whole number of "
                         f"clients up to {num_clients}")
    if participation == 1.0 or participation == num_clients:
        return list(range(num_clients))
    k = int(participation) if participation > 1 else max(1, int(np.rint(participation * num_clients)))
    rng = np.random.default_rng(np.random.SeedSequence([seed, round, 0x5A4D]))
    return sorted(int(i) for i in rng.choice(num_clients, size=k, replace=False))

