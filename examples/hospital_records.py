"""Medical AI across hospitals (the practitioner's guide's first use case): a clinical table at
four hospitals, each with its own case mix and its own model, trained together without pooling
records.

    pip install "fedproto[examples]"
    python examples/hospital_records.py                    # the table of docs/usecase-hospitals.md
    python examples/hospital_records.py --rounds 3 --seeds 1

Data: the Wisconsin diagnostic breast cancer table that scikit-learn ships
(``sklearn.datasets.load_breast_cancer``: 569 patients, 30 features of a fine-needle aspirate's
cell nuclei, malignant or benign), read from the installed package, no download. Each hospital
holds a Dirichlet (alpha 0.5) share of each diagnosis (so its malignant/benign mix differs),
keeps 30% of its patients as its test set and standardises the features with its own training
statistics. The hospitals' models are multilayer perceptrons of different widths (16, 32, 64 and
128 hidden units), each ending in a 16-d embedding and a final ``fc`` layer; FedAvg, which averages
weights, runs where every hospital has the same model (the 32-wide MLP).

Prints a Markdown table: FedProto, Local, FD and FedAvg over 3 seeds (accuracy of each
hospital's own model on its own test patients, mean over hospitals).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer
from torch import nn
from usecase_table import NAMES, add_arguments, compare

from fedproto.federation import Client

HOSPITALS = 4
WIDTHS = (16, 32, 64, 128)
EMBEDDING = 16


class MLP(nn.Module):
    """A hospital's model: 30 features -> ``width`` -> 16-d embedding -> 2 classes (``fc``)."""

    def __init__(self, width: int, features: int = 30, classes: int = 2):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, EMBEDDING), nn.ReLU())
        self.fc = nn.Linear(EMBEDDING, classes)

    def forward(self, x):
        return self.fc(self.body(x))


def hospital_split(seed: int, alpha: float = 0.5):
    """Per hospital: ((x_train, y_train), (x_test, y_test)) float32 features, int64 labels; the
    diagnoses spread over the hospitals by Dirichlet(alpha) shares, features standardised per hospital."""
    x, y = load_breast_cancer(return_X_y=True)
    rng = np.random.default_rng(seed)
    members: list[list[int]] = [[] for _ in range(HOSPITALS)]
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        shares = rng.dirichlet([alpha] * HOSPITALS)
        cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
        for h, part in enumerate(np.split(idx, cuts)):
            members[h].extend(part.tolist())
    out = []
    for h in range(HOSPITALS):
        idx = rng.permutation(members[h])
        n_test = max(2, int(0.3 * len(idx)))
        te, tr = idx[:n_test], idx[n_test:]
        mean, std = x[tr].mean(0), x[tr].std(0) + 1e-6  # each hospital standardises with its own statistics
        train = (((x[tr] - mean) / std).astype(np.float32), y[tr])
        test = (((x[te] - mean) / std).astype(np.float32), y[te])
        out.append((train, test))
    return out


def make_clients(seed: int, widths=WIDTHS) -> list[Client]:
    """The four hospitals of ``seed``: their split and their MLPs (initial weights from ``seed``)."""
    torch.manual_seed(seed)
    return [Client(MLP(w), train, test, head="fc") for w, (train, test) in zip(widths, hospital_split(seed))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, rounds=30)
    parser.set_defaults(methods=["fedproto", "local", "fd", "fedavg"])
    args = parser.parse_args(argv)
    runs = []
    for m in args.methods:
        if m == "fedavg":  # weight averaging needs one architecture: every hospital the 32-wide MLP
            runs.append(("FedAvg (every hospital the 32-wide MLP)", m, lambda s: make_clients(s, (32,) * HOSPITALS)))
        else:
            runs.append((f"{NAMES.get(m, m)} (MLPs 16/32/64/128 wide)", m, make_clients))
    return compare(runs, 2, args.seeds, title="Breast cancer diagnosis at 4 hospitals", rounds=args.rounds, lr=0.05,
                   batch_size=16, threads=args.threads)


if __name__ == "__main__":
    main()
