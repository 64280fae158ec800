"""The supervisor frees a killed SuperNode's node id at the SuperLink (Flower's Fleet API
``DeactivateNode``, signed with the node's key), so that its restart is let in at once instead of
after the 37.5-60 s heartbeat. Here against a stand-in Fleet API on 127.0.0.1 that checks the
signature as Flower's SuperLink does; the slow deployment test does it against a real SuperLink."""

import base64
import http.server
import os
import threading

import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower


class _FleetStandIn(http.server.BaseHTTPRequestHandler):
    """Answers ``/v1/fleet/deactivate-node`` as the SuperLink would: 200 for a request signed by
    the key of ``node_id`` (``server.keys``), 401 for another key, 412 when the node is not online."""

    def do_POST(self):  # noqa: N802 - http.server's name
        from flwr.common.constant import TIMESTAMP_HEADER
        from flwr.proto.fleet_pb2 import DeactivateNodeRequest
        from flwr.supercore.constant import FLEET_HTTP_PUBLIC_KEY_HEADER, FLEET_HTTP_SIGNATURE_HEADER
        from flwr.supercore.primitives.asymmetric import bytes_to_public_key, verify_signature

        body = self.rfile.read(int(self.headers["content-length"]))
        req = DeactivateNodeRequest()
        req.ParseFromString(body)
        pub = base64.b64decode(self.headers[FLEET_HTTP_PUBLIC_KEY_HEADER])
        signed = verify_signature(bytes_to_public_key(pub), self.headers[TIMESTAMP_HEADER].encode("ascii"),
                                  base64.b64decode(self.headers[FLEET_HTTP_SIGNATURE_HEADER]))
        self.server.calls.append((self.path, req.node_id, signed))
        if not signed or self.server.keys.get(req.node_id) != pub:
            status = 401
        elif req.node_id not in self.server.online:
            status = 412
        else:
            self.server.online.discard(req.node_id)
            status = 200
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def fleet():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FleetStandIn)
    server.calls, server.keys, server.online = [], {}, set()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def _node_key(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    key = ec.generate_private_key(ec.SECP384R1())
    path = tmp_path / "site0.key"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    return path, public_key_to_bytes(key.public_key())


def test_deactivate_node_signs_with_the_node_key_and_names_a_bad_key(tmp_path, fleet):
    from fedproto.deploy.supervisor import command_flag, deactivate_node

    key, pub = _node_key(tmp_path)
    fleet.keys[77], fleet.online = pub, {77}
    address = f"127.0.0.1:{fleet.server_address[1]}"
    deactivate_node(address, 77, str(key), insecure=True)
    assert fleet.calls == [("/v1/fleet/deactivate-node", 77, True)] and fleet.online == set()
    import httpx

    with pytest.raises(httpx.HTTPStatusError, match="412"):  # no longer online
        deactivate_node(address, 77, str(key), insecure=True)
    with pytest.raises(httpx.HTTPStatusError, match="401"):  # another node's id: the key does not match
        deactivate_node(address, 78, str(key), insecure=True)
    (tmp_path / "bad.key").write_text("not a key")
    with pytest.raises(ValueError, match=r"bad.key: not an OpenSSH private key"):
        deactivate_node(address, 77, str(tmp_path / "bad.key"), insecure=True)
    cmd = ["flower-supernode", "--superlink=10.0.0.1:9092", "--auth-supernode-private-key", "k", "--insecure"]
    assert (command_flag(cmd, "--superlink"), command_flag(cmd, "--auth-supernode-private-key"),
            command_flag(cmd, "--root-certificates")) == ("10.0.0.1:9092", "k", None)
    # an option where a value should be, or an empty value, is no value
    assert command_flag(["--root-certificates", "--insecure"], "--root-certificates") is None
    assert command_flag(["--superlink="], "--superlink") is None
    with pytest.raises(FileNotFoundError, match=r"the root certificates '/nonexistent/ca.crt' are not a file"):
        deactivate_node(address, 77, str(key), root_certificates="/nonexistent/ca.crt")


@pytest.mark.skipif(os.name == "nt", reason="POSIX shell")
def test_a_killed_node_is_deactivated_and_restarted_at_once(tmp_path, fleet, capsys):
    """A SuperNode that logged its id and was then killed: the supervisor deactivates that id
    with the node's key and restarts it after ``backoff`` (not doubled); with the Fleet API
    unreachable it says so and still restarts (the heartbeat then frees the node); without a key
    (no authentication) it sends nothing."""
    from fedproto.deploy.supervisor import supervise

    key, pub = _node_key(tmp_path)
    fleet.keys[4242], fleet.online = pub, {4242}
    body = (f'n=$(( $(cat {tmp_path}/starts 2>/dev/null || echo 0) + 1 )); echo $n > {tmp_path}/starts; '
            'if [ $n -le 2 ]; then echo "INFO :      SuperNode ID: 4242"; kill -9 $$; fi; exit 0')
    flags = ["--superlink", f"127.0.0.1:{fleet.server_address[1]}", "--insecure", "--auth-supernode-private-key",
             str(key)]
    assert supervise(["sh", "-c", body, "flower-supernode", *flags], backoff=0.1, max_backoff=5) == 0
    err = capsys.readouterr().err
    assert fleet.calls == [("/v1/fleet/deactivate-node", 4242, True)] * 2
    assert f"deactivated node 4242 at 127.0.0.1:{fleet.server_address[1]} (Fleet API DeactivateNode)" in err
    assert "node 4242 is already offline" in err  # the second kill: the stand-in had it offline already
    # a node that keeps crashing still backs off (a reset after every deactivation made a fast crash loop)
    assert "restart 1 in 0.1 s" in err and "restart 2 in 0.2 s" in err

    (tmp_path / "starts").unlink()
    fleet.calls.clear()
    flags[1] = "127.0.0.1:9"  # nothing listens there
    assert supervise(["sh", "-c", body, "flower-supernode", *flags], backoff=0.1, max_backoff=5) == 0
    err = capsys.readouterr().err
    assert "could not deactivate node 4242 at 127.0.0.1:9 (ConnectError" in err and "restart 2 in 0.2 s" in err
    (tmp_path / "starts").unlink()
    assert supervise(["sh", "-c", body, "flower-supernode", "--insecure"], backoff=0.1) == 0
    assert fleet.calls == [] and "deactivat" not in capsys.readouterr().err


@pytest.mark.parametrize("expired", [True, False])
def test_an_executor_child_ends_itself_once_its_message_expired(expired):
    """After the SuperLink died, one of the executor's children hung 12 minutes in Flower's
    retries. A child now ends itself (status 124) once its message expired ``grace`` s ago, or
    ``first_limit`` s after its start when it never saw its message."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    note = "EXPIRY['at'] = time.time() - 1; " if expired else ""
    code = ("import time; from fedproto.deploy.warm_executor import start_watchdog; "
            "from fedproto.flower.client_app import EXPIRY; "
            f"start_watchdog(grace=0.2, first_limit=60 if {expired} else 0.5, tick=0.05); {note}time.sleep(30)")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": src}, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 124, p.stderr[-2000:]
    assert time.monotonic() - t0 < 25  # not the 30 s sleep
    why = "its message expired 1 s ago" if expired else "it got no message within 0.5 s"
    assert f"ends itself: {why} (no reply can be accepted now)" in p.stderr


@pytest.mark.skipif(os.name == "nt", reason="POSIX shell")
def test_the_supervisor_deactivates_before_giving_up_and_survives_a_dead_stdout(tmp_path, fleet):
    """From the breaker: giving up (--max-restarts) skipped the deactivation, so the dead node
    stayed online up to 60 s; a stdout that fails (a full disk, a closed pipe) killed the thread
    that drains the SuperNode's output, and both hung once the pipe was full."""
    import subprocess
    import sys
    from pathlib import Path

    from fedproto.deploy.supervisor import supervise

    key, pub = _node_key(tmp_path)
    fleet.keys[5], fleet.online = pub, {5}
    flags = ["--superlink", f"127.0.0.1:{fleet.server_address[1]}", "--insecure", "--auth-supernode-private-key",
             str(key)]
    assert supervise(["sh", "-c", 'echo "SuperNode ID: 5"; kill -9 $$', "x", *flags], backoff=0.1,
                     max_restarts=0) == 137
    assert fleet.calls == [("/v1/fleet/deactivate-node", 5, True)]

    src = str(Path(__file__).resolve().parents[2] / "src")
    chatty = 'echo "SuperNode ID: 4"; i=0; while [ $i -lt 5000 ]; do echo "a log line $i"; i=$((i+1)); done; exit 0'
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "fedproto.deploy.supervisor", "--", "sh", "-c", chatty],
                           env={**os.environ, "PYTHONPATH": src}, stdout=full, stderr=subprocess.PIPE, text=True,
                           timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "cannot pass the command's output on (OSError" in p.stderr and "not restarting" in p.stderr


def _supervisor(tmp_path, node_cmd: str, flags: list, grace: float = 0.5):
    """``python -m fedproto.deploy.supervisor`` running ``sh -c node_cmd`` as its SuperNode, started once the
    node printed its id (its stdout read up to that line)."""
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    p = subprocess.Popen([sys.executable, "-m", "fedproto.deploy.supervisor", "--backoff", "30", "--stop-grace",
                          str(grace), "--", "sh", "-c", node_cmd, "flower-supernode", *flags],
                         env={**os.environ, "PYTHONPATH": src}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert "SuperNode ID: 6" in p.stdout.readline()
    return p


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGHUP", "SIGKILL-node-then-SIGTERM", "node-ignores-SIGTERM"])
def test_a_supervisor_stopped_by_a_signal_deactivates_its_node_first(tmp_path, fleet, how):
    """The drill: SIGKILL of the SuperNode followed by SIGTERM to its supervisor (what `systemctl stop` does)
    sent no deactivation (the supervisor returned on the signal before its deactivation step) and the round
    waited 52.9 s for the heartbeat. Now every stop signal ends the node's membership at the stand-in Fleet
    API before the supervisor exits (status 0), a node that ignores the signal included (killed after
    --stop-grace)."""
    import signal
    import time

    key, pub = _node_key(tmp_path)
    fleet.keys[6], fleet.online = pub, {6}
    flags = ["--superlink", f"127.0.0.1:{fleet.server_address[1]}", "--insecure", "--auth-supernode-private-key",
             str(key)]
    node = 'echo $$ > node.pid; echo "SuperNode ID: 6"; exec sleep 60'  # the pid file first: read on the id line
    if how == "node-ignores-SIGTERM":
        node = 'trap "" TERM INT HUP; echo $$ > node.pid; echo "SuperNode ID: 6"; while :; do sleep 0.1; done'
    p = _supervisor(tmp_path, node, flags)
    try:
        if how == "SIGKILL-node-then-SIGTERM":
            os.kill(int((tmp_path / "node.pid").read_text()), signal.SIGKILL)
            p.send_signal(signal.SIGTERM)
        else:
            p.send_signal(getattr(signal, how.split("-")[-1]))
        t0 = time.monotonic()
        assert p.wait(timeout=30) == 0
        took = time.monotonic() - t0
        err = p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
    assert fleet.calls == [("/v1/fleet/deactivate-node", 6, True)], err
    assert fleet.online == set()
    assert f"deactivated node 6 at 127.0.0.1:{fleet.server_address[1]}" in err
    assert took < 10, err
    if how == "node-ignores-SIGTERM":
        assert "still running 0.5 s after SIGTERM: killing it" in err
        pid = int((tmp_path / "node.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
def test_a_stopping_supervisor_waits_for_the_deactivation_a_bounded_time(tmp_path):
    """A Fleet API that accepts the connection and never answers: the supervisor still exits, within
    DEACTIVATE_LIMIT (5 s) and a margin, saying the node stays online until its heartbeat expires."""
    import signal
    import socket
    import time

    from fedproto.deploy.supervisor import DEACTIVATE_LIMIT

    key, _ = _node_key(tmp_path)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        flags = ["--superlink", f"127.0.0.1:{silent.getsockname()[1]}", "--insecure",
                 "--auth-supernode-private-key", str(key)]
        p = _supervisor(tmp_path, 'echo "SuperNode ID: 6"; exec sleep 60', flags)
        p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert p.wait(timeout=30) == 0
        took = time.monotonic() - t0
        err = p.stderr.read()
    finally:
        silent.close()
    assert DEACTIVATE_LIMIT - 0.5 < took < DEACTIVATE_LIMIT + 4, err
    assert "could not deactivate node 6" in err and "no answer within 5 s" in err


def test_a_supervisor_stopped_while_waiting_to_restart_says_so(tmp_path):
    """The drill: "restart 1 in 5 s", then a quick SIGTERM, and the supervisor exited without a word. Now it says
    it was stopped, by which signal, and that it does not restart; it exits at once (not after the 5 s)."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    sup = subprocess.Popen([sys.executable, "-m", "fedproto.deploy.supervisor", "--backoff", "5", "--",
                            sys.executable, "-c", "import sys; sys.exit(3)"],
                           env={**os.environ, "PYTHONPATH": src}, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    t0 = time.monotonic()
    while not any("restart 1 in 5 s" in x for x in lines):
        assert time.monotonic() - t0 < 60, lines
        lines.append(sup.stderr.readline())
    t1 = time.monotonic()
    sup.send_signal(signal.SIGTERM)
    rest = sup.communicate(timeout=30)[1]
    took = time.monotonic() - t1
    assert sup.returncode == 0 and took < 3, (took, rest)
    assert ("fedproto.deploy.supervisor: stopped by SIGTERM while waiting to restart "
            f"{sys.executable} (restart 1): not restarted; exiting") in rest, rest


def test_a_supervisor_imports_what_the_deactivation_needs_when_it_starts(tmp_path):
    """The drill at load 15: a stopped site's deactivation gave up after its 5 s (importing Flower's Fleet client
    alone took that long), and the round waited 48.9 s for the node's heartbeat. The supervisor of an authenticated
    SuperNode now imports it when it starts, so a stop costs one HTTP call; without authentication nothing is loaded."""
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    probe = ("import sys; from fedproto.deploy.supervisor import preload_deactivation as p; "
             "assert p(['flower-supernode', '--auth-supernode-private-key', 'node0']); "
             "print(sorted(m for m in ('flwr.supernode.fleet_http_client', "
             "'flwr.supernode.node_auth_http_interceptor', 'flwr.proto.fleet_pb2') if m in sys.modules)); "
             "print(p(['flower-supernode', '--insecure']))")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": src}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["['flwr.proto.fleet_pb2', 'flwr.supernode.fleet_http_client', "
                                       "'flwr.supernode.node_auth_http_interceptor']", "False"], out.stdout
