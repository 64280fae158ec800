"""The practitioner's guide's walkthrough (§3.1-3.3) with fedproto's Python API: ten CIFAR-10
clients with label skew, half with a larger and half with a smaller CNN written by the user,
trained with FedProto. The guide's two CNNs end in 4,096- and 1,024-wide features; their
embeddings are projected to one size (``embedding_dim``) so that prototypes can be averaged.

    FEDPROTO_DATA=/path/to/data python examples/own_federation.py --rounds 10 --threads 1
    python examples/own_federation.py --head-split     # the same models given by their head name

Prints the summary's accuracies and the wall time.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn

from fedproto.data.datasets import load_dataset
from fedproto.data.partition import dirichlet_partition
from fedproto.federation import Client, federate


class LargerCNN(nn.Module):
    """The guide's larger client model; ``forward`` returns (logits, features)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d((4, 4)))
        self.classifier = nn.Linear(256 * 4 * 4, num_classes)

    def forward(self, x):
        h = self.features(x).flatten(1)
        return self.classifier(h), h


class SmallerCNN(nn.Module):
    """The guide's smaller client model."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.AdaptiveAvgPool2d((4, 4)))
        self.classifier = nn.Linear(64 * 4 * 4, num_classes)

    def forward(self, x):
        h = self.features(x).flatten(1)
        return self.classifier(h), h


class Logits(nn.Module):
    """The same model as a plain classifier (forward returns logits only), split at ``classifier``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.features, self.classifier = inner.features, inner.classifier

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=0.1, help="Dirichlet label skew (0.1: one or two classes each)")
    ap.add_argument("--fraction", type=float, default=0.2, help="share of the CIFAR-10 train split to use")
    ap.add_argument("--embedding-dim", type=int, default=256)
    ap.add_argument("--head-split", action="store_true", help="give the models as classifiers plus head name")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="runs/own-federation")
    a = ap.parse_args()
    torch.manual_seed(42)
    ds = load_dataset("cifar10")
    keep = np.random.default_rng(42).permutation(len(ds.train_y))[: int(a.fraction * len(ds.train_y))]
    part = dirichlet_partition(ds.train_y.numpy()[keep], ds.test_y.numpy(), 10, 10, a.alpha, min_samples=50,
                               test_shots=40, seed=42)
    clients = []
    for i, (tr, te) in enumerate(zip(part.train_idx, part.test_idx)):
        model = LargerCNN() if i < 5 else SmallerCNN()
        tr, te = torch.as_tensor(keep[tr]), torch.as_tensor(te)
        clients.append(Client(Logits(model) if a.head_split else model, (ds.train_x[tr], ds.train_y[tr]),
                              (ds.test_x[te], ds.test_y[te]), head="classifier" if a.head_split else None,
                              embedding_dim=a.embedding_dim))
    sim = federate(clients, num_classes=10, algorithm="fedproto", rounds=a.rounds, lambda_proto=1.0,
                   batch_size=32, lr=0.01, momentum=0.9, threads=a.threads, eval_every=0, out=a.out)
    t = time.perf_counter()
    s = sim.run()
    acc, accp = s["accuracy"]["acc"], s["accuracy"]["acc_proto"]
    print(f"{len(clients)} clients, {a.rounds} rounds, alpha {a.alpha}: classifier {100 * acc['mean']:.2f} ± "
          f"{100 * acc['std']:.2f} %, nearest prototype {100 * accp['mean']:.2f} ± {100 * accp['std']:.2f} %, "
          f"{time.perf_counter() - t:.0f} s; results in {a.out}")


if __name__ == "__main__":
    main()
