"""Is anything listening at an address? A quick TCP connect, before a front end imports anything heavy
(``fedproto reproduce --ray HOST:PORT`` is refused in about a second, not after torch and Ray were
imported and Ray had retried). A leaf above the errors: it imports only :mod:`fedproto.errors`."""

from __future__ import annotations

import socket

from fedproto.errors import ConfigError

CONNECT_TIMEOUT_S = 2.0
"""Seconds one connection attempt may take (a host that drops packets): a refusal comes within it."""


def split_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port`` or ``ray://host:port`` (IPv6 in brackets), or None for anything
    else (``auto``, ``local``, a malformed address: left to the program that takes it)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.removeprefix("[").removesuffix("]"), int(port)


def check_reachable(option: str, address: str, fix: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse ``address`` (the value of ``option``, e.g. ``--ray``) where no server accepts a TCP connection
    within ``timeout_s``; an address :func:`split_address` does not parse is not checked.

    Args:
        option: how the message names the option. fix: what to do, appended to the message.
    Raises:
        ConfigError: the host is unknown or nothing answers at the port (names the address, the
            reason and ``fix``).
    """
    parsed = split_address(address)
    if parsed is None:
        return
    host, port = parsed
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except (OSError, OverflowError) as e:
        raise ConfigError(f"{option} {address!r}: nothing answers at {host}:{port} within {timeout_s:g} s ({e}); "
                          f"{fix}") from None


def check_ray_address(address: str) -> None:
    """Refuse a ``--ray`` ``host:port`` address where nothing answers (Ray itself would retry it without
    end); ``auto``, ``local`` and an address Ray cannot parse are left to Ray. ``fedproto reproduce --ray``
    calls it before it imports anything heavy, and :func:`fedproto.reproduce.raycells.connect` before it
    connects.

    Raises:
        ConfigError: the host is unknown, or no server accepts a connection at that port.
    """
    check_reachable("--ray", address, "start the cluster (ray start --head) and give its head node's address, or auto")
