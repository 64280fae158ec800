"""Model names are declared once (fedproto.models.names): the zoo builds each, the config, the
Flower node and ``fedproto reproduce`` read them from there (not five lists)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedproto.errors import ModelError
from fedproto.models.names import MODEL_NAMES, ZOO, mh_variant, zoo_name
from fedproto.models.zoo import build_client_models, check_model_name

SRC = Path(__file__).resolve().parents[2] / "src" / "fedproto"


@pytest.mark.parametrize("spec", ["cnn", "cnn-mh", "resnet18", "resnet18-mh", "projcnn:8-16"])
def test_every_zoo_name_builds_and_validates(spec):
    check_model_name(spec)
    entry = zoo_name(spec)
    assert entry is not None and entry.name == spec.split(":")[0]
    m = build_client_models(spec, 2, 1, 10, 28, 16, 0.0, 0)[0]
    import torch

    logits, h = m(torch.zeros(2, 1, 28, 28))
    assert logits.shape == (2, 10) and h.shape == (2, entry.fixed_embedding or 16)


@pytest.mark.parametrize("spec", ["cnn:3", "projcnn", "resnet", "CNN", "cnn-mh:1"])
def test_names_outside_the_zoo_are_refused(spec):
    assert zoo_name(spec) is None
    with pytest.raises(ModelError, match="unknown model|bad model spec"):
        check_model_name(spec)


def test_fedproto_mh_variants_and_the_help_list():
    assert mh_variant("cnn") == "cnn-mh" and mh_variant("resnet18") == "resnet18-mh"
    assert mh_variant("projcnn:16-32,projcnn:32-64") == "projcnn:16-32,projcnn:32-64"
    assert MODEL_NAMES == ("cnn", "cnn-mh", "resnet18", "resnet18-mh", "projcnn:<c1>-<c2>[,...]")
    assert set(ZOO) == {"cnn", "cnn-mh", "resnet18", "resnet18-mh", "projcnn"}


def test_no_other_module_lists_the_model_names():
    """A second list of the names (as a tuple, set or 'a | b' string) outside fedproto.models.names."""
    pattern = re.compile(r"""["']cnn-mh["']\s*,\s*["']resnet18["']|cnn \| cnn-mh \| resnet18""")
    offenders = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                 if p.name != "names.py" and pattern.search(p.read_text())]
    assert offenders == []
