"""The heterogeneous grid's table of ``fedproto reproduce`` (markdown and CSV) and its ranking.
Part of :mod:`fedproto.reproduce`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

from fedproto.outputs.run_folder import atomic_write_bytes
from fedproto.reproduce.grid import (
    HETERO_METHODS,
    CellResult,
)
from fedproto.reproduce.tables import (
    _csv_bytes,
    _ordered,
    _pm,
    short,
    table_rows,
)

log = logging.getLogger("fedproto.reproduce")  # one logger for the package


HETERO_CAPTION = (
    "Model-heterogeneous grid (`fedproto reproduce --grid hetero`): clients of different architectures, "
    "each method on the same clients, data and seeds. Accuracy in % on each client's own test classes after "
    "the last round, mean over seeds of the per-seed client means ± the per-seed std over clients averaged "
    "over seeds; `[±x]` is the sample std (ddof 1) of the per-seed means (the spread over seeds). "
    "**classifier**: each client's own model after its local training of the last round (personal, every "
    "method). **nearest prototype**: the same model, nearest global prototype (FedProto eq. 4; FedProto and "
    "FedTGP). **global head**: the server's head of the last round on the client's own body (LG-FedAvg: the "
    "averaged head; FedGH: the head the server trained on the prototypes). Params: parameters sent per round "
    "summed over clients, ×10³, up / down. Rounds are fewer than tab. 1's (see the rounds column): the grid "
    "is sized for a CPU; Local trains for the same number of local epochs without communicating."
)
"""Caption of the heterogeneous grid's table."""

HETERO_FIELDS = ("dataset", "model", "method", "algorithm", "ways", "seeds", "failed", "acc_mean", "acc_std_clients",
                 "acc_std_seeds", "acc_proto_mean", "acc_proto_std_clients", "acc_proto_std_seeds", "acc_global_mean",
                 "acc_global_std_clients", "acc_global_std_seeds", "rounds", "params_up_per_round",
                 "params_down_per_round", "wall_s_per_seed", "message")


def ranking(rows: Sequence[dict], key: str = "acc") -> tuple[str | None, list[str], list[str]]:
    """The leader of ``rows`` (one dataset, model set and ways) by ``<key>_mean``, the methods whose
    order against it is undecided and those it leads clearly.

    Rule: a method's gap to the leader (difference of the means over seeds) is compared with the
    larger of the two methods' std over seeds (``<key>_std_seeds``); a gap at most that large leaves
    the order undecided. With one seed (no std over seeds) every order is undecided.

    Returns:
        (leader, undecided, behind); leader None when no row has a value.
    """
    ok = [r for r in rows if r.get(f"{key}_mean", math.nan) == r.get(f"{key}_mean", math.nan)]
    if not ok:
        return None, [], []
    ok.sort(key=lambda r: -r[f"{key}_mean"])
    lead = ok[0]
    undecided, behind = [], []
    for r in ok[1:]:
        spread = max(lead[f"{key}_std_seeds"], r[f"{key}_std_seeds"])
        gap = lead[f"{key}_mean"] - r[f"{key}_mean"]
        (undecided if not gap > spread else behind).append(r["method"])  # NaN spread: undecided
    return lead["method"], undecided, behind


def render_hetero_markdown(rows: Sequence[dict], methods_order: Sequence[str] = tuple(HETERO_METHODS)) -> str:
    """The heterogeneous grid's table: one block per dataset, model set and ways, one row per
    method, with the leader and the undecided orders (:func:`ranking`) under each block."""
    out = ["# Model-heterogeneous methods", "", HETERO_CAPTION, ""]
    blocks: dict[tuple, list[dict]] = {}
    for r in rows:
        blocks.setdefault((r["dataset"], r["model"], r["ways"]), []).append(r)
    failures: dict[str, list[str]] = {}

    def cell(r: dict, key: str) -> str:
        if r.get(f"{key}_mean", math.nan) != r.get(f"{key}_mean", math.nan):
            return "–"
        s = _pm(r[f"{key}_mean"], r[f"{key}_std_clients"])
        return s + (f" [±{r[f'{key}_std_seeds']:.2f}]" if r[f"{key}_std_seeds"] == r[f"{key}_std_seeds"] else "")

    for (ds, model, n), rs in blocks.items():
        by = {r["method"]: r for r in rs}
        out += [f"## {ds}, n={n}, models `{model}`", "",
                "| method | classifier | nearest prototype | global head | params ×10³ up / down | rounds | seeds |",
                "|---|--:|--:|--:|--:|--:|--:|"]
        for m in _ordered(list(by), methods_order):
            r = by[m]
            for name, msg in r.get("failed_cells", []):
                failures.setdefault(short(msg), []).append(name)
            if r["seeds"] == 0:
                out.append(f"| {m} | failed | – | – | – | {r['rounds']} | 0 |")
                continue
            up, down = r["params_up_per_round"] / 1e3, r["params_down_per_round"] / 1e3
            fail = f" ({r['failed']} failed)" if r["failed"] else ""
            out.append(f"| {m} | {cell(r, 'acc')} | {cell(r, 'acc_proto')} | {cell(r, 'acc_global')} | "
                       f"{up:.1f} / {down:.1f} | {r['rounds']} | {r['seeds']}{fail} |")
        lead, undecided, behind = ranking(rs)
        if lead is not None:
            line = f"Classifier accuracy: **{lead}** leads"
            line += (f"; its order against {', '.join(undecided)} is undecided (gap to the leader within the larger "
                     "std over seeds)" if undecided else "")
            line += f"; it leads {', '.join(behind)} by more than the std over seeds." if behind else "."
            out += ["", line]
        out.append("")
    if failures:
        out += ["## Failed cells", "", "First line of each error; full messages in status.json.", ""]
        out += [f"- {', '.join(names)}: {msg}" for msg, names in failures.items()] + [""]
    return "\n".join(out)


def write_hetero_table(out: Path, results: Sequence[CellResult],
                       methods_order: Sequence[str] = tuple(HETERO_METHODS)) -> list[dict]:
    """Write the heterogeneous grid's ``table.md`` and ``table.csv`` (atomically); returns the rows."""
    rows = table_rows(results)
    atomic_write_bytes(Path(out) / "table.md", render_hetero_markdown(rows, methods_order).encode())
    atomic_write_bytes(Path(out) / "table.csv", _csv_bytes(rows, HETERO_FIELDS))
    return rows
