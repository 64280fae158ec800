"""Faults found by feeding fedproto bad and unusual input (the breaker session); one test each."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedproto.errors import DataError
from fedproto.federation import Client, federate


class _Net(nn.Module):
    def __init__(self, d: int = 8, classes: int = 3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, d), nn.ReLU())
        self.fc = nn.Linear(d, classes)

    def forward(self, x):
        h = self.body(x)
        return self.fc(h), h


def _data(n: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    return torch.randn(n, 4, generator=g) + y[:, None].float(), y


@pytest.mark.parametrize("labels, shown", [
    (torch.full((12,), float("inf")), "label inf (item 0)"),
    (np.full(12, 1e20), "label 1e+20 (item 0)"),
    ([2**70] * 12, f"label {2**70} (item 0)"),
    (np.array([1] * 11 + [2**63], dtype=np.uint64), f"label {2**63} (item 11)"),
    (torch.tensor([0.0] * 5 + [float("nan")] * 7), "label nan (item 5)"),
])
def test_labels_int64_cannot_hold_are_named_not_wrapped(labels, shown):
    # Before: inf/1e20/2**63 were cast to int64 and reported as "label -9223372036854775808 is outside
    # 0..2", and Python ints over 2**63 raised a bare OverflowError.
    x, _ = _data()
    with pytest.raises(DataError) as e:
        federate([Client(_Net(), (x, labels), _data(6, 1))], 3, out=False, rounds=1, threads=1)
    assert shown in str(e.value) and "client 0" in str(e.value)
    assert "-9223372036854775808" not in str(e.value)
