"""The results of ``fedproto reproduce``: per-cell numbers over seeds, the paper's table (markdown
and CSV), the status file. Part of :mod:`fedproto.reproduce`.
"""

from __future__ import annotations

import csv
import datetime as _dt
import io
import logging
import math
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.markup import escape

from fedproto.outputs.run_folder import atomic_write_bytes, atomic_write_json
from fedproto.reproduce import paper_numbers as paper
from fedproto.reproduce.grid import (
    METHODS,
    CellResult,
    model_for,
)

log = logging.getLogger("fedproto.reproduce")  # one logger for the package


# ------------------------------------------------------------------------------------------------
# aggregation


def _acc(summary: dict | None, key: str) -> tuple[float, float]:
    a = ((summary or {}).get("accuracy") or {}).get(key) or {}
    m, s = a.get("mean"), a.get("std")
    return (float("nan") if m is None else float(m), float("nan") if s is None else float(s))


def seed_stats(pairs: Sequence[tuple[float, float]]) -> dict[str, float]:
    """Combine per-seed (mean over clients, std over clients).

    Rule: ``mean`` = mean over seeds of the per-seed means; ``std_clients`` = per-seed std over
    clients, averaged over seeds; ``std_seeds`` = sample std (ddof 1) of the per-seed means (NaN for
    one seed). Seeds without a value (NaN) are left out.
    """
    ok = [(m, s) for m, s in pairs if m == m]
    if not ok:
        return {"mean": float("nan"), "std_clients": float("nan"), "std_seeds": float("nan"), "n": 0}
    ms = np.asarray([m for m, _ in ok])
    ss = np.asarray([s for _, s in ok if s == s])
    return {
        "mean": float(ms.mean()),
        "std_clients": float(ss.mean()) if len(ss) else float("nan"),
        "std_seeds": float(ms.std(ddof=1)) if len(ms) > 1 else float("nan"),
        "n": len(ok),
    }


def proto_mse(run_dir: str | Path) -> float:
    """Prototype loss on the test embeddings of a finished run: per client, the mean squared error
    (official form, mean over samples and dimensions) between each embedding and the global
    prototype of its class, over samples whose class has one; then the mean over clients. NaN
    when the run has no prototypes. Unlike the training ``loss_proto`` (0 when λ = 0), it is
    defined for every λ, so fig. 4's curve can start at λ = 0."""
    d = Path(run_dir)
    ef, pf = d / "embeddings.npz", d / "prototypes.npz"
    if not (ef.is_file() and pf.is_file()):
        return float("nan")
    try:
        e, p = np.load(ef), np.load(pf)
        if len(p["classes"]) == 0:
            return float("nan")
        table = {int(c): v for c, v in zip(p["classes"], p["protos"])}
        per_client = []
        for c in np.unique(e["client"]):
            m = (e["client"] == c) & np.isin(e["y"], list(table))
            if not m.any():
                continue
            target = np.stack([table[int(k)] for k in e["y"][m]])
            per_client.append(float(((e["h"][m] - target) ** 2).mean()))
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:  # damaged or foreign files
        log.warning("no prototype distance for %s: %s", d, err)
        return float("nan")
    return float(np.mean(per_client)) if per_client else float("nan")


def _last_loss_proto(run_dir: Path) -> float:
    from fedproto.outputs.run_folder import read_metrics

    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return float("nan")
    rows = read_metrics(f)
    v = rows[-1].get("loss_proto") if rows else None
    return float("nan") if v is None else float(v)


def short(message: str, limit: int = 240) -> str:
    """First line of an error message, cut to ``limit`` characters (full text: status.json)."""
    line = (message or "").strip().splitlines()[0] if (message or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _pm(m: float, s: float) -> str:
    if m != m:
        return "–"
    return f"{m:.2f} ± {s:.2f}" if s == s else f"{m:.2f}"


def _ordered(values: Sequence, order: Sequence) -> list:
    seen = list(dict.fromkeys(values))
    return [v for v in order if v in seen] + [v for v in seen if v not in order]


def table_rows(results: Sequence[CellResult]) -> list[dict]:
    """One row per (dataset, stdev, method, ways): our seed-combined accuracies (%), the paper's,
    rounds and parameters per round."""
    groups: dict[tuple, list[CellResult]] = {}
    for r in results:
        c = r.cell
        groups.setdefault((c.dataset, c.cfg.stdev, c.method, c.ways, c.cfg.model), []).append(r)
    rows = []
    for (ds, sd, method, n, _), rs in groups.items():
        ok = [r for r in rs if r.status in ("done", "skipped") and r.summary]
        failed = [r for r in rs if r.status == "failed"]
        acc = seed_stats([tuple(100 * v for v in _acc(r.summary, "acc")) for r in ok])
        accp = seed_stats([tuple(100 * v for v in _acc(r.summary, "acc_proto")) for r in ok])
        accg = seed_stats([tuple(100 * v for v in _acc(r.summary, "acc_global")) for r in ok])
        pp = paper.accuracy(ds, sd, method, n)
        up = [r.summary["params_per_round"]["up"] for r in ok if r.summary.get("params_per_round")]
        down = [r.summary["params_per_round"].get("down", math.nan) for r in ok if r.summary.get("params_per_round")]
        wall = [r.summary.get("wall_time_s", r.wall_s) for r in ok]
        rows.append({
            "dataset": ds, "stdev": sd, "method": method, "algorithm": rs[0].cell.cfg.algorithm,
            "model": rs[0].cell.cfg.model, "ways": n, "seeds": acc["n"] if ok else 0, "failed": len(failed),
            "acc_mean": acc["mean"], "acc_std_clients": acc["std_clients"], "acc_std_seeds": acc["std_seeds"],
            "acc_proto_mean": accp["mean"], "acc_proto_std_clients": accp["std_clients"],
            "acc_proto_std_seeds": accp["std_seeds"],
            "acc_global_mean": accg["mean"], "acc_global_std_clients": accg["std_clients"],
            "acc_global_std_seeds": accg["std_seeds"],
            "paper_mean": pp[0] if pp else float("nan"), "paper_std": pp[1] if pp else float("nan"),
            "rounds": rs[0].cell.cfg.rounds, "paper_rounds": paper.rounds(ds, method),
            "params_up_per_round": float(np.mean(up)) if up else float("nan"),
            "params_down_per_round": float(np.mean(down)) if down else float("nan"),
            "paper_params_k": paper.params_k(ds, method),
            "wall_s_per_seed": float(np.mean(wall)) if wall else float("nan"),
            "message": "; ".join(f"{r.cell.name}: {short(r.message)}" for r in failed),
            "failed_cells": [(r.cell.name, r.message) for r in failed],
        })
    return rows


CAPTION = (
    "Accuracy in % on each client's own test classes (test split), after the last round, as "
    "mean ± std over clients (each client once). **Ours** is the classifier (argmax of the client's "
    "head) under the *personal* protocol: each client's own model after its local training of the last "
    "round. The weight-sharing methods' *global* protocol (the server's aggregated model of the last round, "
    "before local training, on each client's test set; FedPer/FedRep: the global body with the client's "
    "own head; FeSEM: the client's cluster centre) is in the table \"Global vs personal\" and in table.csv "
    "(acc_global_*); nearest-prototype accuracy (eq. 4) is in its own table and in table.csv. With several "
    "seeds: the mean over seeds of the per-seed client means ± the per-seed std over clients averaged "
    "over seeds; `[±x, s seeds]` is the sample std (ddof 1) of the per-seed means. **Paper**: tab. 1 "
    "(main stdev) or appendix tab. 2–4 (second stdev), 20 clients; n.a. where the paper has no such "
    "setting. Rounds: ours / paper (tab. 1; Local: 0 rounds, no communication). Params: parameters sent "
    "up per round summed over clients, ×10³, ours / paper (tab. 1)."
)


def _ours_cell(row: dict, key: str = "acc") -> str:
    if row["seeds"] == 0:
        return "failed" if row["failed"] else "–"
    s = _pm(row[f"{key}_mean"], row[f"{key}_std_clients"])
    if row["seeds"] > 1 and row[f"{key}_std_seeds"] == row[f"{key}_std_seeds"]:
        s += f" [±{row[f'{key}_std_seeds']:.2f}, {row['seeds']} seeds]"
    if row["failed"]:
        s += f" ({row['failed']} failed)"
    return s


def render_markdown(rows: Sequence[dict], methods_order: Sequence[str] = tuple(METHODS)) -> str:
    """The side-by-side table (one block per dataset and stdev)."""
    out = ["# FedProto reproduction vs the paper", "", CAPTION, ""]
    blocks: dict[tuple, list[dict]] = {}
    for r in rows:
        blocks.setdefault((r["dataset"], r["stdev"]), []).append(r)
    proto_lines: list[str] = []
    global_lines: list[str] = []
    failures: dict[str, list[str]] = {}
    for (ds, sd), rs in blocks.items():
        ways = sorted({r["ways"] for r in rs})
        by = {(r["method"], r["ways"]): r for r in rs}
        methods = _ordered([r["method"] for r in rs], methods_order)
        out += [f"## {ds} (stdev {sd})", ""]
        models = _ordered([r["model"] for r in rs if r.get("model")], [])
        if models:
            paper_models = {model_for(ds, m) for m in methods}
            note = "" if set(models) <= paper_models else " (not the paper's models for this dataset)"
            out += [f"Models: {', '.join(models)}{note}.", ""]
        head = ["method"] + [f"n={n} {w}" for n in ways for w in ("ours", "paper")] + [
            "rounds ours / paper", "params ×10³ ours / paper"]
        out += ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["--:"] * (len(head) - 1)) + "|"]
        for m in methods:
            cells = [m]
            rounds, params = [], []
            for n in ways:
                r = by.get((m, n))
                if r is None:
                    cells += ["–", "–"]
                    continue
                cells.append(_ours_cell(r))
                cells.append(_pm(r["paper_mean"], r["paper_std"]) if r["paper_mean"] == r["paper_mean"] else "n.a.")
                rounds.append(r["rounds"])
                if r["params_up_per_round"] == r["params_up_per_round"]:
                    params.append(r["params_up_per_round"] / 1e3)
                for name, msg in r.get("failed_cells", []):
                    failures.setdefault(short(msg), []).append(name)
            any_r = next(r for r in rs if r["method"] == m)
            pr = any_r["paper_rounds"]
            pk = any_r["paper_params_k"]
            ours_r = (f"{min(rounds)}–{max(rounds)}" if rounds and min(rounds) != max(rounds)
                      else (str(rounds[0]) if rounds else "–"))
            if params and f"{min(params):.1f}" != f"{max(params):.1f}":
                ours_p = f"{min(params):.1f}–{max(params):.1f}"
            else:
                ours_p = f"{params[0]:.1f}" if params else "–"
            cells.append(f"{ours_r} / {pr if pr is not None else 'n.a.'}")
            cells.append(f"{ours_p} / {f'{pk:g}' if pk is not None else 'n.a.'}")
            out.append("| " + " | ".join(cells) + " |")
            for n in ways:
                r = by.get((m, n))
                if r is not None and r["acc_proto_mean"] == r["acc_proto_mean"]:
                    proto_lines.append(f"| {ds} (stdev {sd}) | {m} | {n} | {_ours_cell(r, 'acc_proto')} | "
                                       f"{_ours_cell(r)} |")
                if r is not None and r.get("acc_global_mean", math.nan) == r.get("acc_global_mean", math.nan):
                    paper_cell = (_pm(r["paper_mean"], r["paper_std"]) if r["paper_mean"] == r["paper_mean"]
                                  else "n.a.")
                    global_lines.append(f"| {ds} (stdev {sd}) | {m} | {n} | {_ours_cell(r, 'acc_global')} | "
                                        f"{_ours_cell(r)} | {paper_cell} |")
        out.append("")
    if global_lines:
        out += ["## Global vs personal (weight-sharing methods)", "",
                "Same runs. **global**: the server's aggregated model of the last round (FedPer/FedRep: global body "
                "with the client's own head; FeSEM: the client's cluster centre), before local training, on each "
                "client's test set; **personal**: the client's model after its local training of the last round "
                "(the main table's ours).", "",
                "| dataset | method | n | global | personal | paper |", "|---|---|--:|--:|--:|--:|", *global_lines, ""]
    if proto_lines:
        out += ["## Nearest-prototype accuracy (eq. 4)", "",
                "Same runs and aggregation rule; classifier accuracy repeated for comparison.", "",
                "| dataset | method | n | nearest prototype | classifier |", "|---|---|--:|--:|--:|", *proto_lines, ""]
    if failures:
        out += ["## Failed cells", "", "First line of each error; full messages in status.json.", ""]
        out += [f"- {', '.join(names)}: {msg}" for msg, names in failures.items()] + [""]
    return "\n".join(out)


def _csv_bytes(rows: Sequence[dict], fields: Sequence[str]) -> bytes:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(fields), extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if v is None or (isinstance(v, float) and math.isnan(v)) else
                        (round(v, 4) if isinstance(v, float) else v)) for k, v in r.items()})
    return buf.getvalue().encode()


TABLE_FIELDS = ("dataset", "stdev", "method", "algorithm", "model", "ways", "seeds", "failed", "acc_mean",
                "acc_std_clients", "acc_std_seeds", "acc_proto_mean", "acc_proto_std_clients", "acc_proto_std_seeds",
                "acc_global_mean", "acc_global_std_clients", "acc_global_std_seeds", "paper_mean", "paper_std",
                "rounds", "paper_rounds", "params_up_per_round", "paper_params_k", "message")


def write_status(out: Path, results: Sequence[CellResult]) -> None:
    atomic_write_json(Path(out) / "status.json", [
        {"name": r.cell.name, "dataset": r.cell.dataset, "ways": r.cell.ways, "method": r.cell.method,
         "seed": r.cell.seed, "param": r.cell.param, "value": r.cell.value, "status": r.status,
         "message": r.message, "wall_s": r.wall_s}
        for r in results
    ])


def provenance() -> dict:
    """When, from which code and where a result is being made: UTC date, the git commit of the
    fedproto source (with ``dirty`` if it has uncommitted changes; None outside a git work tree),
    fedproto's and torch's versions, the CPU, its cores and ``/proc/loadavg``."""
    src = Path(__file__).resolve().parent
    commit = None
    try:
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        if commit and subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no", "."],
                                     capture_output=True, text=True, timeout=10).stdout.strip():
            commit += "-dirty"
    except (OSError, subprocess.SubprocessError):
        commit = None
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        load = open("/proc/loadavg").read().strip()
    except OSError:
        load = None
    import fedproto

    torch = sys.modules.get("torch")
    return {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit,
            "fedproto": getattr(fedproto, "__version__", None), "torch": getattr(torch, "__version__", None),
            "cpu": cpu, "cores": os.cpu_count(), "loadavg": load}


def write_table(out: Path, results: Sequence[CellResult], methods_order: Sequence[str] = tuple(METHODS)) -> list[dict]:
    """Write ``table.md``, ``table.csv`` and ``table.json`` (the rows at full precision and when and
    from which code they were made: :func:`provenance`; what
    ``scripts/published_figures.py import`` reads), atomically; returns the rows."""
    rows = table_rows(results)
    atomic_write_bytes(Path(out) / "table.md", render_markdown(rows, methods_order).encode())
    atomic_write_bytes(Path(out) / "table.csv", _csv_bytes(rows, TABLE_FIELDS))
    atomic_write_json(Path(out) / "table.json", {"made": provenance(), "rows": rows})
    return rows


def describe(r: CellResult) -> str:
    """One progress line for a finished cell."""
    if r.status == "failed":
        return f"[red]failed[/]: {escape(short(r.message))}"
    m, s = _acc(r.summary, "acc")
    txt = f"acc {_pm(100 * m, 100 * s)}"
    mp, sp = _acc(r.summary, "acc_proto")
    if mp == mp:
        txt += f", proto {_pm(100 * mp, 100 * sp)}"
    mg, sg = _acc(r.summary, "acc_global")
    if mg == mg:
        txt += f", global {_pm(100 * mg, 100 * sg)}"
    up = (r.summary.get("params_per_round") or {}).get("up")
    if up is not None:
        txt += f", up {up / 1e3:.1f}k/round"
    if r.status == "skipped":
        return f"[yellow]skipped[/] (finished earlier): {txt}"
    return f"[green]done[/] in {r.wall_s:.1f} s: {txt}"
