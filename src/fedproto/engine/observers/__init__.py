"""Observers of the round loop (:class:`fedproto.engine.loop.Observer`), one concern per module:
:mod:`~fedproto.engine.observers.rundir` (metrics, config, summary and result files),
:mod:`~fedproto.engine.observers.checkpoints` (checkpoints and resume),
:mod:`~fedproto.engine.observers.health` (divergence, embedding norms, outlier alerts),
:mod:`~fedproto.engine.observers.progress` (the per-round line and callback),
:mod:`~fedproto.engine.observers.fulltest` (the full test split and the ensemble, in-process)."""
