"""fedproto.engine.observers.progress: progress output of a Python run."""







from fedproto.config.run_config import build_config


def test_python_runs_log_one_line_per_evaluated_round_at_info(caplog):
    """A Python run prints nothing while it trains; at INFO logging (``logging.basicConfig(level=
    logging.INFO)``) each evaluated round is the line the CLI prints off a terminal."""
    import logging

    from fedproto.simulation import Simulation

    cfg = build_config(overrides=dict(dataset="digits", clients=3, rounds=3, eval_every=2, threads=1))
    with caplog.at_level(logging.INFO, logger="fedproto"):
        sim = Simulation(cfg, out=False)
        sim.run()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("round ")]
    assert [line.split(":")[0] for line in lines] == ["round 2/3", "round 3/3"]
    assert f"classifier {100 * sim.history[1]['acc_mean']:.2f}" in lines[0]
