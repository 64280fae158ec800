"""Executors (:class:`~fedproto.engine.executors.base.Executor`): sequential (the reference),
batched (optionally on worker processes) and, in :mod:`fedproto.flower.executor`, Flower."""
