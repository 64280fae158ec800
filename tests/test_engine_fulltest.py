"""fedproto.engine.observers.fulltest: evaluation on the full test split and the ensembles."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import digits_config

from fedproto.simulation import Simulation


def test_full_test_split_and_ensemble():
    sim = Simulation(digits_config(rounds=3, eval_full_test=True), out=False)
    s = sim.run()
    full = s["accuracy_full_test"]
    ds = sim.setup.dataset
    assert "full test split" in full["test_set"] and str(len(ds.test_y)) in full["test_set"]
    from fedproto.training import predict

    outs = [predict(st.model, ds.test_x)[0].double() for st in sim.setup.states]
    probs = sum(torch.softmax(o, 1) for o in outs)
    assert full["ensemble_softmax"] == pytest.approx(float((probs.argmax(1) == ds.test_y).double().mean()), abs=1e-12)
    accs = [float((o.argmax(1) == ds.test_y).double().mean()) for o in outs]
    assert full["acc"]["mean"] == pytest.approx(np.mean(accs), abs=1e-12)
    assert 0 <= full["acc_proto"]["mean"] <= 1 and 0 <= full["ensemble_vote"] <= 1
