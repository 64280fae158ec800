"""Which execution path each client trains on, said once per client for inputs that are not
floating-point tensors (token ids, dicts or tuples of tensors, data read from a Dataset): the
batched executor takes the batched path where it can take the structure, the sequential path
otherwise, and this module logs that choice with its reason (:func:`explain_paths`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch

from fedproto.data.inputs import describe

if TYPE_CHECKING:
    from fedproto.engine.setup import Setup

log = logging.getLogger(__name__)


class PathsExecutor(Protocol):
    """What :func:`explain_paths` reads of the batched executor."""

    setup: Setup
    mode: str


def plain_images(x: object) -> bool:
    """True for floating-point tensor inputs (images, tabular features): the paths chosen for them
    are the engine's defaults, not logged per client."""
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def explain_paths(executor: PathsExecutor, groups: list[tuple[list[int], int]]) -> None:
    """Log once per client, for clients whose inputs are not floating-point tensors, the path it
    trains on (``batched``: in a group of two or more; ``sequential``) and why.

    Args:
        executor: the :class:`~fedproto.engine.executors.batched.BatchedExecutor` (its ``setup``,
            ``mode``; the set ``_paths_said`` records the clients already logged).
        groups: this round's groups (:meth:`BatchedExecutor.groups`).
    """
    said: set[int] = executor.__dict__.setdefault("_paths_said", set())
    data = executor.setup.data
    for members, _ in groups:
        for i in members:
            if i in said:
                continue
            d = data[i]
            if d.is_view or (isinstance(d._x, torch.Tensor) and d._x.is_floating_point()):
                said.add(i)
                continue
            x = d._x
            kind = f"inputs {describe(x[0:1])}" if d.in_memory else "inputs read from a Dataset"
            if len(members) > 1:
                why = f"batched path with {len(members) - 1} other client(s) of its architecture"
            elif not d.in_memory:
                why = "sequential path: its inputs are read from a Dataset item by item"
            elif executor.mode == "sequential" or executor.setup.algorithm.sequential_only:
                why = "sequential path (execution='sequential', or a method that trains one client at a time)"
            else:
                why = ("sequential path: no other client of its architecture, or its model cannot be batched "
                       "(execution='batched' tries torch.func.vmap)")
            log.info("client %d (%s): %s", i, kind, why)
            said.add(i)
