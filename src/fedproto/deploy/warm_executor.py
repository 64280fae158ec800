"""A warm executor for a SuperNode started with ``--isolation process``: rounds in seconds.

By default a SuperNode starts a fresh ``flwr-clientapp`` process for every message; that process
imports torch, flwr and fedproto, reads and decodes the node's data and pays torch's first-step
warm-up before it trains for a fraction of a second. With ``flower-supernode --isolation
process`` the SuperNode starts no process itself: it serves its Runtime API (``--port``) and an
executor asks it for tasks. Flower's own executor (``flower-superexec``) starts ``flwr-clientapp``
per task, which costs the same. This one, one per node::

    flower-supernode --isolation process --port 9100 --superlink 10.0.0.1:9092 ... \\
        --node-config 'client-id=0 data="/data/site0" model="cnn"'
    python -m fedproto.deploy.warm_executor --supernode 127.0.0.1:9100 --insecure \\
        --node-config 'client-id=0 data="/data/site0" model="cnn"'

imports torch, flwr and fedproto's ClientApp once, decodes the node's data once (its node
config's ``data``, kept by :func:`fedproto.data.folder.keep_decoded`), runs one training step of
the node's model spec on a few samples (torch's warm-up, random state restored), and then for
each task the SuperNode hands out forks (``os.fork``) and runs Flower's own ClientApp entry
(``flwr.supernode.runtime.run_clientapp``, what ``flwr-clientapp`` runs) for that task's token in
the child. Flower does all of the protocol in the child (pulling the message, context and app,
pushing the reply and the node's state); the child only inherits the imports, the decoded data
and the warm-up. The client's model still lives in the node's Flower context between messages,
so the numbers are those of the default path.

It polls the Runtime API with Flower's ``AcquireTask`` call (the one ``flower-superexec`` makes),
every ``--poll-interval`` seconds (0.1 by default; a local HTTP call). It needs ``os.fork``
(Linux, macOS). **No child outlives its run or its executor**: each child dies with the executor
(Linux's parent-death signal, ``PR_SET_PDEATHSIG`` by ``prctl``, set right after the fork; elsewhere
its watchdog sees the executor gone within a second); it ends itself once its message has expired by
:data:`CHILD_GRACE` seconds (or after :data:`CHILD_FIRST_LIMIT` seconds without having got its message:
its reply can no longer be accepted, and a SuperLink that died would otherwise hold it in Flower's
retries for as long as the SuperNode waits); and a stop signal (SIGTERM, SIGINT, SIGHUP, or the
SIGINT Flower raises in it when the SuperNode says its run is no longer running) ends it within
:data:`CHILD_STOP_GRACE` seconds even when Flower's own graceful exit hangs. The executor, stopped by
SIGTERM, SIGINT or SIGHUP, passes SIGTERM on to its children and kills those still running
:data:`CHILD_STOP_GRACE` seconds later before it exits. **No reply goes to a message the SuperNode no
longer waits for** (:mod:`fedproto.deploy.warm_tasks`): a task created after another shows that the SuperNode
stopped waiting for the other's message, so a child that has not got it is ended and its task finished with
no reply, and the task of a child that ended without getting the message it pulled is kept alive meanwhile;
else Flower makes up an error reply for it that the SuperNode pushes in place of the next real one, and the
node stays one reply behind (the drill's node after a SuperLink restart).
Changing a node's data files while it runs is noticed (the kept arrays are keyed by each file's
size and modification time); its ``--node-config`` should match the SuperNode's, but a mismatch
only costs speed (the ClientApp reads what the SuperNode's node config names).

Written against Flower 1.42's Runtime API (``flwr.supercore``); another Flower version is
refused at start with the fix.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from fedproto.deploy.warm_children import (
    CHILD_FIRST_LIMIT,
    CHILD_GRACE,
    CHILD_STOP_GRACE,
    STOP_SIGNALS,
    bind_to_parent,
    end_children,
    start_watchdog,
)
from fedproto.deploy.warm_tasks import TaskLedger, child_reporter
from fedproto.errors import ConfigError

FLOWER_VERSIONS = ("1.42.",)
"""Flower versions whose Runtime API this executor was written against."""
CLIENTAPP = "flwr-clientapp"
"""Flower's task type of a ClientApp run (``flwr.supercore.constant.TaskType.CLIENT_APP``)."""

log = logging.getLogger("fedproto.deploy.warm_executor")


def parse_node_config(text: str | None) -> dict[str, Any]:
    """A node config string (``'client-id=0 data="/x" model="cnn"'``) as the SuperNode reads it
    (:func:`flwr.common.config.parse_config_args`); ``{}`` for None or an empty string.

    Raises:
        ConfigError: text Flower cannot parse (the message quotes it).
    """
    if not text or not text.strip():
        return {}
    from flwr.common.config import parse_config_args

    try:
        return dict(parse_config_args([text]))
    except Exception as e:  # noqa: BLE001 - Flower's TOML parser raises several kinds
        raise ConfigError(f"--node-config {text!r} cannot be parsed ({type(e).__name__}: {e}); give it as to "
                          "flower-supernode, e.g. 'client-id=0 data=\"/data/site0\" model=\"cnn\"'") from None


def preload(node_config: Mapping[str, Any], threads: int = 1) -> dict[str, Any]:
    """Before the first fork: import fedproto's ClientApp, decode the node's data folder (its
    ``data`` key) into the kept store (:func:`fedproto.data.folder.preload_client_folder`) and run
    one training and one evaluation step of its ``model`` spec on 8 training samples (torch's
    first-use warm-up; torch's random state is restored after). Each part that cannot be done
    (no ``data`` key, a folder named by class names, a model factory) is skipped and said in the
    returned dict; the ClientApp then does it per message, as it would without this executor.

    Returns:
        ``{"samples": n or None, "warm": True/False, "skipped": [reasons], "seconds": s}``.
    """
    t0 = time.perf_counter()
    import torch

    import fedproto.flower.client_app  # noqa: F401 - the import the children inherit
    from fedproto.data.folder import keep_decoded, load_client_folder, preload_client_folder

    torch.set_num_threads(max(1, int(threads)))
    keep_decoded()
    out: dict[str, Any] = {"samples": None, "warm": False, "skipped": []}
    data, spec = node_config.get("data"), node_config.get("model")
    x = None
    if isinstance(data, str) and data.strip():
        try:
            out["samples"] = preload_client_folder(data)
        except Exception as e:  # noqa: BLE001 - the ClientApp reports data errors to the server
            out["skipped"].append(f"data {data!r} not preloaded ({str(e)[:200]}); each message decodes it")
    else:
        out["skipped"].append("no data in --node-config: each message reads the node's data")
    if out["samples"] is not None:
        try:
            (x, y), _ = load_client_folder(data, 2 ** 31 - 1)
        except Exception as e:  # noqa: BLE001
            out["skipped"].append(f"warm-up skipped ({str(e)[:200]})")
    if getattr(x, "ndim", None) == 4 and isinstance(spec, str) and spec.strip():  # images (not named arrays)
        try:
            _warm_up(spec.strip(), x[:8], y[:8])
            out["warm"] = True
        except Exception as e:  # noqa: BLE001 - e.g. a factory path (package.module:factory): no warm-up
            out["skipped"].append(f"model {spec!r} not warmed up ({type(e).__name__}: {str(e)[:200]})")
    out["seconds"] = time.perf_counter() - t0
    return out


def _warm_up(spec: str, x, y) -> None:
    """One SGD step and one no-grad forward of zoo model ``spec`` on ``x`` (torch's first-use costs)."""
    import torch
    import torch.nn.functional as F

    from fedproto.models.zoo import build_model

    with torch.random.fork_rng(devices=[]):
        classes = int(y.max()) + 1
        model = build_model(spec, 0, int(x.shape[1]), max(classes, 2), int(x.shape[-1]), 50, 0.5, 0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
        model.train()
        logits, emb = model(x)
        loss = F.cross_entropy(logits, y) + F.mse_loss(emb, emb.detach() * 0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            model(x)


def _check_flower() -> None:
    """Refuse a Flower whose Runtime API this module was not written against."""
    try:
        from flwr import __version__ as version
    except ImportError:
        raise ConfigError("the executor needs Flower: pip install \"fedproto[flower]\"") from None
    if not version.startswith(FLOWER_VERSIONS):
        raise ConfigError(f"Flower {version} is installed but this executor is written against Flower "
                          f"{', '.join(v + 'x' for v in FLOWER_VERSIONS)}'s Runtime API; install flwr==1.42.* or "
                          "run the SuperNode without --isolation process (Flower then starts flwr-clientapp itself)")


def _runtime_client(address: str, insecure: bool, root_certificates: str | None, secret: bytes | None,
                    token: str | None = None):
    """A client of the SuperNode's Runtime API: the executor's own (``AcquireTask``), or, with ``token``, one
    acting for that task (its heartbeat, its end; one try per call, so a SuperNode gone does not hold the loop)."""
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
        SuperExecAuthHttpInterceptor,
    )
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.tls import validate_and_resolve_root_certificates

    interceptors: list = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
    if token:
        interceptors.append(RuntimeTokenHttpInterceptor(token))
    elif secret:
        interceptors.append(SuperExecAuthHttpInterceptor(master_secret=secret,
                                                         protected_methods=frozenset({"/flwr.proto.Runtime/AcquireTask"})))
    invoker = make_simple_http_retry_invoker()
    if token:
        invoker.max_tries = 1
    return RuntimeHttpClient.from_server_address(
        server_address=address, insecure=insecure,
        root_certificates=validate_and_resolve_root_certificates(root_certificates, insecure),
        interceptors=interceptors, retry_invoker=invoker)


def _run_child(address: str, token: str, insecure: bool, root_certificates: str | None, parent: int,
               report: int | None = None) -> None:
    """In the forked child: Flower's ClientApp entry for ``token``, telling the executor's ledger what it does
    through pipe ``report`` (:func:`fedproto.deploy.warm_tasks.child_reporter`); never returns."""
    code = 1
    bind_to_parent(parent)
    start_watchdog(parent=parent)
    try:
        if report is not None:
            child_reporter(report)
        from flwr.supercore.tls import validate_and_resolve_root_certificates
        from flwr.supernode.runtime.run_clientapp import run_clientapp

        run_clientapp(runtime_api_address=address, token=token, insecure=insecure,
                      certificates=validate_and_resolve_root_certificates(root_certificates, insecure),
                      parent_pid=parent, runtime_dependency_install=False)
        code = 0
    except SystemExit as e:  # flwr_exit ends the task with sys.exit
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - log it and leave the child, never return into the parent's loop
        log.exception("the ClientApp task failed")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(address: str, insecure: bool = False, root_certificates: str | None = None,
          poll_interval: float = 0.1, secret: bytes | None = None, max_tasks: int | None = None) -> int:
    """Ask the SuperNode's Runtime API at ``address`` for ClientApp tasks and run each in a forked
    child (Flower's ``run_clientapp`` with the task's token), until ``max_tasks`` tasks have ended
    (then returns how many were started) or SIGTERM/SIGINT (exits at once; a task under way is
    ended by Flower's watch of this process in the child). While the SuperNode is unreachable it
    keeps asking (Flower's HTTP retries, with backoff).

    Raises:
        ConfigError: no ``os.fork`` (Windows), ``poll_interval`` outside 0.01..60 s, neither
            ``insecure`` nor ``root_certificates``, or a Flower other than 1.42.
    """
    if not hasattr(os, "fork"):
        raise ConfigError("the executor forks a child per task and needs os.fork (Linux, macOS); on this system run "
                          "the SuperNode without --isolation process")
    if not 0.01 <= poll_interval <= 60:
        raise ConfigError(f"poll_interval={poll_interval}: give seconds between 0.01 and 60 (e.g. 0.1)")
    if not insecure and root_certificates is None:
        raise ConfigError("give --insecure (the SuperNode's Runtime API without TLS, its default) or "
                          "--root-certificates CA.pem (when the SuperNode serves it with --ssl-certfile)")
    _check_flower()
    from flwr.proto.runtime_pb2 import AcquireTaskRequest

    client = _runtime_client(address, insecure, root_certificates, secret)

    def _stop(signum, frame) -> None:  # noqa: ARG001
        # at once, also from inside Flower's retries while the SuperNode is unreachable; a task under
        # way ends too: Flower's run_clientapp in the child watches this process (parent_pid)
        raise SystemExit(0)

    old = {s: signal.signal(s, _stop) for s in STOP_SIGNALS}
    ledger = TaskLedger(lambda token: _runtime_client(address, insecure, root_certificates, secret, token))
    started, me = 0, os.getpid()
    try:
        while max_tasks is None or started < max_tasks:
            try:
                res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[CLIENTAPP]))
            except Exception as e:  # noqa: BLE001 - e.g. the SuperNode restarting: say so and ask again
                log.warning("asking the SuperNode at %s for a task failed (%s: %s); trying again in 1 s", address,
                            type(e).__name__, str(e)[:200])
                time.sleep(1.0)
                continue
            if res.HasField("task") and res.token:
                task = res.task
                # a newer task: the SuperNode no longer waits for the messages of older tasks not yet answered
                ledger.newer_task(task.task_id, task.run_id, task.pending_at)
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:  # the child
                    os.close(r)
                    _run_child(address, res.token, insecure, root_certificates, me, w)
                os.close(w)
                ledger.add(task.task_id, task.run_id, task.pending_at, res.token, pid, r)
                started += 1
                log.info("task %d (run %d): ClientApp in process %d", task.task_id, task.run_id, pid)
            ledger.reap()
            ledger.tend()
            time.sleep(poll_interval)
        for pid in ledger.children():  # max_tasks reached: let the running tasks finish
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    finally:
        for s in STOP_SIGNALS:  # a second signal does not cut the children's end short
            signal.signal(s, signal.SIG_IGN)
        client.close()
        end_children(ledger.children())
        for s, h in old.items():
            signal.signal(s, h)
    return started


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m fedproto.deploy.warm_executor --supernode HOST:PORT --insecure [--node-config ...]``."""
    ap = argparse.ArgumentParser(prog="python -m fedproto.deploy.warm_executor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--supernode", required=True, metavar="HOST:PORT",
                    help="the SuperNode's Runtime API: 127.0.0.1 and its --port (the SuperNode started with "
                         "--isolation process)")
    ap.add_argument("--insecure", action="store_true", help="the Runtime API without TLS (the SuperNode's default)")
    ap.add_argument("--root-certificates", default=None, metavar="CA.pem",
                    help="CA of the Runtime API's certificate (a SuperNode started with --ssl-certfile)")
    ap.add_argument("--superexec-auth-secret-file", default=None,
                    help="the shared secret file, when the SuperNode was given one")
    ap.add_argument("--node-config", default=None,
                    help="the SuperNode's --node-config, to decode its data and warm up its model once")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the warm-up (the run config's "
                                                            "threads apply to the tasks); default 1")
    ap.add_argument("--poll-interval", type=float, default=0.1, help="seconds between task polls (0.01..60)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per poll
    try:
        secret = None
        if args.superexec_auth_secret_file:
            from flwr.supercore.auth.superexec_secret import load_superexec_auth_secret

            try:
                secret = load_superexec_auth_secret(args.superexec_auth_secret_file)
            except ValueError as e:
                raise ConfigError(f"--superexec-auth-secret-file: {e}") from None
        if args.threads < 1:
            raise ConfigError(f"--threads {args.threads}: give 1 or more")
        if not args.insecure and args.root_certificates is None:
            raise ConfigError("give --insecure (the SuperNode's Runtime API without TLS, its default) or "
                              "--root-certificates CA.pem (when the SuperNode serves it with --ssl-certfile)")
        _check_flower()
        info = preload(parse_node_config(args.node_config), args.threads)
        log.info("ready in %.1f s: %s samples decoded, warm-up %s%s", info["seconds"], info["samples"],
                 "done" if info["warm"] else "not done", "".join(f"; {s}" for s in info["skipped"]))
        serve(args.supernode, args.insecure, args.root_certificates, args.poll_interval, secret)
    except ConfigError as e:
        sys.exit(f"fedproto executor: {e}")


if __name__ == "__main__":
    main()


__all__ = ["CHILD_FIRST_LIMIT", "CHILD_GRACE", "CHILD_STOP_GRACE", "STOP_SIGNALS", "bind_to_parent", "end_children",
           "main", "parse_node_config", "preload", "serve", "start_watchdog"]
