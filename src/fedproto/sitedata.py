"""A site's data files for a Flower deployment: ``train.npz`` and ``test.npz`` (``fedproto site-data``).

A Flower SuperNode reads its client's data from a folder (``--node-config data="<folder>"``, see
docs/flower.md "Node data"): ``train.npz`` and ``test.npz``, each with ``x`` (float32, ``(n, C, H, W)``,
``(n, H, W)`` or ``(n, F)``, normalised as the model wants it) and ``y`` (``(n,)`` integer class ids).
This module writes those files, two ways:

* **From the simulator's partition** (:func:`write_partition_sites`): client i's samples of the run
  that ``fedproto run`` with the same options would train, normalised as that run normalises them
  (MNIST: ``x/255`` then ``(x - 0.1307) / 0.3081``; CIFAR-10 per channel; FEMNIST and digits with
  the train split's mean and std), one folder ``site<i>`` per client. A deployment over these folders
  trains the simulator's clients.
* **From a site's own files** (:func:`write_site_from`): a folder of images with one sub-folder per
  class, a ``.npz`` with ``x`` and ``y``, or a CSV with a label column and numeric feature columns;
  split into train and test with a seeded, per-class (stratified) draw, and normalised: ``standardize``
  (the train split's mean and std per feature, or per channel for images: the test split with the
  train split's values), ``mnist`` or ``cifar10`` (the constants of those loaders, for images scaled to
  [0, 1]), or ``none``.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from fedproto.errors import ConfigError, DataError

NORMALIZE = ("standardize", "mnist", "cifar10", "none")
"""What :func:`write_site_from` can do to the features."""

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def _save(folder: Path, x, y, tx, ty) -> tuple[Path, Path]:
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "train.npz", folder / "test.npz"
    np.savez(out[0], x=np.asarray(x, dtype=np.float32), y=np.asarray(y, dtype=np.int64))
    np.savez(out[1], x=np.asarray(tx, dtype=np.float32), y=np.asarray(ty, dtype=np.int64))
    return out


def write_partition_sites(cfg, out: str | Path, clients: list[int] | None = None) -> list[Path]:
    """Write each client's data of the simulator's run ``cfg`` into ``out/site<i>/{train,test}.npz``.

    Args:
        cfg: a :class:`~fedproto.config.RunConfig` (dataset, partition, clients, ways, shots, seed...).
        out: the folder that gets one ``site<i>`` folder per client.
        clients: the client ids to write (default: all).

    Returns:
        The site folders written, in client order.

    Raises:
        ConfigError: ``cfg`` is a custom-data run, or a client id is out of range.
        DataError: the dataset cannot be loaded (as ``fedproto run`` would say).
    """
    from fedproto.engine.setup import prepare

    if cfg.dataset == "custom":
        raise ConfigError("site-data writes the partition of a registered dataset; for your own files give "
                          "--from <folder, .npz or .csv>")
    setup = prepare(cfg, progress=False)
    n = len(setup.data)
    ids = list(range(n)) if clients is None else clients
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise ConfigError(f"client id(s) {bad} are not among the run's {n} clients (0..{n - 1})",
                          option="clients", value=cfg.clients)
    written = []
    for i in ids:
        d = setup.data[i]
        folder = Path(out) / f"site{i}"
        _save(folder, d.x.numpy(), d.y.numpy(), d.test_x.numpy(), d.test_y.numpy())
        written.append(folder)
    return written


def class_ids(labels: list[str], class_names: list[str] | None, where: str) -> list[int]:
    """The run's class id of each label: every site must number classes alike (the label space is shared).

    Args:
        labels: labels as read (class folder names, CSV values).
        class_names: the run's class names in id order (the run config's ``class-names``), or None.
        where: the source, for messages.

    Raises:
        DataError: a name not in ``class_names``, or names without ``class_names`` (only whole-number labels
            are ids by themselves).
    """
    if class_names:
        index = {n: i for i, n in enumerate(class_names)}
        unknown = sorted({v for v in labels if v not in index})
        if unknown:
            raise DataError(f"{where}: label(s) {unknown[:5]} are not among the class names {class_names[:10]}; "
                            "fix the labels or the class names")
        return [index[v] for v in labels]
    if all(v.strip().isdigit() for v in labels):
        return [int(v) for v in labels]
    names = sorted({v for v in labels if not v.strip().isdigit()})
    raise DataError(f"{where}: labels {names[:5]} are names, not class ids; give the run's class names in id order "
                    "(--class-names a,b,c) so that every site numbers the classes alike")


def _read_images(folder: Path, class_names: list[str] | None):
    """``folder/<class>/<image>``: (x (n, C, H, W) in [0, 1], y (n,) class ids)."""
    import numpy as np
    from PIL import Image

    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if not classes:
        raise DataError(f"{str(folder)!r} has no class sub-folders; put each class's images in a folder named by "
                        "its class id (0, 1, ...) or name")
    ids = class_ids(classes, class_names, repr(str(folder)))
    xs, ys, shape = [], [], None
    for label, name in zip(ids, classes):
        for f in sorted((folder / name).iterdir()):
            if f.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            img = Image.open(f)
            arr = np.asarray(img.convert("L" if img.mode in ("L", "I;16", "1") else "RGB"), dtype=np.float32)
            arr = arr / (65535.0 if img.mode == "I;16" else 255.0)
            arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
            if shape is not None and arr.shape != shape:
                raise DataError(f"{str(f)!r} is {arr.shape[1]}x{arr.shape[2]} with {arr.shape[0]} channel(s), the "
                                f"images before it {shape[1]}x{shape[2]} with {shape[0]}; resize them to one size")
            shape = arr.shape
            xs.append(arr)
            ys.append(label)
    if not xs:
        raise DataError(f"{str(folder)!r} holds no images ({', '.join(IMAGE_SUFFIXES)}) in its class folders")
    return np.stack(xs), np.asarray(ys)


def _read_csv(path: Path, label_column: str, class_names: list[str] | None):
    import numpy as np

    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    if not rows or label_column not in rows[0]:
        have = ", ".join(rows[0]) if rows else "no rows"
        raise DataError(f"{str(path)!r} has no column {label_column!r} (columns: {have}); name the label column "
                        "with --label-column")
    y = class_ids([r[label_column] for r in rows], class_names, repr(str(path)))
    features = [k for k in rows[0] if k != label_column]
    try:
        x = np.asarray([[float(r[k]) for k in features] for r in rows], dtype=np.float32)
    except ValueError as e:
        raise DataError(f"{str(path)!r}: a feature value is not a number ({e}); give numeric feature columns "
                        "(encode categories first)") from None
    return x, np.asarray(y)


def read_source(source: str | Path, label_column: str = "label", class_names: list[str] | None = None):
    """A site's own data: (x float32, y (n,) int64 class ids of the run, see :func:`class_ids`).

    Raises:
        DataError: the source does not exist or cannot be read (names it and the formats accepted).
    """
    import numpy as np

    src = Path(source)
    if src.is_dir():
        return _read_images(src, class_names)
    if src.suffix == ".npz" and src.is_file():
        with np.load(src) as z:
            if "x" not in z or "y" not in z:
                raise DataError(f"{str(src)!r} holds {sorted(z.files)}; give arrays named x and y")
            x, y = z["x"].astype(np.float32), z["y"]
        if y.ndim != 1 or len(y) != len(x) or not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{str(src)!r}: y is {y.dtype} of shape {y.shape} beside x of {len(x)} samples; give y "
                            "as (n,) whole-number class ids")
        return x, y.astype(np.int64)
    if src.suffix == ".csv" and src.is_file():
        return _read_csv(src, label_column, class_names)
    raise DataError(f"{str(src)!r} is not a folder of class folders of images, a .npz with x and y, or a .csv; "
                    "give one of these")


def _split(y, test_fraction: float, seed: int):
    """Per class, a seeded ``test_fraction`` of the samples (at least one where the class has two)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    test = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        k = int(round(test_fraction * len(idx)))
        k = max(k, 1) if len(idx) > 1 and test_fraction > 0 else k
        test.extend(idx[:k].tolist())
    mask = np.zeros(len(y), dtype=bool)
    mask[test] = True
    return np.flatnonzero(~mask), np.flatnonzero(mask)


def normalize(x_train, x_test, how: str):
    """Normalise train and test features with the train split's statistics (or fixed constants).

    Args:
        x_train: ``(n, ...)`` float32; x_test: ``(m, ...)`` float32, the same trailing shape.
        how: ``standardize`` (per feature; per channel for ``(n, C, H, W)``), ``mnist``
            (``(x - 0.1307) / 0.3081``), ``cifar10`` (per channel, the CIFAR-10 loader's constants;
            3 channels), ``none``.

    Raises:
        ConfigError: ``how`` is unknown, or ``cifar10`` for inputs without 3 channels.
    """
    import numpy as np

    if how == "none":
        return x_train, x_test
    if how == "mnist":
        return (x_train - 0.1307) / 0.3081, (x_test - 0.1307) / 0.3081
    if how == "cifar10":
        if x_train.ndim != 4 or x_train.shape[1] != 3:
            raise ConfigError(f"normalize=cifar10 takes RGB images (n, 3, H, W), not {x_train.shape}",
                              option="normalize", value=how, hint="use standardize")
        mean = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)[:, None, None]
        std = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)[:, None, None]
        return (x_train - mean) / std, (x_test - mean) / std
    if how == "standardize":
        axes = (0, 2, 3) if x_train.ndim == 4 else 0
        mean = x_train.mean(axis=axes, keepdims=True)
        std = x_train.std(axis=axes, keepdims=True)
        std = np.where(std > 0, std, 1.0).astype(np.float32)
        return (x_train - mean) / std, (x_test - mean) / std
    raise ConfigError(f"normalize={how!r}: choose one of {', '.join(NORMALIZE)}", option="normalize", value=how)


def write_site_from(source: str | Path, out: str | Path, test_fraction: float = 0.2, how: str = "standardize",
                    label_column: str = "label", seed: int = 0,
                    class_names: list[str] | None = None) -> dict[str, Any]:
    """Write ``out/train.npz`` and ``out/test.npz`` from a site's own files (see the module docstring).

    Args:
        source: a folder with one sub-folder of images per class, a ``.npz`` (``x``, ``y``) or a ``.csv``.
        out: the site's data folder (created).
        test_fraction: share of each class held out for the test split, in [0, 1).
        how: the normalisation (:data:`NORMALIZE`).
        label_column: the CSV's label column.
        seed: the split's seed.
        class_names: the run's class names in id order, when the labels are names (:func:`class_ids`).

    Returns:
        What was written: ``train``, ``test`` (paths), ``shape`` (of one sample), ``classes`` (the class ids
        present), ``train_samples``, ``test_samples``.

    Raises:
        ConfigError: ``test_fraction`` outside [0, 1), an unknown ``how``. DataError: an unreadable source.
    """
    if not 0 <= test_fraction < 1:
        raise ConfigError(f"test-fraction {test_fraction}: give a share of each class in [0, 1), e.g. 0.2",
                          option="test_fraction", value=test_fraction)
    if how not in NORMALIZE:
        raise ConfigError(f"normalize={how!r}: choose one of {', '.join(NORMALIZE)}", option="normalize", value=how)
    import numpy as np

    x, y = read_source(source, label_column, class_names)
    tr, te = _split(y, test_fraction, seed)
    x_tr, x_te = normalize(x[tr], x[te], how)
    train, test = _save(Path(out), x_tr, y[tr], x_te, y[te])
    return {"train": train, "test": test, "shape": tuple(x.shape[1:]), "classes": np.unique(y).tolist(),
            "train_samples": len(tr), "test_samples": len(te)}


__all__ = ["NORMALIZE", "class_ids", "normalize", "read_source", "write_partition_sites", "write_site_from"]
