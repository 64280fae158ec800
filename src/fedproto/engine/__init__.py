"""The engine: one set-up (:mod:`~fedproto.engine.setup`), one round loop (:mod:`~fedproto.engine.loop`),
one reply check (:mod:`~fedproto.engine.checks`), the executors that run the clients
(:mod:`~fedproto.engine.executors`) and the observers that hang on the loop
(:mod:`~fedproto.engine.observers`). docs/architecture.md draws the data path of one round."""
