"""The one list of model-zoo names (torch-free, so that the configuration, the command line's
``--help`` and the Flower node can check a name without loading torch).

:func:`fedproto.models.zoo.build_client_models` builds them; the config, the Flower node and
``fedproto reproduce`` read the names from here. A zoo model added here and in ``zoo._one`` is
known everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ZooName:
    """One zoo model name.

    Attributes:
        name: the ``model`` option's value (``projcnn`` takes ``:<c1>-<c2>[-...]`` after it).
        family: the architecture family (``cnn``, ``resnet18``, ``projcnn``).
        heterogeneous: FedProto-mh's variant: clients of one run get different widths or strides.
        mh_variant: the heterogeneous name of the family (``cnn`` -> ``cnn-mh``), None where none.
        fixed_embedding: the embedding size the model always gives (ResNet18: 512), None where
            ``embedding_dim`` sets it.
    """

    name: str
    family: str
    heterogeneous: bool = False
    mh_variant: str | None = None
    fixed_embedding: int | None = None


ZOO: dict[str, ZooName] = {z.name: z for z in (
    ZooName("cnn", "cnn", mh_variant="cnn-mh"),
    ZooName("cnn-mh", "cnn", heterogeneous=True),
    ZooName("resnet18", "resnet18", mh_variant="resnet18-mh", fixed_embedding=512),
    ZooName("resnet18-mh", "resnet18", heterogeneous=True, fixed_embedding=512),
    ZooName("projcnn", "projcnn"),
)}
"""Every zoo model by name (``projcnn`` stands for its parametrised specs)."""

PARAMETRISED = ("projcnn",)
"""Names written ``name:<parameters>`` (``projcnn:16-32``)."""

MODEL_NAMES = tuple(f"{n}:<c1>-<c2>[,...]" if n in PARAMETRISED else n for n in ZOO)
"""The names as help texts and error messages list them."""


def zoo_name(spec: str) -> ZooName | None:
    """The zoo entry of one spec (``cnn``, ``projcnn:16-32``), None when it is no zoo name."""
    base, sep, _ = spec.strip().partition(":")
    entry = ZOO.get(base)
    if entry is None or (sep != "") != (base in PARAMETRISED):
        return None
    return entry


def mh_variant(spec: str) -> str:
    """FedProto-mh's variant of ``spec``: its family's heterogeneous name (``cnn`` -> ``cnn-mh``),
    else ``spec`` itself (a projcnn list is heterogeneous as the user wrote it)."""
    entry = ZOO.get(spec.strip())
    return entry.mh_variant if entry is not None and entry.mh_variant else spec
