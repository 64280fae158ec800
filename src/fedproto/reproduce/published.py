"""Published figures from result files: the tables and numbers of README.md and docs/*.md that
come from a measurement are generated from result files kept in the repository
(``docs/results/*.json``), so a table and the run it reports cannot drift apart. Part of
:mod:`fedproto.reproduce`; ``python scripts/published_figures.py`` is the command.

A **result file** (``docs/results/NAME.json``) holds what one command measured: ``name``, ``what``
(a sentence), ``command`` (how to make it again), ``ci`` (False: too slow for CI) and ``cost``
(how long it took), ``made`` (``date``, ``commit`` and the machine: when and from which code it
was last made) and ``rows`` (``fedproto reproduce``'s table rows, :func:`~fedproto.reproduce.tables.table_rows`,
or a benchmark's rows). ``fedproto reproduce`` writes ``OUT/table.json`` (the rows and ``made``);
``scripts/published_figures.py import OUT --name NAME ...`` turns it into a result file
(:mod:`fedproto.reproduce.result_files` reads, merges and makes them).

In a page, a generated **block** is everything between ``<!-- figures:SPEC -->`` and
``<!-- /figures:SPEC -->``, where SPEC is ``KIND:RESULT[:ARG]`` (:data:`BLOCKS`); a single
number in the text is ``<!-- cell:RESULT:METHOD:WAYS:METRIC:STYLE -->98.46 ± 1.47<!-- /cell -->``
(METRIC: ``acc``, personal/classifier; ``acc_global``; ``acc_proto``, nearest prototype;
STYLE: ``pm`` mean ± std, ``2`` or ``1`` decimals of the mean). A page that is one generated
table starts with ``<!-- figures:file:RESULT -->`` (:data:`FILE`). RESULT may be ``a+b``: the
cells of ``a``, then those of ``b`` that ``a`` lacks. :func:`regenerate` rewrites them all;
:func:`printed_cells` reads every number a block or cell prints back, so :func:`conflicts` can say
where the same cell is printed with two values.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from fedproto.reproduce.grid import METHODS
from fedproto.reproduce.result_files import RESULTS as RESULTS  # re-exported: the result files
from fedproto.reproduce.result_files import PublishedError as PublishedError
from fedproto.reproduce.result_files import _nan, _result
from fedproto.reproduce.result_files import load_results as load_results
from fedproto.reproduce.result_files import make_result as make_result
from fedproto.reproduce.tables import TABLE_FIELDS, _csv_bytes, _ours_cell, _pm, render_markdown

PAGES = ("README.md", "docs/*.md", "docs/results/*.md")
"""The pages whose blocks and cells are generated and cross-checked (globs under the root)."""

NAMES = {"local": "Local", "fesem": "FeSEM", "fedprox": "FedProx", "fedper": "FedPer", "fedavg": "FedAvg",
         "fedrep": "FedRep", "fedproto": "**FedProto**", "fedproto-mh": "**FedProto-mh**"}
"""How the README's tab. 1 table names the methods."""

METRICS = ("acc", "acc_global", "acc_proto")

BLOCK = re.compile(r"<!-- figures:(?P<spec>[\w.:+-]+) -->\n(?P<body>.*?)<!-- /figures:(?P=spec) -->", re.S)
CELL = re.compile(r"<!-- cell:(?P<key>[\w.:+-]+) -->(?P<text>.*?)<!-- /cell -->")


# ------------------------------------------------------------------------------------------------
# what blocks and cells print


def _row(res: dict, method: str, ways: int) -> dict:
    for r in res["rows"]:
        if r.get("method") == method and int(r.get("ways", -1)) == int(ways):
            return r
    raise PublishedError(f"{res['name']}: no row for method {method!r}, n = {ways}")


def format_cell(row: dict, metric: str, style: str) -> str:
    """One number as a page prints it: ``pm`` mean ± std over clients, ``2``/``1``: the mean."""
    if metric not in METRICS:
        raise PublishedError(f"metric {metric!r}: use one of {', '.join(METRICS)}")
    if style == "pm":
        return _ours_cell(row, metric)
    if style in ("1", "2"):
        m = row[f"{metric}_mean"]
        return "–" if m != m else f"{m:.{style}f}"
    raise PublishedError(f"style {style!r}: use pm, 2 or 1")


def _tab1(res: dict, ways: str) -> str:
    """README: tab. 1's block for one n, ours (personal) beside the paper, and parameters."""
    n = int(ways)
    lines = ["| method | ours | paper (tab. 1) | params ×10³ ours / paper |", "|---|--:|--:|--:|"]
    for m in METHODS:
        try:
            r = _row(res, m, n)
        except PublishedError:
            continue
        paper = _pm(r["paper_mean"], r["paper_std"]) if r["paper_mean"] == r["paper_mean"] else "n.a."
        up = r["params_up_per_round"] / 1e3
        pk = r["paper_params_k"]
        lines.append(f"| {NAMES.get(m, m)} | {_ours_cell(r)} | {paper} | "
                     f"{'0' if up == 0 else f'{up:.1f}'} / {'n.a.' if pk is None else f'{pk:g}'} |")
    return "\n".join(lines) + "\n"


def _global_personal(res: dict, arg: str | None = None) -> str:
    """docs/reproducing.md: both protocols of the weight-sharing methods beside the paper, per n."""
    rows = [r for r in res["rows"] if r.get("acc_global_mean") == r.get("acc_global_mean")
            and r.get("acc_global_mean") is not None]
    ways = sorted({int(r["ways"]) for r in rows})
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    head = ["method"] + [f"n={n} {w}" for n in ways for w in ("global", "personal", "paper")]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["--:"] * (len(head) - 1)) + "|"]
    for m in methods:
        cells = [m]
        for n in ways:
            try:
                r = _row(res, m, n)
            except PublishedError:  # a cell not run
                cells += ["–", "–", "–"]
                continue
            cells += [_ours_cell(r, "acc_global"), _ours_cell(r),
                      _pm(r["paper_mean"], r["paper_std"]) if r["paper_mean"] == r["paper_mean"] else "n.a."]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _grid_jobs(res: dict, arg: str | None = None) -> str:
    """docs/benchmarks.md: measured wall times of a grid, serial against ``--jobs 2``, with the load."""
    lines = ["| run | mode | wall s | `cat /proc/loadavg` before | after | table |", "|--:|---|--:|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['run']} | {r['mode']} | {r['wall_s']:.1f} | {r['load_before']} | {r['load_after']} | "
                     f"{r['table']} |")
    serial = {r["run"]: r["wall_s"] for r in res["rows"] if r["mode"].startswith("serial")}
    jobs = {r["run"]: r["wall_s"] for r in res["rows"] if not r["mode"].startswith("serial")}
    if serial and jobs:
        s, j = _median(list(serial.values())), _median(list(jobs.values()))
        pairs = ", ".join(f"{serial[k] / jobs[k]:.2f}x" for k in sorted(serial) if k in jobs)
        lines.append(f"| median | serial / `--jobs 2` | {s:.1f} / {j:.1f} | | | **{s / j:.2f}x** "
                     f"(per run: {pairs}) |")
    return "\n".join(lines) + "\n"


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _flower_sim(res: dict, arg: str | None = None) -> str:
    """docs/benchmarks.md: memory, time and accuracy of bench_flower_sim.py's runs."""
    lines = ["| run | peak RSS (MB) | peak PSS (MB) | actor RSS / USS (MB) | s per round | wall (s) | accuracy "
             "| load average (1 min) before -> after |", "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in res["rows"]:
        actor = f"{r['actor_rss_mb']} / {r['actor_uss_mb']}" if r.get("actors_seen") else "-"
        acc = " / ".join(f"{v:.6f}" for v in r["accuracy"].values())
        lines.append(f"| {r['run']} | {r['peak_rss_mb']} | {r['peak_pss_mb']} | {actor} | {r['s_per_round']:.2f} | "
                     f"{r['wall_s']:.1f} | {acc} | {r['load'][0]:.2f} -> {r['load'][1]:.2f} |")
    return "\n".join(lines) + "\n"


def _index(results: dict, arg: str | None = None) -> str:
    """Every result file: what it holds, when and from which commit it was last made, the command,
    and whether CI can make it again."""
    lines = ["| result file | what | last made (UTC) | commit | CPU | made in CI | command |",
             "|---|---|---|---|---|---|---|"]
    for name, r in sorted(results.items()):
        made = r["made"]
        ci = "yes" if r["ci"] else f"no, too slow: {r.get('cost', '?')}"
        lines.append(f"| `{RESULTS.as_posix()}/{name}.json` | {r.get('what', '')} | {made.get('date', '?')} | "
                     f"{made.get('commit') or '?'} | {made.get('cpu') or '?'} | {ci} | `{r['command']}` |")
    return "\n".join(lines) + "\n"


BLOCKS: dict[str, Callable[..., str]] = {"tab1": _tab1, "global-personal": _global_personal,
                                         "grid-jobs": _grid_jobs, "flower-sim": _flower_sim}
"""Block kinds: ``KIND:RESULT[:ARG]`` renders ``BLOCKS[KIND](result, ARG)``; ``index`` lists all results."""


def render_block(spec: str, results: dict) -> str:
    """The text between a block's markers.

    Raises:
        PublishedError: an unknown kind or result, or a row the block needs is missing.
    """
    kind, _, rest = spec.partition(":")
    if kind == "index":
        return _index(results)
    if kind not in BLOCKS:
        raise PublishedError(f"<!-- figures:{spec} -->: unknown kind {kind!r}; use index or one of "
                             f"{', '.join(BLOCKS)}")
    name, _, arg = rest.partition(":")
    return BLOCKS[kind](_result(results, name), arg or None)


def render_cell(key: str, results: dict) -> str:
    """The text of ``<!-- cell:RESULT:METHOD:WAYS:METRIC:STYLE -->``."""
    parts = key.split(":")
    if len(parts) != 5:
        raise PublishedError(f"<!-- cell:{key} -->: give RESULT:METHOD:WAYS:METRIC:STYLE, "
                             "e.g. mnist:fedavg:3:acc_global:pm")
    name, method, ways, metric, style = parts
    return format_cell(_row(_result(results, name), method, int(ways)), metric, style)


def _grid_order(rows: list[dict]) -> list[dict]:
    """Rows as a grid run lists them: by n, then tab. 1's method order."""
    order = {m: i for i, m in enumerate(METHODS)}
    return sorted(rows, key=lambda r: (str(r.get("dataset")), int(r.get("ways", 0)), order.get(r.get("method"), 99)))


def _made_by(results: dict, name: str) -> str:
    """Where a (merged) result's cells come from: each file with its cells, date, commit, command."""
    merged = _result(results, name)
    taken: dict[str, list[str]] = {}
    for r in merged["rows"]:
        for part in name.split("+"):
            if any(x.get("method") == r.get("method") and x.get("ways") == r.get("ways")
                   and x.get("dataset") == r.get("dataset") for x in results[part]["rows"]):
                taken.setdefault(part, []).append(f"{r['method']} n={r['ways']}")
                break
    lines = ["## Made by", "", f"Generated by `python scripts/published_figures.py` from {RESULTS.as_posix()}/"
             f"{name.replace('+', '.json + ')}.json; each cell from the first file that has it:", ""]
    for part, cells in taken.items():
        made = results[part]["made"]
        lines.append(f"- `{part}.json` ({len(cells)} cells: {', '.join(cells)}): made {made.get('date', '?')} "
                     f"at commit {made.get('commit') or '?'} by `{results[part]['command']}`")
    return "\n".join(lines) + "\n"


def _table_file_md(results: dict, name: str) -> str:
    body = render_markdown(_grid_order(_nan(_result(results, name)["rows"])))
    body += "\n" + _made_by(results, name)
    return f"<!-- figures:file:{name} -->\n{body}\n<!-- /figures:file:{name} -->\n"  # a block too: cross-checked


def _table_file_csv(results: dict, name: str) -> str:
    return _csv_bytes(_grid_order(_result(results, name)["rows"]), TABLE_FIELDS).decode()


FILE = re.compile(r"\A<!-- figures:file:(?P<spec>[\w.:+-]+) -->\n")
"""A page that is one generated table (``docs/results/mnist-table.md``) starts with
``<!-- figures:file:RESULT -->``: the whole page, and the CSV beside it (same name, ``.csv``), is
``fedproto reproduce``'s table.md / table.csv of RESULT (``a+b`` merges, as in blocks)."""


def rewrite(text: str, results: dict) -> str:
    """``text`` with every block and cell rendered afresh from ``results``."""
    text = BLOCK.sub(lambda m: f"<!-- figures:{m['spec']} -->\n{render_block(m['spec'], results)}"
                               f"<!-- /figures:{m['spec']} -->", text)
    return CELL.sub(lambda m: f"<!-- cell:{m['key']} -->{render_cell(m['key'], results)}<!-- /cell -->", text)


def pages(root: Path) -> list[Path]:
    """The pages :data:`PAGES` names, that exist."""
    out: list[Path] = []
    for g in PAGES:
        out += sorted(Path(root).glob(g))
    return list(dict.fromkeys(out))


def regenerate(root: Path, write: bool = True) -> dict[Path, tuple[str, str]]:
    """Render every generated file, block and cell under ``root`` from its result files; returns the
    files whose text changed, as path: (old, new), and writes them unless ``write`` is False."""
    root = Path(root)
    results = load_results(root)
    changed: dict[Path, tuple[str, str]] = {}
    for p in pages(root):
        old = p.read_bytes().decode()  # as bytes: the CSV's line ends are \r\n
        whole = FILE.match(old)
        if whole:  # a generated table page, and its CSV
            new = _table_file_md(results, whole["spec"])
            csv_path = p.with_suffix(".csv")
            old_csv = csv_path.read_bytes().decode() if csv_path.exists() else ""
            new_csv = _table_file_csv(results, whole["spec"])
            if new_csv != old_csv:
                changed[csv_path] = (old_csv, new_csv)
        else:
            new = rewrite(old, results)
        if new != old:
            changed[p] = (old, new)
    if write:
        for p, (_, new) in changed.items():
            p.write_bytes(new.encode())
    return changed


# ------------------------------------------------------------------------------------------------
# the cross-check: a cell printed in two places with two values


_HEAD = re.compile(r"^(?:n=(?P<n>\d+) )?(?P<what>ours|personal|global|classifier|nearest prototype)$")
_METRIC_OF = {"ours": "acc", "personal": "acc", "classifier": "acc", "global": "acc_global",
              "nearest prototype": "acc_proto"}


def _setting(res: dict, row: dict | None = None) -> str:
    r = row or res["rows"][0]
    return f"{r.get('dataset')} stdev {r.get('stdev')} rounds {r.get('rounds')} seeds {r.get('seeds')}"


def _table_cells(body: str, res: dict, ways: int | None) -> list[tuple[tuple, str]]:
    """(key, printed text) of every accuracy a markdown table in ``body`` prints. Key:
    (setting, method, n, metric); columns as headed ``n=3 ours``/``global``/``nearest prototype``...,
    the row's method from a ``method`` column and n from an ``n`` column, the header or ``ways``."""
    out = []
    lines = [ln for ln in body.splitlines()]
    i = 0
    while i < len(lines):
        if not (lines[i].startswith("|") and i + 1 < len(lines) and set(lines[i + 1].replace("|", "").strip())
                <= set("-: ")):
            i += 1
            continue
        head = [c.strip() for c in lines[i].strip().strip("|").split("|")]
        i += 2
        while i < len(lines) and lines[i].startswith("|"):
            cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            i += 1
            row = dict(zip(head, cells))
            method = row.get("method", "").replace("*", "").strip().lower()
            if method not in METHODS:
                continue
            n_row = int(row["n"]) if row.get("n", "").isdigit() else ways
            by_method = [r for r in res["rows"] if r.get("method") == method]
            for h, text in row.items():
                m = _HEAD.match(h)
                if not m or text in ("–", "", "failed"):
                    continue
                n = int(m["n"]) if m["n"] else n_row
                rr = next((r for r in by_method if int(r["ways"]) == n), None)
                out.append(((_setting(res, rr), method, n, _METRIC_OF[m["what"]]), text))
    return out


def printed_cells(root: Path) -> list[tuple[tuple, str, str]]:
    """Every accuracy the pages print in a block or cell: (key, text, where). Key: (setting,
    method, n, metric), the setting being the result's dataset, stdev, rounds and seeds."""
    root = Path(root)
    results = load_results(root)
    found = []
    for p in pages(root):
        text = p.read_text()
        where = p.relative_to(root).as_posix()
        for m in BLOCK.finditer(text):
            kind, _, rest = m["spec"].partition(":")
            name, _, arg = rest.partition(":")
            if kind not in ("tab1", "global-personal", "file"):
                continue
            ways = int(arg) if arg.isdigit() else None
            for key, t in _table_cells(m["body"], _result(results, name), ways):
                found.append((key, t, f"{where} ({m['spec']})"))
        for m in CELL.finditer(text):
            parts = m["key"].split(":")
            if len(parts) != 5:
                continue
            name, method, ways, metric, _ = parts
            res = _result(results, name)
            rr = next((r for r in res["rows"] if r.get("method") == method and int(r["ways"]) == int(ways)), None)
            found.append(((_setting(res, rr), method, int(ways), metric), m["text"], f"{where} (cell {m['key']})"))
    return found


_NUM = re.compile(r"^(?P<mean>\d+(?:\.\d+)?)(?: ± (?P<std>\d+(?:\.\d+)?))?")


def _agree(a: str, b: str) -> bool:
    """Two printings of one cell agree: each number (mean; std where both print it) is the same
    value rounded to the decimals each shows."""
    ma, mb = _NUM.match(a.strip()), _NUM.match(b.strip())
    if not ma or not mb:
        return a.strip() == b.strip()
    for k in ("mean", "std"):
        x, y = ma[k], mb[k]
        if x is None or y is None:
            continue
        dx = len(x.split(".")[1]) if "." in x else 0
        dy = len(y.split(".")[1]) if "." in y else 0
        if abs(float(x) - float(y)) > 0.5 * 10 ** -dx + 0.5 * 10 ** -dy + 1e-9:
            return False
    return True


def conflicts(root: Path) -> list[str]:
    """One line per cell printed with values that cannot be the same number, naming each place."""
    by: dict[tuple, list[tuple[str, str]]] = {}
    for key, text, where in printed_cells(root):
        by.setdefault(key, []).append((text, where))
    out = []
    for key, seen in by.items():
        for t, w in seen[1:]:
            if not _agree(seen[0][0], t):
                out.append(f"{key[1]} n={key[2]} {key[3]} ({key[0]}): {seen[0][0]!r} in {seen[0][1]}, "
                           f"{t!r} in {w}")
    return out
