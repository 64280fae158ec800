"""Keep a SuperNode running: restart ``flower-supernode`` when it fails, and bring it back at once.

    python -m fedproto.deploy.supervisor [--backoff 5] [--max-backoff 60] [--max-restarts N] -- \\
        flower-supernode --superlink 10.0.0.1:9092 --root-certificates ca.crt \\
        --auth-supernode-private-key node0 --node-config 'client-id=0 data="/data/site0" model="cnn"'

Why it is needed (Flower 1.42): a SuperNode that dies without deactivating (killed, a crash, a
power cut) stays *online* in the SuperLink until its heartbeat expires: the SuperLink keeps a node
online until ``HEARTBEAT_PATIENCE`` (2) x its heartbeat interval (30 s, fixed in ``flwr``'s
``HEARTBEAT_DEFAULT_INTERVAL``; no option of ``flower-supernode`` or ``flower-superlink``
changes it) after its last heartbeat, so up to 60 s. Under SuperNode authentication the restarted
node has the same key and therefore the same node id, and ``ActivateNode`` of a node that is still
online is refused (``[code: 2004] Failed to activate SuperNode``, HTTP 412); the SuperNode exits
with Flower's exit code 305 (``SUPERNODE_CONNECTION_ERROR``; the process's exit status is 1: Flower
logs ``Exit Code: <code>`` and exits with status 1 for its codes >= 100 and 0 for the others,
a graceful stop on SIGTERM or SIGINT included). Its own ``--max-retries``/``--max-wait-time``
do not help: they retry only transport errors and HTTP 502/503/504. (Without authentication a
restarted SuperNode makes a new key and gets a new node id, and is not refused.)

**Deactivation, so that the node is back within seconds.** A SuperNode that stops cleanly tells the
SuperLink itself (Flower's Fleet API ``DeactivateNode``, signed with the node's key). One that
was killed cannot, so the supervisor does it for it: it reads the node id from the SuperNode's
``SuperNode ID: <id>`` log line, and when the SuperNode died (a signal or a failure after it was
activated) it sends ``DeactivateNode`` for that id to the same ``--superlink``, over the same TLS
(``--root-certificates``/``--insecure``) and signed with the same ``--auth-supernode-private-key``
(:func:`deactivate_node`: Flower's own HTTP client and request signing; the SuperLink accepts it
only from the holder of the node's key). The SuperLink then marks the node offline at once
(the server records the round's message to it as ``unavailable``, no wait), and the restarted
SuperNode is activated on its first try instead of after the 37.5-60 s heartbeat. When the
deactivation fails (the SuperLink unreachable, another Flower), the restart falls back to retrying
until the heartbeat expires, as below.

This supervisor is the portable equivalent of a systemd unit with ``Restart=on-failure``: it
runs the command (its output passed on to stdout, where the supervisor reads Flower's ``Exit
Code: <code>`` and ``SuperNode ID: <id>`` lines), and when it fails (a non-zero exit status, or
killed by a signal) starts it again after ``backoff`` seconds, doubling the wait up to
``max-backoff`` (back to ``backoff`` once a start has run ``stable`` seconds: a node that keeps
crashing backs off even when each crash is deactivated). A start refused because the SuperLink
still holds the node online (Flower exit code 305, :data:`RETRY_STEADY`) is retried every
``backoff`` seconds without doubling: that refusal ends by itself when the dead node's heartbeat
expires (37.5-60 s after it died, the floor Flower 1.42 sets when the deactivation could not be
sent), and a doubled wait (5, 10, 20, 40 s) would let the node come back up to 40 s after that.
It stops, with the command's exit status, when the command exits 0 or with a Flower exit code in
:data:`NO_RESTART` (a configuration error a restart cannot fix), after ``max-restarts`` restarts,
or when it is itself stopped (SIGTERM, SIGINT or SIGHUP, passed on to the command; a command still
running ``stop-grace`` seconds later is killed). **Every stop ends the node's membership first**: a
supervisor that is stopped or gives up sends the deactivation of the node (when it saw its id) before
it exits, bounded by :data:`DEACTIVATE_LIMIT` seconds (a 412, the node already offline because it
deactivated itself, is fine), so that ``systemctl stop`` or a SIGTERM never leaves a round waiting for
the heartbeat. It logs every
start (with the pid), every deactivation and every restart (with the exit status, Flower's exit
code and Flower's meaning of it) on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

NO_RESTART = (302, 303, 304)
"""Flower exit codes (its ``Exit Code: <code>`` log line) of ``flower-supernode`` that are not
restarted: 302 an invalid authentication key, 303 authentication without TLS, 304 an unreadable
trusted-entities file (configuration errors a restart cannot fix)."""

RETRY_STEADY = (305,)
"""Flower exit codes of ``flower-supernode`` retried every ``backoff`` seconds, without doubling
the wait: 305, the SuperLink refused to activate the node (still online under its old heartbeat, or
the SuperLink not reachable yet), a state that ends by itself within a minute."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals that stop the supervisor, passed on to the command first (SIGHUP: the terminal closed)."""

DEACTIVATE_LIMIT = 5.0
"""Seconds a stopping supervisor waits, at most, for the node's deactivation (one HTTP call)."""

STOP_GRACE = 10.0
"""Seconds a stopped supervisor gives the command to end after passing the signal on, before it kills it."""

_EXIT_LINE = re.compile(r"Exit Code: (\d+)")
_NODE_LINE = re.compile(r"SuperNode ID: (\d+)")


def exit_meaning(status: int, flower_code: int | None = None) -> str:
    """What a ``flower-supernode`` exit means: a signal's name for a negative ``status``, else
    Flower's code and its explanation (``flwr.supercore.exit``) when ``flower_code`` is known, or ''."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    if flower_code is None:
        return ""
    try:
        from flwr.supercore.exit.exit_code import EXIT_CODE_HELP
        help_text = str(EXIT_CODE_HELP.get(flower_code, "")).split("\n")[0]
    except ImportError:
        help_text = ""
    return f"Flower exit code {flower_code}" + (f": {help_text}" if help_text else "")


def supervise(command: Sequence[str], backoff: float = 5.0, max_backoff: float = 60.0,
              max_restarts: int | None = None, stable: float = 120.0, stop_grace: float = STOP_GRACE) -> int:
    """Run ``command`` and restart it when it fails (see the module docstring).

    Args:
        command: the program and its arguments (``flower-supernode ...``).
        backoff: seconds before the first restart; doubled after each failed start, up to
            ``max_backoff``; back to ``backoff`` after a start that ran ``stable`` seconds.
        max_restarts: give up after this many restarts (None: never).
        stable: seconds a start must run to reset the wait to ``backoff``.
        stop_grace: seconds the command has to end after a stop signal was passed on, before it is killed.
    Returns:
        The exit code to exit with: the command's last code (128 + the signal's number when it
        was killed by a signal), or 0 when this supervisor was stopped by SIGTERM, SIGINT or
        SIGHUP (:data:`STOP_SIGNALS`, passed on to the command).
    Raises:
        ValueError: an empty command, ``backoff`` <= 0, ``max_backoff`` < ``backoff``, either not
            finite, ``stable`` or ``stop_grace`` < 0 or not finite, or ``max_restarts`` < 0, naming the value.
        OSError: the program cannot be started (FileNotFoundError: it does not exist;
            PermissionError: a folder or a file without execute permission).
    """
    if not command:
        raise ValueError("no command to supervise: give it after --, e.g. "
                         "-- flower-supernode --superlink HOST:PORT ...")
    if not 0 < backoff < math.inf or not backoff <= max_backoff < math.inf:
        raise ValueError(f"backoff={backoff!r} must be > 0 and max_backoff={max_backoff!r} >= backoff, both finite "
                         "(seconds)")
    if not 0 <= stable < math.inf:
        raise ValueError(f"stable={stable!r} must be >= 0 and finite (seconds)")
    if not 0 <= stop_grace < math.inf:
        raise ValueError(f"stop_grace={stop_grace!r} must be >= 0 and finite (seconds)")
    if max_restarts is not None and max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r} must be >= 0 (or None: no limit)")
    stop: dict = {"signal": None, "at": 0.0}
    child: subprocess.Popen | None = None

    def on_signal(signum, _frame):
        stop["signal"], stop["at"] = signum, time.monotonic()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    old = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    preload_deactivation(command)  # once, before the first start: at a stop only the call is left
    try:
        wait, restarts = backoff, 0
        while True:
            started = time.monotonic()
            child = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace", bufsize=1)
            _say(f"started {command[0]} (pid {child.pid})")
            seen: dict[str, int] = {}
            pump = threading.Thread(target=_pump, args=(child.stdout, seen), daemon=True)
            pump.start()
            code = _wait(child, stop, stop_grace)
            pump.join(2.0)  # the rest of its output (a grandchild may hold the pipe open longer: not waited for)
            flower = seen.get("code")
            what = f"{command[0]} exited with status {code}{_why(code, flower)}"
            if stop["signal"] is not None:
                what = f"{what}; stopped by {signal.Signals(stop['signal']).name}"
                if "node" in seen and command_flag(command, "--auth-supernode-private-key"):
                    _deactivate_after_death(command, seen["node"], what)  # before exiting: it may not have itself
                else:
                    _say(what)
                return 0
            if code == 0 or flower in NO_RESTART:
                _say(f"{what}; not restarting")
                return code
            if "node" in seen:  # it died after it was activated: free its node id (also when giving up)
                _deactivate_after_death(command, seen["node"], what)
            if max_restarts is not None and restarts >= max_restarts:
                _say(f"{what}; giving up after {restarts} restart(s)")
                return 128 - code if code < 0 else code
            if time.monotonic() - started >= stable or flower in RETRY_STEADY:
                wait = backoff
            restarts += 1
            _say(f"{what}; restart {restarts} in {wait:g} s")
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and stop["signal"] is None:
                time.sleep(min(0.2, deadline - time.monotonic()))
            if stop["signal"] is not None:  # stopped while waiting to restart: say so, never exit silently
                _say(f"stopped by {signal.Signals(stop['signal']).name} while waiting to restart {command[0]} "
                     f"(restart {restarts}): not restarted; exiting")
                return 0
            wait = backoff if flower in RETRY_STEADY else min(wait * 2, max_backoff)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _wait(child: subprocess.Popen, stop: dict, grace: float) -> int:
    """Wait for ``child``; once a stop signal was passed on to it, kill it when it is still running
    ``grace`` seconds later (a SuperNode stuck in a retry, or one that ignores the signal)."""
    while True:
        try:
            return child.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            if stop["signal"] is not None and time.monotonic() - stop["at"] >= grace:
                _say(f"{child.args[0]} (pid {child.pid}) still running {grace:g} s after "
                     f"{signal.Signals(stop['signal']).name}: killing it")
                child.kill()


def _pump(stream, seen: dict[str, int]) -> None:
    """Pass the command's output on to stdout, noting the last Flower ``Exit Code: <code>`` and
    ``SuperNode ID: <id>``. Reads to the end whatever happens to stdout (a full disk, a closed
    pipe: the output is then dropped, said once on stderr), so that the command never blocks on a
    full pipe."""
    passing = True
    for line in stream:
        if passing:
            try:
                sys.stdout.write(line)
                sys.stdout.flush()
            except (OSError, ValueError) as e:
                passing = False
                with contextlib.suppress(OSError, ValueError):
                    _say(f"cannot pass the command's output on ({type(e).__name__}: {e}); dropping it from here on")
        if m := _EXIT_LINE.search(line):
            seen["code"] = int(m.group(1))
        elif m := _NODE_LINE.search(line):
            seen["node"] = int(m.group(1))


def command_flag(command: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` (``--flag value`` or ``--flag=value``, the last one given) in ``command``,
    or None (also for an empty value or one that is itself an option, ``--flag --other``)."""
    found = None
    for i, arg in enumerate(command):
        if arg == flag and i + 1 < len(command) and not command[i + 1].startswith("--"):
            found = command[i + 1]
        elif arg.startswith(flag + "=") and arg[len(flag) + 1:]:
            found = arg[len(flag) + 1:]
    return found


def deactivate_node(superlink: str, node_id: int, private_key: str, root_certificates: str | None = None,
                    insecure: bool = False, timeout: float = 10.0) -> None:
    """Tell the SuperLink at ``superlink`` (``host:port`` of its Fleet API) that the authenticated
    node ``node_id`` is gone, as the SuperNode itself does when it stops cleanly: Flower's Fleet API
    ``DeactivateNode``, signed with the node's private key (an OpenSSH EC key, the file given to
    ``flower-supernode --auth-supernode-private-key``) by Flower's own HTTP client
    (``flwr.supernode.fleet_http_client``, ``NodeAuthHttpInterceptor``; flwr 1.42). The SuperLink
    marks the node offline at once; it can be activated again by the next start of its SuperNode.

    Args:
        root_certificates: the CA file of the SuperLink's TLS certificate (``--root-certificates``);
            None with ``insecure`` (no TLS) or for a certificate the system trusts.
        timeout: seconds for the one HTTP call (no retries).
    Raises:
        ValueError: the key file is not an EC private key in OpenSSH format (or has a password),
            naming the file.
        OSError: the key file cannot be read; FileNotFoundError naming ``root_certificates`` when
            that is not a file.
        httpx.HTTPError: the SuperLink refused (401: the key does not belong to ``node_id``; 412: the
            node was not online) or could not be reached.
    """
    from pathlib import Path

    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.proto.fleet_pb2 import DeactivateNodeRequest
    from flwr.supernode.fleet_http_client import FleetHttpClient
    from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor

    try:
        key = load_ssh_private_key(Path(private_key).expanduser().read_bytes(), None)
    except (ValueError, TypeError) as e:  # TypeError: a password-protected key
        raise ValueError(f"{private_key}: not an OpenSSH private key without a password ({e})") from e
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{private_key}: not an elliptic-curve key (Flower's node keys are EC keys)")
    certs = None if insecure else (str(Path(root_certificates).expanduser()) if root_certificates else None)
    if certs is not None and not Path(certs).is_file():
        raise FileNotFoundError(f"the root certificates {certs!r} are not a file")
    with FleetHttpClient.from_server_address(superlink, insecure, certs,
                                             interceptors=[NodeAuthHttpInterceptor(key, key.public_key())]) as client:
        client._client.timeout = timeout  # noqa: SLF001 - one call, no long wait on a SuperLink that is down
        client.DeactivateNode(DeactivateNodeRequest(node_id=node_id))


def preload_deactivation(command: Sequence[str]) -> bool:
    """When ``command`` authenticates (``--auth-supernode-private-key``), import what :func:`deactivate_node`
    needs (Flower's Fleet HTTP client, its request signing, ``cryptography``) now, so that a deactivation at a
    stop is one HTTP call within :data:`DEACTIVATE_LIMIT` (the drill at load 15: the imports alone outlasted
    the 5 s, and the round waited 48.9 s for the node's heartbeat). Returns whether it imported them."""
    if not command_flag(command, "--auth-supernode-private-key"):
        return False
    try:
        import cryptography.hazmat.primitives.serialization  # noqa: F401
        import flwr.proto.fleet_pb2  # noqa: F401
        import flwr.supernode.fleet_http_client  # noqa: F401
        import flwr.supernode.node_auth_http_interceptor  # noqa: F401
    except ImportError:  # deactivate_node says so when it is needed
        return False
    return True


def _deactivate_after_death(command: Sequence[str], node_id: int, what: str, limit: float = DEACTIVATE_LIMIT) -> None:
    """After the SuperNode of ``command`` died, :func:`deactivate_node` its ``node_id`` when the
    command authenticates (``--auth-supernode-private-key``), saying on stderr how it went; waits
    ``limit`` seconds at most for the answer."""
    key = command_flag(command, "--auth-supernode-private-key")
    if not key:
        return  # without authentication the restart gets a new node id: nothing to free
    superlink = command_flag(command, "--superlink") or "127.0.0.1:9092"
    result: dict = {}

    def call() -> None:
        try:
            deactivate_node(superlink, node_id, key, command_flag(command, "--root-certificates"),
                            insecure="--insecure" in command, timeout=limit)
            result["ok"] = True
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e

    t = threading.Thread(target=call, daemon=True)  # httpx's timeout is per phase: a thread bounds the whole call
    t.start()
    t.join(limit)
    if t.is_alive():
        result["error"] = TimeoutError(f"no answer within {limit:g} s")
    e = result.get("error")
    if getattr(getattr(e, "response", None), "status_code", None) == 412:  # not online: nothing to free
        _say(f"{what}; node {node_id} is already offline at {superlink}")
        return
    if e is not None:  # the fallback (wait for the heartbeat to expire) still works
        _say(f"{what}; could not deactivate node {node_id} at {superlink} ({type(e).__name__}: {str(e)[:200]}): "
             "the SuperLink keeps it online until its heartbeat expires (up to 60 s)")
        return
    _say(f"{what}; deactivated node {node_id} at {superlink} (Fleet API DeactivateNode): it can rejoin at once")


def _why(status: int, flower_code: int | None) -> str:
    meaning = exit_meaning(status, flower_code)
    return f" ({meaning})" if meaning else ""


def _say(text: str) -> None:
    print(f"fedproto.deploy.supervisor: {text}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring). Returns the exit code of :func:`supervise`; 2 with a
    message on stderr for bad arguments or a program that does not exist."""
    parser = argparse.ArgumentParser(prog="python -m fedproto.deploy.supervisor",
                                     description="Run a command (flower-supernode ...) and restart it with backoff "
                                                 "when it fails.")
    parser.add_argument("--backoff", type=float, default=5.0, help="seconds before the first restart (default 5)")
    parser.add_argument("--max-backoff", type=float, default=60.0,
                        help="the longest wait between restarts; the wait doubles up to it (default 60)")
    parser.add_argument("--max-restarts", type=int, default=None, help="give up after this many restarts "
                                                                       "(default: never)")
    parser.add_argument("--stable", type=float, default=120.0,
                        help="a start that ran this many seconds resets the wait to --backoff (default 120)")
    parser.add_argument("--stop-grace", type=float, default=STOP_GRACE,
                        help="seconds the command has to end after SIGTERM/SIGINT/SIGHUP before it is killed "
                             f"(default {STOP_GRACE:g}); the node is deactivated before the supervisor exits")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        return supervise(command, args.backoff, args.max_backoff, args.max_restarts, args.stable, args.stop_grace)
    except (ValueError, OSError) as e:  # OSError: a program that cannot run (a folder, no exec permission)
        parser.error(f"{command[0] if command else 'the command'}: {e}" if isinstance(e, OSError) else str(e))
    return 2


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["DEACTIVATE_LIMIT", "NO_RESTART", "RETRY_STEADY", "STOP_GRACE", "STOP_SIGNALS", "command_flag",
           "deactivate_node", "exit_meaning", "main", "supervise"]
