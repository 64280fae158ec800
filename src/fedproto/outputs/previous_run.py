"""An earlier run in the folder of a new one: the files a run writes (:data:`RESULT_FILES`), the
sub-folder a finished earlier run waits in until the new one finishes (:data:`PREVIOUS`), and putting it
back when the new run cannot be continued (:func:`restore_orphan`). :class:`~fedproto.outputs.run_folder.RunDir`
moves the earlier run aside (``begin``) and drops or restores it (``finish``, ``abort``); the names here
are also importable from :mod:`fedproto.outputs.run_folder`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

RESULT_FILES = ("config.json", "metrics.jsonl", "summary.json", "clients.csv", "prototypes.npz",
                "embeddings.npz", "curves.png", "tsne.png", "checkpoint.pt", "models.pt", "failure.json",
                "tensorboard", "resume-app", "restart-app")
"""Files (and the ``tensorboard`` folder of event files, the ``resume-app`` folder of a stopped
Flower run: :func:`fedproto.flower.server_app.write_resume_app`) a run writes. A new run in the same folder never
mixes its files with an older run's (no summary.json means: not finished): a finished older run is moved to
:data:`PREVIOUS` until the new one finishes, an unfinished one is removed."""

PREVIOUS = ".previous"
"""Sub-folder of the finished run a new run in the folder replaces until it finishes (or fails with no checkpoint)."""


def remove_result(path: Path) -> None:
    """Remove a run's file or folder (``tensorboard/``) if it exists; OSError when it cannot."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def restore_orphan(path: str | Path, force: bool = False) -> bool:
    """Put the finished run kept in ``path/.previous`` back when nothing can continue the run that
    replaced it: that run has no checkpoint and did not finish (killed, failed). With ``force``,
    even when that run finished. Returns True when restored; never raises."""
    path = Path(path)
    prev = path / PREVIOUS
    if not prev.is_dir() or (path / "checkpoint.pt").is_file():
        return False
    if not force and (path / "summary.json").is_file():
        return False
    try:
        for name in RESULT_FILES:
            remove_result(path / name)
        for f in prev.iterdir():
            if f.is_dir() and (path / f.name).is_dir():
                shutil.rmtree(path / f.name)
            os.replace(f, path / f.name)
        prev.rmdir()
    except OSError:
        return False
    return True
