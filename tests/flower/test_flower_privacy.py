"""Privacy of what crosses Flower and what the server keeps: under DP (``dp`` prototypes or
full) a node's replies carry only the noised release (no sample counts, losses, step counts or
accuracies; ε under ``prototypes``), seeded DP noise is refused under Flower, and every file of
the server's run folder is private (0600 in a 0700 folder). Nodes are the real ClientApp in this
process (:class:`flower_helpers.RecordingGrid` keeps each reply); secure aggregation's side is in
test_flower_secagg.py."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower

from flower_helpers import (  # noqa: E402  (the Flower tests' grid, configs and node folders)
    LocalGrid,
    RecordingGrid,
    _user_config,
    flower_process,
)
from flwr.app import Message  # noqa: E402

from fedproto.errors import ConfigError  # noqa: E402
from fedproto.flower.node_state import INSTANCE_KEYS  # noqa: E402
from fedproto.flower.records import run_config  # noqa: E402
from fedproto.flower.server_app import FlowerEngine  # noqa: E402
from fedproto.prototypes.dp import epsilon  # noqa: E402


@pytest.fixture(autouse=True)
def _flower_process(tmp_path, monkeypatch):
    """The ServerApp process's task identity and a node-state cache of this test's own
    (:func:`flower_helpers.flower_process`)."""
    yield from flower_process(tmp_path, monkeypatch)


def _reply_keys(rep: Message) -> dict[str, set[str]]:
    """Record name (``config``, ``message``, ``metrics``) -> the keys of that record, for one reply."""
    return {name.removeprefix("fedproto."): set(rec.keys()) for name, rec in rep.content.items()}


@pytest.mark.parametrize("dp", ["off", "prototypes", "full"])
def test_under_dp_a_node_sends_only_the_noised_release(dp, tmp_path, caplog):
    """Under DP the replies of a node carry no sample counts (query, train), no
    losses, step count or embedding norm (train), no accuracy or test count (evaluate): only the
    noised release, the public label set and architecture size, and ε under ``prototypes``."""
    uc = _user_config(dp=dp, dp_noise=1.0, rounds=2, clients=3)
    grid = RecordingGrid(uc, [0, 1, 2])
    summary = FlowerEngine(run_config(uc), grid, out=tmp_path / "run").run()
    q, t, e = (grid.replies[k] for k in ("query", "train", "evaluate"))
    assert len(q) == 3 and len(t) == 6 and len(e) == 3
    query_keys = {"cid", "classes", "params", "embedding-dim", "schema"} | (
        {"train-samples", "test-samples"} if dp == "off" else set())
    assert all(_reply_keys(r)["config"] == query_keys for r in q)
    inst = set(INSTANCE_KEYS)  # random or the server's own round numbers, sent under every dp
    assert all(_reply_keys(r)["metrics"] == inst for r in q)
    if dp == "off":
        sent = {"loss_ce", "loss_proto", "steps", "emb-norm-max", "loss-terms", "num-examples"} | inst
        assert all(_reply_keys(r)["metrics"] == sent for r in t)
        assert summary["accuracy"]["acc"]["mean"] > 0.5
        return
    assert all(set(_reply_keys(r)) == {"message", "metrics"} and _reply_keys(r)["metrics"] == inst
               for r in t)  # the release alone, and the instance keys
    assert all(_reply_keys(r)["message"] == {"classes", "protos", "counts"} for r in t)
    assert all(_reply_keys(r)["metrics"] == ({"dp_epsilon"} if dp == "prototypes" else set()) | inst for r in e)
    assert summary["accuracy"] == {} and summary["clients_evaluated"] == 0 and summary["left_out"] == {}
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss_ce"] for r in rows] == [None, None]
    if dp == "prototypes":
        assert summary["privacy"]["epsilon_max"] == pytest.approx(epsilon([(1.0, 1.0, 2)], 1e-5))
    else:
        assert summary["privacy"]["epsilon_max"] is None and "sample count" in summary["privacy"]["epsilon_note"]
        assert "keeps on this node: acc" in caplog.text and "dp_epsilon" in caplog.text


def test_seeded_dp_noise_is_refused_under_flower():
    with pytest.raises(ConfigError, match="dp_reproducible_noise=True draws the DP noise from the run's seed"):
        run_config(_user_config(dp="prototypes", dp_reproducible_noise=True))


def test_every_file_of_a_flower_run_folder_is_private(tmp_path):
    """The drill: config.json, metrics.jsonl and failure.json of the server's run folder were 0644 in a 0755
    folder (what the nodes sent, readable by every user of the SuperLink's machine). Now the folder is 0700 and
    every file in it 0600, with the usual umask, as the simulator's models and prototypes are."""
    import os

    uc = _user_config(rounds=2, tensorboard=True)
    out = tmp_path / "run"
    old = os.umask(0o022)
    try:
        eng = FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2, 3]), out=out)
        assert out.stat().st_mode & 0o777 == 0o700  # from its creation, before any round
        eng.run()
    finally:
        os.umask(old)
    modes = {p.relative_to(out).as_posix(): p.stat().st_mode & 0o777 for p in out.rglob("*")}
    assert {"config.json", "metrics.jsonl", "summary.json", "clients.csv", "prototypes.npz"} <= set(modes), modes
    assert any(name.startswith("tensorboard/") for name in modes), modes
    assert {name: m for name, m in modes.items() if m != (0o700 if (out / name).is_dir() else 0o600)} == {}
    assert out.stat().st_mode & 0o777 == 0o700
