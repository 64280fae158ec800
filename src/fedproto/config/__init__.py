"""Run configuration: the options every run has (:mod:`fedproto.config.fields`), their checks
(:mod:`fedproto.config.common_options`), the validated :class:`RunConfig` and :func:`build_config`
(:mod:`fedproto.config.run_config`), and every option as a flag (:mod:`fedproto.config.run_options`).
docs/architecture.md, "Layout".
"""


from typing import Any

__all__ = ["RunConfig", "build_config"]


def __getattr__(name: str) -> Any:
    """``fedproto.config.X`` is :mod:`fedproto.config.run_config`'s ``X`` (the module this package was before 0.2)."""
    import importlib

    return getattr(importlib.import_module("fedproto.config.run_config"), name)
