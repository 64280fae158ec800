"""Sensor streams across devices (the practitioner's guide's predictive-maintenance use case):
multivariate motion signals at four sites, a 1-D CNN at two of them and a GRU at the other two.

    pip install "fedproto[examples]"
    python examples/sensor_maintenance.py                  # the table of docs/usecase-sensors.md
    python examples/sensor_maintenance.py --rounds 3 --seeds 1

Data: BasicMotions, the multivariate time-series set that sktime ships inside its package
(``sktime.datasets.load_basic_motions``, read from the installed files, no download): 80 recordings
of a wrist-worn device's 3-axis accelerometer and 3-axis gyroscope, 6 channels x 100 steps at
10 Hz, in 4 activities (standing, walking, running, badminton), the kind of condition monitoring a
device does on its own vibration signals. Each site sees 3 of the 4 activities (a different one
missing at each), and keeps 40% of its recordings as its test set; the channels are standardised
with each site's own training statistics. Sites 0 and 2 run a 1-D CNN (two convolutions over
time), sites 1 and 3 a GRU over the 100 steps; both end in a 32-d embedding and a final ``fc``, so
FedProto can average their prototypes; FedAvg cannot average two architectures (it refuses them,
naming the methods that run them).

Prints a Markdown table: FedProto, Local and FD over 3 seeds (accuracy of each site's own model on
its own test recordings, mean over sites).
"""

from __future__ import annotations

import argparse
import functools

import numpy as np
import torch
from torch import nn
from usecase_table import NAMES, add_arguments, compare

from fedproto.federation import Client

SITES = 4
EMBEDDING = 32
CLASSES = ("standing", "walking", "running", "badminton")


class CNN1d(nn.Module):
    """(B, 6, 100) signals -> two 1-D convolutions over time, global average pool -> 32-d -> ``fc``."""

    def __init__(self, channels: int = 6, classes: int = 4):
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(channels, 16, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2),
                                  nn.Conv1d(16, EMBEDDING, 5, padding=2), nn.ReLU(), nn.AdaptiveAvgPool1d(1),
                                  nn.Flatten())
        self.fc = nn.Linear(EMBEDDING, classes)

    def forward(self, x):
        return self.fc(self.body(x))


class GRUNet(nn.Module):
    """(B, 6, 100) signals -> a GRU over the 100 steps; its last hidden state (32-d) -> ``fc``."""

    def __init__(self, channels: int = 6, classes: int = 4):
        super().__init__()
        self.gru = nn.GRU(channels, EMBEDDING, batch_first=True)
        self.fc = nn.Linear(EMBEDDING, classes)

    def forward(self, x):
        _, h = self.gru(x.transpose(1, 2))  # (B, 100, 6) steps; h: (1, B, 32)
        return self.fc(h[-1])


@functools.cache
def load_signals():
    """All 80 recordings: x (80, 6, 100) float64, y (80,) int64 class ids in the order of CLASSES."""
    from sktime.datasets import load_basic_motions

    x, names = load_basic_motions(return_type="numpy3D")  # train and test splits together
    return np.asarray(x, dtype=np.float64), np.array([CLASSES.index(str(n)) for n in names], dtype=np.int64)


def site_split(seed: int):
    """Per site: ((x_train, y_train), (x_test, y_test)); site s lacks activity (s + seed) % 4."""
    x, y = load_signals()
    rng = np.random.default_rng(seed)
    members: list[list[int]] = [[] for _ in range(SITES)]
    for c in range(len(CLASSES)):
        sites = [s for s in range(SITES) if (s + seed) % len(CLASSES) != c]
        idx = rng.permutation(np.flatnonzero(y == c))
        for k, i in enumerate(idx):
            members[sites[k % len(sites)]].append(int(i))
    out = []
    for s in range(SITES):
        idx = rng.permutation(members[s])
        n_test = int(0.4 * len(idx))
        te, tr = idx[:n_test], idx[n_test:]
        mean = x[tr].mean(axis=(0, 2), keepdims=True)
        std = x[tr].std(axis=(0, 2), keepdims=True) + 1e-6
        out.append(((((x[tr] - mean) / std).astype(np.float32), y[tr]),
                    (((x[te] - mean) / std).astype(np.float32), y[te])))
    return out


def make_clients(seed: int) -> list[Client]:
    """The four sites of ``seed``: a 1-D CNN at sites 0 and 2, a GRU at sites 1 and 3."""
    torch.manual_seed(seed)
    return [Client(CNN1d() if s % 2 == 0 else GRUNet(), train, test, head="fc")
            for s, (train, test) in enumerate(site_split(seed))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, rounds=20)
    args = parser.parse_args(argv)
    load_signals()  # read once, before the timed runs
    runs = [(f"{NAMES.get(m, m)} (1-D CNN and GRU)", m, make_clients) for m in args.methods]
    return compare(runs, len(CLASSES), args.seeds, title="BasicMotions at 4 sites", rounds=args.rounds, lr=0.05,
                   momentum=0.9, batch_size=8, threads=args.threads)


if __name__ == "__main__":
    main()
