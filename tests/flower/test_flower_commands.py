"""Flower's commands are found beside the running Python (a virtual environment that is not
activated), else on PATH; without them the error names where it looked and how to install. No
Flower needed: the commands here are stand-ins."""

import os
import sys
from pathlib import Path

import pytest

from fedproto.deploy.local_federation import FLOWER_COMMANDS, LocalFederation, flower_command
from fedproto.errors import ConfigError


def _stand_ins(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name in FLOWER_COMMANDS:
        exe = folder / name
        exe.write_text("#!/bin/sh\nexit 0\n")
        exe.chmod(0o755)
    return folder


@pytest.mark.skipif(os.name == "nt", reason="POSIX executables")
def test_flower_commands_beside_the_interpreter_then_on_path(tmp_path, monkeypatch):
    venv, other = _stand_ins(tmp_path / "venv" / "bin"), _stand_ins(tmp_path / "elsewhere")
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    monkeypatch.setenv("PATH", str(other))
    assert flower_command("flwr") == str(venv / "flwr")  # the venv's own, though PATH has another
    fed = LocalFederation(tmp_path / "fed")
    assert fed.commands == {n: str(venv / n) for n in FLOWER_COMMANDS}
    assert fed.env["PATH"].split(os.pathsep)[0] == str(venv)  # flwr-serverapp/-clientapp found there too
    (venv / "flwr").unlink()
    assert flower_command("flwr") == str(other / "flwr")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert flower_command("flwr") is None
    with pytest.raises(ConfigError, match=r"flwr is neither beside this Python \(.*venv/bin\) nor on PATH; install "
                       r"Flower into this environment: .*venv/bin/python -m pip install \"fedproto\[flower\]\""):
        LocalFederation(tmp_path / "fed2")


def _script(tmp_path, body: str) -> list[str]:
    """A shell command that counts its starts in ``starts`` (``$n``: this start's number) then runs ``body``."""
    return ["sh", "-c", f'n=$(( $(cat {tmp_path}/starts 2>/dev/null || echo 0) + 1 )); echo $n > {tmp_path}/starts; '
            + body]


@pytest.mark.skipif(os.name == "nt", reason="POSIX shell")
def test_supervise_restarts_a_failed_node_with_backoff_and_stops_when_told(tmp_path, capsys):
    """flower-supernode logs "Exit Code: 305" and exits with status 1 when the SuperLink
    still holds it online; the supervisor starts it again every backoff seconds (that refusal ends
    when the old heartbeat expires: a doubled wait would only delay the node); another failure waits
    backoff, 2 x backoff, ... (capped). It does not restart a clean exit (status 0: Flower's
    graceful stop too) or a configuration error (Flower codes 302-304), and gives up after max_restarts."""
    from fedproto.deploy.supervisor import NO_RESTART, RETRY_STEADY, supervise

    assert supervise(_script(tmp_path, 'if [ $n -le 3 ]; then echo "Exit Code: 305"; exit 1; fi; exit 0'), backoff=0.1,
                     max_backoff=0.4) == 0
    assert (tmp_path / "starts").read_text().strip() == "4" and RETRY_STEADY == (305,)
    out, err = capsys.readouterr()
    assert out.count("Exit Code: 305") == 3  # its output is passed on
    assert "sh exited with status 1 (Flower exit code 305: The SuperNode could not establish a connection to the " \
           "SuperLink.); restart 1 in 0.1 s" in err or "sh exited with status 1 (Flower exit code 305); restart 1 " \
           "in 0.1 s" in err  # Flower's words when it is installed
    assert "restart 2 in 0.1 s" in err and "restart 3 in 0.1 s" in err and "restart 4" not in err
    assert err.count("started sh (pid ") == 4
    (tmp_path / "starts").unlink()
    assert supervise(_script(tmp_path, 'if [ $n -le 3 ]; then exit 1; fi; exit 0'), backoff=0.1, max_backoff=0.3) == 0
    err = capsys.readouterr().err  # a crash: the wait doubles, capped
    assert "restart 1 in 0.1 s" in err and "restart 2 in 0.2 s" in err and "restart 3 in 0.3 s" in err

    (tmp_path / "starts").unlink()
    assert supervise(_script(tmp_path, "kill -9 $$"), backoff=0.05, max_restarts=2) == 128 + 9
    assert (tmp_path / "starts").read_text().strip() == "3"  # killed by a signal: restarted, then given up
    assert "exited with status -9 (killed by SIGKILL); giving up after 2 restart(s)" in capsys.readouterr().err
    for body, status in (('echo "Exit Code: 302"; exit 1', 1), ("exit 0", 0)):
        (tmp_path / "starts").unlink()
        assert supervise(_script(tmp_path, body), backoff=0.05) == status
        assert (tmp_path / "starts").read_text().strip() == "1"  # not restarted
    assert 302 in NO_RESTART and "(Flower exit code 302" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"backoff=0 must be > 0"):
        supervise(["true"], backoff=0)


def _supervised(args: list[str], started: Path):
    """``python -m fedproto.deploy.supervisor ARGS`` (this checkout's fedproto), once the file
    ``started`` (written by the supervised command) exists; stderr piped."""
    import subprocess
    import time

    src = str(Path(__file__).resolve().parents[2] / "src")
    p = subprocess.Popen([sys.executable, "-m", "fedproto.deploy.supervisor", *args],
                         env={**os.environ, "PYTHONPATH": src}, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    return p


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
def test_supervise_passes_sigterm_on_and_does_not_restart(tmp_path):
    import signal

    p = _supervised(["--backoff", "0.05", "--",
                     *_script(tmp_path, "trap 'kill $!; exit 0' TERM; sleep 30 >/dev/null 2>&1 & wait")],
                    tmp_path / "starts")
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 0
    assert (tmp_path / "starts").read_text().strip() == "1"
    assert "restart" not in p.stderr.read()


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
def test_the_supervisor_passes_sighup_on_and_refuses_what_it_cannot_run(tmp_path):
    import signal
    import subprocess
    import time

    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    p = _supervised(["--", "sh", "-c", f"echo $$ > {tmp_path}/pid; exec sleep 60"], tmp_path / "pid")
    p.send_signal(signal.SIGHUP)
    assert p.wait(20) == 0
    child = int((tmp_path / "pid").read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text().lower()
    assert "stopped by SIGHUP" in p.stderr.read()
    for cmd, why in ((["/"], "Permission denied"), (["--backoff", "inf", "--", "true"], "both finite"),
                     (["--stable", "-1", "--", "true"], "stable=-1.0 must be >= 0")):
        r = subprocess.run([sys.executable, "-m", "fedproto.deploy.supervisor", *cmd], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
