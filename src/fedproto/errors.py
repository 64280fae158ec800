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
    """The dataset cannot supply the requested partition (names the class and the shortfall)."""


class ModelError(FedprotoError, ValueError):
    """Client models are incompatible (e.g. different embedding sizes) or a model name is unknown."""


class TrainingError(FedprotoError):
    """Training cannot go on (e.g. the loss became NaN or infinite)."""


class CheckpointError(DataError):
    """A checkpoint file is damaged, of another format, or does not fit the run's models."""


class CheckpointMismatch(ConfigError):
    """A checkpoint was written by a run with other options (names the fields that differ)."""
