"""The canvas every figure is drawn on (matplotlib's Agg, no pyplot) and the one function that
writes a figure (:func:`save_figure`)."""

from __future__ import annotations

import io
from pathlib import Path

from fedproto.outputs.run_folder import atomic_write_bytes


def _figure(width: float, height: float, ncols: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


def save_figure(fig, path: str | Path) -> Path:
    """Write ``fig`` as a PNG (120 dpi) to ``path`` atomically (a reader never sees half a file);
    every figure of :mod:`fedproto.plots` is saved through it.

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
