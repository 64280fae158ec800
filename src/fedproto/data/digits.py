"""scikit-learn's 8x8 digits: a small offline stand-in (not in the paper), bundled with scikit-learn."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedproto.data.datasets import (
    Dataset,
    cached,
    to_images,
)


def load_digits_bundled(root: str | Path | None, download: bool, progress: bool) -> Dataset:
    """The registry's loader of ``digits``: scikit-learn's bundled 8x8 digits (``root`` unused)."""
    return cached(("digits",), _load_digits)


def _load_digits() -> Dataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = x.astype(np.float32) / 16.0
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.3, stratify=y, random_state=0
    )
    mean, std = x_train.mean(), x_train.std()
    return Dataset(
        name="digits",
        train_x=to_images((x_train - mean) / std, (1, 8, 8)),
        train_y=torch.from_numpy(y_train.astype(np.int64)),
        test_x=to_images((x_test - mean) / std, (1, 8, 8)),
        test_y=torch.from_numpy(y_test.astype(np.int64)),
        num_classes=10,
        class_names=[str(i) for i in range(10)],
    )
