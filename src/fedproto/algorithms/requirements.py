"""What each method needs from its clients' models, and the one set-up check derived from it.

Every algorithm states in ``model_needs`` (a class attribute) what its clients' models must share:

* :data:`ONE_ARCHITECTURE`: the same tensors, names and shapes (the weights are averaged: FedAvg,
  FedProx, FedPer, FedRep, FeSEM);
* :data:`ONE_EMBEDDING`: one embedding size d, any bodies (prototypes or heads of size d are
  shared: FedProto, FedTGP, FedGH, LG-FedAvg); the default of a plug-in that states nothing;
* :data:`LABEL_SPACE`: only the classes 0..C-1 (per-class logits are shared: FD);
* :data:`NOTHING`: nothing (Local: no communication).

:func:`check_model_needs` is the check :func:`fedproto.engine.setup.build_setup` runs for every
front end; a refusal names the clients that differ and the methods that would run these models as
they are (:func:`methods_for`). An algorithm's own ``check_models`` adds what this statement
cannot say (FedAvg: frozen tensors that differ; LG-FedAvg: one linear head layer).

Size: about 160 lines.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

from torch import nn

from fedproto.errors import ModelError
from fedproto.models.proto_model import ProtoModel

H = TypeVar("H", bound=Hashable)

Signature = tuple[tuple[str, tuple[int, ...]], ...]
"""A model's architecture as weight averaging sees it: (name, shape) per shared tensor."""

ONE_ARCHITECTURE = "one architecture"
ONE_EMBEDDING = "one embedding size"
LABEL_SPACE = "only the label space"
NOTHING = "nothing"
NEEDS = (NOTHING, LABEL_SPACE, ONE_EMBEDDING, ONE_ARCHITECTURE)
"""The statements, from the weakest to the strongest (each implies those before it)."""

WHY = {
    ONE_ARCHITECTURE: "it averages model weights",
    ONE_EMBEDDING: "it shares embedding-sized vectors (prototypes or heads)",
    LABEL_SPACE: "it shares per-class outputs only",
    NOTHING: "it shares nothing",
}


def model_needs(cls: type) -> str:
    """The statement of algorithm class ``cls`` (``cls.model_needs``; :data:`ONE_EMBEDDING` when it
    states none).

    Raises:
        ValueError: ``model_needs`` is not one of :data:`NEEDS`.
    """
    needs: Any = getattr(cls, "model_needs", ONE_EMBEDDING)  # declared on Algorithm; the same default for a bare class
    if needs not in NEEDS:
        raise ValueError(f"{getattr(cls, 'name', cls.__name__)}.model_needs={needs!r}: state one of {NEEDS}")
    return str(needs)


def needs_one_size(algorithm: str) -> bool:
    """True when the algorithm named ``algorithm`` needs one embedding size across clients
    (:data:`ONE_EMBEDDING` or :data:`ONE_ARCHITECTURE`); a Flower node checks its model's size
    against the run's ``embedding-dim`` only then. Raises ConfigError for an unknown name."""
    from fedproto.algorithms import get_algorithm

    return model_needs(get_algorithm(algorithm)) in (ONE_EMBEDDING, ONE_ARCHITECTURE)


def architecture(model: nn.Module, include: Callable[[str], bool] | None = None) -> Signature:
    """A model's architecture as weight averaging sees it: the names and shapes of its parameters
    and buffers (those ``include(name)`` keeps, when given: the tensors a method shares)."""
    return tuple((n, tuple(t.shape)) for n, t in [*model.named_parameters(), *model.named_buffers()]
                 if include is None or include(n))


def _groups(values: Sequence[H]) -> dict[H, list[int]]:
    out: dict[H, list[int]] = {}
    for i, v in enumerate(values):
        out.setdefault(v, []).append(i)
    return out


def architecture_groups(sigs: Sequence[Signature], cids: Sequence[int], limit: int | None = None) -> list[str]:
    """Clients grouped by architecture signature, in words: ``clients [..] (like client c0)`` for the first
    client's group, ``clients [..] (differ at 'name': b vs a)`` for each other group (the first parameter whose
    shape differs). ``sigs``: one signature (a tuple of (name, shape) pairs) per client, ``cids`` their ids."""
    groups: dict[Signature, list[int]] = {}
    for sig, cid in zip(sigs, cids):
        groups.setdefault(sig, []).append(cid)
    ref, parts = sigs[0], []
    for sig, ids in groups.items():
        ids = ids[:limit] if limit else ids
        if sig == ref:
            parts.append(f"clients {ids} (like client {cids[0]})")
            continue
        a, b = dict(ref), dict(sig)
        diff = next((n for n in list(a) + list(b) if a.get(n) != b.get(n)), "?")
        parts.append(f"clients {ids} (differ at {diff!r}: {b.get(diff)} vs {a.get(diff)})")
    return parts


def meets(needs: str, models: Sequence[ProtoModel]) -> bool:
    """True when ``models`` (one per client) meet the statement ``needs``."""
    if needs in (NOTHING, LABEL_SPACE):
        return True
    if len({int(m.embedding_dim) for m in models}) > 1:
        return False
    return needs != ONE_ARCHITECTURE or len({architecture(m) for m in models}) <= 1


def methods_for(models: Sequence[ProtoModel]) -> list[str]:
    """The registered algorithms (plug-ins included) whose statement ``models`` meet, by name."""
    from fedproto.algorithms import get_algorithm
    from fedproto.plugins import algorithm_names

    out = []
    for name in algorithm_names():
        try:
            if meets(model_needs(get_algorithm(name)), models):
                out.append(name)
        except Exception:  # noqa: BLE001 - a broken plug-in is not named; its own run reports it
            continue
    return out


def _named(names: list[str]) -> str:
    return ", ".join(f"algorithm='{n}'" for n in names) if names else "none of the registered methods"


def check_model_needs(name: str, needs: str, models: Sequence[ProtoModel], fix: str | None = None) -> int:
    """Refuse client models that do not meet algorithm ``name``'s statement ``needs``.

    Args:
        name: the algorithm's name (for the message). needs: its :func:`model_needs`.
        models: one per client, in client order (their index names the client).
        fix: how the front end's user gives the models one embedding size (None: the general advice).
    Returns:
        The embedding size the run reports: the shared d, or the largest of the clients' where the
        statement lets them differ (:data:`LABEL_SPACE`, :data:`NOTHING`).
    Raises:
        ModelError: no models; embedding sizes differ where ``needs`` asks for one (names the clients
            of each size; :func:`check_architectures` checks the architectures once the method is
            built), naming the methods that run these models as they are.
    """
    if not models:
        raise ModelError("no client models were built")
    dims = [int(m.embedding_dim) for m in models]
    if needs in (NOTHING, LABEL_SPACE) or meets(needs, models):
        return max(dims)
    others = _named(methods_for(models))
    by_dim = _groups(dims)
    if len(by_dim) > 1:
        groups = "; ".join(f"d={v}: clients {by_dim[v]}" for v in sorted(by_dim))
        fix = fix or "give every model the same embedding_dim (add a projection layer)"
        raise ModelError(f"clients have different embedding sizes ({groups}); {name} needs {needs} for all clients "
                         f"({WHY[needs]}): {fix}. Methods that run these models as they are: {others}")
    return max(dims)


def check_architectures(name: str, models: Sequence[ProtoModel], include: Callable[[str], bool] | None = None,
                        fix: str | None = None) -> None:
    """Refuse client models whose shared tensors differ, for a method of :data:`ONE_ARCHITECTURE`.

    Args:
        name: the algorithm's name. models: one per client. include: predicate on tensor names, the
            tensors the method shares (None: all). fix: what to do, for the front end that built the
            models (None: one zoo model for all clients, ``model cnn`` worded per front end).
    Raises:
        ConfigError: names the clients of each architecture, the first tensor that differs, and the
            methods that run these models as they are.
    """
    from fedproto.errors import ConfigError

    archs = [architecture(m, include) for m in models]
    by_arch = _groups(archs)
    if len(by_arch) <= 1:
        return
    parts = architecture_groups(archs, list(range(len(archs))), limit=10)
    from fedproto.errors import opt

    fix = fix or f"use one model for all clients (e.g. {opt('model', 'cnn')})"
    raise ConfigError(f"{name} averages model weights, so every client needs the same architecture, but the client "
                      f"models differ: {'; '.join(parts)}. {fix[0].upper() + fix[1:]}, or a "
                      f"method that runs these models as they are: {_named(methods_for(models))}")


__all__ = ["LABEL_SPACE", "NEEDS", "NOTHING", "ONE_ARCHITECTURE", "ONE_EMBEDDING", "WHY", "architecture",
           "check_architectures", "check_model_needs", "meets", "methods_for", "model_needs", "needs_one_size"]
