"""Executors (:class:`~fedproto.engine.executors.executor.Executor`): sequential (the reference),
batched (optionally on worker processes) and, in :mod:`fedproto.flower.flower_executor`, Flower."""
