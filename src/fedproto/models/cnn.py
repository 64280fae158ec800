"""The paper's CNN for MNIST/FEMNIST (official code: ``CNNMnist``/``CNNFemnist``).

conv(1->10, 5x5) -> maxpool 2 -> ReLU -> conv(10->c2, 5x5) -> Dropout2d -> maxpool 2 -> ReLU
-> fc(c2*4*4 -> 50) -> ReLU  [= embedding, 50-d]  -> dropout -> fc(50 -> classes).
FedProto-mh varies c2 (18/20/22, official code); the embedding stays 50-d.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedproto.models.proto_model import Noise, ProtoModel


def _apply_mask(x: torch.Tensor, mask: torch.Tensor | None, p: float, training: bool, channel: bool):
    if not training or p == 0.0:
        return x
    if mask is None:
        return F.dropout2d(x, p, True) if channel else F.dropout(x, p, True)
    return x * (mask[:, :, None, None] if channel else mask)


class PaperCNN(ProtoModel):
    """The paper's 2-conv + 2-FC CNN (§Experiments; official code ``CNNMnist``).

    Args:
        in_channels: input channels (1 for MNIST/FEMNIST, 3 for CIFAR-10).
        num_classes: logits width C.
        conv2_channels: width of the second conv (20 in the paper; 18/20/22 for FedProto-mh).
        embedding_dim: width of the first fc (= prototype size; 50 in the paper).
        input_size: side of the square input (28 for MNIST; 8 for sklearn digits, 32 CIFAR).
        dropout: p of Dropout2d after conv2 and dropout before the head (official: 0.5).
        conv1_channels: width of the first conv (10 in the paper).

    Shapes: x (B, in_channels, input_size, input_size) -> logits (B, C), h (B, embedding_dim).
    """

    head_prefixes = ("fc2.",)
    fc_prefixes = ("fc1.", "fc2.")

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        conv2_channels: int = 20,
        embedding_dim: int = 50,
        input_size: int = 28,
        dropout: float = 0.5,
        conv1_channels: int = 10,
    ):
        super().__init__()
        # 5x5 valid convolutions as in the paper; small inputs (8x8 digits) use 3x3 "same" ones
        k, pad = (5, 0) if input_size >= 20 else (3, 1)
        side = ((input_size - k + 1 + 2 * pad) // 2 - k + 1 + 2 * pad) // 2
        if side < 1:
            raise ValueError(f"input_size={input_size} is too small for the paper CNN")
        self.kernel = k
        self.pad = pad
        self.side = side
        self.in_channels = in_channels
        self.conv1 = nn.Conv2d(in_channels, conv1_channels, k, padding=pad)
        self.conv2 = nn.Conv2d(conv1_channels, conv2_channels, k, padding=pad)
        self.fc1 = nn.Linear(conv2_channels * side * side, embedding_dim)
        self.fc2 = nn.Linear(embedding_dim, num_classes)
        self.embedding_dim = embedding_dim
        self.num_classes = num_classes
        self._p = float(dropout)

    @property
    def dropout(self) -> float:
        return self._p

    def noise_widths(self) -> dict[str, int]:
        if self._p == 0.0:
            return {}
        return {"conv2": self.conv2.out_channels, "fc1": self.embedding_dim}

    def arch_key(self):
        return (
            "paper_cnn",
            self.in_channels,
            self.conv1.out_channels,
            self.conv2.out_channels,
            self.embedding_dim,
            self.num_classes,
            self.kernel,
            self.pad,
            self.side,
            self._p,
        )

    batch_params = ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias",
                    "fc2.weight", "fc2.bias")

    def grouped_forward(self, P: dict[str, torch.Tensor], xb: torch.Tensor, G: int, noise: Noise | None = None):
        """Forward pass of G stacked paper CNNs.

        Args:
            P: name -> stacked parameter (G, *shape). xb: (B, G*Cin, H, W) channels-last.
            noise: name -> (G, B, width) masks or None (eval mode).
        Returns:
            logits (G, B, C), h (G, B, d).
        """
        B = xb.shape[0]
        w1 = P["conv1.weight"].reshape(-1, *P["conv1.weight"].shape[2:])
        a = F.conv2d(xb, w1, P["conv1.bias"].reshape(-1), padding=self.pad, groups=G)
        a = F.relu(F.max_pool2d(a, 2))
        w2 = P["conv2.weight"].reshape(-1, *P["conv2.weight"].shape[2:])
        a = F.conv2d(a, w2, P["conv2.bias"].reshape(-1), padding=self.pad, groups=G)
        if noise:
            c2 = P["conv2.weight"].shape[1]
            a = a * noise["conv2"].permute(1, 0, 2).reshape(B, G * c2, 1, 1)
        a = F.relu(F.max_pool2d(a, 2))
        a = a.reshape(B, G, -1).transpose(0, 1)  # (G, B, c2*side*side)
        h = F.relu(torch.baddbmm(P["fc1.bias"].unsqueeze(1), a, P["fc1.weight"].transpose(1, 2)))
        hd = h * noise["fc1"] if noise else h
        logits = torch.baddbmm(P["fc2.bias"].unsqueeze(1), hd, P["fc2.weight"].transpose(1, 2))
        return logits, h

    def embed(self, x: torch.Tensor, noise: Noise | None = None) -> torch.Tensor:
        noise = noise or {}
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = self.conv2(x)
        x = _apply_mask(x, noise.get("conv2"), self._p, self.training, channel=True)
        x = F.relu(F.max_pool2d(x, 2))
        return F.relu(self.fc1(x.flatten(1)))

    def head(self, h: torch.Tensor, noise: Noise | None = None) -> torch.Tensor:
        noise = noise or {}
        h = _apply_mask(h, noise.get("fc1"), self._p, self.training, channel=False)
        return self.fc2(h)


class ProjectedCNN(ProtoModel):
    """A CNN of configurable width and depth ending in a projection to the shared embedding.

    For per-client model lists (a larger and a smaller client model, practitioner's guide §3.2,
    fixed so both share one embedding size): ``channels`` conv3x3+ReLU+maxpool blocks,
    adaptive average pooling to 4x4, then Linear(channels[-1]*16 -> embedding_dim) + ReLU.
    The 4x4 pool keeps the coarse layout of the image: a global (1x1) pool learned half as fast
    (MNIST, ``projcnn:32-64,projcnn:16-32``, 20 clients, 5 rounds: 42% against 80%).
    """

    pool = 4

    head_prefixes = ("fc.",)
    fc_prefixes = ("proj.", "fc.")

    def __init__(self, in_channels=1, num_classes=10, channels=(32, 64), embedding_dim=50, dropout=0.0):
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        for w in channels:
            layers += [nn.Conv2d(c, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True)]
            c = w
        layers += [nn.AdaptiveAvgPool2d(self.pool), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.proj = nn.Linear(c * self.pool * self.pool, embedding_dim)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(embedding_dim, num_classes)
        self.embedding_dim = embedding_dim
        self.num_classes = num_classes

    def embed(self, x, noise=None):
        return F.relu(self.proj(self.features(x)))

    def head(self, h, noise=None):
        return self.fc(self.drop(h))


__all__ = ["PaperCNN", "ProjectedCNN"]
