"""ResNet18 for CIFAR-10 (paper §Experiments: "ResNet18 pretrained on ImageNet"; official code
``lib/models/resnet.py``, a copy of torchvision's ResNet with configurable strides).

Layout (parameter and buffer names are exactly torchvision's ``resnet18`` state-dict names, 122
entries with the BatchNorm ``num_batches_tracked`` buffers):

    conv1 (7x7, 64, stride s1, pad 3, no bias) -> bn1 -> ReLU -> maxpool (3x3, stride s2, pad 1)
    -> layer1 (2 BasicBlocks, 64) -> layer2 (128, /2) -> layer3 (256, /2) -> layer4 (512, /2)
    [= embedding] -> fc (512 -> classes)

Strides ``(s1, s2)``: (2, 2) is torchvision's and the official default; FedProto-mh on CIFAR-10
gives clients 0-9 (1, 4) and the others (2, 2) (official code: exps/federated_main.py).

Embedding: the official code takes layer4's output before average pooling as the prototype.
For 32x32 inputs both stride settings give a 512x1x1 map (32 -> 16 -> 8 -> 8, 4, 2, 1 with
(2, 2); 32 -> 32 -> 8 -> 8, 4, 2, 1 with (1, 4)), so the embedding is that map flattened,
d = 512, and the head (avgpool -> fc) is the official one. For larger inputs, where layer4's
map is bigger than 1x1, the map is average-pooled to 1x1 (as torchvision's avgpool before fc)
so d stays 512 for every client; the official code would flatten the whole map instead.

BatchNorm keeps running statistics, so these models are trained on the sequential path only
(:meth:`arch_key` is None). Pretrained weights: :func:`load_pretrained`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fedproto.errors import DataError, ModelError, first_line
from fedproto.models.proto_model import Noise, ProtoModel

PRETRAINED_SKIP = ("conv1.", "bn1.", "fc.")
"""Key prefixes kept at their random initialisation when loading ImageNet weights (official
code: exps/federated_main.py keeps ``conv1``, ``bn1`` and ``fc`` of the fresh model)."""

MH_STRIDES = ((1, 4), (2, 2))
"""FedProto-mh (conv1 stride, maxpool stride): first half of the clients, second half
(official code for 20 clients: clients 0-9 (1, 4), 10-19 (2, 2))."""


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: two 3x3 convs with BatchNorm and an identity/1x1 shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = _conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = _conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class ResNet18(ProtoModel):
    """ResNet18 as a :class:`ProtoModel` (see the module docstring).

    Args:
        num_classes: logits width C. in_channels: input channels (3 for CIFAR-10; conv1 is never
            loaded from pretrained weights, so other values work with them too).
        conv1_stride: stride of conv1, 2 by default (1 for half the FedProto-mh clients).
        maxpool_stride: stride of the max pool after conv1, 2 by default (4 for half the FedProto-mh clients).

    Shapes: x (B, in_channels, H, W) -> logits (B, C), h (B, 512).

    A training batch of one sample is normalised with the BatchNorm running statistics (one
    sample at layer4's 1x1 map has no batch variance and torch would raise). Short trailing
    batches are folded into the batch before them (:func:`fedproto.training.min_batch`), so this
    happens only with batch size 1 or for a client that holds a single training sample.
    """

    head_prefixes = ("fc.",)

    def __init__(self, num_classes: int = 10, in_channels: int = 3, conv1_stride: int = 2, maxpool_stride: int = 2):
        super().__init__()
        self.strides = (int(conv1_stride), int(maxpool_stride))
        self.conv1 = nn.Conv2d(in_channels, 64, 7, stride=conv1_stride, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, stride=maxpool_stride, padding=1)
        widths = (64, 128, 256, 512)
        cin = 64
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w)))
            cin = w
        self.fc = nn.Linear(512, num_classes)
        self.embedding_dim = 512
        self.num_classes = num_classes
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """layer4's output (B, 512, h, w) (the official code's prototype before flattening)."""
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))

    def embed(self, x: torch.Tensor, noise: Noise | None = None) -> torch.Tensor:
        ctx = _running_stats(self) if self.training and x.shape[0] == 1 else contextlib.nullcontext()
        with ctx:
            f = self.feature_map(x)
        if f.shape[-2:] != (1, 1):
            f = F.adaptive_avg_pool2d(f, 1)
        return f.flatten(1)

    def head(self, h: torch.Tensor, noise: Noise | None = None) -> torch.Tensor:
        return self.fc(h)


@contextlib.contextmanager
def _running_stats(model: nn.Module):
    """Temporarily put the BatchNorm layers in eval mode (running statistics, no updates)."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    for m in bns:
        m.eval()
    try:
        yield
    finally:
        for m in bns:
            m.train()


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a state dict file saved with ``torch.save`` (torchvision layout, e.g.
    ``resnet18-f37072fd.pth``). A ``{"state_dict": ...}`` wrapper and a ``module.`` prefix on
    every key (DataParallel) are accepted.

    Raises:
        DataError: the file does not exist, cannot be read by ``torch.load(weights_only=True)``,
            or does not hold a mapping of names to tensors.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(
            f"pretrained weights file {str(p)!r} {'is not a regular file' if p.exists() else 'does not exist'}; "
            "pass a torchvision resnet18 state "
            "dict saved with torch.save (e.g. resnet18-f37072fd.pth from download.pytorch.org/models/)"
        )
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt zip/pickle, truncated file, foreign objects: all one cause
        if isinstance(exc, pickle.UnpicklingError) and "weights_only" in str(exc):
            raise DataError(f"{str(p)!r} holds pickled Python objects (a whole model?), not a state dict; save "
                            "model.state_dict() with torch.save and pass that file") from None
        raise DataError(f"cannot read pretrained weights {str(p)!r} ({type(exc).__name__}: "
                        f"{first_line(exc)[:200]}); replace it with a good copy of the state dict "
                        "file") from None
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping) or not obj or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise DataError(f"{str(p)!r} does not hold a state dict (a non-empty mapping of names to tensors)")
    state = dict(obj)
    if all(k.startswith("module.") for k in state):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    return state


def load_pretrained(model: ResNet18, source: str | os.PathLike | Mapping[str, torch.Tensor],
                    origin: str | None = None) -> list[str]:
    """Load torchvision-layout ResNet18 weights into every tensor except ``conv1.*``, ``bn1.*``
    and ``fc.*``, which keep their random initialisation (official code: exps/federated_main.py).

    Args:
        model: a :class:`ResNet18`. source: a file path (see :func:`read_state_dict`) or a state dict.
        origin: where a given state dict came from (a file name), for error messages.
    Returns:
        The names loaded (114 for resnet18: its 122 keys minus conv1.weight, the 5 bn1 entries
        and fc.weight, fc.bias).
    Raises:
        DataError: see :func:`read_state_dict`.
        ModelError: a needed key is missing, a key is not a resnet18 key, or a shape differs
            (the message names the key and both shapes), a dtype differs, or a tensor holds NaN or
            infinite values.
    """
    state = dict(source) if isinstance(source, Mapping) else read_state_dict(source)
    if isinstance(source, Mapping):
        where = repr(origin) if origin else "(state dict)"
    else:
        where = repr(str(source))
    own = model.state_dict()
    wanted = [k for k in own if not k.startswith(PRETRAINED_SKIP)]
    missing = [k for k in wanted if k not in state]
    if missing:
        raise ModelError(
            f"pretrained weights {where} lack {missing[0]!r} ({len(missing)} key(s) missing); "
            "expected a torchvision resnet18 state dict"
        )
    unexpected = [k for k in state if k not in own]
    if unexpected:
        raise ModelError(
            f"pretrained weights {where} hold {unexpected[0]!r}, not a resnet18 key ({len(unexpected)} "
            "such key(s)); expected a torchvision resnet18 state dict, not another architecture"
        )
    for k in wanted:
        if tuple(state[k].shape) != tuple(own[k].shape):
            raise ModelError(
                f"pretrained tensor {k!r} in {where} has shape {tuple(state[k].shape)} but the model "
                f"expects {tuple(own[k].shape)}; expected a torchvision resnet18 state dict"
            )
        if state[k].dtype != own[k].dtype:
            raise ModelError(f"pretrained tensor {k!r} in {where} has dtype {state[k].dtype} but the model "
                             f"expects {own[k].dtype}; expected a torchvision resnet18 state dict")
        if state[k].is_floating_point() and not bool(torch.isfinite(state[k]).all()):
            bad = int((~torch.isfinite(state[k])).sum())
            raise ModelError(f"pretrained tensor {k!r} in {where} holds {bad} NaN or infinite value(s); "
                             "the file is damaged: use a good copy of the weights")
    model.load_state_dict({**own, **{k: state[k] for k in wanted}}, strict=True)
    return wanted


__all__ = ["BasicBlock", "MH_STRIDES", "PRETRAINED_SKIP", "ResNet18", "load_pretrained", "read_state_dict"]
