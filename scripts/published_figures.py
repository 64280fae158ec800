"""Regenerate every published table and number of README.md and docs/*.md from the result files
in docs/results/*.json, check them, or add a result file.

    python scripts/published_figures.py            # rewrite the generated tables, numbers and files
    python scripts/published_figures.py --check    # exit 1 if any page differs from its results,
                                                   # or one cell is printed with two values (CI)
    python scripts/published_figures.py --list     # the result files: when made, commit, CI or not
    python scripts/published_figures.py import reproduce/mnist --name mnist \\
        --what "tab. 1's MNIST block" --command "fedproto reproduce ..." --slow "about 45 min"

Rendering only reads the result files: it takes seconds and runs in CI. Making a result file
again means running its command (``--list`` says which are too slow for CI, and when and from
which commit each was last made). The markers and the file format: fedproto.reproduce.published.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fedproto.outputs.run_folder import atomic_write_json  # noqa: E402
from fedproto.reproduce.published import (  # noqa: E402
    RESULTS,
    PublishedError,
    conflicts,
    load_results,
    make_result,
    regenerate,
)


def _list(root: Path) -> None:
    for name, r in sorted(load_results(root).items()):
        made = r["made"]
        ci = "made in CI" if r["ci"] else f"too slow for CI ({r.get('cost', '?')})"
        print(f"{RESULTS.as_posix()}/{name}.json: last made {made.get('date', '?')} at commit "
              f"{made.get('commit') or '?'}; {ci}\n    {r['command']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this script's)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 on a difference or a conflict")
    ap.add_argument("--list", action="store_true", help="list the result files")
    sub = ap.add_subparsers(dest="cmd")
    imp = sub.add_parser("import", help="make docs/results/NAME.json from a reproduce folder's table.json")
    imp.add_argument("out", type=Path, help="the reproduce --out folder (holds table.json)")
    imp.add_argument("--name", required=True)
    imp.add_argument("--what", required=True, help="one sentence: what the result is")
    imp.add_argument("--command", required=True, help="the command that made it")
    imp.add_argument("--slow", default=None, help="too slow for CI: how long it took (else: made in CI)")
    imp.add_argument("--commit", default=None, help="the commit the cells ran (default: table.json's)")
    imp.add_argument("--replace", action="store_true", help="overwrite an existing result file of that name")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "import":
            if args.check:
                ap.error("--check writes nothing, and import writes a result file: run import without --check")
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.name) or ".." in args.name:
                ap.error(f"--name {args.name!r}: a result file's name is letters, digits, '_', '-' and '.' "
                         "(it becomes docs/results/NAME.json), e.g. --name mnist-2026-12-06")
            dest = args.root / RESULTS / f"{args.name}.json"
            if dest.exists() and not args.replace:
                ap.error(f"{dest} exists: pick another --name, or add --replace to overwrite it")
            table = args.out / "table.json"
            if not table.is_file():
                ap.error(f"{table} not found: run fedproto reproduce --out {args.out} first (this version "
                         "writes table.json; an older grid: run its command again, every cell is skipped)")
            res = make_result(table, args.name, args.what, args.command, args.slow is None, args.slow or "",
                              args.commit)
            atomic_write_json(dest, res)  # NaN as null
            print(f"wrote {dest}")
            return 0
        if args.list:
            _list(args.root)
            return 0
        if not (args.root / RESULTS).is_dir() or not load_results(args.root):
            raise PublishedError(f"no result files in {args.root / RESULTS}: nothing to check or render "
                                 "(--root is the repository that holds docs/results/*.json)")
        changed = regenerate(args.root, write=not args.check)
        for p, (old, new) in changed.items():
            rel = p.relative_to(args.root)
            if args.check:
                sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                           f"{rel} (as it is)", f"{rel} (from its results)"))
            else:
                print(f"rewrote {rel}")
        bad = conflicts(args.root)
        for line in bad:
            print(f"conflict: {line}")
        if not changed and not bad:
            print("every generated table, number and file agrees with docs/results/*.json")
        _list(args.root)
        return 1 if (args.check and changed) or bad else 0
    except PublishedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
