"""The Flower Apps a stopped run's folder holds: ``resume-app`` (continues the run from its checkpoint) and
``restart-app`` (starts a run that never reached round 1 again), written by the ServerApp
(:class:`fedproto.flower.server_app.FlowerEngine`) so that ``failure.json``'s command can be pasted as it is."""

from __future__ import annotations

import json
from pathlib import Path

RESUME_APP = "resume-app"
"""The folder, inside a stopped run's folder, of the Flower App that continues it (:func:`write_resume_app`)."""
RESTART_APP = "restart-app"
"""The folder, inside the folder of a run that never started, of the Flower App that starts it again."""
RESUME_WAIT_NODES = 180.0
"""The least ``wait-nodes`` (s) of a resumed run: after a SuperLink restart the SuperNodes need about
a minute to reconnect (Flower's retries with backoff)."""


def write_resume_app(run_dir: Path, run_cfg: dict, folder: str = RESUME_APP) -> Path:
    """Write ``<run_dir>/resume-app/pyproject.toml``: a Flower App with fedproto's components whose
    ``[tool.flwr.app.config]`` is the stopped run's run config (every key, as the SuperLink gave it
    to the ServerApp) with ``resume-from`` set to ``run_dir`` (absolute) and ``wait-nodes`` at least
    :data:`RESUME_WAIT_NODES`, so that ``flwr run <run_dir>/resume-app --stream`` continues the run
    as printed (the checkpoint's options are the run's; ``wait-nodes`` is not a run option).
    ``folder=RESTART_APP``: the app that starts a run that never started again (its run config as
    given, ``wait-nodes`` included, no ``resume-from``). Both are 0600 in 0700 folders.

    Returns:
        The app folder (absolute).
    Raises:
        OSError: the folder cannot be written.
        ValueError: a value that is not a bool, number or string (Flower's run configs hold only
            those), naming its key, or a text TOML cannot hold; nothing is written then.
    """
    import math

    import tomllib

    from fedproto.config.run_config import toml_value
    from fedproto.outputs.atomic import atomic_write_bytes

    app_dir = run_dir.absolute() / folder
    resume = folder == RESUME_APP
    cfg = {str(k): v for k, v in run_cfg.items()
           if k not in ("resume-from", "resume_from", "wait-nodes", "wait_nodes")}
    bad = {k: v for k, v in cfg.items() if not isinstance(v, (bool, int, float, str))}
    if bad:
        k, v = next(iter(bad.items()))
        raise ValueError(f"run config {k}={v!r}: a Flower run config holds bools, numbers and strings only")
    try:
        wait = float(run_cfg.get("wait-nodes", run_cfg.get("wait_nodes", 0.0)) or 0.0)
    except (TypeError, ValueError):
        wait = 0.0
    if resume:
        cfg.update({"resume-from": str(run_dir.absolute()),
                    "wait-nodes": max(wait, RESUME_WAIT_NODES) if math.isfinite(wait) else RESUME_WAIT_NODES})
    else:
        cfg.update({"resume-from": "", "wait-nodes": wait})
    lines = ["# Written by the fedproto ServerApp when its run stopped: `flwr run <this folder> --stream` continues",
             "# the run from its checkpoint (docs/flower.md, 'A server restart loses nothing').",
             "[build-system]", 'requires = ["hatchling"]', 'build-backend = "hatchling.build"', "",
             "[project]", 'name = "fedproto-resume"', 'version = "0.1.0"',
             'description = "Continues a stopped fedproto run from its checkpoint"', 'license = "MIT"',
             'dependencies = ["fedproto[flower]"]', "", "[tool.hatch.build.targets.wheel]", 'packages = ["."]', "",
             "[tool.flwr.app]", 'publisher = "fedproto"', "", "[tool.flwr.app.components]",
             'serverapp = "fedproto.flower.server_app:app"', 'clientapp = "fedproto.flower.client_app:app"', "",
             "[tool.flwr.app.config]", *(f"{toml_value(str(k))} = {toml_value(v)}" for k, v in cfg.items())]
    text = "\n".join(lines) + "\n"
    try:  # what is written must read back: never a file flwr run cannot parse
        tomllib.loads(text)
        data = text.encode("utf-8")
    except (tomllib.TOMLDecodeError, UnicodeError) as e:
        raise ValueError(f"the run config cannot be written as TOML ({e})") from None
    atomic_write_bytes(app_dir / "pyproject.toml", data, private=True)
    return app_dir


def resume_config(run_cfg: dict) -> str:
    """``key=value `` pairs of a Flower run config, for ``--run-config "..."`` in a shell: strings
    as TOML literal strings (single quotes), ``resume-from`` left out."""
    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        return f"'{v}'" if "'" not in str(v) else json.dumps(str(v))

    return "".join(f"{k}={value(v)} " for k, v in run_cfg.items() if k not in ("resume-from", "resume_from"))


__all__ = ["RESTART_APP", "RESUME_APP", "RESUME_WAIT_NODES", "resume_config", "write_resume_app"]
