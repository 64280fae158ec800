"""Keep a SuperNode running: restart ``flower-supernode`` with backoff when it fails.

    python -m fedproto.flower.supervise [--backoff 5] [--max-backoff 60] [--max-restarts N] -- \\
        flower-supernode --superlink 10.0.0.1:9092 --root-certificates ca.crt \\
        --auth-supernode-private-key site0.key --node-config 'client-id=0 data="/data/site0" model="cnn"'

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

This supervisor is the portable equivalent of a systemd unit with ``Restart=on-failure``: it
runs the command (its output passed on to stdout, where the supervisor reads Flower's ``Exit
Code: <code>`` line), and when it fails (a non-zero exit status, or killed by a signal) starts it
again after ``backoff`` seconds, doubling the wait up to ``max-backoff`` (back to ``backoff`` once
a start has run ``stable`` seconds). A start refused because the SuperLink still holds the node
online (Flower exit code 305, :data:`RETRY_STEADY`) is retried every ``backoff`` seconds without
doubling: that refusal ends by itself when the dead node's heartbeat expires (37.5-60 s after it
died, the floor Flower 1.42 sets), and a doubled wait (5, 10, 20, 40 s) would let the node come
back up to 40 s after that. With the defaults a node killed at any time is back within about
60 s + ``backoff`` + its start-up time. It stops, with the command's exit status, when the command exits
0 or with a Flower exit code in :data:`NO_RESTART` (a configuration error a restart cannot fix),
after ``max-restarts`` restarts, or when it is itself stopped (SIGTERM or SIGINT, passed on to the
command). It logs every start (with the pid) and every restart (with the exit status, Flower's
exit code and Flower's meaning of it) on stderr.
"""

from __future__ import annotations

import argparse
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

_EXIT_LINE = re.compile(r"Exit Code: (\d+)")


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
              max_restarts: int | None = None, stable: float = 120.0) -> int:
    """Run ``command`` and restart it when it fails (see the module docstring).

    Args:
        command: the program and its arguments (``flower-supernode ...``).
        backoff: seconds before the first restart; doubled after each failed start, up to
            ``max_backoff``; back to ``backoff`` after a start that ran ``stable`` seconds.
        max_restarts: give up after this many restarts (None: never).
    Returns:
        The exit code to exit with: the command's last code (128 + the signal's number when it
        was killed by a signal), or 0 when this supervisor was stopped by SIGTERM or SIGINT.
    Raises:
        ValueError: an empty command, ``backoff`` <= 0, ``max_backoff`` < ``backoff`` or
            ``max_restarts`` < 0, naming the value.
        FileNotFoundError: the program does not exist.
    """
    if not command:
        raise ValueError("no command to supervise: give it after --, e.g. "
                         "-- flower-supernode --superlink HOST:PORT ...")
    if not backoff > 0 or not max_backoff >= backoff:
        raise ValueError(f"backoff={backoff!r} must be > 0 and max_backoff={max_backoff!r} >= backoff")
    if max_restarts is not None and max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r} must be >= 0 (or None: no limit)")
    stop = {"signal": None}
    child: subprocess.Popen | None = None

    def on_signal(signum, _frame):
        stop["signal"] = signum
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
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
            code = child.wait()
            pump.join(2.0)  # the rest of its output (a grandchild may hold the pipe open longer: not waited for)
            flower = seen.get("code")
            what = f"{command[0]} exited with status {code}{_why(code, flower)}"
            if stop["signal"] is not None:
                return 0
            if code == 0 or flower in NO_RESTART:
                _say(f"{what}; not restarting")
                return code
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
            if stop["signal"] is not None:
                return 0
            wait = backoff if flower in RETRY_STEADY else min(wait * 2, max_backoff)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _pump(stream, seen: dict[str, int]) -> None:
    """Pass the command's output on to stdout, noting the last Flower ``Exit Code: <code>``."""
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()
        if m := _EXIT_LINE.search(line):
            seen["code"] = int(m.group(1))


def _why(status: int, flower_code: int | None) -> str:
    meaning = exit_meaning(status, flower_code)
    return f" ({meaning})" if meaning else ""


def _say(text: str) -> None:
    print(f"fedproto.flower.supervise: {text}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring). Returns the exit code of :func:`supervise`; 2 with a
    message on stderr for bad arguments or a program that does not exist."""
    parser = argparse.ArgumentParser(prog="python -m fedproto.flower.supervise",
                                     description="Run a command (flower-supernode ...) and restart it with backoff "
                                                 "when it fails.")
    parser.add_argument("--backoff", type=float, default=5.0, help="seconds before the first restart (default 5)")
    parser.add_argument("--max-backoff", type=float, default=60.0,
                        help="the longest wait between restarts; the wait doubles up to it (default 60)")
    parser.add_argument("--max-restarts", type=int, default=None, help="give up after this many restarts "
                                                                       "(default: never)")
    parser.add_argument("--stable", type=float, default=120.0,
                        help="a start that ran this many seconds resets the wait to --backoff (default 120)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        return supervise(command, args.backoff, args.max_backoff, args.max_restarts, args.stable)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    return 2


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["NO_RESTART", "RETRY_STEADY", "exit_meaning", "main", "supervise"]
