"""The benchmarks refuse bad arguments up front with one line naming the argument, not a traceback
deep inside (or, for --before, by silently measuring the installed fedproto as 'before')."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("script, args, says", [
    ("bench_engine.py", ["--repeats", "0"], "argument --repeats: 0 is less than 1"),
    ("bench_engine.py", ["--rounds", "-2"], "argument --rounds: -2 is less than 1"),
    ("bench_engine.py", ["--before", "/nonexistent"], "--before /nonexistent: no fedproto package there"),
    ("bench_engine.py", ["--scale", "abc"], "--scale 'abc': give client counts separated by commas"),
    ("bench_engine.py", ["--scale", "100,1"], "each client count must be at least 2"),
    ("bench_engine.py", ["--max-workers", "-1"], "--max-workers -1: give 1 or more"),
    ("bench_kernels.py", ["--repeats", "0"], "argument --repeats: 0 is less than 1"),
    ("bench_kernels.py", ["--groups", "x"], "argument --groups: 'x' is not an integer"),
    ("bench_startup.py", ["--repeats", "0"], "argument --repeats: 0 is less than 1"),
    ("bench_flower_sim.py", ["--clients", "0"], "--clients 0: give 1 or more"),
    ("bench_flower_sim.py", ["--actors", "1,x"], "--actors '1,x': give actor counts separated by commas"),
    ("bench_secagg.py", ["--rounds", "0"], "argument --rounds: 0 is less than 1"),
    ("bench_official.py", ["--share-only", "--pairs", "0"], "argument --pairs: 0 is less than 1"),
    ("bench_official.py", [], "--official is required"),
    ("bench_kernels.py", ["--clock", "sun"], "argument --clock: invalid choice: 'sun'"),
    ("grid_scaling.py", ["status.json", "--jobs", "2,0"], "--jobs '2,0': each slot count must be 1 or more"),
    ("grid_scaling.py", ["missing.json"], "'missing.json': not a readable status.json"),
])
def test_bad_benchmark_arguments(script, args, says, tmp_path):
    r = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr, r.stderr
