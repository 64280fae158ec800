"""Figures: training curves, t-SNE of embeddings (fig. 2), parameter sweeps (fig. 3, fig. 4).

Figures are drawn on matplotlib's Agg canvas directly (no pyplot, no global backend switch) and
written as PNG with :func:`fedproto.results.atomic_write_bytes`.

Size: about 430 lines: the figures of the paper (curves, t-SNE, sweeps), each a short function on
one shared canvas function.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedproto.errors import ConfigError, FedprotoError
from fedproto.results import atomic_write_bytes, read_metrics

EMBEDDINGS_FILE = "embeddings.npz"
PROTOTYPES_FILE = "prototypes.npz"
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "<", ">", "p", "h", "*", "8", "d", "H")
TSNE_SEED = 0


class TooFewPoints(FedprotoError):
    """A t-SNE needs at least 3 points (a run too small to draw, not a damaged file)."""


def _figure(width: float, height: float, ncols: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


def save_figure(fig, path: str | Path) -> Path:
    """Write ``fig`` as a PNG (120 dpi) to ``path`` atomically (a reader never sees half a file);
    every figure of this module is saved through it.

    Returns:
        ``path`` as a Path.

    Raises:
        OSError: the folder cannot be written.
    """
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    path = Path(path)
    atomic_write_bytes(path, buf.getvalue())
    return path


def _class_colors(num: int) -> list:
    from matplotlib import colormaps

    if num <= 10:
        cmap = colormaps["tab10"]
        return [cmap(i) for i in range(num)]
    if num <= 20:
        cmap = colormaps["tab20"]
        return [cmap(i) for i in range(num)]
    cmap = colormaps["hsv"]
    return [cmap(i / num) for i in range(num)]


# -------------------------------------------------------------------------------------------------
# curves


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
    return save_figure(fig, path if path is not None else run_dir / "curves.png")


# -------------------------------------------------------------------------------------------------
# embeddings and t-SNE


def collect_embeddings(sim) -> dict[str, np.ndarray]:
    """Test-set embeddings of every client of a finished :class:`~fedproto.simulation.Simulation`
    (eval mode): ``h`` (N, d) float32, ``y`` (N,) int64, ``client`` (N,) int64. Where the clients'
    embedding sizes differ (methods that share no embeddings, e.g. FD, Local) each is zero-padded to
    the largest d: their spaces are not comparable across clients."""
    from fedproto.training import embed_all

    hs, ys, cs = [], [], []
    setup = getattr(sim, "setup", sim)  # a Simulation or its Setup
    for i, (state, data) in enumerate(zip(setup.states, setup.data)):
        h = embed_all(state.model, data.test_x)
        hs.append(h.cpu().numpy().astype(np.float32))
        ys.append(data.test_y.cpu().numpy().astype(np.int64))
        cs.append(np.full(len(data.test_y), i, dtype=np.int64))
    d = max([setup.embedding_dim, *(h.shape[1] for h in hs)])
    if len({h.shape[1] for h in hs}) > 1:  # methods that let the sizes differ (fd, local): zeros fill the smaller
        hs = [np.pad(h, ((0, 0), (0, d - h.shape[1]))) for h in hs]
    return {
        "h": np.concatenate(hs) if hs else np.zeros((0, d), np.float32),
        "y": np.concatenate(ys) if ys else np.zeros(0, np.int64),
        "client": np.concatenate(cs) if cs else np.zeros(0, np.int64),
    }


def save_embeddings(sim, run_dir: str | Path) -> Path:
    """Write ``embeddings.npz`` (h, y, client: every client's test embeddings) into ``run_dir``.

    Raises:
        ConfigError: the file cannot be written (full disk, permissions; names the file).
    """
    arrays = collect_embeddings(sim)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    path = Path(run_dir) / EMBEDDINGS_FILE
    try:
        atomic_write_bytes(path, buf.getvalue())
    except OSError as e:
        raise ConfigError(f"cannot write {str(path)!r}: {e.strerror or e}; free space or fix that path (the run's "
                          "other files are written)") from None
    return path


def _subsample(client: np.ndarray, max_per_client: int | None, seed: int) -> np.ndarray:
    idx = np.arange(len(client))
    if not max_per_client:
        return idx
    rng = np.random.default_rng(seed)
    keep = []
    for c in np.unique(client):
        members = idx[client == c]
        if len(members) > max_per_client:
            members = np.sort(rng.choice(members, max_per_client, replace=False))
        keep.append(members)
    return np.concatenate(keep) if keep else idx[:0]


def plot_tsne_arrays(
    h: np.ndarray,
    y: np.ndarray,
    client: np.ndarray,
    path: str | Path,
    proto_classes: np.ndarray | None = None,
    protos: np.ndarray | None = None,
    max_per_client: int | None = 200,
    perplexity: float = 30.0,
    random_state: int = TSNE_SEED,
    title: str | None = None,
) -> Path:
    """t-SNE of embeddings (fig. 2): colour = class, marker = client (markers cycle), global
    prototypes as large black-edged stars in their class colour. Prototypes are projected jointly
    with the embeddings (one t-SNE fit over both).

    Args:
        h: (N, d) embeddings; y: (N,) classes; client: (N,) client ids.
        proto_classes, protos: (P,) classes and (P, d) global prototypes, or None.
        max_per_client: keep at most this many points per client (fixed random subsample).
        perplexity: t-SNE perplexity (lowered automatically for small N).
        random_state: t-SNE seed.
    Raises:
        FedprotoError: no embeddings, or prototypes of another dimension.
        TooFewPoints: fewer than 3 points (embeddings and prototypes together).
    """
    from sklearn.manifold import TSNE

    h, y, client = np.asarray(h, np.float32), np.asarray(y), np.asarray(client)
    if len(h) == 0:
        raise FedprotoError("no embeddings to plot")
    finite = np.isfinite(h).all(axis=1) if h.ndim == 2 else np.ones(len(h), bool)
    if not finite.all():  # a blown-up client (flagged nonfinite in clients.csv) is left out, not fatal
        bad = sorted({int(c) for c in client[~finite]})
        logging.getLogger(__name__).warning(
            "t-SNE leaves out %d test embedding(s) that are NaN or infinite (clients %s)", int((~finite).sum()), bad)
        h, y, client = h[finite], y[finite], client[finite]
        if len(h) == 0:
            raise FedprotoError(f"every test embedding is NaN or infinite (clients {bad}); nothing to plot")
    sel = _subsample(client, max_per_client, random_state)
    h, y, client = h[sel], y[sel], client[sel]
    P = 0
    pts = h
    if protos is not None and len(protos):
        protos = np.asarray(protos, np.float32)
        if protos.shape[1] != h.shape[1]:
            raise FedprotoError(f"prototypes have dimension {protos.shape[1]}, embeddings {h.shape[1]}")
        P = len(protos)
        pts = np.concatenate([h, protos])
    n = len(pts)
    if n < 3:
        raise TooFewPoints(f"t-SNE needs at least 3 points, got {n}")
    perp = float(min(perplexity, max(1.0, (n - 1) / 3)))
    from threadpoolctl import threadpool_limits

    # One OpenMP thread: with torch's own libgomp loaded in the same process, sklearn's OpenMP
    # threads can spin against torch's idle ones (measured: 0.1 s -> 20-60 s for 80 points).
    with threadpool_limits(limits=1, user_api="openmp"):
        z = TSNE(n_components=2, perplexity=perp, init="pca", learning_rate="auto",
                 random_state=random_state).fit_transform(pts.astype(np.float64))
    zh, zp = z[: len(h)], z[len(h):]
    num_classes = int(max(y.max(initial=0), (np.max(proto_classes) if P else 0))) + 1
    colors = _class_colors(num_classes)
    fig, (ax,) = _figure(8, 7)
    clients = np.unique(client)
    for c, marker in zip(clients, itertools.cycle(MARKERS)):
        m = client == c
        ax.scatter(zh[m, 0], zh[m, 1], c=[colors[int(k)] for k in y[m]], marker=marker, s=14, alpha=0.7,
                   linewidths=0)
    for cls, p in zip(proto_classes if P else [], zp):
        ax.scatter([p[0]], [p[1]], marker="*", s=420, c=[colors[int(cls)]], edgecolors="black", linewidths=1.2,
                   zorder=5)
    from matplotlib.lines import Line2D

    shown = sorted(set(int(k) for k in y) | set(int(k) for k in (proto_classes if P else [])))
    handles = []
    if len(shown) <= 20:
        handles += [Line2D([], [], ls="", marker="o", color=colors[k], label=f"class {k}") for k in shown]
    if len(clients) <= 10:
        handles += [Line2D([], [], ls="", marker=mk, color="gray", label=f"client {int(c)}")
                    for c, mk in zip(clients, itertools.cycle(MARKERS))]
    if P:
        handles.append(Line2D([], [], ls="", marker="*", ms=14, color="white", markeredgecolor="black",
                              label="global prototype"))
    if handles:
        ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    ax.set_xticks([])
    ax.set_yticks([])
    repeat = f"; shapes repeat after {len(MARKERS)}" if len(clients) > len(MARKERS) else ""
    ax.set_xlabel(f"colour: class · marker shape: client ({len(clients)} clients{repeat})"
                  + ("\nstar: global prototype of the class" if P else ""))
    ax.set_title(title or f"t-SNE of test embeddings: {len(h)} samples, {len(clients)} clients"
                 + (f", {P} global prototypes" if P else ""))
    return save_figure(fig, path)


def plot_tsne(sim, path: str | Path, max_per_client: int | None = 200, **kw: Any) -> Path:
    """Fig. 2 for a finished simulation: its clients' test embeddings and its global prototypes
    (if the algorithm has them). Keyword arguments go to :func:`plot_tsne_arrays`."""
    e = collect_embeddings(sim)
    msg = getattr(sim, "message", {}) or {}
    classes = protos = None
    if "protos" in msg and len(msg.get("classes", [])):
        classes, protos = np.asarray(msg["classes"]), np.asarray(msg["protos"])
    return plot_tsne_arrays(e["h"], e["y"], e["client"], path, classes, protos, max_per_client, **kw)


def plot_tsne_run(run_dir: str | Path, path: str | Path | None = None, max_per_client: int | None = 200,
                  **kw: Any) -> Path:
    """Fig. 2 from a run directory's ``embeddings.npz`` and ``prototypes.npz``."""
    run_dir = Path(run_dir)
    e = np.load(run_dir / EMBEDDINGS_FILE)
    classes = protos = None
    pfile = run_dir / PROTOTYPES_FILE
    if pfile.is_file():
        p = np.load(pfile)
        classes, protos = p["classes"], p["protos"]
    return plot_tsne_arrays(e["h"], e["y"], e["client"], path if path is not None else run_dir / "tsne.png",
                            classes, protos, max_per_client, title=kw.pop("title", None) or
                            f"{run_dir.name}: t-SNE of test embeddings", **kw)


# -------------------------------------------------------------------------------------------------
# sweeps


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
    return save_figure(fig, path)
