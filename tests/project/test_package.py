"""Start-up: heavy libraries are imported where they are used, not when ``fedproto``
is imported or ``fedproto run --help`` is printed. Each check runs a fresh interpreter (this test
process has imported everything already) and looks at its ``sys.modules``; no timing here (the
speed figures are in benchmarks/bench_startup.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_mnist

import fedproto

NEVER_AT_START = ["matplotlib", "sklearn", "scipy", "flwr", "opacus", "ray", "PIL", "tensorboard", "torchvision"]

"""Needed only by plots, the digits data set, robust aggregation, Flower, DP-SGD, image folders, the
tensorboard option, pretrained ResNet18 weights."""


NOT_FOR_HELP = [*NEVER_AT_START, "torch", "numpy", "rich.progress", "rich.table"]

"""``import fedproto``, ``import fedproto.cli.app`` and ``--help`` train nothing and draw no result table
(the help of the group and of ``run`` is drawn in panels of rich tables)."""


_PROBE = """
import json, runpy, sys
{body}
sys.stdout.write("\\n@@" + json.dumps([m for m in {heavy!r} if m in sys.modules]))
"""


def _loaded(body: str, heavy: list[str], tmp_path: Path) -> tuple[list[str], str]:
    """Run ``body`` in a fresh interpreter on this checkout's fedproto; return which of ``heavy``
    it imported, and its output before that list."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    src = str(Path(fedproto.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(body=body, heavy=heavy)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out, _, found = proc.stdout.rpartition("\n@@")
    return json.loads(found), out


def _main(*args: str) -> str:
    """``python -m fedproto ARGS``, in the probe; a SystemExit other than 0 fails it."""
    return (f"sys.argv = ['fedproto', *{list(args)!r}]\n"
            "try:\n    runpy.run_module('fedproto', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code in (0, None), e.code")


@pytest.mark.parametrize("module", ["fedproto", "fedproto.cli.app"])
def test_import_loads_no_heavy_library(module, tmp_path):
    loaded, _ = _loaded(f"import {module}", NOT_FOR_HELP, tmp_path)
    assert loaded == []


@pytest.mark.parametrize("args", [["run", "--help"], ["--help"], ["--version"]])
def test_help_loads_no_heavy_library(args, tmp_path):
    heavy = [m for m in NOT_FOR_HELP if not ("--help" in args and m == "rich.table")]  # help is drawn in tables
    if args[0] != "run":  # the group's help lists run without building its flags from the validated options
        heavy += ["pydantic", "fedproto.config.run_config"]
    loaded, out = _loaded(_main(*args), heavy, tmp_path)
    assert loaded == []
    assert ("fedproto 0." in out) if args == ["--version"] else ("Usage:" in out)


@needs_mnist
def test_one_round_run_loads_only_what_it_uses(tmp_path):
    """The default MNIST run (mean aggregation, no DP, no attack, no plot) needs torch and numpy,
    not scipy, scikit-learn, matplotlib, opacus, TensorBoard or Flower."""
    loaded, out = _loaded(_main("run", "--dataset", "mnist", "--rounds", "1", "--eval-every", "0", "--threads", "1",
                                "--quiet", "--out-dir", str(tmp_path), "--name", "x"), NEVER_AT_START, tmp_path)
    assert loaded == []
    assert (tmp_path / "x" / "summary.json").is_file(), out
