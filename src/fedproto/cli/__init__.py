"""The command line: ``fedproto run`` (:mod:`fedproto.cli.run_command`), ``tune``
(:mod:`fedproto.cli.tune_command`), ``plot``, ``site-data``, ``onboard`` (:mod:`fedproto.cli.tool_commands`)
and the rest (:mod:`fedproto.cli.app`). docs/architecture.md, "Layout".
"""

from typing import Any


def __getattr__(name: str) -> Any:
    """``fedproto.cli.main`` (the console script of releases before 0.2) and the rest of :mod:`fedproto.cli.app`."""
    import importlib

    return getattr(importlib.import_module("fedproto.cli.app"), name)
