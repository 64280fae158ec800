"""The Flower engine (DESIGN.md "Engines"): FedProto and every baseline over Flower's transport.

Three adapters, no algorithm code: :mod:`.common` maps our messages (``dict[str, ndarray]``) and
run options to Flower records, :mod:`.client_app` is the ``ClientApp`` (one client per
SuperNode, chosen by its ``partition-id`` node config), :mod:`.server_app` is the ``ServerApp``
(the in-process round engine with its client step sent over a Flower ``Grid``). Same config and
seed give the same numbers as ``fedproto run --set execution=sequential``.

Needs the optional dependency ``flwr`` (``pip install "fedproto[flower]"``); importing a
submodule without it raises :class:`ImportError` saying so.
"""
