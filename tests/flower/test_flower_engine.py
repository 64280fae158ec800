"""The Flower engine (``fedproto.flower.server_app``, ``records``, ``exchange``) against the real
ClientApp in this process (:class:`flower_helpers.LocalGrid`, no SuperLink): the simulation's
numbers for the homogeneous and the model-heterogeneous methods, records that round-trip every
dtype, the run config's and ``FlowerOptions``' checks (partition ids, min-replies, poll-interval),
a user mistake logged in one line, and the server's exchange with the nodes: messages that expire
with their round, replies pulled at the server's own poll interval and counted only for the
message they answer."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower

from flower_helpers import (  # noqa: E402  (the Flower tests' grid, configs and node folders)
    BASE,
    LocalGrid,
    PushPullGrid,
    _own_config,
    _user_config,
    flower_process,
    node_configs,
    write_node_folders,
)
from flwr.app import Context, Message, RecordDict  # noqa: E402

from fedproto.config.run_config import build_config  # noqa: E402
from fedproto.errors import ConfigError, TrainingError  # noqa: E402
from fedproto.flower import client_app  # noqa: E402
from fedproto.flower.records import from_record, run_config, to_record  # noqa: E402
from fedproto.flower.server_app import FlowerEngine  # noqa: E402
from fedproto.simulation import Simulation  # noqa: E402


@pytest.fixture(autouse=True)
def _flower_process(tmp_path, monkeypatch):
    """The ServerApp process's task identity and a node-state cache of this test's own
    (:func:`flower_helpers.flower_process`)."""
    yield from flower_process(tmp_path, monkeypatch)


@pytest.mark.parametrize("algorithm", ["fedproto", "fesem", "fedrep"])
def test_flower_engine_matches_the_simulation(algorithm):
    """Same config and seed: the Flower engine (every client step on its node, state kept in the
    node's context) gives the sequential simulation's accuracies, losses and message sizes."""
    uc = _user_config(algorithm=algorithm)
    cfg = run_config(uc)
    ref = Simulation(build_config(overrides={**BASE, "algorithm": algorithm, "execution": "sequential"}), out=False)
    want = ref.run()
    # nodes connect in another order than their partition ids
    grid = LocalGrid(uc, [2, 0, 3, 1])
    eng = FlowerEngine(cfg, grid, out=False)
    got = eng.run()
    assert eng.nodes == {0: 1001, 1: 1003, 2: 1000, 3: 1002}
    for key in want["accuracy"]:
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9)
        assert got["accuracy"][key]["std"] == pytest.approx(want["accuracy"][key]["std"], abs=1e-9)
    assert got["accuracy"]["acc"]["mean"] > 0.5  # learned something (chance is 1/3 on 3 classes)
    for a, b in zip(eng.history, ref.history):
        assert a["loss_ce"] == pytest.approx(b["loss_ce"], rel=1e-6)
        assert a["loss_proto"] == pytest.approx(b["loss_proto"], rel=1e-6, abs=1e-12)
        assert (a["up_params"], a["down_params"], a["up_bytes"]) == (b["up_params"], b["down_params"], b["up_bytes"])
    assert grid.sent.count("query") == 4 and grid.sent.count("train") == 4 * BASE["rounds"]
    assert grid.sent.count("evaluate") == 4
    # the client models stayed on the nodes: the server's copies were never trained
    w_node = grid.contexts[1001].state[client_app.STATE_MODEL].to_torch_state_dict()
    w_ref = ref.setup.states[0].model.state_dict()
    for k in w_ref:
        torch.testing.assert_close(w_node[k], w_ref[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("algorithm", ["fedtgp", "fd", "fedgh", "lgfedavg"])
def test_heterogeneous_methods_give_the_simulation_numbers_under_flower(algorithm):
    """The model-heterogeneous methods on nodes of two architectures: the Flower engine
    gives the sequential simulation's accuracies (classifier, nearest prototype, global head),
    losses, server message and message sizes for the same clients and seed."""
    over = dict(algorithm=algorithm, model="projcnn:8-16,cnn", server_epochs=5)
    uc = _user_config(**over)
    ref = Simulation(build_config(overrides={**BASE, **over, "execution": "sequential"}), out=False)
    want = ref.run()
    eng = FlowerEngine(run_config(uc), LocalGrid(uc, [2, 0, 3, 1]), out=False)
    got = eng.run()
    assert set(got["accuracy"]) == set(want["accuracy"]) and len(want["accuracy"]) >= (
        2 if algorithm in ("fedtgp", "fedgh", "lgfedavg") else 1)
    for key in want["accuracy"]:
        assert got["accuracy"][key]["mean"] == pytest.approx(want["accuracy"][key]["mean"], abs=1e-9), key
    assert got["params_per_round"] == want["params_per_round"]
    for a, b in zip(eng.history, ref.history):
        assert a["loss_ce"] == pytest.approx(b["loss_ce"], rel=1e-6)
        assert (a["up_params"], a["down_params"], a["up_bytes"]) == (b["up_params"], b["down_params"], b["up_bytes"])
    assert set(eng.loop.message) == set(ref.message)
    for k in ref.message:
        np.testing.assert_allclose(eng.loop.message[k], ref.message[k], rtol=1e-5, atol=1e-6)


def test_records_round_trip_every_dtype_and_shape():
    msg = {"protos": np.arange(6, dtype=np.float32).reshape(2, 3), "classes": np.array([3, 7]),
           "lambda": np.array(0.5, np.float32), "empty": np.zeros((0, 4), np.float32)}
    back = from_record(to_record(msg))
    assert set(back) == set(msg)
    for k in msg:
        assert back[k].dtype == msg[k].dtype and back[k].shape == msg[k].shape
        np.testing.assert_array_equal(back[k], msg[k])


def test_run_config_accepts_flower_spelling_and_names_unknown_keys():
    cfg = run_config({"local-epochs": 2, "lambda-proto": 0.5, "dataset": "digits"})
    assert (cfg.local_epochs, cfg.lambda_proto) == (2, 0.5)
    with pytest.raises(ConfigError, match="Flower run config: .*unknown option 'num_rounds'"):
        run_config({"num-rounds": 3})
    with pytest.raises(ConfigError, match="lr=-1"):
        run_config({"lr": -1})


def test_duplicate_and_missing_partition_ids_are_refused():
    uc = _user_config()
    with pytest.raises(ConfigError, match=r"nodes \[1000, 1001\] all have partition-id=0"):
        FlowerEngine(run_config(uc), LocalGrid(uc, [0, 0, 1, 2]), out=False)


def test_too_few_nodes_and_wrong_num_partitions_fail_clearly():
    uc = _user_config()
    with pytest.raises(TrainingError, match="3 SuperNodes joined within 0 s, but the run has clients=4 and needs 4"):
        FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2], num_partitions=4), out=False, wait_s=0)
    with pytest.raises(TrainingError, match="num-partitions=5 but the run has clients=4"):
        FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2, 3], num_partitions=5), out=False)


def test_server_app_logs_a_user_mistake_in_one_line(caplog):
    """Reported: every user mistake under Flower printed a ServerApp traceback."""
    from fedproto.flower import server_app

    uc = {**_user_config(), "resume-from": "/no/such/run"}
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=uc)
    server_app.main(LocalGrid(uc, [0, 1, 2, 3]), ctx)  # returns instead of raising
    assert any("fedproto: resume-from='/no/such/run' is not a folder" in r.getMessage() for r in caplog.records)


def test_a_fractional_partition_id_is_refused():
    """Reported: partition-id=2.5 was silently truncated to client 2."""
    uc = _user_config()
    with pytest.raises(TrainingError, match=r"partition-id=2.5 is not a whole number"):
        FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2.5, 3]), out=False)


def test_flower_options_are_read_and_checked():
    from fedproto.flower.records import FlowerOptions

    o = FlowerOptions.from_user_config({"round-timeout": 5, "min-replies": 2, "class-names": "cat, dog", "lr": 0.1})
    assert (o.round_timeout, o.min_replies, o.round_retries, o.class_names) == (5.0, 2, 2, ("cat", "dog"))
    with pytest.raises(ConfigError, match=r"min-replies=0; give a whole number >= 1"):
        FlowerOptions.from_user_config({"min-replies": 0})
    with pytest.raises(ConfigError, match=r"round-timeout=0; give a number of seconds > 0"):
        FlowerOptions.from_user_config({"round_timeout": 0})
    for key in ("round-timeout", "wait-nodes", "min-replies", "round-retries"):
        for bad in (float("nan"), float("inf")):
            with pytest.raises(ConfigError, match=rf"Flower run config: {key}={bad!r}; give .*not NaN or infinity"):
                FlowerOptions.from_user_config({key: bad})
    assert run_config({"dataset": "custom", "classes": 4, "round-timeout": 3}).model == "custom"


def test_min_replies_above_clients_is_refused_up_front():
    from fedproto.flower.records import FlowerOptions

    uc = _own_config()
    grid = LocalGrid(uc, partition_ids=[])
    with pytest.raises(ConfigError, match=r"min-replies=5 is larger than clients=3.*give min-replies <= clients"):
        FlowerEngine(run_config(uc), grid, out=False, options=FlowerOptions(min_replies=5), wait_s=0)
    assert grid.sent == []


def test_messages_expire_with_their_round_and_an_expired_one_is_not_run(tmp_path, caplog):
    """The nodes kept starting ClientApps for a run that had stopped: Flower's default ttl is
    12 hours. Every message now lives the exchange's deadline plus TTL_MARGIN (the SuperLink drops
    it after that), and a ClientApp that gets one late refuses it before any handler runs."""
    from flwr.app import ConfigRecord

    from fedproto.flower.client_app import EXPIRY, MessageExpired
    from fedproto.flower.exchange import TTL_MARGIN
    from fedproto.flower.records import FlowerOptions

    folders = write_node_folders(tmp_path)
    uc = _own_config(**{"rounds": 2})
    grid = LocalGrid(uc, node_configs=node_configs(folders))
    ttls: list = []
    grid.on_send = lambda g, kind, group: ttls.append(kind)
    orig = grid.send_and_receive

    def keep(messages, *, timeout=None):
        ttls.extend(m.metadata.ttl for m in messages)
        return orig(messages, timeout=timeout)

    grid.send_and_receive = keep
    FlowerEngine(run_config(uc), grid, out=tmp_path / "run", options=FlowerOptions(round_timeout=45)).run()
    assert [k for k in ttls if isinstance(k, str)] == ["query", "train", "train", "evaluate"]
    assert [t for t in ttls if not isinstance(t, str)] == [45 + TTL_MARGIN] * 12  # 3 nodes x 4 exchanges
    assert EXPIRY["at"] > time.time() + 40  # the last message's expiry, noted for the executor's child

    late = Message(RecordDict({"fedproto.config": ConfigRecord({"round": 2})}), dst_node_id=1000,
                   message_type="train", ttl=75)
    late.metadata.__dict__["_created_at"] = time.time() - 200  # sent 200 s ago, expired 125 s ago
    called = []
    with pytest.raises(MessageExpired, match=r"the train message of round 2 expired 12[5-9]\.\d s before it "
                                             r"reached the ClientApp .* not run"):
        client_app.drop_expired(late, grid.contexts[1000], lambda m, c: called.append(m))
    assert called == [] and "a train message of round 2 expired" in caplog.text
    fresh = Message(RecordDict({"fedproto.config": ConfigRecord({"round": 2})}), dst_node_id=1000,
                    message_type="train", ttl=75)
    client_app.drop_expired(fresh, grid.contexts[1000], lambda m, c: called.append(m))
    assert called == [fresh] and EXPIRY["at"] == pytest.approx(fresh.metadata.created_at + 75)
    for ttl in (float("nan"), float("inf")):  # no expiry known (a NaN turned the child's watchdog off silently)
        fresh.metadata.__dict__["_ttl"] = ttl
        client_app.drop_expired(fresh, grid.contexts[1000], lambda m, c: called.append(m))
        assert called[-1] is fresh and EXPIRY["at"] == float("inf")


def test_the_server_pulls_replies_at_its_own_poll_interval():
    """Flower's Grid.send_and_receive sleeps 3 s between pulls; the server pushes and pulls itself
    every ``poll-interval`` seconds, with the numbers of the default exchange."""
    from fedproto.flower.records import FlowerOptions

    uc = _user_config()
    want = FlowerEngine(run_config(uc), LocalGrid(uc, [0, 1, 2, 3]), out=False).run()
    grid = PushPullGrid(uc, [0, 1, 2, 3])
    t0 = time.perf_counter()
    got = FlowerEngine(run_config(uc), grid, out=False, options=FlowerOptions(poll_interval=0.01)).run()
    assert time.perf_counter() - t0 < 20 and grid.pulls >= 2 * (1 + BASE["rounds"] + 1)
    assert got["accuracy"] == want["accuracy"]
    with pytest.raises(ConfigError, match=r"poll-interval=0; give a number of seconds > 0"):
        FlowerOptions.from_user_config({"poll-interval": 0})


class OneBehindGrid(PushPullGrid):
    """Node 1001 is one reply behind (the drill's node after a SuperLink restart): each pull brings its reply to the
    message before, never to the one asked."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.held: list = []

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        late = [m for m in messages if m.metadata.dst_node_id == 1001]
        for m in late:  # its reply to this message comes with the next one
            self._ready[m.metadata.message_id], self.held[:] = list(self.held), self._ready[m.metadata.message_id]
        return ids

    def pull_messages(self, message_ids):
        self.pulls += 1
        out = []
        for i in list(message_ids):
            out += self._ready.pop(i, None) or []
        return out


def test_a_reply_to_an_earlier_message_is_not_counted_for_the_next_one(tmp_path):
    """A reply counts only for the message (id and run) it answers: the late reply of a node one message behind
    was matched by its source node and counted as the next round's."""
    from fedproto.flower.records import FlowerOptions

    folders = write_node_folders(tmp_path / "data")
    uc = _own_config(**{"round-timeout": 30, "rounds": 1})  # a push runs the ClientApps here: room for a loaded CPU
    grid = OneBehindGrid(uc, node_configs=node_configs(folders))
    eng = FlowerEngine(run_config(uc), grid, out=False, options=FlowerOptions(poll_interval=0.01, round_timeout=30.0,
                                                                             wait_nodes=3))
    assert sorted(eng.nodes) == [0, 2]  # node 1001's query reply never came back as the query's
    eng.run()
    assert [row["replied"] for row in eng.history] == [[0, 2]]


def test_a_poll_interval_that_floods_the_superlink_or_outlasts_the_round_is_refused():
    """poll-interval=1e-6 (a million pulls a second) and 1e9 were accepted; one not below
    round-timeout made every round last the whole round-timeout."""
    from fedproto.flower.records import FlowerOptions

    for bad in (1e-6, 0.001, 61, 1e9):
        with pytest.raises(ConfigError, match=rf"poll-interval={bad!r}; give seconds between 0.01 and 60"):
            FlowerOptions.from_user_config({"poll-interval": bad})
    with pytest.raises(ConfigError, match=r"poll-interval=5 is not below round-timeout=2; every round would last"):
        FlowerOptions.from_user_config({"poll-interval": 5, "round-timeout": 2})
    with pytest.raises(ConfigError, match=r"poll-interval=0.2 is not below round-timeout=0.1.*longer round-timeout"):
        FlowerOptions.from_user_config({"round-timeout": 0.1})
    o = FlowerOptions.from_user_config({"poll-interval": 0.01, "round-timeout": 0.5})
    assert (o.poll_interval, o.round_timeout) == (0.01, 0.5)
    assert FlowerOptions.from_user_config({"poll-interval": 60}).poll_interval == 60.0
