"""Your own federation with fedproto's Python API: ten MNIST (or CIFAR-10) clients with Dirichlet
label skew, half with a wider and half with a narrower CNN written here, trained with FedProto.

    FEDPROTO_DATA=/path/to/data python examples/own_federation.py                # MNIST, 5 rounds
    python examples/own_federation.py --dataset cifar10 --rounds 20 --threads 4

The two CNNs end in embeddings of different sizes (wide: 64 x 4 x 4 = 1,024, narrow: 32 x 4 x 4 =
512); ``Client(..., embedding_dim=128)`` appends a projection to 128 so that prototypes can be
averaged. Prints the summary's accuracies; the run directory (metrics, embeddings for
``fedproto plot``) is written to runs/own-federation.
"""

import argparse

import numpy as np
import torch
from torch import nn

from fedproto.data import load_dataset
from fedproto.data.partition import dirichlet_partition
from fedproto.federation import Client, federate


class CNN(nn.Module):
    """A user's CNN: two conv blocks ``width`` and ``2 * width`` channels wide; ``forward``
    returns (logits, embedding), the embedding being the (2 * width) x 4 x 4 feature map, flattened."""

    def __init__(self, in_channels: int, width: int, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d((4, 4)), nn.Flatten())
        self.classifier = nn.Linear(2 * width * 16, num_classes)

    def forward(self, x):
        h = self.features(x)
        return self.classifier(h), h


def main(dataset="mnist", rounds=5, fraction=0.1, alpha=0.1, threads=0, out="runs/own-federation"):
    """Train and return the summary. fraction: share of the training split used (0.1 of MNIST:
    6,000 images over the 10 clients); alpha: Dirichlet concentration (0.1: one or two classes
    per client); threads: CPU threads (0: one per core)."""
    torch.manual_seed(0)  # the models' initial weights
    ds = load_dataset(dataset)  # (N, C, H, W) float tensors and (N,) labels; $FEDPROTO_DATA, else downloads
    keep = np.random.default_rng(0).permutation(len(ds.train_y))[: int(fraction * len(ds.train_y))]
    part = dirichlet_partition(ds.train_y[keep].numpy(), ds.test_y.numpy(), num_classes=ds.num_classes,
                               num_clients=10, alpha=alpha, min_samples=20, test_shots=40, seed=0)
    clients = []
    for i, (train_idx, test_idx) in enumerate(zip(part.train_idx, part.test_idx)):
        tr, te = torch.as_tensor(keep[train_idx]), torch.as_tensor(test_idx)
        model = CNN(ds.input_shape[0], width=32 if i < 5 else 16, num_classes=ds.num_classes)
        clients.append(Client(model, train=(ds.train_x[tr], ds.train_y[tr]), test=(ds.test_x[te], ds.test_y[te]),
                              embedding_dim=128))
    sim = federate(clients, dataset=dataset, algorithm="fedproto", rounds=rounds, batch_size=32, lr=0.01,
                   momentum=0.9, threads=threads, out=out)
    summary = sim.run()
    acc, proto = summary["accuracy"]["acc"], summary["accuracy"]["acc_proto"]
    print(f"{len(clients)} clients, {rounds} rounds, alpha {alpha}: classifier {100 * acc['mean']:.2f} ± "
          f"{100 * acc['std']:.2f} %, nearest prototype {100 * proto['mean']:.2f} ± {100 * proto['std']:.2f} %, "
          f"{summary['wall_time_s']:.0f} s")
    return summary


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Ten clients, two CNN widths, FedProto.")
    ap.add_argument("--dataset", default="mnist", choices=["mnist", "cifar10"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=0.1, help="share of the training split to use")
    ap.add_argument("--alpha", type=float, default=0.1, help="Dirichlet label skew (0.1: one or two classes each)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: one per core)")
    a = ap.parse_args()
    main(a.dataset, a.rounds, a.fraction, a.alpha, a.threads)
