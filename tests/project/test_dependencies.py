"""Every package the library imports is declared in pyproject.toml for the install that uses it.

The README's install (``pip install -e ".[dev]"``) once gave a CLI that could not start: the code
imported ``click``, which only arrived as a dependency of typer until typer stopped installing it.
This test reads every module's imports (top level and inside functions) and checks each
third-party one against ``[project].dependencies``, plus the ``flower`` extra for
``fedproto.flower``, so an import that works only because something else pulled the package in
fails here.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib








from conftest import DOCS

ROOT = Path(__file__).resolve().parents[2]


SRC = ROOT / "src" / "fedproto"


# import name -> distribution name, where the two differ
DISTRIBUTION = {"PIL": "pillow", "sklearn": "scikit-learn", "flwr": "flwr", "yaml": "pyyaml", "Crypto": "pycryptodome"}


# which installs a module belongs to: the base install, or the base install plus an extra
EXTRA_OF = {"flower": "flower", "deploy": "flower", "deploy/netcheck.py": None, "deploy/site_data.py": None,
            "secagg": "flower", "engine/observers/tensorboard_log.py": "tensorboard", "reproduce/raycells.py": "ray",
            "tuning": "tune"}


def _requirement_name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {_requirement_name(r) for r in project["dependencies"]}
    extras = {k: {_requirement_name(r) for r in v} for k, v in project.get("optional-dependencies", {}).items()}
    return base, extras


def third_party_imports(path: Path) -> dict[str, int]:
    """Top-level names of the absolute imports in one file (stdlib and fedproto left out) -> first line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in ("fedproto", "__future__"):
                continue
            found.setdefault(top, node.lineno)
    return found


def undeclared(src: Path = SRC) -> list[str]:
    """'file:line imports X (distribution Y), not declared for <install>' for every offending import."""
    base, extras = _declared()
    problems = []
    for path in sorted(src.rglob("*.py")):
        sub = path.relative_to(src).parts[0]
        extra = EXTRA_OF.get(path.relative_to(src).as_posix(), EXTRA_OF.get(sub))  # a file's own, else its folder's
        allowed = base | (extras.get(extra, set()) if extra else set())
        for top, line in third_party_imports(path).items():
            dist = DISTRIBUTION.get(top, top).lower().replace("_", "-")
            if dist not in allowed:
                where = f'the "{extra}" extra' if extra else "the base install"
                problems.append(f"{path.relative_to(src.parent)}:{line} imports {top} (distribution {dist}), "
                                f"not declared for {where} in pyproject.toml")
    return problems


def test_every_import_is_declared_for_its_install():
    assert undeclared() == []


def test_the_check_catches_an_undeclared_import(tmp_path):
    """The check itself: a module importing click, yaml or a flower-only package where they are not declared."""
    pkg = tmp_path / "fedproto"
    (pkg / "flower").mkdir(parents=True)
    (pkg / "cli.py").write_text("import typer\n\ndef f():\n    import yaml.safe_load\n")
    (pkg / "plots.py").write_text("from flwr.common import Context\nimport os\n")
    (pkg / "flower" / "app.py").write_text("from flwr.common import Context\nfrom cryptography import x509\n")
    problems = undeclared(pkg)
    assert len(problems) == 2
    assert "cli.py:4 imports yaml (distribution pyyaml)" in problems[0]
    assert "plots.py:1 imports flwr" in problems[1] and "the base install" in problems[1]


@pytest.mark.parametrize("name", ["click", "typer", "threadpoolctl"])
def test_cli_and_plot_dependencies_are_direct(name):
    """The packages of the reported fault are declared by name, not left to another package's requirements."""
    base, _ = _declared()
    assert name in base


def test_tensorboard_is_allowed_in_its_module_only(tmp_path):
    """fedproto/engine/observers/tensorboard_log.py may import the ``tensorboard`` extra's package; any other
    module may not."""
    pkg = tmp_path / "fedproto"
    (pkg / "engine" / "observers").mkdir(parents=True)
    (pkg / "engine" / "observers" / "tensorboard_log.py").write_text(
        "import tensorboard\nfrom torch.utils.tensorboard import SummaryWriter\n")
    (pkg / "results.py").write_text("import tensorboard\n")
    problems = undeclared(pkg)
    assert len(problems) == 1 and "results.py:1 imports tensorboard" in problems[0], problems
    _, extras = _declared()
    assert extras["tensorboard"] == {"tensorboard"}


def test_readme_runs_what_ci_runs():
    """CI proves the README: .ci/run reads the README's CPU install line and its test command from
    README.md and runs them in a fresh venv (so the README's install cannot fail while CI, installing
    more, passes). The README names no machine path."""
    import re

    root = DOCS.parent
    ci = (root / ".ci" / "run").read_text()
    readme = (root / "README.md").read_text(encoding="utf-8")
    lines = [line.strip() for block in re.findall(r"```bash\n(.*?)```", readme, re.S) for line in block.splitlines()]
    install = [line for line in lines if line.startswith("pip install torch")]
    tests = [line for line in lines if line.startswith("python -m pytest")]
    assert len(install) == 1 and install[0].endswith('pip install -e ".[dev]"'), install
    assert tests == ["python -m pytest -q"]
    assert "readme_line '^pip install torch'" in ci and "readme_line '^python -m pytest'" in ci
    assert 'bash -c "$ci_install"' in ci and 'bash -c "$test_cmd"' in ci
    assert "/work/" not in readme and len(readme.splitlines()) <= 200
