"""The package's layout (docs/architecture.md, "Layout"; issue 43): a handful of modules at the top of
``src/fedproto``, no two modules or packages with the same name, no function over 80 lines in the core
packages, and no test file over 800 lines outside the tests' folders."""

import ast
from collections import Counter
from pathlib import Path

import fedproto

SRC = Path(fedproto.__file__).resolve().parent
TESTS = Path(__file__).resolve().parents[1]
TOP_MODULES = {"__init__.py", "__main__.py", "errors.py", "plugins.py", "simulation.py"}  # the public API
CORE = ("engine", "training", "algorithms", "prototypes")  # the round engine, the training step, the methods, the math
MAX_FUNCTION_LINES = 80
MAX_TEST_FILE_LINES = 800


def long_functions(root: Path, limit: int, base: Path = SRC) -> list[str]:
    """``path:name (lines)`` for every function or method under ``root`` longer than ``limit`` lines
    (decorators excluded, docstring included)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    found.append(f"{path.relative_to(base)}:{node.name} ({n} lines)")
    return found


def test_layout_has_no_loose_modules_or_clashing_names():
    top = {p.name for p in SRC.glob("*.py")}
    assert len(top) <= 6, f"{len(top)} modules at the top of src/fedproto: {sorted(top)}"
    loose = sorted(top - TOP_MODULES)
    assert not loose, (f"modules at the top of src/fedproto that belong in a package: {loose} "
                       "(docs/architecture.md, 'Layout', says which package holds what)")
    stems = [p.stem for p in SRC.rglob("*.py") if p.stem not in ("__init__", "__main__")]
    packages = [p.parent.name for p in SRC.rglob("__init__.py") if p.parent != SRC]
    clashes = {n: c for n, c in Counter(stems + packages).items() if c > 1}
    assert not clashes, f"module or package names used more than once: {clashes}"
    too_long = [f for pkg in CORE for f in long_functions(SRC / pkg, MAX_FUNCTION_LINES)]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines in the core packages: {too_long}"


def test_tests_are_laid_out_like_the_code():
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not loose, f"test files outside a package's folder in tests/: {loose}"
    folders = {p.parent.name for p in TESTS.rglob("test_*.py")}
    packages = {p.parent.name for p in SRC.glob("*/__init__.py")} | {"project"}
    assert folders <= packages, f"test folders named after no package of src/fedproto: {sorted(folders - packages)}"
    big = {str(p.relative_to(TESTS)): n for p in TESTS.rglob("test_*.py")
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_TEST_FILE_LINES}
    assert not big, f"test files over {MAX_TEST_FILE_LINES} lines: {big}"


def test_long_functions_finds_a_long_function(tmp_path):
    """The checker itself: an 81-line function is found, an 80-line one is not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    (tmp_path / "m.py").write_text(f"def short():\n{body}\n\n\ndef long():\n{body}\n    y = 0\n")
    assert long_functions(tmp_path, 80, base=tmp_path) == ["m.py:long (81 lines)"]


def test_old_module_paths_still_import_with_a_warning():
    """A module path of releases before the layout (``fedproto.cli_run``, ``fedproto.algorithms.base``,
    ``fedproto.htmath.fd``) imports the module at its new path, the same object, with a DeprecationWarning
    naming the new path; every entry of the table points at a module that exists."""
    import importlib
    import importlib.util
    import sys
    import warnings

    for old, new in [("fedproto.cli_run", "fedproto.cli.run_command"),
                     ("fedproto.algorithms.base", "fedproto.algorithms.algorithm"),
                     ("fedproto.htmath.fd", "fedproto.algorithms.hetero_math.fd_math")]:
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(new)
        assert module.__name__ == new and module.__spec__.name == new
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), \
            [str(w.message) for w in caught]
    missing = [new for new in fedproto._MOVED.values() if importlib.util.find_spec(new) is None]
    assert not missing, f"the old-path table points at modules that do not exist: {missing}"


def test_an_old_module_path_warns_at_the_importing_line_by_default():
    """Python shows a DeprecationWarning by default only when it is attributed to ``__main__``: the
    warning of an old path points at the line that imports it, so a script sees it without -W."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import fedproto.cli_run"], capture_output=True, text=True,
                         check=True)
    assert "<string>:1: DeprecationWarning: fedproto.cli_run is now fedproto.cli.run_command" in out.stderr, out.stderr


def test_python_m_on_an_old_path_runs_the_new_module_and_old_submodule_names_still_resolve():
    """Reported: ``python -m fedproto.flower.supervise`` (a deployment unit of releases before 0.2) was an
    AttributeError of the import hook, and ``fedproto.htmath.fd`` no longer an attribute after
    ``import fedproto.htmath``."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "fedproto.flower.supervise", "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "usage: python -m fedproto.deploy.supervisor" in out.stdout, out.stderr
    assert "FutureWarning: python -m fedproto.flower.supervise is now python -m fedproto.deploy.supervisor" \
        in out.stderr
    code = "import fedproto.htmath as h; print(h.fd.__name__, h.heads.lg_aggregate.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["fedproto.algorithms.hetero_math.fd_math",
                                  "fedproto.algorithms.hetero_math.heads_math"]
