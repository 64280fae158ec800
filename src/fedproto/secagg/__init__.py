"""Secure aggregation (option ``secagg``): the server learns only the sums of the clients' replies.

:mod:`fedproto.secagg.protocol` is the SecAgg+ protocol on Flower's and ``cryptography``'s
primitives, :mod:`fedproto.secagg.codec` what each method sums and the fixed-point encoding,
:mod:`fedproto.secagg.engine` its place in the round loop (the simulator's clients, the server's
aggregation); the Flower side is :mod:`fedproto.flower.secagg`. What it costs and what crosses the
wire: ``docs/secure-aggregation.md``.

It needs the ``flower`` extra (``pip install "fedproto[flower]"``) in the simulator too: the
Shamir secret sharing and the key agreement are Flower's (:func:`require`).
"""

from __future__ import annotations

from typing import Any

from fedproto.errors import ConfigError, opt


def require() -> None:
    """Raise ``ConfigError`` when the ``flower`` extra (flwr, cryptography) is missing."""
    try:
        import cryptography  # noqa: F401
        import flwr.common.secure_aggregation.crypto.shamir  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"{opt('secagg', True)} uses Flower's secure-aggregation primitives (Shamir shares, key "
                          f"agreement), which are not installed ({e.name} is missing); install them with pip install "
                          "\"fedproto[flower]\" (Python 3.11+) or run without secagg", option="secagg",
                          value=True) from None


def check(cfg: Any, algorithm: Any) -> None:
    """Refuse ``secagg`` where it cannot run: the extra missing, a method or option that needs
    individual replies, simulated attacks (they change replies on the server, which under secure
    aggregation holds masked vectors only). Raises ``ConfigError`` naming the conflict."""
    from fedproto.secagg.codec import check as check_codec

    require()
    check_codec(cfg, algorithm)
    if getattr(cfg, "attack", "none") != "none":
        raise ConfigError(f"{opt('secagg', True)} hides each client's reply from the server, where "
                          f"{opt('attack', cfg.attack)} changes replies; run the attack without secagg",
                          option="secagg", value=True)


def install(cfg: Any, algorithm: Any, executor: Any | None = None) -> tuple[Any, Any]:
    """The algorithm's server part and (in the simulator) the executor under ``secagg``, or both
    unchanged when ``cfg.secagg`` is off.

    Args:
        cfg: the run config. algorithm: the run's algorithm. executor: an in-process executor to
            wrap (:class:`fedproto.secagg.engine.SimulatedSecAgg`); None: the caller wraps its own.
    Returns:
        (algorithm, executor), wrapped; the session is ``algorithm._session``.
    Raises:
        ConfigError: see :func:`check`.
    """
    if not getattr(cfg, "secagg", False):
        return algorithm, executor
    check(cfg, algorithm)
    from fedproto.secagg.dp import adjust
    from fedproto.secagg.engine import SecureServer, Session, SimulatedSecAgg

    adjust(cfg, algorithm)  # with DP, distributed noise: each client adds its share
    session = Session(cfg.secagg_threshold, cfg.secagg_neighbours)
    server = SecureServer(algorithm, session)
    return server, (SimulatedSecAgg(executor, algorithm, session) if executor is not None else None)
