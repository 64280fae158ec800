"""fedproto: federated prototype learning (FedProto, arXiv 2105.00243).

The names most scripts need, imported on first use: :func:`build_config` (options ->
validated :class:`RunConfig`; raises ConfigError), :class:`Simulation` (the in-process round
engine; ``Simulation(cfg).run()`` returns the summary dict) and the error classes of
:mod:`fedproto.errors`, and :func:`tune` (hyperparameter search on validation data,
:mod:`fedproto.tuning`; the ``tune`` extra).
"""

__version__ = "0.1.0"

_LAZY = {
    "RunConfig": "fedproto.config.run_config",
    "build_config": "fedproto.config.run_config",
    "Simulation": "fedproto.simulation",
    "FedprotoError": "fedproto.errors",
    "ConfigError": "fedproto.errors",
    "DataError": "fedproto.errors",
    "tune": "fedproto.tuning",
}

# Where each module of releases before 0.2 lives now (docs/architecture.md, "Layout"): ``import
# fedproto.cli_run`` still works, warns once (DeprecationWarning) and gives the module at its new path.
_MOVED = {
    "fedproto.federation.models": "fedproto.federation.own_models",
    "fedproto.federation.data": "fedproto.federation.own_data",
    "fedproto.algorithms.base": "fedproto.algorithms.algorithm",
    "fedproto.algorithms.local": "fedproto.algorithms.local_only",
    "fedproto.algorithms.options": "fedproto.algorithms.method_options",
    "fedproto.algorithms.server": "fedproto.algorithms.server_part",
    "fedproto.algorithms.state": "fedproto.algorithms.server_state",
    "fedproto.atomic": "fedproto.outputs.atomic",
    "fedproto.attacks": "fedproto.engine.attacks",
    "fedproto.checkpoint": "fedproto.outputs.checkpoint",
    "fedproto.cli_common": "fedproto.cli.console",
    "fedproto.cli_run": "fedproto.cli.run_command",
    "fedproto.cli_tools": "fedproto.cli.tool_commands",
    "fedproto.cli_tune": "fedproto.cli.tune_command",
    "fedproto.config_common": "fedproto.config.common_options",
    "fedproto.config_fields": "fedproto.config.fields",
    "fedproto.config_fixes": "fedproto.config.fixes",
    "fedproto.devices": "fedproto.training.devices",
    "fedproto.engine.attack": "fedproto.engine.attack_stage",
    "fedproto.engine.executors.base": "fedproto.engine.executors.executor",
    "fedproto.engine.executors.local": "fedproto.engine.executors.in_process",
    "fedproto.engine.executors.store": "fedproto.engine.client_store",
    "fedproto.flower.children": "fedproto.deploy.warm_children",
    "fedproto.flower.common": "fedproto.flower.records",
    "fedproto.flower.credentials": "fedproto.deploy.credentials",
    "fedproto.flower.executor": "fedproto.flower.flower_executor",
    "fedproto.flower.local": "fedproto.deploy.local_federation",
    "fedproto.flower.prefork": "fedproto.deploy.warm_executor",
    "fedproto.flower.secagg": "fedproto.flower.secagg_messages",
    "fedproto.flower.supervise": "fedproto.deploy.supervisor",
    "fedproto.flower.tasks": "fedproto.deploy.warm_tasks",
    "fedproto.grouped": "fedproto.training.grouped_forward",
    "fedproto.htmath": "fedproto.algorithms.hetero_math",
    "fedproto.htmath.common": "fedproto.algorithms.hetero_math.uploads",
    "fedproto.htmath.fd": "fedproto.algorithms.hetero_math.fd_math",
    "fedproto.htmath.fedtgp": "fedproto.algorithms.hetero_math.fedtgp_math",
    "fedproto.htmath.heads": "fedproto.algorithms.hetero_math.heads_math",
    "fedproto.models.base": "fedproto.models.proto_model",
    "fedproto.netcheck": "fedproto.deploy.netcheck",
    "fedproto.onboarding": "fedproto.federation.onboarding",
    "fedproto.options": "fedproto.config.run_options",
    "fedproto.paper": "fedproto.reproduce.paper_numbers",
    "fedproto.parallel": "fedproto.engine.executors.worker_pool",
    "fedproto.parallel_worker": "fedproto.engine.executors.worker",
    "fedproto.privacy": "fedproto.prototypes.dp",
    "fedproto.reproduce.parallel": "fedproto.reproduce.side_by_side",
    "fedproto.results": "fedproto.outputs.run_folder",
    "fedproto.secagg.dp": "fedproto.secagg.epsilon",
    "fedproto.secagg.engine": "fedproto.secagg.masked_round",
    "fedproto.sitedata": "fedproto.deploy.site_data",
    "fedproto.tensorboard": "fedproto.engine.observers.tensorboard_log",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fedproto' has no attribute {name!r}")


class _MovedModules:
    """Import hook for the old module paths of :data:`_MOVED`: the new module itself, under its old
    name too (one module object: patching either name patches both)."""

    @classmethod
    def find_spec(cls, fullname: str, path: object = None, target: object = None) -> object:
        if fullname not in _MOVED:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(fullname, cls())

    def create_module(self, spec: object) -> object:
        import importlib
        import warnings

        name = spec.name  # type: ignore[attr-defined]
        warnings.warn(f"{name} is now {_MOVED[name]}; import it from there (the old path goes in 1.0)",
                      DeprecationWarning, stacklevel=2)  # the importing line (import frames skipped)
        module = importlib.import_module(_MOVED[name])
        self._spec = module.__spec__
        return module

    def exec_module(self, module: object) -> None:
        module.__spec__ = self._spec  # type: ignore[attr-defined]  # the import system wrote the old name's spec

    def get_code(self, fullname: str) -> object:
        """``python -m <old path>`` (a deployment unit written before 0.2): the new module's code, run as
        ``__main__``, with a FutureWarning (shown by default) naming the new path."""
        import importlib.util
        import warnings

        new = _MOVED[fullname]
        warnings.warn(f"python -m {fullname} is now python -m {new}; change the command (the old path goes in 1.0)",
                      FutureWarning, stacklevel=1)
        spec = importlib.util.find_spec(new)
        return spec.loader.get_code(new)  # type: ignore[union-attr]


import sys as _sys  # noqa: E402

if not any(isinstance(f, type) and f.__name__ == "_MovedModules" for f in _sys.meta_path):
    _sys.meta_path.append(_MovedModules)
