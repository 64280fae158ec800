"""Secure aggregation (option ``secagg``): the server learns only the sums of the clients' replies.

:mod:`fedproto.secagg.protocol` is the SecAgg+ protocol on Flower's and ``cryptography``'s
primitives, :mod:`fedproto.secagg.codec` what each method sums and the fixed-point encoding,
:mod:`fedproto.secagg.masked_round` its place in the round loop (the simulator's clients, the server's
aggregation); the Flower side is :mod:`fedproto.flower.secagg_messages`. What it costs and what crosses the
wire: ``docs/secure-aggregation.md``.

It needs the ``flower`` extra (``pip install "fedproto[flower]"``) in the simulator too: the
Shamir secret sharing (pycryptodome) and the key agreement (cryptography) come with it (:func:`require`).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from fedproto.errors import ConfigError, opt, render

log = logging.getLogger(__name__)


def require() -> None:
    """Raise ``ConfigError`` when the ``flower`` extra's cryptography and pycryptodome are missing."""
    try:
        import Crypto.Protocol.SecretSharing  # noqa: F401
        import cryptography  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"{opt('secagg', True)} uses the secure-aggregation primitives of the flower extra (Shamir "
                          f"shares, key agreement), which are not installed ({e.name} is missing); install them with "
                          "pip install "
                          "\"fedproto[flower]\" (Python 3.11+) or run without secagg", option="secagg",
                          value=True) from None


def check(cfg: Any, algorithm: Any) -> None:
    """Refuse ``secagg`` where it cannot run: the extra missing, a method or option that needs
    individual replies, simulated attacks (they change replies on the server, which under secure
    aggregation holds masked vectors only), fewer clients than ``secagg_min_contributors``.
    Raises ``ConfigError`` naming the conflict."""
    from fedproto.secagg.codec import check as check_codec

    require()
    check_codec(cfg, algorithm)
    k = cfg.secagg_neighbours
    if k == 1 or k % 2:
        raise ConfigError(f"{opt('secagg_neighbours', k)}: the ring gives each client as many neighbours on each side, "
                          f"so the number is even; use {k + 1 if k > 1 else 2} (or 0: every client shares with all)",
                          option="secagg_neighbours", value=k)
    n, m = getattr(cfg, "clients", None), cfg.secagg_min_contributors
    if isinstance(n, int) and n < m:
        raise ConfigError(f"{opt('secagg_min_contributors', m)} decodes a sum only over at least {m} clients, but the "
                          f"run has {n}: nothing could ever be aggregated; use more clients or "
                          f"secagg_min_contributors={max(1, n)} (what the sum then reveals: "
                          "docs/secure-aggregation.md)", option="secagg_min_contributors", value=m)
    if getattr(cfg, "attack", "none") != "none":
        raise ConfigError(f"{opt('secagg', True)} hides each client's reply from the server, where "
                          f"{opt('attack', cfg.attack)} changes replies; run the attack without secagg",
                          option="secagg", value=True)
    weak(cfg)


def weak(cfg: Any) -> list[str]:
    """Settings under which secure aggregation hides little, each logged as a warning and returned: fewer
    than 3 clients (a client of 2 subtracts its own reply from the sum; 1 client's sum is its reply), a
    threshold of 1 share (one colluding neighbour rebuilds a client's masks), more neighbours than clients,
    a minimum of 1 contributor per class, a threshold fraction under 0.5."""
    out = []
    n = getattr(cfg, "clients", None)
    k = getattr(cfg, "secagg_neighbours", 0)
    group = n if not k or not isinstance(n, int) else min(n, k + 1)
    if isinstance(n, int) and n < 3:
        out.append(f"with {n} client(s) the sum the server learns reveals every reply (a client's own, or the other "
                   "one's to either client); secure aggregation needs 3 clients or more to hide anything")
    if isinstance(group, int) and int(cfg.secagg_threshold * group) + 1 < 2:
        out.append(f"{opt('secagg_threshold', cfg.secagg_threshold)} makes 1 share enough to rebuild a client's "
                   "masks: any one neighbour can unmask it; use 0.5 (the default) or more")
    if isinstance(n, int) and getattr(cfg, "secagg_neighbours", 0) > max(n - 1, 0):
        out.append(f"{opt('secagg_neighbours', cfg.secagg_neighbours)} is more than the {n - 1} other clients: "
                   "every client shares with all")
    if getattr(cfg, "secagg_min_contributors", 2) < 2:
        out.append(f"{opt('secagg_min_contributors', cfg.secagg_min_contributors)} lets the server decode a class held "
                   "by one client, which is that client's prototype; use 2 (the default) or more")
    if cfg.secagg_threshold < 0.5:
        out.append(f"{opt('secagg_threshold', cfg.secagg_threshold)} lets a server that shows two halves of a share "
                   "group different dropouts collect both shares of one client; use 0.5 (the default) or more")
    if isinstance(group, int) and group > 1 and int(cfg.secagg_threshold * group) + 1 >= group:
        out.append(f"{opt('secagg_threshold', cfg.secagg_threshold)} needs every member of a share group of {group} "
                   "to answer: one dropout ends the run; use 0.5 (the default) to survive dropouts")
    p, m = getattr(cfg, "participation", 1.0), getattr(cfg, "secagg_min_contributors", 2)
    if isinstance(n, int) and isinstance(p, (int, float)):
        k = int(p) if p > 1 else max(1, int(np.rint(p * n)))
        if k < m:
            out.append(f"{opt('participation', p)} samples {k} of {n} clients a round, fewer than "
                       f"{opt('secagg_min_contributors', m)}: no round can be aggregated; sample at least {m}")
    h = getattr(cfg, "secagg_honest", 2)
    if getattr(cfg, "dp", "off") != "off" and isinstance(h, int) and h > m:
        out.append(f"{opt('secagg_honest', h)} is more than {opt('secagg_min_contributors', m)}: a class decoded over "
                   f"fewer than {h} contributors carries less noise than dp_noise's (its epsilon, stated per class in "
                   f"summary.json, is larger); use secagg_min_contributors={h} to decode only classes with h or more")
    out = [render(w) for w in out]
    for w in out:
        log.warning("secagg: %s", w)
    return out


def install(cfg: Any, algorithm: Any, executor: Any | None = None) -> tuple[Any, Any]:
    """The algorithm's server part and (in the simulator) the executor under ``secagg``, or both
    unchanged when ``cfg.secagg`` is off.

    Args:
        cfg: the run config. algorithm: the run's algorithm. executor: an in-process executor to
            wrap (:class:`fedproto.secagg.masked_round.SimulatedSecAgg`); None: the caller wraps its own.
    Returns:
        (algorithm, executor), wrapped; the session is ``algorithm._session``.
    Raises:
        ConfigError: see :func:`check`.
    """
    if not getattr(cfg, "secagg", False):
        return algorithm, executor
    check(cfg, algorithm)
    from fedproto.secagg.epsilon import adjust
    from fedproto.secagg.masked_round import SecureServer, Session, SimulatedSecAgg

    adjust(cfg, algorithm)  # with DP, distributed noise: each client adds its share
    session = Session(cfg.secagg_threshold, cfg.secagg_neighbours, cfg.secagg_min_contributors)
    server = SecureServer(algorithm, session)
    return server, (SimulatedSecAgg(executor, algorithm, session) if executor is not None else None)
