"""The Flower engine (docs/architecture.md, "One round on Flower"): FedProto and every baseline over Flower's transport.

Adapters, no algorithm code: :mod:`.common` maps our messages (``dict[str, ndarray]``) and run
options to Flower records, :mod:`.client_app` is the ``ClientApp`` (one client per SuperNode:
its own data folder and model, :mod:`.node`, or client ``partition-id`` of a benchmark
partition), :mod:`.server_app` is the ``ServerApp`` (the in-process round engine with its client
step sent over a Flower ``Grid``; it holds no data and no client model; it samples connected
nodes, tolerates dropouts and checks every reply), :mod:`.node_state` keeps a node's client state
across a restart of its SuperNode (and the instance id every reply carries), :mod:`.supervise`
restarts a failed SuperNode with backoff, :mod:`.deadline` sets how long the server waits for a
round's replies (following the measured round times), :mod:`.prefork` is a warm executor for a SuperNode under
``--isolation process`` (imports and data once, a fork per message), :mod:`.local` starts a
SuperLink and SuperNodes on this machine (with TLS and SuperNode authentication if asked). Same clients and
seed give the numbers of an in-process run. See docs/flower.md.

Needs the optional dependency ``flwr`` (``pip install "fedproto[flower]"``); importing a
submodule without it raises :class:`ImportError` saying so.
"""
