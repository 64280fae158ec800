"""One client's own data on disk: what a Flower SuperNode (or any single client) reads.

A client folder holds a train and a test split in one of two forms:

* ``train.npz`` and ``test.npz``, each with arrays ``x`` (n, C, H, W), (n, H, W) (one channel
  added) or (n, F) (flat features; for a model factory that takes them) and ``y`` (n,) integer
  class ids. ``x`` is used as stored (cast to float32): normalise it before saving.
* ``train/`` and ``test/``, each with one sub-folder per class holding image files (PNG, JPEG,
  anything Pillow reads). A sub-folder is named by its class id (``0``, ``7``) or by a class
  name listed in ``class_names``. All images of a client must have one size; they are read as
  grayscale when every image is, else as RGB, and scaled to [0, 1].

Labels must lie in the run's class set 0..C-1; :func:`load_client_folder` says which file holds
one that does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fedproto.errors import DataError

SPLITS = ("train", "test")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm", ".ppm")


def load_client_folder(folder: str | Path, num_classes: int, class_names: Sequence[str] | None = None
                       ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The ``(x, y)`` train and test splits of a client folder (see the module docstring).

    Args:
        folder: the client's folder.
        num_classes: C, the run's number of classes; labels must lie in 0..C-1.
        class_names: the names of classes 0..C-1, for image sub-folders named by class name.
    Returns:
        ``((x, y), (test_x, test_y))``: x float32 (n, C, H, W) (or (n, F)), y int64 (n,).
    Raises:
        DataError: the folder or a split is missing or empty, an array is missing or has the wrong
            shape, a label is not a whole number in 0..C-1, images differ in size or cannot be read
            (each message names the file and the fix).
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise DataError(f"client data folder {str(folder)!r} does not exist; give a folder holding train.npz and "
                        "test.npz, or train/ and test/ sub-folders of class folders of images")
    out = []
    for split in SPLITS:
        npz, images = folder / f"{split}.npz", folder / split
        if npz.is_file():
            x, y = _read_npz(npz)
        elif images.is_dir():
            x, y = _read_images(images, num_classes, class_names)
        else:
            raise DataError(f"client data folder {str(folder)!r} has neither {split}.npz nor a {split}/ folder of "
                            "class folders; put the client's " + split + " split there")
        where = str(npz if npz.is_file() else images)
        if len(y) == 0:
            raise DataError(f"{where!r} holds no samples; give every client train and test samples")
        bad = (y < 0) | (y >= num_classes)
        if bad.any():
            raise DataError(f"{where!r}: label {int(y[bad][0])} is outside the run's classes 0..{num_classes - 1} "
                            f"(classes={num_classes}); relabel this client's data, or declare more classes")
        if not torch.isfinite(x).all():
            raise DataError(f"{where!r}: {int((~torch.isfinite(x)).flatten(1).any(1).sum())} input(s) hold NaN or "
                            "infinite values; clean or drop them")
        out.append((x, y))
    if out[0][0].shape[1:] != out[1][0].shape[1:]:
        raise DataError(f"{str(folder)!r}: train inputs have shape {tuple(out[0][0].shape[1:])} but test inputs "
                        f"{tuple(out[1][0].shape[1:])}; give both splits one input shape")
    return out[0], out[1]


def _read_npz(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {str(path)!r} ({e}); save it with numpy.savez(path, x=..., y=...)") from None
    if "x" not in arrays or "y" not in arrays:
        raise DataError(f"{str(path)!r} holds arrays {sorted(arrays)}, expected 'x' and 'y'; save it with "
                        "numpy.savez(path, x=inputs, y=labels)")
    x, y = arrays["x"], arrays["y"]
    if x.ndim == 0 or y.ndim == 0:
        raise DataError(f"{str(path)!r}: x has shape {x.shape} and y {y.shape}; give one row of x and one label in y "
                        "per sample, e.g. x (n, C, H, W) and y (n,)")
    if x.dtype.kind not in "biuf" or y.dtype.kind not in "biuf":
        raise DataError(f"{str(path)!r}: x has dtype {x.dtype} and y {y.dtype}; both must be numbers")
    if y.ndim != 1 or len(y) != len(x):
        raise DataError(f"{str(path)!r}: {len(x)} inputs but labels of shape {y.shape}; give one label per input")
    if y.dtype.kind == "f" and not np.array_equal(y, np.round(y)):
        raise DataError(f"{str(path)!r}: labels with fractions; give integer class ids")
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim not in (2, 4):
        raise DataError(f"{str(path)!r}: x has shape {x.shape}; give (n, C, H, W), (n, H, W) or (n, F)")
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), torch.from_numpy(y.astype(np.int64))


def _class_id(name: str, num_classes: int, class_names: Sequence[str] | None, where: Path) -> int:
    if class_names and name in class_names:
        return list(class_names).index(name)
    if name.isdigit():
        return int(name)
    known = f" or one of the class names {list(class_names)[:10]}" if class_names else ""
    raise DataError(f"{str(where)!r}: sub-folder {name!r} is not a class id 0..{num_classes - 1}{known}; name each "
                    "class folder by its class id (or declare class-names in the run config)")


def _read_images(root: Path, num_classes: int, class_names: Sequence[str] | None) -> tuple[torch.Tensor, torch.Tensor]:
    from PIL import Image, UnidentifiedImageError

    files: list[tuple[Path, int]] = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        c = _class_id(sub.name, num_classes, class_names, root)
        files += [(f, c) for f in sorted(sub.iterdir()) if f.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        raise DataError(f"{str(root)!r} holds no class folders of images ({', '.join(IMAGE_SUFFIXES[:3])}...)")
    images = []
    for f, _ in files:
        try:
            with Image.open(f) as im:
                images.append(im.copy())
        except (OSError, UnidentifiedImageError) as e:
            raise DataError(f"cannot read image {str(f)!r} ({e}); remove or replace it") from None
    gray = all(im.mode in ("1", "L", "I", "I;16", "F") for im in images)
    size = images[0].size
    arrays = []
    for (f, _), im in zip(files, images):
        if im.size != size:
            raise DataError(f"image {str(f)!r} is {im.size[0]}x{im.size[1]} but {str(files[0][0])!r} is "
                            f"{size[0]}x{size[1]}; resize the client's images to one size")
        a = np.asarray(im.convert("L" if gray else "RGB"), dtype=np.float32) / 255.0
        arrays.append(a[None] if gray else a.transpose(2, 0, 1))
    x = torch.from_numpy(np.stack(arrays))
    y = torch.tensor([c for _, c in files], dtype=torch.int64)
    return x, y


__all__ = ["load_client_folder"]
