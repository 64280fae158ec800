"""Checkpoints: everything a simulation needs to continue after an interruption.

A checkpoint is one file, ``checkpoint.pt`` in the run directory, written atomically (same-folder
temp file, fsync, rename) every ``checkpoint_every`` rounds and removed when the run finishes. It
holds, after round r:

* ``round``: r; ``config``: :meth:`RunConfig.result_fields` of the run;
* ``message``: the server message that round r + 1 starts from (global prototypes or weights);
* ``server_state``: the algorithm's own server-side state (``ServerState.checkpoint`` of the
  round's aggregation, e.g. FedGH's head as trained);
* ``clients``: per client, the model's ``state_dict`` and ``ClientState.extra``;
* ``history``: the metrics rows of rounds 1..r; ``totals``, ``train_time_s``, ``wall_time_s``.

Every round draws its randomness from ``(seed, round, client)`` alone (batch order, dropout
masks, augmentation), and SGD starts a fresh optimizer each round, so a resumed run gives the
same numbers as one that was never interrupted.

The file is read with ``torch.load(weights_only=True)``: numpy arrays are stored as tagged
tensors (and turned back into arrays on load), so loading never runs pickled code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
import torch

from fedproto.errors import CheckpointError, first_line
from fedproto.outputs.atomic import atomic_write
from fedproto.outputs.run_folder import CHECKPOINT_FILE  # re-exported: the file name is the run directory's

FORMAT = 1


_ARRAY = "__ndarray__"
_PLAIN = (type(None), bool, int, float, str, torch.Tensor)


def _to_torch(obj: Any, where: str = "state") -> Any:
    """numpy arrays -> ``{"__ndarray__": tensor}`` (0-d kept), numpy scalars -> Python numbers,
    tuples -> lists; raises ``TypeError`` for anything ``torch.load(weights_only=True)`` cannot
    read back, naming where it sits."""
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            raise TypeError(f"{where}: object arrays cannot be checkpointed")
        return {_ARRAY: torch.from_numpy(np.array(obj, copy=True, order="C"))}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _to_torch(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_torch(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, _PLAIN):
        return obj
    raise TypeError(f"{where}: a {type(obj).__name__} cannot be checkpointed (use numbers, strings, "
                    "lists, dicts, numpy arrays or tensors)")


def _from_torch(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_ARRAY} and isinstance(obj[_ARRAY], torch.Tensor):
            return obj[_ARRAY].numpy()
        return {k: _from_torch(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_torch(v) for v in obj]
    return obj


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` (the fields of the module docstring) atomically to ``path``.

    numpy arrays anywhere in ``state`` come back from :func:`load_checkpoint` as equal arrays
    (shape and dtype kept), tensors as tensors, tuples as lists.
    Raises:
        TypeError: ``state`` holds something else (a custom object), named by its place.
        OSError: the folder cannot be written (a full disk included; torch reports those as
            RuntimeError, turned back into OSError here). The temp file is removed.
    """
    payload = {"format": FORMAT, **{k: _to_torch(v, k) for k, v in state.items()}}

    def write(f: BinaryIO) -> None:
        try:
            torch.save(payload, f)
        except RuntimeError as e:  # torch wraps write errors (ENOSPC) in RuntimeError
            cause = e.__context__ if isinstance(e.__context__, OSError) else None
            raise OSError(cause.errno if cause else None,
                          cause.strerror if cause else f"torch.save failed: {first_line(e)}") from e

    atomic_write(Path(path), write, private=True)  # models and prototypes: 0600 in a 0700 folder


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Returns the state dict, numpy arrays restored (see :func:`save_checkpoint`).
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
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{str(path)!r} is not a fedproto checkpoint of format {FORMAT}; {fix}")
    bad = _malformed(state)
    if bad:
        raise CheckpointError(f"{str(path)!r} is damaged ({bad}); {fix}")
    return cast("dict[str, Any]", _from_torch(state))  # _from_torch turns a dict into a dict


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _malformed(state: dict[str, Any]) -> str:
    """What is wrong with a loaded checkpoint's structure ('' when nothing)."""
    types: dict[str, type | tuple[type, ...]] = {
        "round": int, "config": dict, "message": dict, "server_state": dict, "clients": list, "history": list,
        "totals": dict, "train_time_s": (int, float), "wall_time_s": (int, float)}
    for k, t in types.items():
        if k not in state:
            return f"no {k!r}"
        if not isinstance(state[k], t) or isinstance(state[k], bool):
            return f"{k!r} is a {type(state[k]).__name__}"
    r = state["round"]
    if len(state["history"]) != r or not all(isinstance(h, dict) and h.get("round") == i + 1
                                             for i, h in enumerate(state["history"])):
        return f"'history' does not hold rounds 1..{r}"
    if not all(_number(v) for v in state["totals"].values()):
        return "'totals' holds a non-number"
    if not all(isinstance(c, dict) and isinstance(c.get("model"), dict) and isinstance(c.get("extra"), dict)
               for c in state["clients"]):
        return "a client entry lacks its model or extras"
    return ""


__all__ = ["CHECKPOINT_FILE", "FORMAT", "load_checkpoint", "save_checkpoint"]
