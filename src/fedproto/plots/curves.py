"""Training curves of a run (``curves.png``) and parameter sweeps (fig. 3, fig. 4)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedproto.errors import FedprotoError
from fedproto.outputs.run_folder import read_metrics
from fedproto.plots import canvas
from fedproto.plots.canvas import _figure


def accuracy_limits(low: float, high: float) -> tuple[float, float]:
    """y-limits of an accuracy panel (in %) that hold the band or error bar [low, high] with a margin
    of 8% of its height (at least 2 points) on both sides, so no bar end sits on an axis."""
    pad = max(2.0, 0.08 * (high - low))
    return low - pad, high + pad


def plot_curves(run_dir: str | Path, path: str | Path | None = None) -> Path:
    """Accuracy (classifier and nearest-prototype, mean ± std over clients, evaluated rounds),
    training losses (cross-entropy, prototype term) and, for FedProto runs that record it, the
    prototype distance (mean and largest over clients) per round from ``metrics.jsonl``.

    Args:
        run_dir: a run directory. path: output PNG (default ``run_dir/curves.png``).
    Raises:
        FedprotoError: no ``metrics.jsonl`` or no rows in it.
    """
    run_dir = Path(run_dir)
    mfile = run_dir / "metrics.jsonl"
    if not mfile.is_file():
        raise FedprotoError(f"{run_dir} has no metrics.jsonl; pass a run directory written by `fedproto run`")
    rows = read_metrics(mfile)
    if not rows:
        raise FedprotoError(f"{mfile} is empty; the run wrote no rounds yet")
    title = run_dir.name
    cfg_file = run_dir / "config.json"
    if cfg_file.is_file():
        c = json.loads(cfg_file.read_text())
        part = {"fewshot": f"ways {c.get('ways')}, shots {c.get('shots')}, ", "natural": "one client per writer, ",
                "dirichlet": f"Dirichlet alpha {c.get('alpha')}, "}.get(c.get("partition"), "")  # own clients: none
        model = (f"model {c.get('model')}" if c.get("dataset") != "custom"
                 else f"own models, {c.get('embedding_dim')}-d embeddings")
        title = f"{c.get('algorithm')} on {c.get('dataset')}: {c.get('clients')} clients, {part}{model}"
    monitored = any(isinstance(r.get("proto_dist"), (int, float)) for r in rows)
    if monitored:
        fig, (ax_acc, ax_loss, ax_dist) = _figure(16, 4.2, ncols=3)
    else:
        fig, (ax_acc, ax_loss) = _figure(11, 4.2, ncols=2)
    band_lo, band_hi = [], []
    for key, label, color in (("acc", "classifier", "C0"), ("acc_proto", "nearest prototype (eq. 4)", "C1")):
        pts = [(r["round"], r.get(f"{key}_mean"), r.get(f"{key}_std")) for r in rows]
        pts = [(x, m, s or 0.0) for x, m, s in pts if m is not None and not math.isnan(m)]
        if not pts:
            continue
        x, m, s = (np.asarray(v, dtype=float) for v in zip(*pts))
        lo, hi = np.clip(100 * (m - s), 0, 100), np.clip(100 * (m + s), 0, 100)  # an accuracy lies in [0, 100]
        band_lo.append(float(lo.min()))
        band_hi.append(float(hi.max()))
        ax_acc.plot(x, 100 * m, marker="o", ms=3, color=color, label=label)
        if len(x) > 1:
            ax_acc.fill_between(x, lo, hi, color=color, alpha=0.2)
        else:
            ax_acc.errorbar(x, 100 * m, yerr=[100 * m - lo, hi - 100 * m], color=color, capsize=4)
    ax_acc.set_xlabel("round")
    ax_acc.set_ylabel("test accuracy % (mean ± std over clients)")
    ax_acc.set_title("accuracy (per-client test sets)")
    if band_lo:  # the whole band or error bar inside the panel, with a margin (a short run has one bar)
        ax_acc.set_ylim(*accuracy_limits(min(band_lo), max(band_hi)))
        ax_acc.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False, fontsize=9)
    x = np.asarray([r["round"] for r in rows], dtype=float)
    ce = np.asarray([np.nan if r.get("loss_ce") is None else r["loss_ce"] for r in rows], dtype=float)
    ax_loss.plot(x, ce, color="C0", marker="o" if len(x) == 1 else None, label="cross-entropy")
    ax_loss.set_xlabel("round")
    ax_loss.set_ylabel("cross-entropy (mean over clients)")
    lp = np.asarray([np.nan if r.get("loss_proto") is None else r["loss_proto"] for r in rows], dtype=float)
    if np.nanmax(np.abs(lp), initial=0.0) > 0:
        ax2 = ax_loss.twinx()
        ax2.plot(x, lp, color="C3", label="prototype loss")
        ax2.set_ylabel("prototype loss (mean over clients)", color="C3")
        h1, l1 = ax_loss.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax_loss.legend(h1 + h2, l1 + l2, loc="upper right")
    else:
        ax_loss.legend(loc="upper right")
    ax_loss.set_title("training losses")
    axes = [ax_acc, ax_loss]
    if monitored:  # FedProto's prototype-distance monitoring (practitioner's guide §4.3.5)
        for key, label, color in (("proto_dist", "mean over clients", "C0"),
                                  ("proto_dist_max", "largest client", "C3")):
            v = np.asarray([r[key] if isinstance(r.get(key), (int, float)) else np.nan for r in rows], dtype=float)
            ax_dist.plot(x, v, color=color, marker="o" if len(x) == 1 else None, label=label)
        ax_dist.set_xlabel("round")
        ax_dist.set_ylabel("L2 distance, local to global prototypes")
        ax_dist.set_title("prototype distance (monitoring)")
        ax_dist.legend(loc="upper right")
        axes.append(ax_dist)
    from matplotlib.ticker import MaxNLocator

    lo, hi = float(x.min()), float(x.max())
    pad = max(0.5, 0.03 * (hi - lo))
    for ax in axes:  # one round axis for all panels (an accuracy panel with one evaluation included)
        ax.set_xlim(lo - pad, hi + pad)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title)
    return canvas.save_figure(fig, path if path is not None else run_dir / "curves.png")


def plot_sweep(
    rows: Sequence[dict],
    x: str,
    path: str | Path,
    y: str = "acc_mean",
    yerr: str | None = "acc_std",
    y2: str | None = None,
    group: str | None = "method",
    xlabel: str | None = None,
    ylabel: str = "test accuracy % (mean ± std over clients)",
    y2label: str | None = None,
    title: str | None = None,
    percent: bool = True,
) -> Path:
    """Accuracy against a swept parameter, one line per ``group`` value, with an optional second
    quantity (e.g. the prototype loss, fig. 4) on a right-hand axis.

    Used for fig. 3 (accuracy vs shots k, FedProto and FedAvg) and fig. 4 (accuracy and prototype
    loss vs λ). Rows are dicts; missing or NaN values are skipped.

    Args:
        rows: one dict per point. x: key of the swept parameter. y, yerr: keys of the value and its
            error band (fractions in [0, 1] when ``percent``). y2: key for the right axis.
        group: key that splits rows into lines (None: one line).
    """

    def num(v):
        try:
            f = float(v)
        except (TypeError, ValueError):
            return float("nan")
        return f

    groups: dict[Any, list[dict]] = {}
    for r in rows:
        groups.setdefault(r.get(group) if group else None, []).append(r)
    # text values (e.g. aggregation=mean,median) go at positions 0, 1, ... in their given order
    labels_x = list(dict.fromkeys(str(r.get(x)) for r in rows))
    categorical = any(r.get(x) is not None and num(r.get(x)) != num(r.get(x)) for r in rows)
    xnum = (lambda v: float(labels_x.index(str(v)))) if categorical else num
    scale = 100.0 if percent else 1.0
    fig, (ax,) = _figure(7, 4.5)
    ax2 = ax.twinx() if y2 else None
    if categorical:
        ax.set_xticks(range(len(labels_x)), labels_x)
    for gi, (g, rs) in enumerate(groups.items()):
        rs = sorted(rs, key=lambda r: xnum(r.get(x)))
        xs = np.asarray([xnum(r.get(x)) for r in rs])
        ys = np.asarray([num(r.get(y)) for r in rs]) * scale
        ok = ~np.isnan(xs) & ~np.isnan(ys)
        color = f"C{gi % 10}"
        label = str(g) if g is not None else y
        if ok.any():
            ax.plot(xs[ok], ys[ok], marker="o", color=color, label=label)
            if yerr:
                es = np.nan_to_num(np.asarray([num(r.get(yerr)) for r in rs]) * scale)
                lo, hi = ys[ok] - es[ok], ys[ok] + es[ok]
                if percent:  # an accuracy lies in [0, 100]
                    lo, hi = np.clip(lo, 0, 100), np.clip(hi, 0, 100)
                ax.fill_between(xs[ok], lo, hi, color=color, alpha=0.15)
        if ax2 is not None:
            y2s = np.asarray([num(r.get(y2)) for r in rs])
            ok2 = ~np.isnan(xs) & ~np.isnan(y2s)
            if ok2.any():
                ax2.plot(xs[ok2], y2s[ok2], marker="s", ls="--", color=color,
                         label=f"{label}: {y2label or y2}")
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel)
    handles, labels = ax.get_legend_handles_labels()
    if ax2 is not None:
        ax2.set_ylabel(y2label or y2)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:  # below the axes: inside, it would cover points of one of the two y-axes (fig. 4)
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=min(len(handles), 3),
                  fontsize=9, frameon=False)
    if title:
        ax.set_title(title)
    return canvas.save_figure(fig, path)
