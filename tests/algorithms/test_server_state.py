"""Every method's server returns its state explicitly (``ServerState``); a plain message is wrapped
as it is, and a class still written against the older side-attribute hooks is refused by name
instead of losing its metrics or checkpoint in silence."""

import numpy as np
import pytest

from fedproto.algorithms import ALGORITHMS, Algorithm
from fedproto.algorithms.server_state import LEGACY_HOOKS, ServerState, as_state, server_update
from fedproto.training import OptimConfig


class _Plain(Algorithm):
    name = "plainmsg"

    def aggregate(self, round, messages):
        return {"x": np.full(2, float(round))}


class _Legacy(_Plain):
    name = "legacymsg"

    def round_metrics(self):
        return {"m": 1.0}


def test_a_plain_message_is_wrapped_and_nothing_else_is_invented():
    state = server_update(_Plain(3, OptimConfig()), 4, {}, ServerState({}))
    assert isinstance(state, ServerState) and state.message["x"].tolist() == [4.0, 4.0]
    assert state.metrics == {} and state.checkpoint == {} and state.alerts == [] and state.files == {}


def test_a_side_attribute_server_is_refused_naming_the_hook():
    with pytest.raises(TypeError, match="defines round_metrics, which fedproto no longer reads"):
        server_update(_Legacy(3, OptimConfig()), 1, {}, ServerState({}))
    with pytest.raises(TypeError, match="returned list"):
        as_state(_Plain(3, OptimConfig()), [1, 2])


def test_no_library_method_defines_a_side_attribute_hook():
    for name, cls in ALGORITHMS.items():
        assert not [h for h in LEGACY_HOOKS if hasattr(cls, h)], name


def test_the_dp_seed_warning_comes_from_the_method(caplog):
    """The engine logs the method's set-up warnings; it names no option of a method itself."""
    from conftest import digits_config

    from fedproto.simulation import Simulation

    with caplog.at_level("WARNING"):
        Simulation(digits_config(rounds=1, dp="prototypes", dp_reproducible_noise=True), out=False)
    assert any("the privacy guarantee does not hold against anyone who knows the seed" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING"):
        Simulation(digits_config(rounds=1, dp_reproducible_noise=True), out=False)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("dp_reproducible_noise")] == [
        "dp_reproducible_noise: ignored, it acts with dp prototypes or full only"]
