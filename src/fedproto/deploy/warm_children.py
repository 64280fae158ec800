"""The warm executor's children (:mod:`fedproto.deploy.warm_executor`): no child outlives its run or its executor.

A child forked for one task dies with the executor (:func:`bind_to_parent`: Linux's parent-death signal,
``prctl(PR_SET_PDEATHSIG)``; elsewhere :func:`start_watchdog` sees the executor gone), ends itself once its
message expired (:data:`CHILD_GRACE`) or when it never got one (:data:`CHILD_FIRST_LIMIT`), and a stop signal
ends it within :data:`CHILD_STOP_GRACE` seconds even while Flower's own graceful exit hangs (the SIGINT
Flower raises when the SuperNode says the task's run is no longer running included). A stopping executor
ends its children with :func:`end_children`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

CHILD_GRACE = 30.0
"""Seconds a child may run past its message's expiry (``created_at + ttl``: the server's deadline
plus :data:`fedproto.flower.exchange.TTL_MARGIN`) before it ends itself."""
CHILD_FIRST_LIMIT = 60.0
"""Seconds a child may run before its ClientApp has seen its message (Flower fetching the
message, the context and the app from the SuperNode, on this machine: well under a second, seconds
under load) before it ends itself. A task of a run that is no longer running never gets its message
(the SuperNode dropped it; Flower retries the pull for up to 2 hours): the drill's child lived 8.5 min."""
CHILD_STOP_GRACE = 5.0
"""Seconds a child has after a stop signal (Flower's graceful exit: pushing its status) before it is
ended; also what a stopping executor gives its children before it kills them."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals that stop the executor (passed on to its children as SIGTERM) and end a child."""
PR_SET_PDEATHSIG = 1
"""Linux ``prctl`` option: the signal a process gets when its parent dies (``<linux/prctl.h>``)."""

log = logging.getLogger("fedproto.deploy.warm_executor")


def bind_to_parent(parent: int) -> bool:
    """In a forked child: be killed (SIGKILL) when the process ``parent`` dies, by Linux's
    ``prctl(PR_SET_PDEATHSIG)`` (through ctypes); exits at once (status 1) when ``parent`` is already gone.

    Returns:
        True when the parent-death signal is set; False elsewhere (macOS: the child's watchdog
        checks its parent instead, :func:`start_watchdog`).
    """
    armed = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # died between the fork and the prctl
        os._exit(1)
    return armed


def start_watchdog(grace: float | None = None, first_limit: float | None = None, tick: float = 1.0,
                   parent: int | None = None, stop_grace: float | None = None) -> None:
    """In a child (from its main thread): a daemon thread that ends the process, with a log line,

    * (status 124) once its message expired ``grace`` s ago (:data:`fedproto.flower.client_app.EXPIRY`),
      or ``first_limit`` s after the start when the ClientApp never saw its message;
    * (status 128 + the signal) ``stop_grace`` s after a stop signal (:data:`STOP_SIGNALS`, seen through
      :func:`signal.set_wakeup_fd`, so also while Flower's own handler hangs or ignores a second signal);
    * (status 1) as soon as its parent is no longer ``parent`` (the executor died; None: not checked).
    """
    from fedproto.flower.client_app import EXPIRY

    EXPIRY.clear()  # the message of this child, not one the executor knew before the fork
    grace = CHILD_GRACE if grace is None else grace
    first_limit = CHILD_FIRST_LIMIT if first_limit is None else first_limit
    stop_grace = CHILD_STOP_GRACE if stop_grace is None else stop_grace
    started = time.time()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)  # written for every signal with a Python handler
    for s in STOP_SIGNALS:  # a Python handler for each, so the wakeup fd sees them (Flower replaces two later)
        signal.signal(s, _child_stop)
    stopped: dict[str, Any] = {}

    def end(code: int, why: str) -> None:
        log.error("ClientApp process %d ends itself: %s", os.getpid(), why)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def watch() -> None:
        import select

        while True:
            if select.select([wake_r], [], [], tick)[0]:
                for b in os.read(wake_r, 64):
                    if b in (int(s) for s in STOP_SIGNALS) and "signal" not in stopped:
                        stopped.update({"signal": b, "at": time.time()})
            if parent is not None and os.getppid() != parent:
                end(1, f"its executor (process {parent}) is gone")
            if "signal" in stopped and time.time() > stopped["at"] + stop_grace:
                end(128 + stopped["signal"], f"still running {stop_grace:g} s after "
                    f"{signal.Signals(stopped['signal']).name}")
            at = EXPIRY.get("at")
            limit = at + grace if at is not None else started + first_limit
            if time.time() > limit:
                why = (f"its message expired {time.time() - at:.0f} s ago" if at is not None
                       else f"it got no message within {first_limit:g} s")
                end(124, f"{why} (no reply can be accepted now)")

    threading.Thread(target=watch, name="fedproto-prefork-watchdog", daemon=True).start()


def _child_stop(signum, frame) -> None:  # noqa: ARG001
    """A child's handler of a stop signal before Flower installs its own: exit now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signum)


def end_children(children: set[int], grace: float = CHILD_STOP_GRACE) -> None:
    """SIGTERM to each process of ``children`` still running, then SIGKILL to those still running
    ``grace`` seconds later; all of them reaped (the executor's exit)."""
    alive = set(children) - reaped(children)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive -= reaped(alive)
    for pid in alive:
        log.warning("ClientApp process %d still running %g s after SIGTERM: killing it", pid, grace)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def reaped(children: set[int]) -> set[int]:
    """The processes of ``children`` that have ended (reaped now, a non-zero exit logged) or were never ours."""
    done = set()
    for pid in children:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done.add(pid)
            continue
        if got:
            done.add(pid)
            code = os.waitstatus_to_exitcode(status)
            if code:
                log.warning("ClientApp process %d exited with %d", pid, code)
    return done



__all__ = ["CHILD_FIRST_LIMIT", "CHILD_GRACE", "CHILD_STOP_GRACE", "STOP_SIGNALS", "bind_to_parent", "end_children",
           "reaped", "start_watchdog"]
