"""Mutation testing of fedproto's core math with mutmut (the ``mutation`` extra).

For each module (the prototype math, the privacy module, the heterogeneous methods' math, the
partition) this copies the checkout (the files git tracks or would track) to a work folder, writes
a ``[tool.mutmut]`` section there that mutates that one module against the fast tests that cover
it, and runs ``mutmut run`` with one worker process. mutmut changes one thing at a time in the
module (an operator, a number, a comparison, a string, an argument) and runs the tests that call
the changed function: a mutant is *killed* when a test fails, *survived* when all pass.

Not mutated: statements that raise an error or write a log line or a warning (their wording is a
message to the user, checked by phrase in the error tests, not math), and the module-level
constants (mutmut mutates function and method bodies only).

Usage (from the repository root, in a venv with ``pip install -e ".[dev,mutation]"``)::

    OMP_NUM_THREADS=1 python tools/mutation.py --work /tmp/fedproto-mutation
    OMP_NUM_THREADS=1 python tools/mutation.py --modules partition --work /tmp/fedproto-mutation

It prints, per module and in all, the mutants killed, survived, timed out and not covered, and
writes ``<work>/report.json`` (counts and every survivor's diff) and ``<work>/survivors.md``.
A module's folder is reused on a later run (mutmut keeps its results there); ``--fresh``
starts it again.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODULES: dict[str, tuple[str, list[str]]] = {
    "prototypes": ("src/fedproto/prototypes/*",
                   ["tests/prototypes/test_prototypes.py", "tests/prototypes/test_core_math.py"]),
    "privacy": ("src/fedproto/prototypes/dp.py", [
        "tests/prototypes/test_privacy.py", "tests/prototypes/test_core_math.py",
        # whole DP runs (seeded and secure noise, epsilon reported, BatchNorm refused): 10-80 s each
        "-k", "not differs_between_runs and not report_epsilon and not refuses_batchnorm and not plain_sgd"]),
    "htmath": ("src/fedproto/algorithms/hetero_math/*",
               ["tests/algorithms/test_htmath.py", "tests/prototypes/test_core_math.py"]),
    "partition": ("src/fedproto/data/partition.py", [
        "tests/data/test_data_partition.py", "tests/prototypes/test_core_math.py",
        # the end-to-end runs (a simulation, 10,000 clients, FEMNIST's writers) take 6-50 s each
        "-k", "not 10000 and not end_to_end and not one_client_per_writer"]),
}
"""Module key -> (the file mutated, or the files of a package as a glob, and the fast tests run against its mutants)."""

NOT_MUTATED = [r"^\s*raise ", r"\blog\.(debug|info|warning|error)\(", r"\bwarnings\.warn\("]
"""Lines whose statement mutmut leaves alone (``do_not_mutate_patterns``): messages to the user."""

KILLED, SURVIVED = "killed", "survived"


def toml_list(values: list[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def copy_checkout(dest: Path) -> None:
    """The files git tracks or would track (untracked, not ignored) copied to ``dest``."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def prepare(key: str, work: Path, fresh: bool) -> Path:
    """The work folder of module ``key``: a copy of the checkout with its ``[tool.mutmut]`` section."""
    path, tests = MODULES[key]
    folder = work / key
    if fresh and folder.exists():
        shutil.rmtree(folder)
    if not folder.exists():
        folder.mkdir(parents=True)
        copy_checkout(folder)
        with open(folder / "pyproject.toml", "a", encoding="utf-8") as f:
            f.write("\n[tool.mutmut]\n"
                    'source_paths = ["src"]\n'
                    f"only_mutate = {toml_list([path])}\n"
                    f"do_not_mutate_patterns = {toml_list(NOT_MUTATED)}\n"
                    f"pytest_add_cli_args_test_selection = {toml_list(tests)}\n"
                    'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q"]\n'
                    'process_isolation = "forkserver"\n'
                    "use_git_change_detection = false\n")
    return folder


def statuses(folder: Path) -> dict[str, str]:
    """Mutant name -> status, as ``mutmut results --all true`` prints them."""
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=folder,
                         capture_output=True, text=True, check=True).stdout
    got = {}
    for line in out.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and name:
            got[name] = status.strip()
    return got


def diff(folder: Path, name: str) -> str:
    return subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=folder, capture_output=True,
                          text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", default=",".join(MODULES),
                    help=f"comma-separated, of {', '.join(MODULES)} (default: all)")
    ap.add_argument("--work", type=Path, required=True, help="work folder (one copy of the checkout per module)")
    ap.add_argument("--fresh", action="store_true", help="start each module's folder again")
    ap.add_argument("--only", nargs="*", default=[],
                    help="mutant name patterns (fnmatch), e.g. 'fedproto.prototypes.dp.x_noisy_prototypes*'")
    ap.add_argument("--sample", type=int, default=0,
                    help="run a seeded random sample of this many mutants per module (0: all of them)")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed")
    args = ap.parse_args(argv)
    keys = [k.strip() for k in args.modules.split(",") if k.strip()]
    bad = [k for k in keys if k not in MODULES]
    if bad:
        ap.error(f"--modules {','.join(bad)}: choose from {', '.join(MODULES)}")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("PYTHONPATH", None)
    report: dict = {"modules": {}}
    for key in keys:
        folder = prepare(key, args.work.resolve(), args.fresh)
        print(f"== {key}: mutmut run in {folder}", flush=True)
        names = list(args.only)
        if args.sample:
            # generate the mutants (a filter that matches none stops mutmut right after), then draw the sample
            subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", "1", "none-such-mutant"],
                           cwd=folder, env=env, check=False, capture_output=True)
            pool = sorted(n for n in statuses(folder) if not args.only or any(fnmatch(n, o) for o in args.only))
            rng = random.Random(f"{args.seed}:{key}")
            names = sorted(rng.sample(pool, min(args.sample, len(pool))))
            print(f"   {key}: a sample of {len(names)} of {len(pool)} mutants (seed {args.seed})", flush=True)
        subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", "1", *names], cwd=folder,
                       env=env, check=False)
        st = statuses(folder)
        if args.sample:
            st = {n: s for n, s in st.items() if n in set(names)}
        counts: dict[str, int] = {}
        for s in st.values():
            counts[s] = counts.get(s, 0) + 1
        survivors = sorted(n for n, s in st.items() if s == SURVIVED)
        report["modules"][key] = {"file": MODULES[key][0], "tests": MODULES[key][1], "counts": counts,
                                  "sampled": len(st) if args.sample else None,
                                  "survivors": {n: diff(folder, n) for n in survivors}}
        print(f"   {key}: {counts}", flush=True)
    total: dict[str, int] = {}
    for m in report["modules"].values():
        for s, n in m["counts"].items():
            total[s] = total.get(s, 0) + n
    report["total"] = total
    judged = total.get(KILLED, 0) + total.get(SURVIVED, 0)
    report["score"] = total.get(KILLED, 0) / judged if judged else float("nan")
    (args.work / "report.json").write_text(json.dumps(report, indent=1))
    with open(args.work / "survivors.md", "w", encoding="utf-8") as f:
        for m in report["modules"].values():
            for name, d in m["survivors"].items():
                f.write(f"### {name}\n\n```diff\n{d}\n```\n\n")
    print(f"all: {total}; killed {total.get(KILLED, 0)} of {judged} judged ({100 * report['score']:.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
