"""Checkpoints: everything a simulation needs to continue after an interruption.

A checkpoint is one file, ``checkpoint.pt`` in the run directory, written atomically (same-folder
temp file, fsync, rename) every ``checkpoint_every`` rounds and removed when the run finishes. It
holds, after round r:

* ``round``: r; ``config``: :meth:`RunConfig.result_fields` of the run;
* ``message``: the server message that round r + 1 starts from (global prototypes or weights);
* ``server_state``: the algorithm's own server-side state (:meth:`Algorithm.server_state`, e.g.
  FeSEM's cluster centres);
* ``clients``: per client, the model's ``state_dict`` and ``ClientState.extra``;
* ``history``: the metrics rows of rounds 1..r; ``totals``, ``train_time_s``, ``wall_time_s``.

Every round draws its randomness from ``(seed, round, client)`` alone (batch order, dropout
masks, augmentation), and SGD starts a fresh optimizer each round, so a resumed run gives the
same numbers as one that was never interrupted.

The file is read with ``torch.load(weights_only=True)``: numpy arrays are stored as tensors
(and turned back into arrays on load), so loading never runs pickled code.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedproto.errors import CheckpointError

FORMAT = 1
CHECKPOINT_FILE = "checkpoint.pt"
_NUMPY_SECTIONS = ("message", "server_state")


def _to_torch(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj).copy())
    if isinstance(obj, dict):
        return {k: _to_torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_torch(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _to_numpy(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.numpy()
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_numpy(v) for v in obj]
    return obj


def save_checkpoint(path: str | Path, state: dict) -> None:
    """Write ``state`` (the fields of the module docstring) atomically to ``path``.

    numpy arrays anywhere in ``state`` are stored as tensors. Raises ``OSError`` when the folder
    cannot be written (the caller names the run directory).
    """
    path = Path(path)
    payload = {"format": FORMAT, **{k: _to_torch(v) for k, v in state.items()}}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Returns the state dict with the ``message`` and ``server_state`` sections as numpy arrays.
    Raises:
        CheckpointError: (a DataError) the file cannot be read, is not a checkpoint (damaged, or another program's),
            or has another format version; the message names the file and says to delete it.
    """
    path = Path(path)
    fix = f"delete {str(path)!r} to start the run from round 1"
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointError(f"cannot read the checkpoint {str(path)!r}: {e.strerror or e}; {fix}") from None
    with f:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file: pickle, zip and torch errors alike
            raise CheckpointError(f"{str(path)!r} is not a readable fedproto checkpoint ({type(e).__name__}); "
                                  f"{fix}") from None
    needed = ("round", "config", "message", "server_state", "clients", "history", "totals")
    if not isinstance(state, dict) or state.get("format") != FORMAT or any(k not in state for k in needed):
        raise CheckpointError(f"{str(path)!r} is not a fedproto checkpoint of format {FORMAT}; {fix}")
    for k in _NUMPY_SECTIONS:
        state[k] = _to_numpy(state[k])
    return state


__all__ = ["CHECKPOINT_FILE", "FORMAT", "load_checkpoint", "save_checkpoint"]
