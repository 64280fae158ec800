"""The FedProto math: class means (eq. 3), aggregation (eq. 6), distances (eq. 7/8), and
nearest-prototype inference (eq. 4). Pure tensor/array functions, no state.

Conventions: ``d`` is the embedding size, ``C`` the number of classes of the dataset, a
prototype table is ``(C, d)`` float with a boolean ``(C,)`` mask of which rows exist. Absent
classes are never filled with zeros and averaged in: they are masked out everywhere.

The functions live in three modules and are all importable from here:
:mod:`fedproto.prototypes.aggregation` (eq. 3 and 6, momentum, the dense table),
:mod:`fedproto.prototypes.distances` (the loss term, eq. 4, embedding health, λ's schedule) and
:mod:`fedproto.prototypes.monitor` (client distances, the class check, robust z-scores); the
design: docs/architecture.md.
"""

from __future__ import annotations

from fedproto.prototypes.aggregation import (
    AGGREGATION_RULES,
    AggregationRule,
    aggregate_prototypes,
    class_sums,
    local_prototypes,
    momentum_prototypes,
    prototype_table,
)
from fedproto.prototypes.distances import (
    DISTANCE_FORMS,
    LAMBDA_SCHEDULES,
    DistanceForm,
    embedding_health,
    lambda_at,
    nearest_prototype,
    proto_loss,
)
from fedproto.prototypes.monitor import class_check, client_distances, robust_z

__all__ = ["AGGREGATION_RULES", "DISTANCE_FORMS", "LAMBDA_SCHEDULES", "AggregationRule", "DistanceForm",
           "aggregate_prototypes", "class_check", "class_sums", "client_distances", "embedding_health", "lambda_at",
           "local_prototypes", "momentum_prototypes", "nearest_prototype", "proto_loss", "prototype_table",
           "robust_z"]
