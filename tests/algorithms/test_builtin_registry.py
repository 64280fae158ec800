"""The library's methods are declared as a plug-in package declares its own (the
``fedproto.algorithms`` entry-point group of fedproto's pyproject.toml), and a third-party plug-in
package installed beside fedproto (a real ``.dist-info`` on ``sys.path``) changes nothing inside the
library's scope nor with ``FEDPROTO_NO_ENTRY_POINTS``, while a user's process sees it."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fedproto
from fedproto import plugins
from fedproto.algorithms import ALGORITHMS
from fedproto.algorithms.method_options import BUILTIN_OPTIONS

ROOT = Path(fedproto.__file__).resolve().parents[2]
EXPECTED = ["fedproto", "local", "fedavg", "fedprox", "fedper", "fedrep", "fesem", "fedtgp", "fd", "fedgh", "lgfedavg"]


def test_builtins_are_the_entry_points_of_fedproto_s_own_pyproject():
    tomllib = pytest.importorskip("tomllib")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][plugins.GROUP]
    assert list(declared) == EXPECTED == list(plugins.BUILTIN) == list(ALGORITHMS) == list(BUILTIN_OPTIONS)
    for name, value in declared.items():
        module, _, attr = value.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        assert ALGORITHMS[name] is cls and cls.name == name
        assert cls.Options is BUILTIN_OPTIONS[name]  # the torch-free table --help reads is the class's own
        assert getattr(fedproto.algorithms, attr) is cls


def test_installed_metadata_declares_the_same_builtins():
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        eps = {ep.name: ep.value for ep in distribution("fedproto").entry_points if ep.group == plugins.GROUP}
    except PackageNotFoundError:
        pytest.skip("fedproto runs from its sources without being installed")
    assert eps == dict(plugins.BUILTIN_ENTRY_POINTS)


_PLUGIN = '''
from pydantic import Field

from fedproto.algorithms import FedProto
from fedproto.plugins import AlgorithmOptions


class ThirdProto(FedProto):
    name = "thirdproto"

    class Options(AlgorithmOptions):
        third_x: float = Field(1.0, description="x of the third-party method")


class Impostor(FedProto):
    name = "fedavg"
'''

_PROBE = '''
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from fedproto import plugins
from fedproto.algorithms import get_algorithm
from fedproto.config.run_config import RunConfig, config_model
out = {"names": plugins.algorithm_names(), "fedavg": get_algorithm("fedavg").__module__,
       "third_x": "third_x" in config_model().model_fields, "plain": config_model() is RunConfig}
with plugins.scope():
    out["scoped"] = plugins.algorithm_names()
    out["scoped_plain"] = config_model() is RunConfig
print("@@" + json.dumps(out))
'''


def _site(tmp_path: Path) -> Path:
    """A plug-in package as pip installs one: its module and a ``.dist-info`` with two entry points
    of the group (a method of its own, and one that tries to take a built-in's name)."""
    site = tmp_path / "site"
    (site / "thirdproto").mkdir(parents=True)
    (site / "thirdproto" / "__init__.py").write_text(_PLUGIN)
    info = site / "thirdproto-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdproto\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{plugins.GROUP}]\nthirdproto = thirdproto:ThirdProto\n"
                                           "fedavg = thirdproto:Impostor\n")
    return site


def _probe(site: Path, no_entry_points: bool) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != plugins.NO_ENTRY_POINTS}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    if no_entry_points:
        env[plugins.NO_ENTRY_POINTS] = "1"
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300,
                          cwd=site)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.rpartition("@@")[2]), proc.stderr


def test_an_installed_plugin_package_is_seen_by_users_and_left_out_of_the_library_scope(tmp_path):
    site = _site(tmp_path)
    user, log = _probe(site, no_entry_points=False)
    # the built-ins first, then the plug-ins (this one, and any other the environment has installed)
    assert user["names"][:len(EXPECTED)] == EXPECTED and "thirdproto" in user["names"][len(EXPECTED):]
    assert user["third_x"] and not user["plain"]
    assert user["fedavg"] == "fedproto.algorithms.fedavg"  # a plug-in cannot take a built-in's name
    assert "'fedavg' (thirdproto:Impostor) could not be loaded" in log and "one of fedproto's own methods" in log
    assert user["scoped"] == EXPECTED and user["scoped_plain"]  # the library's scope: built-ins only
    off, log = _probe(site, no_entry_points=True)
    assert off["names"] == off["scoped"] == EXPECTED and off["plain"] and not off["third_x"]
    assert off["fedavg"] == "fedproto.algorithms.fedavg" and "thirdproto" not in log
