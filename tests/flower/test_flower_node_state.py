"""fedproto.flower.node_state: a node's state file (its client's model) at rest."""

from __future__ import annotations

import os
import stat

import pytest
import torch

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower

from conftest import Interrupted, interrupt_at  # noqa: E402

from fedproto.config.run_config import build_config  # noqa: E402
from fedproto.flower import node_state  # noqa: E402
from fedproto.flower.records import run_config  # noqa: E402


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_node_state_files_are_private(tmp_path):
    """Was: a node's state file (its client's trained model) was written 0644 into a 0755 folder,
    readable by every user of the site's machine. Now 0600 in a 0700 folder, also over an older
    0644 file and inside a folder that already existed with 0755."""
    old = os.umask(0o022)
    try:
        cfg = run_config({"dataset": "custom", "classes": 3, "shots": 4, "test-shots": 2})
        nc = {"client-id": 0, "data": "/d0", "model": "cnn"}
        key = node_state.state_key(7, 0, cfg, nc)
        model = {"fc.weight": torch.ones(2, 3)}
        new = tmp_path / "new" / "site0"  # not there yet
        f = node_state.state_file(new, key)
        node_state.save_state(f, key, 5, 1, model, {"n": 1})
        assert _mode(f) == 0o600 and _mode(new) == 0o700
        assert node_state.load_state(f, key)["round"] == 1

        shared = tmp_path / "shared"
        shared.mkdir(mode=0o755)
        g = node_state.state_file(shared, key)
        g.write_bytes(b"an older file")
        g.chmod(0o644)
        assert _mode(shared) == 0o755 and _mode(g) == 0o644
        node_state.save_state(g, key, 5, 2, model, {})
        assert _mode(g) == 0o600 and _mode(shared) == 0o700
        assert torch.equal(node_state.load_state(g, key)["model"]["fc.weight"], model["fc.weight"])
        assert not [p.name for p in shared.iterdir() if p != g]  # no temp file left
    finally:
        os.umask(old)


def test_server_files_holding_models_or_prototypes_are_private(tmp_path):
    """The server's run folder: checkpoint.pt (models, prototypes), prototypes.npz and models.pt are
    0600 in a 0700 run folder; the other files keep the usual permissions."""
    from fedproto.simulation import Simulation

    old = os.umask(0o022)
    try:
        cfg = build_config(overrides=dict(dataset="digits", clients=3, ways=3, shots=10, stdev=1, test_shots=5,
                                          rounds=2, eval_every=0, threads=1, checkpoint_every=1, save_models=True))

        run = tmp_path / "run"
        with pytest.raises(Interrupted):
            Simulation(cfg, out=run, on_round=interrupt_at(1)).run()
        assert _mode(run / "checkpoint.pt") == 0o600 and _mode(run) == 0o700
        Simulation(cfg, out=run).run(resume=True)
        assert {n: _mode(run / n) for n in ("prototypes.npz", "models.pt", "metrics.jsonl", "summary.json")} == {
            "prototypes.npz": 0o600, "models.pt": 0o600, "metrics.jsonl": 0o644, "summary.json": 0o644}
        assert _mode(run) == 0o700
    finally:
        os.umask(old)
