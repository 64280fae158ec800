"""The result files of the published figures (:mod:`fedproto.reproduce.published`): ``docs/results/*.json``,
each what one command measured, read (:func:`load_results`), merged by name (``a+b``: the cells of
``a``, then those of ``b`` that ``a`` lacks) and made from a reproduce folder's ``table.json``
(:func:`make_result`); their errors are :class:`PublishedError`. The file format is described in
:mod:`fedproto.reproduce.published`, which re-exports the names here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

RESULTS = Path("docs") / "results"
"""Where the result files live, under the repository root."""


class PublishedError(ValueError):
    """A result file, block or cell that cannot be read or rendered (the message names it)."""


def _nan(rows: list[dict]) -> list[dict]:
    """JSON's nulls back to NaN in the numeric fields (the renderers test NaN)."""
    out = []
    for r in rows:
        out.append({k: (math.nan if v is None and (k.startswith(("acc_", "paper_", "params_")) or k.endswith("_s"))
                        else v) for k, v in r.items()})
    return out


def load_results(root: Path) -> dict[str, dict]:
    """Every result file under ``root/docs/results`` by name.

    Raises:
        PublishedError: a file that is not JSON, lacks ``rows``/``made``/``command``, or whose
            ``name`` is not its file name.
    """
    found = {}
    for f in sorted((Path(root) / RESULTS).glob("*.json")):
        try:
            r = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise PublishedError(f"{f}: not a readable JSON result file ({e})") from None
        missing = [k for k in ("name", "command", "made", "rows", "ci") if k not in r]
        if missing:
            raise PublishedError(f"{f}: a result file needs {', '.join(missing)}; make it with "
                                 "scripts/published_figures.py import")
        if r["name"] != f.stem:
            raise PublishedError(f"{f}: its name is {r['name']!r}; name the file {r['name']}.json")
        r["rows"] = _nan(r["rows"])
        found[r["name"]] = r
    return found


def make_result(table_json: Path, name: str, what: str, command: str, ci: bool, cost: str,
                commit: str | None = None) -> dict:
    """A result file's content from a reproduce folder's ``table.json`` (``commit``: the code the
    cells ran, where it differs from the one that wrote the table)."""
    try:
        t = json.loads(Path(table_json).read_text())
    except (OSError, ValueError) as e:
        raise PublishedError(f"{table_json}: not a readable table.json of fedproto reproduce ({e})") from None
    rows_in = t.get("rows") if isinstance(t, dict) else None
    if not isinstance(rows_in, list) or not rows_in or not all(
            isinstance(r, dict) and {"dataset", "method"} <= r.keys() for r in rows_in):
        raise PublishedError(f"{table_json}: not a table.json of fedproto reproduce (it needs 'rows', each with "
                             "'dataset' and 'method'); run fedproto reproduce --out FOLDER and import FOLDER")
    made = dict(t.get("made") or {})
    if commit:
        made["commit"] = commit
    rows = [{k: v for k, v in r.items() if k != "failed_cells"} for r in rows_in]
    return {"name": name, "what": what, "command": command, "ci": ci, "cost": cost, "made": made, "rows": rows}


def _result(results: dict, name: str) -> dict:
    """The result file ``name``; ``a+b+...``: the rows of ``a``, then those of ``b`` for the cells
    (dataset, stdev, method, n) ``a`` lacks, and so on (a table whose cells were run apart).

    Raises:
        PublishedError: a result file that does not exist.
    """
    parts = name.split("+")
    for part in parts:
        if part not in results:
            raise PublishedError(f"no result file {RESULTS / (part + '.json')} (have: {', '.join(results) or 'none'})")
    if len(parts) == 1:
        return results[name]
    rows, seen = [], set()
    for part in parts:
        for r in results[part]["rows"]:
            key = (r.get("dataset"), r.get("stdev"), r.get("method"), r.get("ways"))
            if key not in seen:
                seen.add(key)
                rows.append(r)
    return {**results[parts[0]], "name": name, "rows": rows}
