"""fedproto.engine.setup: prepare and build_setup (one set-up path for the CLI and the Python API)."""

from __future__ import annotations

import logging
from dataclasses import asdict

from conftest import SMALL, digits_config, own_digits_clients

from fedproto.config.run_config import build_config
from fedproto.engine.setup import prepare
from fedproto.federation import Client, federate


def test_options_of_other_algorithms_are_warned_about(caplog):
    """The engine names options that act on other algorithms only (each option's owners,
    fedproto.algorithms.method_options.owners), without knowing any algorithm by name."""
    from fedproto.engine.setup import prepare

    with caplog.at_level(logging.WARNING, logger="fedproto"):
        prepare(digits_config(algorithm="fedavg", proto_momentum=0.5, personal_layers="head"), progress=False)
    assert "fedavg ignores personal_layers, proto_momentum" in caplog.text
    assert "proto_momentum acts on fedproto only" in caplog.text
    assert "personal_layers acts on fedper, fedrep" in caplog.text


def test_test_classes_absent_from_training_are_named(caplog):
    clients = own_digits_clients()
    x, y = clients[1].train
    keep = y != y[0]  # client 1 loses every training sample of one of its classes
    gone = int(y[0])
    clients[1] = Client(clients[1].model, (x[keep], y[keep]), clients[1].test)
    with caplog.at_level(logging.WARNING):
        federate(clients, num_classes=10, rounds=1, threads=1, out=False)
    warned = [r.getMessage() for r in caplog.records if "absent from their training data" in r.getMessage()]
    assert len(warned) == 1 and f"client 1: [{gone}]" in warned[0] and "client 0" not in warned[0]


def test_cli_and_api_set_up_resolve_the_same_configuration():
    opts = {**SMALL, "clients": 4, "rounds": 1, "batch_size": 10000, "lr": 0.05}
    cli = prepare(build_config(overrides=opts), progress=False)
    clients = [Client(s.model, (d.x, d.y), (d.test_x, d.test_y)) for s, d in zip(cli.states, cli.data)]
    api = federate(clients, 10, False, **{k: v for k, v in opts.items() if k not in ("dataset", "clients")}).setup
    largest = max(len(d.y) for d in cli.data)
    assert asdict(cli.algorithm.opt) == asdict(api.algorithm.opt)
    assert api.algorithm.opt.batch_size == largest < 10000  # capped by both front ends
    assert (cli.embedding_dim, type(cli.algorithm)) == (api.embedding_dim, type(api.algorithm))
    assert [list(s.classes) for s in cli.states] == [list(s.classes) for s in api.states]
