"""The run directory: resolved config, per-round metrics (JSON lines), summary, per-client CSV
and global prototypes. Every whole-file write is atomic (temp file + ``os.replace``),
so an interrupted run never leaves a half-written file behind. An earlier run in the folder is set
aside and restored by :mod:`fedproto.outputs.previous_run` (its names are importable from here too).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, cast

import numpy as np

from fedproto.outputs.atomic import atomic_write as atomic_write  # re-exported: writers import them from here
from fedproto.outputs.atomic import atomic_write_bytes as atomic_write_bytes
from fedproto.outputs.atomic import make_private_folder, outermost_new, remove_empty_folders
from fedproto.outputs.previous_run import PREVIOUS as PREVIOUS  # re-exported: the run folder's names
from fedproto.outputs.previous_run import RESULT_FILES as RESULT_FILES
from fedproto.outputs.previous_run import remove_result
from fedproto.outputs.previous_run import restore_orphan as restore_orphan

if TYPE_CHECKING:
    import torch

_P = ParamSpec("_P")


def pct(x: float | None) -> str:
    """An accuracy in [0, 1] as a percentage with 2 decimals; '-' for None or NaN."""
    return "-" if x is None or x != x else f"{100 * x:.2f}"


def round_line(row: dict[str, Any], rounds: int, elapsed: float) -> str:
    """One plain progress line of an evaluated round, for output that is no terminal (a log file,
    CI): ``round 10/100: loss ce 0.1234, proto 0.0567; accuracy % classifier 97.50, nearest
    prototype 97.81; elapsed 42.0 s``. ``row`` is a metrics row (``metrics.jsonl``) holding
    ``acc_mean``; the prototype parts only where the run has them."""
    losses = f"loss ce {row['loss_ce']:.4f}"
    if row.get("loss_proto"):
        losses += f", proto {row['loss_proto']:.4f}"
    accs = f"accuracy % classifier {pct(row['acc_mean'])}"
    if "acc_global_mean" in row:  # weight-sharing methods: the server's model before local training
        accs += f", global model {pct(row['acc_global_mean'])}"
    if "acc_proto_mean" in row:
        accs += f", nearest prototype {pct(row['acc_proto_mean'])}"
    return f"round {row['round']}/{rounds}: {losses}; {accs}; elapsed {elapsed:.1f} s"


INF_KEYS = ("epsilon",)
"""Values under a JSON key containing one of these are written ``"inf"`` when infinite (a privacy
epsilon without noise), as ``clients.csv`` and the console spell it; every other infinite or NaN
value is written ``null``."""


def _clean(obj: Any, inf_ok: bool = False) -> Any:
    """``obj`` ready for JSON: numpy values as Python ones, NaN as None, infinity as ``"inf"``
    (``"-inf"``) where ``inf_ok`` (under a key of :data:`INF_KEYS`) and as None elsewhere."""
    if isinstance(obj, dict):
        return {str(k): _clean(v, inf_ok or any(w in str(k) for w in INF_KEYS)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v, inf_ok) for v in obj]
    if isinstance(obj, np.ndarray):
        return _clean(obj.tolist(), inf_ok)
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        f = float(obj)
        if math.isinf(f) and inf_ok:
            return "inf" if f > 0 else "-inf"
        return None if math.isnan(f) or math.isinf(f) else f
    return obj


def atomic_write_json(path: Path, obj: Any, private: bool = False) -> None:
    """JSON via :func:`atomic_write_bytes`: NaN written as null, an infinite epsilon as ``"inf"``
    (:data:`INF_KEYS`), other infinities as null (``private``: 0600 in a 0700 folder)."""
    atomic_write_bytes(path, (json.dumps(_clean(obj), indent=2) + "\n").encode(), private)


MODELS_FILE = "models.pt"
CHECKPOINT_FILE = "checkpoint.pt"
"""The run directory's checkpoint: :func:`fedproto.outputs.checkpoint.save_checkpoint` writes it, through
:meth:`RunDir.write_checkpoint`."""
"""The trained client models of a run with ``save_models`` (:meth:`RunDir.write_models`, :func:`load_models`)."""

LOCK = ".lock"
"""File holding the pid of the process writing a run folder (see :meth:`RunDir.acquire`)."""

PRIVATE_SUFFIXES = (".npz", ".pt")
"""Run folder files holding models, prototypes or embeddings (checkpoint, models, .npz): 0600 in a 0700 folder."""


def is_private(name: str | Path) -> bool:
    """Whether the run folder file ``name`` holds models, prototypes or embeddings (:data:`PRIVATE_SUFFIXES`)."""
    return Path(name).suffix in PRIVATE_SUFFIXES


class RunDir:
    """A run's output folder. ``metrics.jsonl`` gets one line per round (appended and flushed).

    Creating it only checks that the folder can be written; the files of an earlier run in the
    same folder stay untouched until :meth:`begin` (called when training starts), so a run that
    fails during set-up (missing data, an impossible partition) loses nothing.

    Raises:
        ConfigError: the folder cannot be created or written (names the path).
    """

    def __init__(self, path: str | Path, private: bool = False):  # private: 0700, its files 0600 (Flower server)
        self.path, self.private = Path(path), private
        self._metrics = self.path / "metrics.jsonl"
        self._created = not self.path.exists()
        # ".." resolved by name (os.path.abspath), so "new/../run" creates (and may remove) "run" alone
        self._abs = Path(os.path.abspath(self.path))
        self._created_top = outermost_new(self.path)
        self._begun = False
        try:
            make_private_folder(self._abs) if private else self._abs.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self.path, prefix=".write-check-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise self._unwritable(e) from None
        if self.lock_owner() is None:
            restore_orphan(self.path)

    def begin(self, history: list[dict[str, Any]] | None = None) -> None:
        """Start a run and an empty ``metrics.jsonl``. A finished earlier run (one with
        ``summary.json``) is moved to :data:`PREVIOUS` (see :meth:`finish`, :meth:`abort`); the
        files of an unfinished one are removed.

        Args:
            history: resuming from a checkpoint: the metrics rows it holds. The checkpoint and
                ``config.json`` are kept, ``metrics.jsonl`` is rewritten (atomically) with exactly
                these rows, and the files a finished run writes are removed.
        Raises:
            ConfigError: the folder cannot be written.
        """
        # resuming keeps the event files: TensorBoardObserver purges the rounds after the checkpoint
        keep = ("config.json", "checkpoint.pt", "tensorboard") if history is not None else ()
        moved: list[str] = []
        prev = self.path / PREVIOUS
        try:
            if history is None and (self.path / "summary.json").is_file():
                logging.getLogger(__name__).warning(
                    "%s holds a finished run: this run replaces it when it finishes (until then it waits in %s and "
                    "comes back if this run fails); give another name (--name) to keep both", self.path, PREVIOUS)
                if prev.exists():
                    shutil.rmtree(prev)
                prev.mkdir()
                for name in (*RESULT_FILES, "onboard"):
                    if (self.path / name).exists():
                        os.replace(self.path / name, prev / name)
                        moved.append(name)
            for name in RESULT_FILES:
                if name not in keep:
                    remove_result(self.path / name)
                for tmp in self.path.glob(f".{name}.*.tmp"):  # left by a killed process mid-write
                    tmp.unlink(missing_ok=True)
            rows = "".join(json.dumps(_clean(r)) + "\n" for r in history or ())
            atomic_write_bytes(self._metrics, rows.encode(), self.private)
        except OSError as e:
            if moved:  # all or nothing: put the finished run moved aside back where it was
                restore_orphan(self.path, force=True)
            raise self._unwritable(e) from None
        self._begun = True

    def finish(self) -> None:
        """The run finished: drop the earlier run kept in :data:`PREVIOUS`."""
        shutil.rmtree(self.path / PREVIOUS, ignore_errors=True)

    def abort(self) -> bool:
        """The run failed or was interrupted: put the earlier finished run back, unless this run
        left a checkpoint to resume from (then it stays in :data:`PREVIOUS` until this run
        finishes). Returns True when it was restored; never raises."""
        return self._begun and restore_orphan(self.path, force=True)

    def lock_owner(self) -> int | None:
        """The pid of another live process writing this folder (its ``.lock``), else None."""
        try:
            pid = int((self.path / LOCK).read_text().strip())
        except (OSError, ValueError):
            return None
        if pid == os.getpid():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None  # stale: that process is gone
        except PermissionError:
            return pid
        return pid

    def acquire(self) -> None:
        """Mark the folder as written by this process. Raises ConfigError when another live
        process holds it (two runs in one folder would mix their files)."""
        owner = self.lock_owner()
        if owner is not None:
            from fedproto.errors import ConfigError, opt

            raise ConfigError(f"another fedproto process (pid {owner}) is writing {str(self.path)!r}; wait for it "
                              f"to finish or stop it, or write this run elsewhere ({opt('out_dir|name')})")
        self._write(atomic_write_bytes, self.path / LOCK, str(os.getpid()).encode(), self.private)

    def release(self) -> None:
        """Drop this process's mark (never raises)."""
        try:
            if (self.path / LOCK).read_text().strip() == str(os.getpid()):
                (self.path / LOCK).unlink()
        except (OSError, ValueError):
            pass

    @property
    def checkpoint(self) -> Path:
        """Path of the run's checkpoint file (see :mod:`fedproto.outputs.checkpoint`)."""
        return self.path / CHECKPOINT_FILE

    def _unwritable(self, e: OSError) -> Exception:
        from fedproto.errors import ConfigError, opt

        file = Path(str(e.filename)) if e.filename else self.path
        where = f"the run directory {str(self.path)!r}" if file == self.path else f"{str(file)!r}"
        return ConfigError(f"cannot write {where}: {e.strerror or e}", option="out_dir",
                           hint=f"free or fix that path, or write the run elsewhere ({opt('out_dir|name')})")

    def _write(self, fn: Callable[_P, object], *args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except OSError as e:
            raise self._unwritable(e) from None

    def discard_if_unused(self) -> None:
        """Remove the folder if this object created it and no run began in it (set-up failed), and the
        parent folders it created for it, as far as they are empty."""
        if self._created and not self._begun:
            remove_empty_folders(self._abs, self._created_top)

    # Every writer below raises ConfigError (naming the file) instead of OSError, e.g. on a full disk.
    def write_config(self, cfg: dict[str, Any]) -> None:
        self._write(atomic_write_json, self.path / "config.json", cfg, self.private)

    def log_round(self, row: dict[str, Any]) -> None:
        def append() -> None:
            with open(self._metrics, "a") as f:
                f.write(json.dumps(_clean(row)) + "\n")
                f.flush()

        self._write(append)

    def write_summary(self, summary: dict[str, Any]) -> None:
        self._write(atomic_write_json, self.path / "summary.json", summary, self.private)

    def write_clients(self, rows: Iterable[dict[str, Any]]) -> None:
        rows = list(rows)
        buf = io.StringIO()
        if rows:  # every key any row has (a node that did not answer lacks its own report's keys)
            w = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in rows for k in r)), restval="")
            w.writeheader()
            for r in rows:
                w.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()})
        self._write(atomic_write_bytes, self.path / "clients.csv", buf.getvalue().encode(), self.private)

    def write_arrays(self, name: str, arrays: dict[str, np.ndarray]) -> None:
        """``name`` (an ``.npz`` file of the run folder, e.g. ``prototypes.npz``) holding ``arrays``,
        written atomically (a method's :attr:`~fedproto.algorithms.server_state.ServerState.files`).

        Raises:
            ValueError: ``name`` is not a plain ``.npz`` file name.
        """
        if "/" in name or "\\" in name or not name.endswith(".npz") or name.startswith("."):
            raise ValueError(f"run folder file {name!r}: give a plain file name ending in .npz")
        buf = io.BytesIO()
        np.savez(buf, **arrays)  # type: ignore[arg-type]  # numpy's stub: a **dict could fill allow_pickle (bool)
        self._write(atomic_write_bytes, self.path / name, buf.getvalue(), True)

    def write_prototypes(self, classes: np.ndarray, protos: np.ndarray, contributors: np.ndarray | None) -> None:
        buf = io.BytesIO()
        np.savez(buf, classes=classes, protos=protos,
                 contributors=contributors if contributors is not None else np.zeros(0, np.int64))
        self._write(atomic_write_bytes, self.path / "prototypes.npz", buf.getvalue(), True)

    def write_models(self, models: Iterable[torch.nn.Module]) -> None:
        """``models.pt``: ``{"format": 1, "clients": [state_dict, ...]}`` in client order, tensors on
        the CPU (``save_models``); read it back with :func:`load_models`."""
        import torch

        state = {"format": 1, "clients": [{k: v.detach().cpu() for k, v in m.state_dict().items()} for m in models]}
        self._write(atomic_write, self.path / MODELS_FILE, lambda f: torch.save(state, f), True)

    def write_checkpoint(self, save: Callable[[Path, dict[str, Any]], None], state: dict[str, Any]) -> None:
        """``save(path, state)`` into :attr:`checkpoint` (``save``: :func:`fedproto.outputs.checkpoint.save_checkpoint`;
        passed in, so that the run directory, a lower layer, imports no checkpoint format)."""
        self._write(save, self.checkpoint, state)


def load_models(path: str | Path) -> list[dict[str, torch.Tensor]]:
    """The trained client models a run wrote with ``save_models``: one ``state_dict`` per client, in
    client order, to load into models of the same architecture, e.g.
    ``sim.models[i].load_state_dict(load_models(run_dir)[i])`` for a :class:`~fedproto.simulation.Simulation`
    built as the run was (:attr:`~fedproto.simulation.Simulation.models`).

    Args:
        path: the run directory, or its ``models.pt``.
    Raises:
        DataError: the file is missing or is not a ``models.pt`` (names the file).
    """
    import torch

    from fedproto.errors import DataError, first_line

    p = Path(path)
    if p.is_dir():
        p = p / MODELS_FILE
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DataError(f"{str(p)!r} does not exist; run with save_models=True (--save-models) to write it") from None
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a file that is not its own
        raise DataError(f"cannot read {str(p)!r} ({type(e).__name__}: {first_line(e)[:160]}); pass a "
                        "models.pt written by a run with save_models=True") from None
    if not (isinstance(state, dict) and state.get("format") == 1 and isinstance(state.get("clients"), list)
            and all(isinstance(sd, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                 for k, v in sd.items()) for sd in state["clients"])):
        raise DataError(f"{str(p)!r} is not a models.pt of fedproto (format 1: one state_dict per client); pass "
                        "one written by a run with save_models=True")
    return cast("list[dict[str, torch.Tensor]]", state["clients"])  # its shape checked just above


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl`` (list of dicts).

    Raises:
        DataError: the file is missing or unreadable, or a line is not a JSON object (names the
            file and line).
    """
    from fedproto.errors import DataError

    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {p}: {getattr(e, 'strerror', None) or e}; pass a run directory "
                        "written by `fedproto run`") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}: line {n} is not valid JSON ({e.msg}); the run may have been cut short") from None
        if not isinstance(row, dict):
            raise DataError(f"{p}: line {n} is not a JSON object")
        rows.append(row)
    return rows
