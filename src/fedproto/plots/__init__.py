"""Figures: training curves, t-SNE of embeddings (fig. 2), parameter sweeps (fig. 3, fig. 4).

Figures are drawn on matplotlib's Agg canvas directly (no pyplot, no global backend switch) and
written as PNG with :func:`fedproto.outputs.run_folder.atomic_write_bytes`.

The figures live in :mod:`fedproto.plots.curves` (curves, sweeps) and :mod:`fedproto.plots.tsne`
(embeddings, t-SNE), drawn on :mod:`fedproto.plots.canvas`; every name is importable from here.
"""

from __future__ import annotations

from fedproto.plots.canvas import save_figure
from fedproto.plots.curves import accuracy_limits, plot_curves, plot_sweep
from fedproto.plots.tsne import (
    EMBEDDINGS_FILE,
    MARKERS,
    PROTOTYPES_FILE,
    TSNE_SEED,
    TooFewPoints,
    collect_embeddings,
    plot_tsne,
    plot_tsne_arrays,
    plot_tsne_run,
    save_embeddings,
)

__all__ = ["EMBEDDINGS_FILE", "MARKERS", "PROTOTYPES_FILE", "TSNE_SEED", "TooFewPoints", "accuracy_limits",
           "collect_embeddings", "plot_curves", "plot_sweep", "plot_tsne", "plot_tsne_arrays", "plot_tsne_run",
           "save_embeddings", "save_figure"]
