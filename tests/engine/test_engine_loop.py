"""fedproto.engine.loop: the round loop (client sampling)."""



import pytest
import torch
from conftest import digits_eval_config

from fedproto.simulation import Simulation


@pytest.mark.parametrize("algorithm", ["fedproto", "fedavg", "fesem"])
def test_client_sampling_leaves_unsampled_clients_untouched(algorithm):
    """participation 0.5 of 6 clients: 3 clients per round, drawn from (seed, round) alone; the
    others' models are bit for bit what they were; the round's row names the sampled clients and
    counts only their messages."""
    import copy

    from fedproto.engine.seeding import sample_clients

    cfg = digits_eval_config(rounds=1, participation=0.5, algorithm=algorithm, eval_every=0)
    sim = Simulation(cfg, out=False)
    before = [copy.deepcopy(s.model.state_dict()) for s in sim.setup.states]
    sim.run()
    picked = sample_clients(cfg.seed, 1, 6, 0.5)
    assert sim.history[0]["sampled"] == picked and len(picked) == 3
    for s, b in zip(sim.setup.states, before):
        same = all(torch.equal(v, b[k]) for k, v in s.model.state_dict().items())
        assert same == (s.cid not in picked), s.cid
    full = Simulation(digits_eval_config(rounds=1, algorithm=algorithm, eval_every=0), out=False)
    full.run()
    assert "sampled" not in full.history[0]
    assert sim.history[0]["up_params"] < full.history[0]["up_params"]
    if algorithm == "fedproto":  # only the sampled clients' classes reach the server
        held = sorted({int(c) for i in picked for c in sim.setup.states[i].classes})
        assert sim.message["classes"].tolist() == held
        assert sim.loop.server.checkpoint["last_cids"].tolist() == picked
