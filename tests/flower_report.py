"""Pytest hooks (imported by conftest.py) that say which Flower tests ran and which were skipped, and why.

Without the flower extra a test module that skips itself at import (``pytest.importorskip("flwr")``
at module level, as tests/flower/test_flower_*.py) would show as one SKIPPED line for all its tests. Here
such a module is collected as one skipped test per test function it defines (read from its
source, not imported), each with the reason and the install command, and the end of the run
prints one line: how many tests marked ``flower`` passed, failed and were skipped, with the skip
reasons counted.
"""

from __future__ import annotations

import ast
import importlib.util
from collections import Counter
from pathlib import Path

import pytest

FLOWER_MISSING = importlib.util.find_spec("flwr") is None
REASON = 'the flower extra is not installed (flwr): pip install -e ".[flower]"'


def skips_itself_without_flower(path: Path) -> bool:
    """True if the module at ``path`` calls ``pytest.importorskip("flwr")`` at module level."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return False
    for node in tree.body:
        call = node.value if isinstance(node, ast.Expr) else None
        if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "importorskip" and call.args \
                and isinstance(call.args[0], ast.Constant) and call.args[0].value == "flwr":
            return True
    return False


class SkippedFlowerTest(pytest.Item):
    """One test function of a module that needs Flower, marked skipped with :data:`REASON` (the
    report names the module and the line of the function)."""

    lineno: int | None = None

    def runtest(self) -> None:  # never reached: the skip marker skips it in setup
        pytest.skip(REASON)

    def reportinfo(self):
        return self.path, self.lineno, self.name


class SkippedFlowerModule(pytest.File):
    """A Flower test module collected without importing it: one :class:`SkippedFlowerTest` per
    module-level ``test_*`` function."""

    def collect(self):
        tree = ast.parse(self.path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                item = SkippedFlowerTest.from_parent(self, name=node.name)
                item.lineno = node.lineno - 1
                item.add_marker(pytest.mark.flower)
                item.add_marker(pytest.mark.skip(reason=REASON))
                yield item


def pytest_pycollect_makemodule(module_path: Path, parent):
    if FLOWER_MISSING and skips_itself_without_flower(Path(module_path)):
        return SkippedFlowerModule.from_parent(parent, path=Path(module_path))
    return None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line on the Flower tests: passed, failed, skipped (and why)."""
    counts: Counter = Counter()
    reasons: Counter = Counter()
    for outcome in ("passed", "failed", "skipped", "error"):
        for rep in terminalreporter.stats.get(outcome, []):
            if "flower" not in getattr(rep, "keywords", {}):
                continue
            if rep.when != "call" and outcome == "passed":
                continue
            counts[outcome] += 1
            if outcome == "skipped" and isinstance(rep.longrepr, tuple):
                reasons[rep.longrepr[2].removeprefix("Skipped: ")] += 1
    if not counts:
        return
    parts = [f"{counts[k]} {k}" for k in ("passed", "failed", "error", "skipped") if counts[k]]
    terminalreporter.write_sep("-", "flower tests (marker flower): " + ", ".join(parts))
    for why, n in reasons.most_common():
        terminalreporter.write_line(f"  {n} skipped: {why}")
