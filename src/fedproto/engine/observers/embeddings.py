"""``embeddings.npz``: every client's test embeddings at the end of an in-process run, for
``fedproto plot``'s t-SNE (fig. 2); written by every front end that writes a run folder."""

from __future__ import annotations

from fedproto.engine.loop import Observer, RoundLoop
from fedproto.engine.setup import Setup
from fedproto.engine.summary import ClientMetrics, Summary
from fedproto.outputs.run_folder import RunDir


class Embeddings(Observer):
    """Writes ``embeddings.npz`` (:func:`fedproto.plots.save_embeddings`) into ``run_dir``."""

    def __init__(self, setup: Setup, run_dir: RunDir) -> None:
        self.setup, self.run_dir = setup, run_dir

    def finish(self, loop: RoundLoop, summary: Summary, per_client: list[ClientMetrics]) -> None:
        from fedproto.plots import save_embeddings

        save_embeddings(self.setup, self.run_dir.path)
