"""fedproto.deploy.warm_tasks: the warm executor never lets a reply reach a message its SuperNode no longer waits for.

Flower 1.42's SuperNode waits for *any* reply after each message; a reply it did not wait for (Flower's "ClientApp
stopped responding" for the dead run's message a child never got, after a SuperLink restart) left the drill's node
one reply behind for the rest of the run. Here the children are real processes and the Runtime API a recorder."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest

pytest.importorskip("flwr")
pytestmark = [pytest.mark.flower,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table in /proc")]


def alive(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


class Runtime:
    """The SuperNode's Runtime API as one task's token sees it: records each call."""

    def __init__(self):
        self.calls: list[tuple[str, str, object]] = []
        self.available: set[str] = set()
        self.closed = 0

    def client_for(self, token):
        rt = self

        class Client:
            def PushTaskOutput(self, req):
                rt.calls.append(("PushTaskOutput", token, (req.sub_status, req.details)))

            def SendTaskHeartbeat(self, req):
                rt.calls.append(("SendTaskHeartbeat", token, None))
                return type("R", (), {"success": True})()

            def PullObject(self, req):
                rt.calls.append(("PullObject", token, req.object_id))
                ok = req.object_id in rt.available
                return type("R", (), {"object_found": True, "object_available": ok})()

            def close(self):
                rt.closed += 1

        return Client()


def _at(seconds: float) -> str:
    return (datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=seconds)).isoformat()


def _child(ledger, task_id: int, pending_s: float, says: str = ""):
    """A child (a sleeping process) for task ``task_id``, created ``pending_s`` s into the test day, that has
    written ``says`` to its pipe."""
    proc = subprocess.Popen(["sleep", "60"])
    r, w = os.pipe()
    os.write(w, says.encode())
    ledger.add(task_id, 7, _at(pending_s), f"token{task_id}", proc.pid, r)
    return proc, w


def test_a_task_the_supernode_moved_past_is_ended_with_no_reply():
    """A child that pulled the dead run's message and never got its content: the next task shows the SuperNode no
    longer waits for it, so the child is killed and its task finished as failed (Flower then makes up no reply)."""
    from flwr.common.constant import SubStatus

    from fedproto.deploy.warm_tasks import TaskLedger

    rt = Runtime()
    ledger = TaskLedger(rt.client_for)
    stale, _ = _child(ledger, 1, 0, "Pmsg-of-dead-run\n")
    answered, _ = _child(ledger, 2, 1, "Pmsg2\nG\n")  # got its message: the SuperNode waits for its reply
    try:
        assert ledger.newer_task(3, 8, _at(5)) == [1]
        assert not alive(stale.pid) and alive(answered.pid)
        assert rt.calls == [("PushTaskOutput", "token1", (SubStatus.FAILED, rt.calls[0][2][1]))]
        assert "without waiting for this task's message" in rt.calls[0][2][1]
        assert set(ledger.tasks) == {2}
        assert ledger.newer_task(0, 8, _at(-5)) == []  # an older task (re-pended by Flower) shows nothing
    finally:
        for p in (stale, answered):
            p.kill()
            p.wait()


def test_a_child_ended_without_its_message_keeps_its_task_alive_until_a_newer_task():
    """The child ended (its no-message limit) after pulling a message whose content never came: its task is parked,
    its heartbeat kept (else Flower stores "ClientApp stopped responding" 60 s later and the SuperNode pushes it in
    place of the next real reply), and finished with no reply once a newer task comes."""
    from fedproto.deploy.warm_tasks import TaskLedger
    from fedproto.flower import tasks

    rt = Runtime()
    ledger = TaskLedger(rt.client_for)
    proc, w = _child(ledger, 1, 0, "Pstale\n")
    proc.kill()
    proc.wait()  # reaped here, so the ledger's waitpid finds no such child: it counts as ended
    t0 = time.monotonic()
    while ledger.tasks[1].pid is not None and time.monotonic() - t0 < 5:
        ledger.reap()
        time.sleep(0.05)
    assert ledger.tasks[1].pid is None and ledger.tasks[1].message_id == "stale"
    ledger.tend()
    assert [c[0] for c in rt.calls] == ["PullObject", "SendTaskHeartbeat"]
    ledger.tend()  # within HEARTBEAT_EVERY: nothing sent
    assert len(rt.calls) == 2 and tasks.HEARTBEAT_EVERY <= 30  # well inside Flower's 60 s patience
    assert ledger.newer_task(2, 7, _at(10)) == [1]
    assert rt.calls[-1][0] == "PushTaskOutput" and not ledger.tasks
    os.close(w)


def test_a_parked_task_whose_message_arrives_is_left_to_flower():
    """The SuperNode was still pulling the message's content (a slow link): it does wait for a reply, so the
    ledger stops the heartbeat and Flower answers it with its error, as without the ledger."""
    from fedproto.deploy.warm_tasks import TaskLedger

    rt = Runtime()
    ledger = TaskLedger(rt.client_for)
    proc, w = _child(ledger, 1, 0, "Pslow\n")
    proc.kill()
    proc.wait()
    ledger.ended({proc.pid})
    rt.available.add("slow")
    ledger.tend()
    assert [c[0] for c in rt.calls] == ["PullObject"] and not ledger.tasks
    os.close(w)


def test_a_child_that_replied_is_never_ended_by_a_newer_task():
    """The SuperNode makes the next task once the reply is in: the child that is still pushing its context (the
    client's model) must not be killed."""
    from fedproto.deploy.warm_tasks import TaskLedger

    rt = Runtime()
    ledger = TaskLedger(rt.client_for)
    proc, w = _child(ledger, 1, 0, "Pm1\nR\n")
    try:
        assert ledger.newer_task(2, 7, _at(3)) == []
        assert alive(proc.pid) and rt.calls == []
    finally:
        proc.kill()
        proc.wait()
        os.close(w)
