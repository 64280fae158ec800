"""fedproto: federated prototype learning (FedProto, arXiv 2105.00243).

The names most scripts need, imported on first use: :func:`build_config` (options ->
validated :class:`RunConfig`; raises ConfigError), :class:`Simulation` (the in-process round
engine; ``Simulation(cfg).run()`` returns the summary dict) and the error classes of
:mod:`fedproto.errors`, and :func:`tune` (hyperparameter search on validation data,
:mod:`fedproto.tuning`; the ``tune`` extra).
"""

__version__ = "0.1.0"

_LAZY = {
    "RunConfig": "fedproto.config",
    "build_config": "fedproto.config",
    "Simulation": "fedproto.simulation",
    "FedprotoError": "fedproto.errors",
    "ConfigError": "fedproto.errors",
    "DataError": "fedproto.errors",
    "tune": "fedproto.tuning",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fedproto' has no attribute {name!r}")
