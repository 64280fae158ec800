"""Measure a small grid's wall time serially and with ``--jobs 2``, runs alternating, with
``/proc/loadavg`` read before and after each, and write the result file docs/results/NAME.json
that docs/benchmarks.md's table is generated from (scripts/published_figures.py).

    OMP_NUM_THREADS=1 FEDPROTO_DATA=... python scripts/measure_grid_jobs.py --pairs 2

Each run starts from an empty output folder (no cell skipped) as a whole ``fedproto reproduce``
process: the serial one with ``--threads 1``, the other with ``--threads 2 --jobs 2`` (two
processes of one thread). Every run's ``table.md`` is compared with the first serial run's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fedproto.outputs.run_folder import atomic_write_json  # noqa: E402
from fedproto.reproduce.published import RESULTS  # noqa: E402
from fedproto.reproduce.tables import provenance  # noqa: E402

GRID = "--grid hetero --datasets mnist --seeds 1234 --rounds 3 --methods local,fedproto"


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=2, help="serial / --jobs 2 pairs, alternating")
    ap.add_argument("--grid", default=GRID, help=f"the reproduce options of the grid (default: {GRID})")
    ap.add_argument("--work", type=Path, default=Path("/tmp/measure-grid-jobs"), help="scratch folder")
    ap.add_argument("--name", default="grid-jobs", help="the result file's name")
    ap.add_argument("--no-write", action="store_true", help="print the rows only")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git's, where the source is a clone)")
    args = ap.parse_args()
    if args.pairs < 1:
        ap.error("--pairs: give 1 or more")
    made = provenance()
    made["commit"] = args.commit or made["commit"]
    modes = [("serial (`--threads 1`)", ["--threads", "1"]), ("`--jobs 2` (`--threads 2`)",
                                                               ["--threads", "2", "--jobs", "2"])]
    rows, reference = [], None
    t_all = time.perf_counter()
    for i in range(args.pairs):
        for label, extra in modes:
            out = args.work / f"run{i + 1}-{'serial' if 'serial' in label else 'jobs2'}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = ["fedproto", "reproduce", *shlex.split(args.grid), *extra, "--out", str(out)]
            before = _load()
            t0 = time.perf_counter()
            res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            wall = time.perf_counter() - t0
            after = _load()
            if res.returncode != 0:
                print(res.stdout[-2000:], res.stderr[-2000:], file=sys.stderr)
                return 1
            table = (out / "table.md").read_text()
            first, reference = reference is None, table if reference is None else reference
            row = {"run": i + 1, "mode": label, "wall_s": wall, "load_before": before, "load_after": after,
                   "table": "reference" if first else ("identical" if table == reference else "differs")}
            rows.append(row)
            print(row, flush=True)
    result = {"name": args.name, "what": f"wall time of `fedproto reproduce {args.grid}`, serial and `--jobs 2`, "
                                        "alternating", "command": "python scripts/measure_grid_jobs.py "
                                        f"--pairs {args.pairs}", "ci": False,
              "cost": f"{(time.perf_counter() - t_all) / 60:.0f} min", "made": made, "rows": rows}
    if not args.no_write:
        dest = ROOT / RESULTS / f"{args.name}.json"
        atomic_write_json(dest, result)
        print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
