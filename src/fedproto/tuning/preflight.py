"""What ``fedproto tune`` checks before any study is created or trial runs: the fixed options
(no tune option, output or thread option among them, none also searched), the metric every
method reports, a space the method uses, and the output folder (:func:`prepare_out`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedproto.errors import ConfigError, opt

TUNE_OPTIONS = ("trials", "timeout", "baselines", "metric", "jobs", "val_fraction", "final_seeds", "study_name",
                "storage", "out", "space")
"""Options of ``fedproto tune`` itself (not run options): refused among the fixed run options."""

OWN_OPTIONS = {"out_dir": "the output folder is --out (Python: out=...)",
               "name": "each trial and final run names itself; the studies are named by --study-name",
               "threads": "give --threads N (Python: threads=N), the budget the jobs share"}
"""Run options ``fedproto tune`` sets itself, and what to give instead."""


def check_fixed(file_opts: dict, options: dict, config: Any = None) -> None:
    """Refuse a tune option (``trials = 5``) or an option tune sets itself (``out_dir``, ``name``,
    ``threads``) among the fixed run options of the config file or ``--set``.

    Raises:
        ConfigError: naming the key, where it was given and the option to use instead.
    """
    for where, opts in ((f"config file {str(config)!r}", file_opts), ("--set", options)):
        for k, v in (opts or {}).items():
            key = str(k).strip().replace("-", "_")
            if key in TUNE_OPTIONS:
                flag = "--" + key.replace("_", "-")
                raise ConfigError(f"{where}: {key} = {v!r} is an option of fedproto tune, not a run option; give "
                                  f"{flag} {v} (Python: {key}={v!r}) instead" + (" ([space] table for the space)"
                                                                                  if key == "space" else ""))
            if key in OWN_OPTIONS:
                raise ConfigError(f"{where}: {key} = {v!r} is set by fedproto tune itself: {OWN_OPTIONS[key]}")


def check_not_searched(base: dict, dims: dict, default: bool = False) -> None:
    """Refuse an option both fixed and in the search space (the search would override it
    silently); ``default``: the space is the default one (the message says so)."""
    both = sorted(set(base) & set(dims))
    if both:
        k = both[0]
        note = (f" (the default space searches {', '.join(dims)}; give the space yourself, e.g. --space "
                f"{next((d for d in dims if d != k), 'lambda_proto')}=..., to fix {k})" if default else "")
        raise ConfigError(f"{opt(k, base[k])} is fixed and also searched (the search space's {k}={dims[k].spec()}); "
                          f"keep one: drop {k} from the fixed options to search it, or from the space to fix it"
                          + note)


def reported_metrics(method: str) -> list[str] | None:
    """The accuracies ``method`` reports (its ``eval_protocols``; None when they cannot be read
    without building it: the trial then checks)."""
    from fedproto.algorithms import get_algorithm

    try:
        cls = get_algorithm(method)
        return list(cls.eval_protocols(object.__new__(cls)))
    except Exception:  # a plug-in whose protocols need its state: checked on the first trial instead
        return None


def check_metric(metric: str, methods: list[str]) -> None:
    """Refuse a metric one of the methods (the tuned one or a baseline) does not report."""
    for m in methods:
        has = reported_metrics(m)
        if has is not None and metric not in has:
            raise ConfigError(f"--metric {metric}: {m} does not report it (it reports {', '.join(has)}); pick one "
                              f"every method reports, or leave {m} out")


def check_space_used(dims: dict, mdims: dict, method: str) -> None:
    """Refuse a space none of whose options ``method`` uses (it would "tune" nothing), naming the
    methods that own them."""
    if dims and not mdims:
        from fedproto.algorithms.method_options import owners

        named = "; ".join(f"{k} is an option of {', '.join(owners(k)) or 'no method'}" for k in sorted(dims))
        raise ConfigError(f"{method} uses none of the search space's options ({named}); search an option {method} "
                          f"uses (e.g. lr=log:0.001:0.1), or tune the method that owns it (--method)")


def prepare_out(out: Path, files: list[str], folders: list[str]) -> list[Path]:
    """Check the output folder and the paths written in it, then create it. Returns the folders
    created (:func:`undo_out` removes them again when they stay empty).

    Raises:
        ConfigError: ``out`` (or a folder above it) is a file, a file written there is a folder,
            a folder written there is a file, or ``out`` cannot be created; naming the path.
    """
    out = Path(out)
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"--out {str(out)!r}: {str(p)!r} is a file, not a folder; give another --out (a "
                                  "new folder, or one fedproto tune wrote)")
            break
    for name in files:
        if (out / name).is_dir():
            raise ConfigError(f"--out {str(out)!r}: {str(out / name)!r} is a folder where fedproto tune writes a file; "
                              "move it away, or give another --out")
    for name in folders:
        if (out / name).exists() and not (out / name).is_dir():
            raise ConfigError(f"--out {str(out)!r}: {str(out / name)!r} is a file where fedproto tune writes a "
                              "folder; move it away, or give another --out")
    created = [p for p in (out, *out.parents) if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {str(out)!r}: cannot create the folder ({e.strerror or e}); give a folder you can "
                          "write") from None
    return created


def undo_out(created: list[Path]) -> None:
    """Remove the folders :func:`prepare_out` created, deepest first, as long as they are empty."""
    for p in created:
        try:
            p.rmdir()
        except OSError:
            return


__all__ = ["OWN_OPTIONS", "TUNE_OPTIONS", "check_fixed", "check_metric", "check_not_searched", "check_space_used",
           "prepare_out", "reported_metrics", "undo_out"]
