"""Natural (per-writer) and FEMNIST few-shot partitions, ResNet18 (names, shapes, pretrained
loading), train-time augmentation (crop + flip, batched == sequential), CIFAR-10 end to end."""

import copy
from pathlib import Path

import pytest
import torch
from conftest import saved_resnet18_weights

from fedproto.config.run_config import build_config
from fedproto.errors import DataError, ModelError
from fedproto.models.cnn import PaperCNN
from fedproto.models.proto_model import WrappedModel, check_embedding_dims
from fedproto.models.resnet import ResNet18, load_pretrained
from fedproto.models.zoo import build_client_models, mh_resnet_strides


def _torchvision_resnet18_keys() -> list[str]:
    """torchvision.models.resnet18().state_dict().keys(), written out (122 keys)."""
    bn = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    keys = ["conv1.weight", *[f"bn1.{b}" for b in bn]]
    for layer in (1, 2, 3, 4):
        for block in (0, 1):
            p = f"layer{layer}.{block}."
            keys += [p + "conv1.weight", *[p + f"bn1.{b}" for b in bn]]
            keys += [p + "conv2.weight", *[p + f"bn2.{b}" for b in bn]]
            if layer > 1 and block == 0:
                keys += [p + "downsample.0.weight", *[p + f"downsample.1.{b}" for b in bn]]
    return keys + ["fc.weight", "fc.bias"]


TORCHVISION_SHAPES = {  # a few spot checks of torchvision's shapes
    "conv1.weight": (64, 3, 7, 7),
    "layer1.0.conv1.weight": (64, 64, 3, 3),
    "layer2.0.downsample.0.weight": (128, 64, 1, 1),
    "layer3.1.bn2.running_var": (256,),
    "layer4.0.conv1.weight": (512, 256, 3, 3),
    "layer4.1.conv2.weight": (512, 512, 3, 3),
    "fc.weight": (1000, 512),
}


@pytest.mark.usefixtures("one_thread")
def test_resnet18_names_match_torchvision():
    m = ResNet18(num_classes=1000)
    sd = m.state_dict()
    expected = _torchvision_resnet18_keys()
    assert len(expected) == 122
    assert list(sd) == expected
    for k, shape in TORCHVISION_SHAPES.items():
        assert tuple(sd[k].shape) == shape, k
    assert sum(p.numel() for p in m.parameters()) == 11_689_512  # torchvision resnet18
    assert m.is_head_param("fc.weight") and not m.is_head_param("layer4.1.bn2.weight")
    # FedPer/FedRep: ResNet18's only fully connected layer is fc, so both splits keep fc alone
    for layers in ("fc", "head"):
        assert m.is_personal_param("fc.bias", layers) and not m.is_personal_param("layer4.1.conv2.weight", layers)
    assert m.arch_key() is None


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("strides", [(2, 2), (1, 4)])
def test_resnet18_embedding_is_layer4_output(strides):
    torch.manual_seed(0)
    m = ResNet18(10, 3, *strides).eval()
    x = torch.randn(2, 3, 32, 32)
    fmap = m.feature_map(x)
    assert fmap.shape == (2, 512, 1, 1)  # official prototype: layer4 output, 512x1x1 on 32x32
    logits, h = m(x)
    assert h.shape == (2, 512) and logits.shape == (2, 10)
    assert torch.equal(h, fmap.flatten(1))
    big = torch.randn(2, 3, 64, 64)
    assert m.feature_map(big).shape == (2, 512, 2, 2) and m.embed(big).shape == (2, 512)  # pooled to 1x1


@pytest.mark.usefixtures("one_thread")
def test_resnet18_single_sample_training_batch():
    m = ResNet18(10).train()
    before = m.layer4[1].bn2.running_mean.clone()
    logits, h = m(torch.randn(1, 3, 32, 32))
    assert h.shape == (1, 512) and m.training and m.layer4[1].bn2.training
    assert torch.equal(before, m.layer4[1].bn2.running_mean)


@pytest.mark.usefixtures("one_thread")
def test_resnet18_zoo_names_and_mh_strides():
    assert [mh_resnet_strides(i, 20) for i in range(20)] == [(1, 4)] * 10 + [(2, 2)] * 10  # official: 0-9
    assert [m.strides for m in build_client_models("resnet18-mh", 3, 3, 10, 32)] == [(1, 4), (1, 4), (2, 2)]
    assert all(m.strides == (2, 2) for m in build_client_models("resnet18", 2, 3, 10, 32))


@pytest.mark.usefixtures("one_thread")
def test_pretrained_loads_all_but_conv1_bn1_fc(tmp_path):
    path, saved = saved_resnet18_weights(tmp_path)
    torch.manual_seed(2)
    fresh = ResNet18(num_classes=10)
    init = copy.deepcopy(fresh.state_dict())
    loaded = load_pretrained(fresh, path)
    assert len(loaded) == 114
    after = fresh.state_dict()
    for k in after:
        if k.startswith(("conv1.", "bn1.", "fc.")):
            assert torch.equal(after[k], init[k]), k
            assert k.startswith("fc.") or not torch.equal(after[k], saved[k]), k
        else:
            assert torch.equal(after[k], saved[k]), k
    models = build_client_models("resnet18-mh", 3, 3, 10, 32, pretrained=str(path))
    for m in models:
        assert torch.equal(m.layer3[0].conv1.weight, saved["layer3.0.conv1.weight"])


@pytest.mark.usefixtures("one_thread")
def test_pretrained_errors(tmp_path):
    path, saved = saved_resnet18_weights(tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        load_pretrained(ResNet18(), tmp_path / "nope.pth")
    bad = tmp_path / "corrupt.pth"
    bad.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(DataError, match="cannot read pretrained weights"):
        load_pretrained(ResNet18(), bad)
    wrong = dict(saved, **{"layer2.1.conv1.weight": torch.zeros(64, 64, 3, 3)})
    with pytest.raises(ModelError, match=r"'layer2.1.conv1.weight'.*\(64, 64, 3, 3\).*\(128, 128, 3, 3\)"):
        load_pretrained(ResNet18(), wrong)
    missing = {k: v for k, v in saved.items() if k != "layer4.1.bn2.running_var"}
    with pytest.raises(ModelError, match="lack 'layer4.1.bn2.running_var'"):
        load_pretrained(ResNet18(), missing)
    # reported: a NaN tensor was only caught as "training diverged ... lower --lr"
    nan = dict(saved, **{"layer3.0.bn1.weight": saved["layer3.0.bn1.weight"].clone().fill_(float("nan"))})
    with pytest.raises(ModelError, match=r"'layer3.0.bn1.weight' .* holds 256 NaN or infinite value"):
        load_pretrained(ResNet18(), nan)
    as_int = dict(saved, **{"layer1.0.conv1.weight": saved["layer1.0.conv1.weight"].long()})
    with pytest.raises(ModelError, match=r"'layer1.0.conv1.weight' .* dtype torch.int64"):
        load_pretrained(ResNet18(), as_int)
    with pytest.raises(DataError, match="is not a regular file"):
        load_pretrained(ResNet18(), tmp_path)
    with pytest.raises(ModelError, match="'layer5.0.conv1.weight', not a resnet18 key"):
        load_pretrained(ResNet18(), dict(saved, **{"layer5.0.conv1.weight": torch.zeros(1)}))
    with pytest.raises(ModelError, match="resnet18"):
        build_client_models("cnn", 2, 1, 10, 28, pretrained=str(path))


@pytest.mark.usefixtures("one_thread")
def test_projcnn_spec_bounds():
    from fedproto.models.zoo import check_model_name, projcnn_channels

    assert projcnn_channels("projcnn:16") == (16,) and projcnn_channels("projcnn:32-64") == (32, 64)
    for bad in ("projcnn:99999999999999999999-2", "projcnn:\u0661\u0666-32", "projcnn:0-4", "projcnn:4-",
                "projcnn:" + "-".join(["4"] * 9)):
        with pytest.raises(ModelError, match="bad model spec"):
            check_model_name(bad)


@pytest.mark.usefixtures("one_thread")
def test_pretrained_pickled_model_and_relative_path(tmp_path, monkeypatch):
    """Reported: a whole pickled model printed torch's weights_only advice; a relative
    --pretrained path was stored relative, so onboard and --resume from another folder failed."""
    whole = tmp_path / "module.pth"
    torch.save(torch.nn.Linear(2, 2), whole)
    with pytest.raises(DataError, match="holds pickled Python objects .* not a state dict; save model.state_dict"):
        load_pretrained(ResNet18(), whole)
    monkeypatch.chdir(tmp_path)

    cfg = build_config(overrides={"dataset": "cifar10", "pretrained": "w.pth"})
    assert cfg.pretrained == str(tmp_path / "w.pth")


@pytest.mark.usefixtures("one_thread")
def test_the_model_zoo_and_the_loader_are_public_and_documented():
    """fedproto.models exports the zoo (build_model and friends, each from its module); the API
    reference documents the zoo's modules and the data loader a user calls."""
    import fedproto.models as zoo

    for name in zoo.__all__:
        assert getattr(zoo, name) is not None, name
    assert zoo.build_model is build_client_models.__globals__["build_model"] and zoo.ResNet18 is ResNet18
    model = zoo.build_model("cnn", cid=0, in_channels=1, num_classes=10, input_size=28)  # the docstring's example
    logits, h = model(torch.zeros(2, 1, 28, 28))
    assert isinstance(model, PaperCNN) and logits.shape == (2, 10) and h.shape == (2, 50)
    assert [m.conv2.out_channels for m in zoo.build_client_models("cnn-mh", 3, 1, 10, 28)] == [18, 20, 22]
    with pytest.raises(AttributeError, match="no attribute 'build'"):
        zoo.build  # noqa: B018
    api = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text(encoding="utf-8")
    for module in ("fedproto.models", "fedproto.models.zoo", "fedproto.models.proto_model", "fedproto.models.cnn",
                   "fedproto.models.resnet", "fedproto.data.datasets.load_dataset", "fedproto.data.datasets.Dataset"):
        assert f"::: {module}\n" in api, module


def test_embedding_dims_must_match():
    a = WrappedModel(torch.nn.Flatten(), torch.nn.Linear(4, 2), 4, 2)
    b = WrappedModel(torch.nn.Flatten(), torch.nn.Linear(8, 2), 8, 2)
    with pytest.raises(ModelError, match=r"d=4: clients \[0, 2\]; d=8: clients \[1\]"):
        check_embedding_dims([a, b, a])
