"""Exception types. Every error a user can cause derives from :class:`FedprotoError`.

The CLI turns any :class:`FedprotoError` into one message on stderr and exit code 2,
without a traceback. Messages name the bad value and say how to fix it.
"""

from __future__ import annotations


class FedprotoError(Exception):
    """Base class of all user-facing errors (bad config, missing data, impossible partition)."""


class ConfigError(FedprotoError, ValueError):
    """A run configuration value is invalid (raised before any training starts)."""


class DataError(FedprotoError):
    """A dataset file is missing, corrupt, or cannot be downloaded."""


class PartitionError(FedprotoError, ValueError):
    """The dataset cannot supply the requested partition (names the class and the shortfall).

    A training-sample shortfall of :func:`fedproto.data.partition.fewshot_partition` also carries
    it as data, so each front end can word its own advice: ``short_class`` (the class that runs
    shortest), ``needed`` and ``available`` (its training samples), ``short_classes`` (how many
    classes run short), ``fitting_shots`` (the largest shots that fits with this seed, or 0).
    Other partition errors leave them None."""

    def __init__(self, message: str, *, short_class: int | None = None, needed: int | None = None,
                 available: int | None = None, short_classes: int | None = None, fitting_shots: int | None = None):
        super().__init__(message)
        self.short_class, self.needed, self.available = short_class, needed, available
        self.short_classes, self.fitting_shots = short_classes, fitting_shots


class ModelError(FedprotoError, ValueError):
    """Client models are incompatible (e.g. different embedding sizes) or a model name is unknown."""


class TrainingError(FedprotoError):
    """Training cannot go on (e.g. the loss became NaN or infinite)."""


class CheckpointError(DataError):
    """A checkpoint file is damaged, of another format, or does not fit the run's models."""


class CheckpointMismatch(ConfigError):
    """A checkpoint was written by a run with other options (names the fields that differ)."""
