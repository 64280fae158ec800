"""The warm executor's ledger of the SuperNode's tasks: no reply is ever sent to a message the SuperNode
no longer waits for, so a node is never left answering one message behind.

Flower 1.42's SuperNode (``flwr/supernode/start_client_internal.py``) handles one message at a time: it
pulls a message, creates a task for it, waits until *any* reply is in its node state, pushes every reply
there and pulls the next message. A reply it was not waiting for therefore releases that wait early, and the
reply it was waiting for stays behind until the next message comes: from then on each round's reply leaves
one message late and every round waits its deadline for the node (the drill after a SuperLink restart). Such
a reply arises when, after a SuperLink restart, the SuperNode pulls a message of the dead run: pulling its
content raises Flower's ``RunNotRunningException`` (a ``BaseException``), the SuperNode logs ``Run ID ... is
not in RUNNING status. Ignoring message ...`` and goes on, but leaves the message and its task behind. A
child of the warm executor takes the task, never gets the message's content and ends; 60 s later Flower sees
the task's heartbeat lapse and stores the error reply "ClientApp stopped responding" for it, which the
SuperNode then pushes in place of the next real reply.

:class:`TaskLedger` keeps that from happening, from facts of Flower's loop:

* a task created after another means the SuperNode stopped waiting for the other's message (it waits for a
  reply before it pulls the next message). A child of an older task that has neither got its message nor
  started its reply is then killed and its task finished as failed, which Flower answers with no reply;
* a child that ends without having got the message it pulled (its content never came) leaves its task
  *parked*: the ledger keeps the task's heartbeat going, so Flower makes up no reply, until a newer task
  shows the message is not awaited (the task is then finished as failed), or the message's content arrives
  after all (the SuperNode was still pulling it and does wait: the heartbeat stops and Flower answers it
  with its error once the task's patience is over, as it would have without the ledger).

The child tells the ledger what it did through a pipe (:func:`child_reporter`): ``P<message id>`` when
Flower's ``PullMessages`` gave it a message, ``G`` when fedproto's ClientApp got it (after its content was
pulled), ``R`` before it pushes a reply.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from fedproto.deploy.warm_children import reaped

HEARTBEAT_EVERY = 15.0
"""Seconds between the ledger's heartbeats of a parked task (Flower 1.42 ends a running task whose
heartbeat is ``HEARTBEAT_PATIENCE`` x 30 s = 60 s late, and stores its error reply then)."""

log = logging.getLogger("fedproto.deploy.warm_executor")


@dataclass
class Task:
    """One task the executor acquired: its child process (None once it ended), token and what the child said."""

    task_id: int
    run_id: int
    pending_at: str
    token: str
    pid: int | None
    fd: int | None
    message_id: str = ""
    got: bool = False
    replying: bool = False
    beat: float = field(default_factory=time.monotonic)

    def answered(self) -> bool:
        """The child got its message or started its reply: the SuperNode waits for (or has) its reply."""
        return self.got or self.replying


def _when(iso: str) -> datetime | None:
    try:
        return datetime.fromisoformat(iso)
    except (TypeError, ValueError):
        return None


class TaskLedger:
    """The tasks of one warm executor, each with its child and its pipe (see the module's docstring).

    Args:
        client_for: ``client_for(token)`` -> a Flower ``RuntimeHttpClient`` that sends ``token`` (the task's
            Runtime API token) with every call; the ledger closes it after use.
    """

    def __init__(self, client_for: Callable[[str], object]):
        self.client_for = client_for
        self.tasks: dict[int, Task] = {}

    def add(self, task_id: int, run_id: int, pending_at: str, token: str, pid: int, fd: int) -> None:
        """A child ``pid`` was forked for task ``task_id``; ``fd`` is the read end of its pipe."""
        old = self.tasks.pop(task_id, None)
        if old is not None and old.fd is not None:  # the task came back (Flower re-pends a task never started)
            with contextlib.suppress(OSError):
                os.close(old.fd)
        os.set_blocking(fd, False)
        self.tasks[task_id] = Task(task_id, run_id, pending_at, token, pid, fd)

    def drain(self) -> None:
        """Read what every child said so far."""
        for t in self.tasks.values():
            if t.fd is None:
                continue
            data = b""
            while True:
                try:
                    chunk = os.read(t.fd, 4096)
                except BlockingIOError:
                    break
                except OSError:
                    chunk = b""
                if not chunk:
                    with contextlib.suppress(OSError):
                        os.close(t.fd)
                    t.fd = None
                    break
                data += chunk
            for line in data.decode(errors="replace").splitlines():
                if line.startswith("P"):
                    t.message_id = line[1:].strip()
                elif line == "G":
                    t.got = True
                elif line == "R":
                    t.replying = True

    def newer_task(self, task_id: int, run_id: int, pending_at: str) -> list[int]:
        """Task ``task_id`` (created at ``pending_at``) was acquired: the SuperNode no longer waits for the message
        of any task created before it, so each such task whose child has not got its message is ended with no
        reply (child killed, task finished as failed). Returns the task ids ended."""
        self.drain()
        new = _when(pending_at)
        ended = []
        for t in list(self.tasks.values()):
            old = _when(t.pending_at)
            if t.task_id == task_id or t.answered() or new is None or old is None or old >= new:
                continue
            if t.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(t.pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(t.pid, 0)
            self._finish(t, f"the SuperNode moved on to task {task_id} (run {run_id}) without waiting for this task's "
                            "message (Flower ignores a message of a run that is no longer running): no reply")
            ended.append(t.task_id)
        return ended

    def ended(self, pids: set[int]) -> None:
        """The children ``pids`` ended (reaped): forget their tasks, except a task whose child pulled a message and
        never got it, which is parked (its heartbeat kept, so Flower stores no error reply for it)."""
        self.drain()
        for t in list(self.tasks.values()):
            if t.pid not in pids:
                continue
            t.pid = None
            if t.answered() or not t.message_id:
                self._forget(t)
            else:
                t.beat = 0.0
                log.warning("task %d (run %d): its ClientApp ended without getting message %s; the task is kept alive "
                            "(no reply is made up for a message the SuperNode may not wait for) until a newer task "
                            "or the message's content arrives", t.task_id, t.run_id, t.message_id[:12])

    def tend(self) -> None:
        """Every :data:`HEARTBEAT_EVERY` s, each parked task: released when its message's content has arrived (the
        SuperNode waits for it: Flower answers it with its error once the heartbeat lapses), else its heartbeat
        sent; forgotten when the SuperNode no longer knows its token (restarted)."""
        from flwr.proto.message_pb2 import PullObjectRequest
        from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest

        now = time.monotonic()
        for t in [t for t in self.tasks.values() if t.pid is None and now - t.beat >= HEARTBEAT_EVERY]:
            t.beat = now
            client = self.client_for(t.token)
            try:
                res = client.PullObject(PullObjectRequest(run_id=t.run_id, object_id=t.message_id))
                if res.object_found and res.object_available:
                    log.warning("task %d (run %d): the content of message %s arrived after its ClientApp ended; the "
                                "SuperNode waits for it, so Flower answers it with an error", t.task_id, t.run_id,
                                t.message_id[:12])
                    self._forget(t)
                elif not client.SendTaskHeartbeat(SendTaskHeartbeatRequest()).success:
                    self._forget(t)
            except Exception as e:  # noqa: BLE001 - the SuperNode restarted (token unknown) or is unreachable
                log.info("task %d: parked task dropped (%s: %s)", t.task_id, type(e).__name__, str(e)[:120])
                self._forget(t)
            finally:
                with contextlib.suppress(Exception):
                    client.close()

    def reap(self) -> set[int]:
        """Reap the children that ended (:func:`fedproto.deploy.warm_children.reaped`) and note it; returns their
        pids."""
        pids = {t.pid for t in self.tasks.values() if t.pid is not None}
        done = reaped(pids)
        if done:
            self.ended(done)
        return done

    def children(self) -> set[int]:
        """The pids of the children still running."""
        return {t.pid for t in self.tasks.values() if t.pid is not None}

    def _finish(self, t: Task, why: str) -> None:
        from flwr.common.constant import SubStatus
        from flwr.proto.runtime_pb2 import PushTaskOutputRequest

        client = self.client_for(t.token)
        try:
            client.PushTaskOutput(PushTaskOutputRequest(sub_status=SubStatus.FAILED, details=why))
            log.warning("task %d (run %d, message %s): %s", t.task_id, t.run_id, t.message_id[:12] or "not pulled", why)
        except Exception as e:  # noqa: BLE001 - its token lapsed or the SuperNode restarted: nothing is left to end
            log.info("task %d: could not be finished (%s: %s)", t.task_id, type(e).__name__, str(e)[:120])
        finally:
            with contextlib.suppress(Exception):
                client.close()
        self._forget(t)

    def _forget(self, t: Task) -> None:
        if t.fd is not None:
            with contextlib.suppress(OSError):
                os.close(t.fd)
        self.tasks.pop(t.task_id, None)


def child_reporter(fd: int) -> None:
    """In a child (before Flower's ClientApp entry runs): report to the ledger through pipe ``fd`` when Flower's
    ``PullMessages`` gives a message (``P<id>``), when fedproto's ClientApp gets it (``G``) and before a reply is
    pushed (``R``), by wrapping the two calls of Flower's ``RuntimeHttpClient`` in this process only."""
    from flwr.supercore.runtime import RuntimeHttpClient

    from fedproto.flower import client_app

    def say(text: str) -> None:
        with contextlib.suppress(OSError):
            os.write(fd, (text + "\n").encode())

    pull, push = RuntimeHttpClient.PullMessages, RuntimeHttpClient.PushMessages

    def pull_messages(self, request):
        res = pull(self, request)
        if res.message_object_trees:
            say("P" + res.message_object_trees[0].object_id)
        return res

    def push_messages(self, request):
        say("R")
        return push(self, request)

    RuntimeHttpClient.PullMessages = pull_messages
    RuntimeHttpClient.PushMessages = push_messages
    client_app.SEEN_HOOKS[:] = [lambda: say("G")]


__all__ = ["HEARTBEAT_EVERY", "Task", "TaskLedger", "child_reporter"]
