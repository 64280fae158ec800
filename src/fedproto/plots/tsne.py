"""Test-set embeddings of a run (``embeddings.npz``) and their t-SNE with the global prototypes (fig. 2)."""

from __future__ import annotations

import io
import itertools
import logging
from pathlib import Path
from typing import Any

import numpy as np

from fedproto.errors import ConfigError, FedprotoError
from fedproto.outputs.run_folder import atomic_write_bytes
from fedproto.plots import canvas
from fedproto.plots.canvas import _figure

EMBEDDINGS_FILE = "embeddings.npz"
PROTOTYPES_FILE = "prototypes.npz"
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "<", ">", "p", "h", "*", "8", "d", "H")
TSNE_SEED = 0


class TooFewPoints(FedprotoError):
    """A t-SNE needs at least 3 points (a run too small to draw, not a damaged file)."""


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
        atomic_write_bytes(path, buf.getvalue(), private=True)  # embeddings of private data
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
    return canvas.save_figure(fig, path)


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
