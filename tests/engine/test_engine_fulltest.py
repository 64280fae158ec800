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
    # nearest global prototype among every class the server holds, recomputed from the embeddings
    msg = sim.message
    table = torch.as_tensor(msg["protos"], dtype=torch.float64)
    by_proto = []
    for st in sim.setup.states:
        st.model.eval()
        with torch.no_grad():
            h = st.model(ds.test_x)[1].double()
        pred = torch.as_tensor(msg["classes"])[torch.cdist(h, table).argmin(1)]
        by_proto.append(float((pred == ds.test_y).double().mean()))
    assert len(msg["classes"]) == 10  # the 6 clients together hold every digit
    assert full["acc_proto"]["mean"] == pytest.approx(np.mean(by_proto), abs=1e-12)
    # majority vote of the classifiers, ties to the lowest class (np.argmax takes the first maximum)
    votes = np.zeros((len(ds.test_y), 10))
    for o in outs:
        votes[np.arange(len(ds.test_y)), o.argmax(1).numpy()] += 1
    assert full["ensemble_vote"] == pytest.approx(float((votes.argmax(1) == ds.test_y.numpy()).mean()), abs=1e-12)
