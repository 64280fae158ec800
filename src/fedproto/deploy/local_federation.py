"""A Flower federation on this machine: a SuperLink and SuperNodes on 127.0.0.1 as child processes.

For tests, the example script (``examples/flower/run_local.py``) and trying a deployment before
spreading it over machines. It drives Flower's own commands (``flower-superlink``,
``flower-supernode``, ``flwr run``, ``flwr supernode register``); the traffic is Flower's.

    with LocalFederation(workdir, tls=True, auth=True) as fed:
        fed.start_superlink()
        fed.start_supernode({"client-id": 0, "data": "/data/site0", "model": "cnn"})
        result = fed.flwr_run("examples/flower/own_data", {"rounds": 3})

TLS and authentication (:func:`make_credentials`, with the ``cryptography`` package Flower
itself depends on): a CA, a SuperLink certificate for ``127.0.0.1``/``localhost`` signed by it,
and one EC (P-384) key pair per SuperNode in OpenSSH format, as Flower's SuperNode
authentication expects. With ``auth`` the SuperLink runs with ``--enable-supernode-auth`` and
only SuperNodes whose public key was registered (``flwr supernode register``) may connect.

Every process is started in its own process group and stopped when the context exits.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedproto.deploy.credentials import Credentials, make_credentials
from fedproto.errors import ConfigError

CONNECTION = "fedproto-local"
"""Name of the SuperLink connection written to ``FLWR_HOME/config.toml``."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    """True when something accepts TCP connections on 127.0.0.1:``port``."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def toml_value(v: Any) -> str:
    """A value in the TOML form Flower's ``--node-config`` / ``--run-config`` parse."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))


def config_arg(values: Mapping[str, Any]) -> str:
    """``key=value`` pairs separated by spaces (strings quoted)."""
    return " ".join(f"{k}={toml_value(v)}" for k, v in values.items())


FLOWER_COMMANDS = ("flower-superlink", "flower-supernode", "flwr")
"""Flower's commands this module runs."""


def flower_command(name: str) -> str | None:
    """The path of Flower's command ``name`` (``flwr``, ``flower-superlink``...): the one installed
    beside the running Python (its environment's ``bin``/``Scripts`` folder, found even when that
    environment is not activated), else the one on PATH; None when neither has it."""

    here = Path(sys.executable).parent
    beside = shutil.which(name, path=str(here))
    return beside or shutil.which(name)


class LocalFederation:
    """A SuperLink and SuperNodes on 127.0.0.1 (see the module docstring).

    Args:
        workdir: folder for logs, the SuperLink database, ``FLWR_HOME`` and credentials.
        tls: TLS between SuperNodes, ``flwr`` and the SuperLink (certificates made here).
        auth: SuperNode authentication (needs ``tls``): only registered node keys connect.
        simulation: start the SuperLink for Flower's simulation runtime (no SuperNodes; ``flwr
            run`` gets ``num-supernodes``).
        env: extra environment for every process (e.g. ``PYTHONPATH``).
    Raises:
        ConfigError: ``auth`` without ``tls``; Flower's commands neither beside the running Python
            nor on PATH (:func:`flower_command`).
    """

    def __init__(self, workdir: str | Path, tls: bool = False, auth: bool = False, simulation: bool = False,
                 env: Mapping[str, str] | None = None):
        if auth and not tls:
            raise ConfigError("SuperNode authentication needs TLS: pass tls=True with auth=True")

        self.commands = {cmd: flower_command(cmd) for cmd in FLOWER_COMMANDS}
        for cmd, path in self.commands.items():
            if path is None:
                raise ConfigError(f"Flower's command {cmd} is neither beside this Python "
                                  f"({Path(sys.executable).parent}) nor on PATH; install Flower into this environment: "
                                  f"{sys.executable} -m pip install \"fedproto[flower]\"")
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.tls, self.auth, self.simulation = tls, auth, simulation
        self.port = free_port()
        self.home = self.workdir / "flwr-home"
        self.home.mkdir(exist_ok=True)
        self.env = {**os.environ, **(env or {}), "FLWR_HOME": str(self.home), "PYTHONUNBUFFERED": "1"}
        # the SuperLink and SuperNodes start Flower's own programs (flwr-serverapp, flwr-clientapp) by name: find them
        # where flower-superlink was found, activated environment or not
        bin_dir = str(Path(self.commands["flower-superlink"]).parent)
        self.env["PATH"] = os.pathsep.join([bin_dir, *filter(None, [self.env.get("PATH")])])
        self.creds: Credentials | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self._keys_made = 0
        if tls:
            self.creds = make_credentials(self.workdir / "credentials", 0)
        conn = f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "127.0.0.1:{self.port}"\n'
        conn += f'root-certificates = "{self.creds.ca_cert}"\n' if tls else "insecure = true\n"
        (self.home / "config.toml").write_text(conn)

    # -- processes ------------------------------------------------------------------------------
    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "w")
        p = subprocess.Popen(args, env=self.env, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        log.close()
        self.procs[name] = p
        return p

    def log(self, name: str) -> str:
        """The output of process ``name`` so far (``superlink``, ``node0``...)."""
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start_superlink(self, timeout: float = 60.0, name: str = "superlink") -> None:
        """Start the SuperLink and wait until it listens; again after it stopped (a restart): the same
        port and database file (``superlink.db`` in ``workdir``), its log under another ``name``
        (process ``name``, log ``<name>.log``). Raises ConfigError if it exits or does not listen in time."""
        args = [self.commands["flower-superlink"], "--port", str(self.port), "--database",
                str(self.workdir / "superlink.db"), "--disable-runtime-dependency-installation"]
        if self.tls:
            c = self.creds
            args += ["--ssl-ca-certfile", str(c.ca_cert), "--ssl-certfile", str(c.server_cert),
                     "--ssl-keyfile", str(c.server_key)]
        else:
            args.append("--insecure")
        if self.auth:
            args.append("--enable-supernode-auth")
        if self.simulation:
            args.append("--simulation")
        p = self._start(name, args)
        deadline = time.monotonic() + timeout
        while not listening(self.port):
            if p.poll() is not None or time.monotonic() > deadline:
                raise ConfigError("the SuperLink did not start:\n" + self.log(name)[-3000:])
            time.sleep(0.3)

    def node_key(self, register: bool = True) -> tuple[Path, Path]:
        """A new SuperNode key pair (private, public), registered with the SuperLink unless
        ``register`` is False (``flwr supernode register``). Needs ``auth``."""
        if not self.auth:
            raise ConfigError("node keys are for SuperNode authentication: LocalFederation(..., tls=True, auth=True)")
        i = self._keys_made
        self._keys_made += 1
        folder = self.workdir / "credentials" / f"key{i}"
        priv, pub = make_credentials(folder, 1).node_keys[0]
        if register:
            res = subprocess.run([self.commands["flwr"], "supernode", "register", str(pub), CONNECTION], env=self.env,
                                 cwd=self.workdir, capture_output=True, text=True, timeout=120)
            if res.returncode != 0:
                raise ConfigError(f"flwr supernode register failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
        return priv, pub

    def start_supernode(self, node_config: Mapping[str, Any], name: str | None = None,
                        key: Path | None = None, max_wait: float | None = None,
                        restart: tuple[float, float] | None = None,
                        executor: str | None = None) -> subprocess.Popen:
        """Start a SuperNode with ``node_config`` (its ``--node-config``); with ``auth``, ``key`` is
        its private key (default: a new registered one). ``max_wait``: seconds it keeps trying to
        connect (default: forever). ``restart``: (backoff, max backoff) in seconds: run it under
        :mod:`fedproto.deploy.supervisor`, which starts it again when it fails (the returned process
        is the supervisor's; the SuperNode's pid is in its log: ``started flower-supernode (pid N)``).
        ``executor``: None (default: the SuperNode starts a ``flwr-clientapp`` process per
        message), ``"fedproto"`` (``--isolation process`` and ``python -m fedproto.deploy.warm_executor``
        as process ``<name>-executor``: one warm process that forks per message) or ``"flower"``
        (``--isolation process`` and Flower's ``flower-superexec``). Raises ConfigError for another
        ``executor``."""
        if executor not in (None, "fedproto", "flower"):
            raise ConfigError(f"executor={executor!r}: choose None (Flower's default), 'fedproto' or 'flower'")
        name = name or f"node{sum(n.startswith('node') and not n.endswith('-executor') for n in self.procs)}"
        runtime_port = free_port()
        args = [self.commands["flower-supernode"], "--superlink", f"127.0.0.1:{self.port}", "--port", str(runtime_port),
                "--node-config", config_arg(node_config)]
        if executor:
            args += ["--isolation", "process"]
            runtime = f"127.0.0.1:{runtime_port}"
            if executor == "fedproto":
                cmd = [sys.executable, "-m", "fedproto.deploy.warm_executor", "--supernode", runtime, "--insecure",
                       "--node-config", config_arg(node_config)]
            else:
                superexec = flower_command("flower-superexec")
                if superexec is None:
                    raise ConfigError("Flower's command flower-superexec is neither beside this Python nor on PATH")
                cmd = [superexec, "--runtime-api-address", runtime, "--insecure"]
            self._start(f"{name}-executor", cmd)
        args += ["--root-certificates", str(self.creds.ca_cert)] if self.tls else ["--insecure"]
        if self.auth:
            args += ["--auth-supernode-private-key", str(key or self.node_key()[0])]
        if max_wait is not None:
            args += ["--max-wait-time", str(max_wait)]
        if restart is not None:
            args = [sys.executable, "-m", "fedproto.deploy.supervisor", "--backoff", str(restart[0]),
                    "--max-backoff", str(restart[1]), "--", *args]
        return self._start(name, args)

    def supernode_pids(self, name: str) -> list[int]:
        """The pids of the SuperNodes a supervisor (``start_supernode(..., restart=...)``) started
        for ``name``, oldest first (from its log)."""
        import re

        return [int(m) for m in re.findall(r"started \S*flower-supernode \(pid (\d+)\)", self.log(name))]

    def kill(self, name: str) -> None:
        """Kill process ``name`` and its children at once (SIGKILL: a node that drops off); a
        SuperNode's executor (``<name>-executor``) with it."""
        for p in (self.procs[name], self.procs.get(f"{name}-executor")):
            if p is not None and p.poll() is None:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
                p.wait(10)

    def flwr_run(self, app: str | Path, run_config: Mapping[str, Any] | None = None, timeout: float = 600.0,
                 num_supernodes: int | None = None,
                 federation_config: Mapping[str, Any] | None = None) -> subprocess.CompletedProcess:
        """``flwr run <app> --stream`` against this SuperLink with ``run_config`` overrides (keys
        must be listed in the app's ``[tool.flwr.app.config]``); ``num_supernodes`` for the
        simulation runtime, and ``federation_config`` for its other keys (``--federation-config``:
        ``client-resources-num-cpus``, ``init-args-num-cpus``...: as many actors run as
        ``init-args-num-cpus // client-resources-num-cpus``). Returns the finished process (stdout and
        stderr as text)."""
        args = [self.commands["flwr"], "run", str(app), CONNECTION, "--stream"]
        if run_config:
            args += ["--run-config", config_arg(run_config)]
        fed = {**({"num-supernodes": int(num_supernodes)} if num_supernodes is not None else {}),
               **(federation_config or {})}
        if fed:
            args += ["--federation-config", config_arg(fed)]
        return subprocess.run(args, env=self.env, cwd=self.workdir, capture_output=True, text=True, timeout=timeout)

    def run_printed(self, command: str, timeout: float = 600.0) -> subprocess.CompletedProcess:
        """Run a ``flwr ...`` command as fedproto printed it (``failure.json``'s ``resume``), with
        this federation's ``FLWR_HOME`` (its default connection is this SuperLink) and Flower's
        ``flwr`` beside this Python. Returns the finished process (stdout and stderr as text).

        Raises:
            ValueError: ``command`` does not start with ``flwr``.
        """
        import shlex

        args = shlex.split(command)
        if args[:1] != ["flwr"]:
            raise ValueError(f"not a flwr command: {command!r}")
        return subprocess.run([self.commands["flwr"], *args[1:]], env=self.env, cwd=self.workdir,
                              capture_output=True, text=True, timeout=timeout)

    def stop(self) -> None:
        """Stop every process started here (SIGTERM, then SIGKILL after 10 s); never raises."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, 15)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass

    def __enter__(self) -> LocalFederation:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["Credentials", "LocalFederation", "config_arg", "free_port", "listening", "make_credentials"]
