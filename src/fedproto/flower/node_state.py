"""A node's client state across restarts of its SuperNode: the instance id and the state file.

Flower keeps a node's ``context.state`` in the SuperNode process; a SuperNode that crashes or is
restarted starts with an empty one, and its client with a freshly initialised model. This module
gives the node two things, called from :mod:`fedproto.flower.client_app`:

**An instance id in every reply.** Each reply of the ClientApp (``query``, ``train``,
``evaluate``) carries in its metrics record (``fedproto.metrics``) the keys of
:data:`INSTANCE_KEYS`:

``instance``
    A random whole number in ``1..2**53-1`` (exact as a float64) naming this node's client state.
    Drawn with :mod:`secrets` when the state is first built in ``context.state`` and kept there
    (and in the state file), so it is the same in every reply of one SuperNode process, and the same
    after a restart whose state was reloaded from the state file; it is new after a restart that
    lost the state. A server that sees a client's ``instance`` change knows the client's model was
    re-initialised.
``restored``
    1 when this SuperNode process reloaded the state from the node's state file (it was restarted,
    and kept its state), else 0. The same in every reply of the process.
``state-round``
    The round of the last ``train`` the state holds (0: initial weights). After a restart with
    ``restored`` = 1 it says which round the client resumed from (a node killed after its state
    was saved but before its reply arrived holds one round more than the server counted).

The values are random or the server's own round numbers: nothing of the node's data, so they
are sent under every ``dp`` mode.

**A state file.** With a state folder (node config ``state-dir``, see :func:`state_dir`) the node
writes its client's model (``state_dict``) and ``ClientState.extra`` atomically
(:func:`fedproto.outputs.atomic.atomic_write`; one file per client, replaced each time) when the state is
first built and after every ``train``, and reloads it when ``context.state`` is empty (the first
message after a restart). The file name carries the run id, the client id and a hash
(:func:`state_key`) of the run config's result fields (:meth:`fedproto.config.run_config.RunConfig.result_fields`)
and of the node config, and the file repeats them: a different run, client, configuration,
data folder or model never loads it. A file that cannot be read, or whose tensors do not fit the
node's model (a factory changed under the same spec), is logged and ignored (the client starts
afresh, with a new ``instance``). It is read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context

from fedproto.config.run_config import RunConfig
from fedproto.errors import ConfigError
from fedproto.outputs.atomic import atomic_write

STATE_NODE = "fedproto.node"
STATE_RUN = "fedproto.run"
"""The ``context.state`` record holding the server's run key (:data:`RUN_KEY`)."""
"""The ``context.state`` record (a ConfigRecord) holding :data:`INSTANCE_KEYS`."""
INSTANCE_KEYS = ("instance", "restored", "state-round")
"""The keys every ClientApp reply carries in its metrics record (module docstring)."""
RUN_KEY = "run-key"
"""The key of the run the server sends in every message's config record: the state file belongs to
it (not to Flower's run id, which a run resumed on a new SuperLink does not keep)."""
STATE_DIR_KEY = "state-dir"
"""The node config key of the state folder (:func:`state_dir`)."""
FORMAT = 1

log = logging.getLogger(__name__)


def new_instance() -> int:
    """A fresh instance id: a uniform random whole number in ``1..2**53-1`` (from :mod:`secrets`,
    never from the run's seed, so two starts of one node never draw the same id by construction)."""
    return 1 + secrets.randbelow(2**53 - 1)


def default_state_dir() -> Path:
    """``<user cache>/node-state``: ``$XDG_CACHE_HOME/fedproto/node-state``, else
    ``~/.cache/fedproto/node-state`` (:func:`fedproto.data.download.default_cache_dir`)."""
    from fedproto.data.download import default_cache_dir

    return default_cache_dir() / "node-state"


def state_dir(node_config: Mapping[str, Any], own_data: bool) -> Path | None:
    """The folder of this node's state file, from node config ``state-dir``; None: no state file.

    ``state-dir`` unset: :func:`default_state_dir` for a node with its own data (``client-id``
    nodes), none for a benchmark node (``partition-id``: what Flower's simulation runtime starts,
    whose nodes never restart; give it ``state-dir`` to have one). ``state-dir=""`` turns the
    state file off.

    Raises:
        ConfigError: ``state-dir`` is not a string.
    """
    v = node_config.get(STATE_DIR_KEY)
    if v is None:
        return default_state_dir() if own_data else None
    if not isinstance(v, str):
        raise ConfigError(f"node config state-dir={v!r} is not a folder path; give a string, e.g. "
                          "state-dir=\"/var/lib/fedproto/site0\" (or state-dir=\"\" for no state file)")
    return Path(v).expanduser() if v.strip() else None


def state_key(run_id: int | str, cid: int, cfg: RunConfig, node_config: Mapping[str, Any]) -> dict[str, Any]:
    """What a state file belongs to: ``run_id`` (the server's run key, :data:`RUN_KEY`, where its
    messages carry one, else Flower's run id), ``client_id`` and ``hash``, the SHA-256 (first 16
    hex digits) of the run config's result fields and the node config (``state-dir`` left out)."""
    nc = {str(k): v for k, v in node_config.items() if k != STATE_DIR_KEY}
    blob = json.dumps({"config": cfg.result_fields(), "node": nc}, sort_keys=True, default=str)
    run = run_id if isinstance(run_id, str) else int(run_id)
    if isinstance(run, str) and not run.replace("-", "").isalnum():
        raise ConfigError(f"run key {run!r}: letters, digits and '-' only")
    return {"run_id": run, "client_id": int(cid), "hash": hashlib.sha256(blob.encode()).hexdigest()[:16]}


def state_file(folder: Path, key: Mapping[str, Any]) -> Path:
    """``<folder>/run-<run id>-client-<client id>-<hash>.pt``."""
    return Path(folder) / f"run-{key['run_id']}-client-{key['client_id']}-{key['hash']}.pt"


def save_state(path: Path, key: Mapping[str, Any], instance: int, round: int,
               model: Mapping[str, torch.Tensor], extra: Mapping[str, Any]) -> None:
    """Write a state file atomically: ``key`` (:func:`state_key`), ``instance``, ``round`` (the
    last ``train`` the model holds), the model's ``state_dict`` (``model``) and ``extra``
    (numbers, strings, lists of them).

    Raises:
        OSError: the folder cannot be written (the temp file is removed; an older file is kept).
    """
    payload = {"format": FORMAT, "key": dict(key), "instance": int(instance), "round": int(round),
               "model": {k: v.detach().cpu() for k, v in model.items()}, "extra": dict(extra)}

    def write(f) -> None:
        try:
            torch.save(payload, f)
        except RuntimeError as e:  # torch wraps write errors (ENOSPC) in RuntimeError
            raise OSError(f"torch.save failed: {e}") from e

    atomic_write(Path(path), write, private=True)  # the client's model: 0600 in a 0700 folder


def load_state(path: Path, key: Mapping[str, Any]) -> dict[str, Any] | None:
    """The state saved at ``path`` for ``key`` (``instance``, ``round``, ``model``, ``extra``);
    None when there is no such file. A file that cannot be read, is not a state file of this
    format, or belongs to another key is logged (a warning naming it) and ignored: None."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        with open(path, "rb") as f:
            state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: pickle, zip, torch and OS errors alike
        log.warning("fedproto: ignoring the node state file %s: it cannot be read (%s: %s); the client starts "
                    "afresh", path, type(e).__name__, str(e)[:200])
        return None
    ok = (isinstance(state, dict) and state.get("format") == FORMAT and state.get("key") == dict(key)
          and isinstance(state.get("instance"), int) and isinstance(state.get("round"), int)
          and isinstance(state.get("model"), dict) and isinstance(state.get("extra"), dict))
    if not ok:
        log.warning("fedproto: ignoring the node state file %s: not a state file of format %d for %s; the client "
                    "starts afresh", path, FORMAT, dict(key))
        return None
    return state


def begin(context: Context, cid: int, cfg: RunConfig, model: torch.nn.Module,
          extra: Mapping[str, Any], run_key: str | None = None) -> dict[str, Any] | None:
    """At every message: on the first one of a SuperNode process (no :data:`STATE_NODE` in
    ``context.state``), reload the client's state file if there is one (returned: its ``model``
    state_dict and ``extra``, for the caller to put in ``context.state``; ``restored`` = 1), else
    draw a new instance id and, with a state folder, save ``model`` and ``extra`` as round 0.
    Returns None when nothing was reloaded.

    ``run_key``: the server's run key (:data:`RUN_KEY`), kept in ``context.state`` for the state
    file's name; None: Flower's run id.

    Raises:
        ConfigError: a bad ``state-dir`` (:func:`state_dir`).
    """
    if run_key:
        context.state[STATE_RUN] = ConfigRecord({RUN_KEY: str(run_key)})
    if STATE_NODE in context.state:
        return None
    path = _path(context, cid, cfg)
    saved = load_state(path, _key(context, cid, cfg)) if path is not None else None
    if saved is not None and (bad := _mismatch(saved["model"], model.state_dict())):
        log.warning("fedproto client %d: ignoring the node state file %s: it does not fit this node's model (%s); "
                    "the client starts afresh", cid, path, bad)
        saved = None
    if saved is not None:
        log.warning("fedproto client %d: restored its state of round %d from %s (instance %d)", cid, saved["round"],
                    path, saved["instance"])
        context.state[STATE_NODE] = ConfigRecord({"instance": saved["instance"], "restored": 1,
                                                  "state-round": saved["round"]})
        return saved
    context.state[STATE_NODE] = ConfigRecord({"instance": new_instance(), "restored": 0, "state-round": 0})
    if path is not None:
        _write(context, cid, path, cfg, model.state_dict(), extra)
    return None


def after_train(context: Context, cid: int, cfg: RunConfig, round: int, model: torch.nn.Module,
                extra: Mapping[str, Any]) -> None:
    """After a ``train``: record ``round`` as the state's round and, with a state folder, save the
    client's state (``model``, ``extra``) to its file. A failed write is logged, not raised (the
    reply still goes out; the file keeps the previous round)."""
    rec = context.state[STATE_NODE]
    rec["state-round"] = int(round)
    path = _path(context, cid, cfg)
    if path is not None:
        _write(context, cid, path, cfg, model.state_dict(), extra)


def reply_metrics(context: Context) -> dict[str, int]:
    """The :data:`INSTANCE_KEYS` of this node's state, for a reply's metrics record."""
    rec = context.state[STATE_NODE]
    return {k: int(rec[k]) for k in INSTANCE_KEYS}


def _mismatch(saved: Mapping[str, Any], model: Mapping[str, torch.Tensor]) -> str:
    """'' when ``saved`` has exactly the tensors of ``model`` (names and shapes), else what differs
    (a model factory changed under the same spec)."""
    if saved.keys() != model.keys():
        return f"tensors {sorted(set(saved) ^ set(model))[:3]} differ"
    for k, v in model.items():
        if not isinstance(saved[k], torch.Tensor) or saved[k].shape != v.shape:
            return f"tensor {k!r} has shape {tuple(getattr(saved[k], 'shape', ()))}, the model's {tuple(v.shape)}"
    return ""


def _own_data(node_config: Mapping[str, Any]) -> bool:
    return "partition-id" not in node_config


def _key(context: Context, cid: int, cfg: RunConfig) -> dict[str, Any]:
    run = context.state[STATE_RUN][RUN_KEY] if STATE_RUN in context.state else context.run_id
    return state_key(run, cid, cfg, context.node_config)


def _path(context: Context, cid: int, cfg: RunConfig) -> Path | None:
    folder = state_dir(context.node_config, _own_data(context.node_config))
    return None if folder is None else state_file(folder, _key(context, cid, cfg))


def _write(context: Context, cid: int, path: Path, cfg: RunConfig, model: Mapping[str, torch.Tensor],
           extra: Mapping[str, Any]) -> None:
    rec = context.state[STATE_NODE]
    try:
        save_state(path, _key(context, cid, cfg), int(rec["instance"]), int(rec["state-round"]), model, extra)
    except OSError as e:
        log.warning("fedproto client %d: cannot write its state file %s (%s); a restart of this node will lose its "
                    "state", cid, path, e)


__all__ = ["INSTANCE_KEYS", "STATE_DIR_KEY", "STATE_NODE", "after_train", "begin", "default_state_dir",
           "load_state", "new_instance", "reply_metrics", "save_state", "state_dir", "state_file", "state_key"]
