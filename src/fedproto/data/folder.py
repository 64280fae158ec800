"""One client's own data on disk: what a Flower SuperNode (or any single client) reads.

A client folder holds a train and a test split in one of two forms:

* ``train.npz`` and ``test.npz``, each with arrays ``x`` (n, C, H, W), (n, H, W) (one channel
  added) or (n, F) (flat features; for a model factory that takes them) and ``y`` (n,) integer
  class ids. ``x`` is used as stored (cast to float32): normalise it before saving.
* ``train/`` and ``test/``, each with one sub-folder per class holding image files (PNG, JPEG,
  anything Pillow reads). A sub-folder is named by its class id (``0``, ``7``) or by a class
  name listed in ``class_names``. All images of a client must have one size; they are read as
  grayscale when every image of the client (train and test) is, else as RGB, and scaled to
  [0, 1] by their mode's range (8-bit by 255, 16-bit by 65535).

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
    read: dict[str, list] = {}
    for split in SPLITS:
        images = folder / split
        if not (folder / f"{split}.npz").is_file() and images.is_dir():
            read[split] = _list_images(images, num_classes, class_names)
    # grayscale or RGB is decided once per client, over both splits
    gray = all(_is_gray(im) for entries in read.values() for _, _, im in entries)
    out = []
    for split in SPLITS:
        npz, images = folder / f"{split}.npz", folder / split
        if npz.is_file():
            x, y = _read_npz(npz)
        elif split in read:
            x, y = _stack_images(read[split], gray)
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


GRAY_MODES = ("1", "L", "I", "I;16", "I;16B", "I;16L", "I;16N", "F")


def _is_gray(im) -> bool:
    return im.mode in GRAY_MODES


def _list_images(root: Path, num_classes: int, class_names: Sequence[str] | None) -> list:
    """``(file, class id, image)`` of every image under ``root``'s class folders, all one size."""
    from PIL import Image, UnidentifiedImageError

    files: list[tuple[Path, int]] = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        c = _class_id(sub.name, num_classes, class_names, root)
        files += [(f, c) for f in sorted(sub.iterdir()) if f.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        raise DataError(f"{str(root)!r} holds no class folders of images ({', '.join(IMAGE_SUFFIXES[:3])}...)")
    out = []
    for f, c in files:
        try:
            with Image.open(f) as im:
                out.append((f, c, im.copy()))
        except (OSError, UnidentifiedImageError) as e:
            raise DataError(f"cannot read image {str(f)!r} ({e}); remove or replace it") from None
    size = out[0][2].size
    for f, _, im in out:
        if im.size != size:
            raise DataError(f"image {str(f)!r} is {im.size[0]}x{im.size[1]} but {str(out[0][0])!r} is "
                            f"{size[0]}x{size[1]}; resize the client's images to one size")
    return out


def _gray01(f: Path, im) -> np.ndarray:
    """A one-channel image scaled to [0, 1] by its mode's range (8-bit /255, 16-bit /65535)."""
    if im.mode in ("1", "L"):
        return np.asarray(im.convert("L"), dtype=np.float32) / 255.0
    a = np.asarray(im, dtype=np.float64)
    if im.mode.startswith("I;16") or (im.mode == "I" and a.size and a.min() >= 0 and a.max() <= 65535):
        return (a / 65535.0).astype(np.float32)
    if im.mode == "F" and a.size and np.isfinite(a).all() and a.min() >= 0 and a.max() <= 1:
        return a.astype(np.float32)
    raise DataError(f"image {str(f)!r} has mode {im.mode!r} with values {a.min():g}..{a.max():g}, outside the "
                    "8-bit (0..255) and 16-bit (0..65535) ranges; save it as an 8- or 16-bit image")


def _stack_images(entries: list, gray: bool) -> tuple[torch.Tensor, torch.Tensor]:
    arrays = []
    for f, _, im in entries:
        if gray:
            arrays.append(_gray01(f, im)[None])
        elif _is_gray(im) and im.mode not in ("1", "L"):  # a 16-bit or float grayscale image among RGB ones
            arrays.append(np.repeat(_gray01(f, im)[None], 3, axis=0))
        else:
            arrays.append(np.asarray(im.convert("RGB"), dtype=np.float32).transpose(2, 0, 1) / 255.0)
    x = torch.from_numpy(np.stack(arrays))
    y = torch.tensor([c for _, c, _ in entries], dtype=torch.int64)
    return x, y


__all__ = ["load_client_folder"]
