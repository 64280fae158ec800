"""fedproto.engine.seeding: seeded client sampling."""



import pytest

from fedproto.config.run_config import build_config


def test_sample_clients_is_seeded_per_round_and_sized():
    from fedproto.engine.seeding import sample_clients

    assert sample_clients(1, 1, 20, 1.0) == list(range(20))
    draws = [sample_clients(1, r, 20, 0.2) for r in range(1, 6)]
    assert all(len(d) == 4 and d == sorted(set(d)) and 0 <= min(d) and max(d) < 20 for d in draws)
    assert draws[0] == sample_clients(1, 1, 20, 0.2) and len({tuple(d) for d in draws}) > 1
    assert sample_clients(2, 1, 20, 0.2) != draws[0] or sample_clients(3, 1, 20, 0.2) != draws[0]
    assert len(sample_clients(1, 1, 3, 0.01)) == 1  # at least one client
    with pytest.raises(ValueError, match="participation=0"):
        sample_clients(1, 1, 3, 0.0)
    with pytest.raises(Exception, match="participation"):
        build_config(overrides=dict(participation=1.5))
