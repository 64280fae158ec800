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
    """Write both files into same-folder temporary files first, then rename them over ``train.npz`` and
    ``test.npz``: a failure leaves the folder's earlier files (and a folder this call made: removed) as they were."""
    import os
    import tempfile

    import numpy as np

    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{str(folder)!r} is a file; give a folder for the site's train.npz and test.npz")
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "train.npz", folder / "test.npz"
    tmps: list[str] = []
    try:
        for path, a, b in ((out[0], x, y), (out[1], tx, ty)):
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
            tmps.append(tmp)
            with os.fdopen(fd, "wb") as f:
                np.savez(f, x=np.asarray(a, dtype=np.float32), y=np.asarray(b, dtype=np.int64))
        umask = os.umask(0)
        os.umask(umask)
        for tmp, path in zip(tmps, out):
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the usual permissions
            os.replace(tmp, path)
    except BaseException:
        for tmp in tmps:
            if os.path.exists(tmp):
                os.unlink(tmp)
        if made and not any(folder.iterdir()):
            folder.rmdir()
        raise
    return out


def write_partition_sites(cfg, out: str | Path, clients: list[int] | None = None) -> list[Path]:
    """Write each client's data of the simulator's run ``cfg`` into ``out/site<i>/{train,test}.npz``.

    Args:
        cfg: a :class:`~fedproto.config.run_config.RunConfig` (dataset, partition, clients, ways, shots, seed...).
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
        ConfigError: ``class_names`` holds an empty name or a name twice.
        DataError: a name not in ``class_names``, or names without ``class_names`` (only whole-number labels
            are ids by themselves).
    """
    if class_names:
        for i, n in enumerate(class_names):
            if not n:
                raise ConfigError(f"an empty class name (position {i}) in {class_names[:10]}; give the run's class "
                                  "names in id order, e.g. --class-names cat,dog,bird")
            if n in class_names[:i]:
                raise ConfigError(f"class name {n!r} is given twice in {class_names[:10]}; give each class once, "
                                  "in id order")
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
    """``folder/<class>/<image>``: (x (n, C, H, W) in [0, 1], y (n,) class ids), decoded as a Flower node decodes
    a ``train/`` folder (:mod:`fedproto.data.folder`): grayscale when every image is, else RGB; 8-bit /255,
    16-bit /65535."""
    from fedproto.data.folder import _is_gray, _list_images, _stack_images

    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if not classes:
        raise DataError(f"{str(folder)!r} has no class sub-folders; put each class's images in a folder named by "
                        "its class id (0, 1, ...) or name")
    class_ids(classes, class_names, repr(str(folder)))  # every folder a class of the run
    entries = _list_images(folder, None, class_names)
    x, y = _stack_images(entries, all(_is_gray(im) for _, _, im in entries))
    return x.numpy(), y.numpy()


def _read_csv(path: Path, label_column: str, class_names: list[str] | None):
    import numpy as np

    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        rows = []
        for r in reader:
            if None in r or None in r.values():  # more values than the header has columns, or fewer
                k = len(r) - (None in r) + len(r.get(None) or ()) - sum(v is None for v in r.values())
                raise DataError(f"{str(path)!r}: line {reader.line_num} has {k} values but the header "
                                f"{len(reader.fieldnames)} columns; give every row one value per column")
            rows.append({k: v.strip() for k, v in r.items()})
    if not rows or label_column not in rows[0]:
        have = ", ".join(rows[0]) if rows else "no rows"
        raise DataError(f"{str(path)!r} has no column {label_column!r} (columns: {have}); name the label column "
                        "with --label-column")
    y = class_ids([r[label_column] for r in rows], class_names, repr(str(path)))
    features = [k for k in rows[0] if k != label_column]
    if not features:
        raise DataError(f"{str(path)!r} has no feature columns beside {label_column!r}; give numeric feature columns")
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

    src = Path(source)
    if src.is_dir():
        return _read_images(src, class_names)
    if src.suffix == ".npz" and src.is_file():
        from fedproto.data.folder import _read_npz

        x, y = (t.numpy() for t in _read_npz(src))  # as a node reads it: (n, C, H, W) or (n, F), numbers
        return x, y
    if src.suffix == ".csv" and src.is_file():
        return _read_csv(src, label_column, class_names)
    raise DataError(f"{str(src)!r} is not a folder of class folders of images, a .npz with x and y, or a .csv; "
                    "give one of these")


def _checked(source, x, y):
    """``(x, y)`` when a node would take them: samples, finite inputs, class ids >= 0 (else DataError)."""
    import numpy as np

    where = repr(str(source))
    if len(y) == 0:
        raise DataError(f"{where} holds no samples; give the site's samples")
    if y.min() < 0:
        raise DataError(f"{where}: label {int(y.min())} is not a class id; class ids are whole numbers 0, 1, ... "
                        "(relabel the data)")
    bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
    if bad.any():
        raise DataError(f"{where}: {int(bad.sum())} sample(s) hold NaN or infinite values (the first: sample "
                        f"{int(np.flatnonzero(bad)[0])}); clean or drop them")
    return x, y


def _split(y, test_fraction: float, seed: int):
    """Per class, a seeded ``test_fraction`` of the samples (at least one where the class has two, and at least
    one left for train)."""
    import numpy as np

    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed {seed!r}: give a whole number, 0 or more (e.g. seed=0)")
    rng = np.random.default_rng(seed)
    test = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        k = int(round(test_fraction * len(idx)))
        k = max(k, 1) if len(idx) > 1 and test_fraction > 0 else k
        k = min(k, len(idx) - 1)  # every class present keeps a train sample
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
        ConfigError: ``test_fraction`` outside [0, 1), an unknown ``how``, class names empty or given twice, a
            test split that would be empty, ``out`` is a file.
        DataError: an unreadable source, one without samples or features, a negative label, NaN or infinite
            inputs (each message names the source and the fix).
    """
    if not 0 <= test_fraction < 1:
        raise ConfigError(f"test-fraction {test_fraction}: give a share of each class in [0, 1), e.g. 0.2",
                          option="test_fraction", value=test_fraction)
    if how not in NORMALIZE:
        raise ConfigError(f"normalize={how!r}: choose one of {', '.join(NORMALIZE)}", option="normalize", value=how)
    import numpy as np

    x, y = _checked(source, *read_source(source, label_column, class_names))
    tr, te = _split(y, test_fraction, seed)
    if len(te) == 0:
        sizes = np.bincount(y).tolist()
        raise ConfigError(f"the test split would be empty (test-fraction {test_fraction}, class sizes "
                          f"{[n for n in sizes if n]}), and a node needs test samples; give --test-fraction > 0 and "
                          "classes of two or more samples", option="test_fraction", value=test_fraction)
    x_tr, x_te = normalize(x[tr], x[te], how)
    train, test = _save(Path(out), x_tr, y[tr], x_te, y[te])
    return {"train": train, "test": test, "shape": tuple(x.shape[1:]), "classes": np.unique(y).tolist(),
            "train_samples": len(tr), "test_samples": len(te)}


__all__ = ["NORMALIZE", "class_ids", "normalize", "read_source", "write_partition_sites", "write_site_from"]
