"""A method's two parts apart (issue 43, item 3): the server strategy is an abstract base whose
``aggregate`` must be implemented, usable alone on hand-made messages without a client part or
torch; the client part is usable alone; the run's ``freeze_after`` reaches a method through its
constructor (``from_config``), never written onto it by the engine; ``model_needs`` and ``include``
are declared hooks with defaults."""

import subprocess
import sys

import numpy as np
import pytest
from conftest import digits_config

from fedproto.algorithms.algorithm import Algorithm, ClientPart, ClientState
from fedproto.algorithms.requirements import ONE_EMBEDDING, model_needs
from fedproto.algorithms.server_part import ServerPart
from fedproto.algorithms.server_state import ServerState
from fedproto.training import Objective, OptimConfig, Phase


class _NoAggregate(ServerPart):
    def downlink(self, message, cid):
        return message


class _Mean(ServerPart):
    """A server strategy alone: the mean of the clients' ``x``, their count as a metric."""

    name = "mean"

    def reply_problem(self, reply, sent, embedding_dim):
        return "" if set(reply) == {"x"} else f"entries {sorted(reply)}"

    def aggregate(self, round, messages, state=None):
        x = np.mean([m["x"] for m in messages.values()], axis=0)
        return ServerState({"x": x.astype(np.float32)}, metrics={"senders": len(messages)})


def test_a_server_strategy_without_aggregate_cannot_be_instantiated():
    with pytest.raises(TypeError, match="aggregate"):
        _NoAggregate()

    class _Method(Algorithm):
        name = "noagg"

    with pytest.raises(TypeError, match="aggregate"):
        _Method(3, OptimConfig())


def test_the_server_part_runs_alone_on_hand_made_messages():
    server = _Mean(freeze_after=2)
    assert not hasattr(server, "join_message") and not hasattr(server, "client_update")  # no client hook
    first = server.initial_message_from({0: {}, 1: {}})
    assert first == {}
    msgs = {0: {"x": np.array([1.0, 2.0])}, 3: {"x": np.array([3.0, 6.0])}}
    assert all(server.reply_problem(m, first, 2) == "" for m in msgs.values())
    assert server.reply_problem({"y": np.zeros(1)}, first, 2) != ""
    state = server.aggregate(1, msgs, ServerState(first))
    assert state.message["x"].tolist() == [2.0, 4.0] and state.metrics == {"senders": 2}
    # freeze_after came in through the constructor: the second stage from round 3 on
    assert "head_only" not in server.broadcast(2, state.message)
    assert server.broadcast(3, state.message)["head_only"].tolist() == [1]
    assert server.downlink(state.message, 3) is state.message
    assert server.resume_state(state.message, {"k": 1}).checkpoint == {"k": 1}


def test_the_server_part_imports_no_client_code():
    code = ("import sys, fedproto.algorithms.server_part; "
            "print(sorted(m for m in ('torch', 'fedproto.training', 'fedproto.algorithms.algorithm') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_the_client_part_runs_alone():
    from fedproto.models.zoo import build_client_model

    client = ClientPart(3, OptimConfig(), local_epochs=2)
    assert not hasattr(client, "aggregate") and not hasattr(client, "broadcast")  # no server hook
    model = build_client_model("cnn", 0, 1, 1, 3, 28)
    state = ClientState(0, model, np.array([0, 1, 2]))
    obj = client.local_objective(state, {})
    assert isinstance(obj, Objective) and [p.epochs for p in obj.phases] == [2]
    assert client.join_message(state) == {} and client.include(model) is None
    assert client.local_objective(state, {"head_only": np.ones(1, np.int8)}).phases[0].trains is not None
    assert Phase(1).trains is None


def test_freeze_after_reaches_the_method_through_its_constructor():
    from fedproto.algorithms import ALGORITHMS
    from fedproto.engine.setup import build_algorithm

    cfg = digits_config(freeze_after=2)
    for name, cls in ALGORITHMS.items():
        if name == "fedrep":  # FedRep refuses freeze_after (it trains its head alone already)
            continue
        c = digits_config(algorithm=name, freeze_after=2)
        assert cls.from_config(c, 50).freeze_after == 2, name  # the constructor argument, no engine write
        assert build_algorithm(c, 50).freeze_after == 2, name
    assert build_algorithm(digits_config(), 50).freeze_after == 0

    class _OwnFromConfig(_PlainMethod):  # a plug-in's from_config written before freeze_after was an argument
        name = "ownfromconfig"

        @classmethod
        def from_config(cls, cfg, embedding_dim):
            return cls(cfg.num_classes, OptimConfig(), cfg.local_epochs)

    alg = _OwnFromConfig.from_run(cfg, 50)
    assert alg.freeze_after == 2 and alg.seed == cfg.seed  # as the engine gave them before


class _PlainMethod(Algorithm):
    name = "plainparts"

    def aggregate(self, round, messages, state=None):
        return ServerState({})


def test_model_needs_and_include_are_declared_with_defaults():
    alg = _PlainMethod(3, OptimConfig())
    assert Algorithm.model_needs == ONE_EMBEDDING and model_needs(_PlainMethod) == ONE_EMBEDDING
    assert alg.include(None) is None
    for hook in ("model_needs", "include", "freeze_after", "seed", "options", "embedding_dim", "sequential_only",
                 "shares_weights", "Options"):
        assert any(hook in vars(k) for k in Algorithm.__mro__), hook
