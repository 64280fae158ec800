"""One client's own data on disk: what a Flower SuperNode (or any single client) reads.

A client folder holds a train and a test split in one of two forms:

* ``train.npz`` and ``test.npz``, each with arrays ``x`` (n, C, H, W), (n, H, W) (one channel
  added) or (n, F) (flat features; for a model factory that takes them) and ``y`` (n,) integer
  class ids. ``x`` is used as stored (cast to float32): normalise it before saving.
  Instead of ``x``, several named input arrays ``x.<name>`` (e.g. ``x.input_ids`` and
  ``x.attention_mask`` (n, L) of a tokenizer, or ``x.signal`` and ``x.site``), each with one row
  per sample: the model (a factory's) is called with the dict ``{name: batch}``
  (:class:`fedproto.data.inputs.Inputs`); integer arrays keep their integer dtype (int64; token ids
  are never cast to float), floating ones become float32. Both splits hold the same names.
  ``numpy.savez(path, **{"x.input_ids": ids, "x.attention_mask": mask, "y": labels})`` writes one.
* ``train/`` and ``test/``, each with one sub-folder per class holding image files (PNG, JPEG,
  anything Pillow reads). A sub-folder is named by its class id (``0``, ``7``) or by a class
  name listed in ``class_names``. All images of a client must have one size; they are read as
  grayscale when every image of the client (train and test) is, else as RGB, and scaled to
  [0, 1] by their mode's range (8-bit by 255, 16-bit by 65535).

Labels must lie in the run's class set 0..C-1; :func:`load_client_folder` says which file holds
one that does not.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fedproto.data.inputs import Inputs, finite
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

    Every call reads the files, unless :func:`keep_decoded` was turned on in this process (the
    Flower executor does): then a folder's decoded arrays are reused while its files are unchanged.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise DataError(f"client data folder {str(folder)!r} does not exist; give a folder holding train.npz and "
                        "test.npz, or train/ and test/ sub-folders of class folders of images")
    if _KEPT is None:  # the default: read the files on every call
        return _checked(folder, _decode(folder, num_classes, class_names), num_classes)
    entry = _kept_entry(folder, class_names, num_classes)
    if num_classes not in entry:
        entry[num_classes] = _checked(folder, entry["decoded"], num_classes)
    return entry[num_classes]


_KEPT: OrderedDict | None = None
_KEPT_SIZE = 4


def keep_decoded(on: bool = True, size: int = 4) -> None:
    """Keep the decoded arrays of the last ``size`` client folders in this process (off by default).

    With it on, :func:`load_client_folder` decodes a folder once and then returns the same tensors
    while the folder's files are unchanged (same names, sizes and modification times: a fingerprint
    taken with one ``stat`` per file on every call). A long-lived process that answers many
    messages (``python -m fedproto.deploy.warm_executor``, which turns this on and preloads before it
    forks) so pays the decoding once, not per message. Callers must not modify the returned
    tensors in place. ``on=False`` turns it off and drops what was kept.

    Raises:
        ValueError: ``size`` < 1.
    """
    global _KEPT, _KEPT_SIZE
    if size < 1:
        raise ValueError(f"size={size}: keep at least 1 folder")
    _KEPT, _KEPT_SIZE = (OrderedDict() if _KEPT is None else _KEPT) if on else None, size


def preload_client_folder(folder: str | Path, class_names: Sequence[str] | None = None) -> int:
    """Decode a client folder into the store of :func:`keep_decoded` (turned on here if it is off),
    before the run's class count is known; :func:`load_client_folder` later checks the labels
    against the run's classes. Returns the number of samples (train + test).

    Raises:
        DataError: as :func:`load_client_folder` (a missing folder or split, unreadable files).
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise DataError(f"client data folder {str(folder)!r} does not exist; give a folder holding train.npz and "
                        "test.npz, or train/ and test/ sub-folders of class folders of images")
    if _KEPT is None:
        keep_decoded()
    entry = _kept_entry(folder, class_names, None)
    return sum(len(y) for _, y, _ in entry["decoded"])


def _kept_entry(folder: Path, class_names: Sequence[str] | None, num_classes: int | None) -> dict:
    """The kept entry of ``folder`` (decoded now when it is new or its files changed)."""
    key = (str(folder.resolve()), tuple(class_names) if class_names else None)
    stamp = _fingerprint(folder)
    entry = _KEPT.get(key)
    if entry is None or entry["stamp"] != stamp:
        entry = {"stamp": stamp, "decoded": _decode(folder, num_classes, class_names)}
        _KEPT[key] = entry
    _KEPT.move_to_end(key)
    while len(_KEPT) > _KEPT_SIZE:
        _KEPT.popitem(last=False)
    return entry


def _fingerprint(folder: Path) -> tuple:
    """(relative path, size, mtime_ns) of every file a load reads: the npz files or the images."""
    out = []
    for split in SPLITS:
        npz = folder / f"{split}.npz"
        if npz.is_file():
            st = npz.stat()
            out.append((npz.name, st.st_size, st.st_mtime_ns))
        elif (folder / split).is_dir():
            for sub in sorted(os.scandir(folder / split), key=lambda e: e.name):
                if sub.is_dir():
                    for f in sorted(os.scandir(sub.path), key=lambda e: e.name):
                        st = f.stat()
                        out.append((f"{split}/{sub.name}/{f.name}", st.st_size, st.st_mtime_ns))
    return tuple(out)


def _decode(folder: Path, num_classes: int | None, class_names: Sequence[str] | None) -> list:
    """``[(x, y, where)]`` of the train and test splits, read from disk, labels not yet checked."""
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
        out.append((x, y, str(npz if npz.is_file() else images)))
    return out


def _checked(folder: Path, decoded: list, num_classes: int
             ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The decoded splits after the checks of :func:`load_client_folder` (labels, finite inputs, one shape)."""
    out = []
    for x, y, where in decoded:
        if len(y) == 0:
            raise DataError(f"{where!r} holds no samples; give every client train and test samples")
        bad = (y < 0) | (y >= num_classes)
        if bad.any():
            raise DataError(f"{where!r}: label {int(y[bad][0])} is outside the run's classes 0..{num_classes - 1} "
                            f"(classes={num_classes}); relabel this client's data, or declare more classes")
        arrays = x.tree.items() if isinstance(x, Inputs) and isinstance(x.tree, dict) else [("x", x)]
        for name, a in arrays:  # the array named as saved in the .npz, the samples counted
            if isinstance(a, torch.Tensor) and a.is_floating_point() and not bool(torch.isfinite(a).all()):
                bad = (~torch.isfinite(a)).reshape(len(a), -1).any(1)
                raise DataError(f"{where!r}: array {name!r}: {int(bad.sum())} sample(s) hold NaN or infinite values "
                                f"(the first: sample {int(bad.nonzero()[0, 0])}); clean or drop them")
        if isinstance(x, Inputs) and not finite(x):
            raise DataError(f"{where!r}: an input array holds NaN or infinite values; clean or drop them")
        out.append((x, y))
    (a, _), (b, _) = out
    if isinstance(a, Inputs) or isinstance(b, Inputs):
        names = [sorted(v.tree) if isinstance(v, Inputs) else ["x"] for v in (a, b)]
        if names[0] != names[1]:
            raise DataError(f"{str(folder)!r}: train inputs are the arrays {names[0]} but test inputs {names[1]}; save "
                            "both splits with the same named arrays")
        return out[0], out[1]
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
    named = {k[2:]: v for k, v in arrays.items() if k.startswith("x.")}
    if named and "x" not in arrays and "y" in arrays:
        return _named_inputs(path, named, arrays["y"])
    if "x" not in arrays or "y" not in arrays:
        raise DataError(f"{str(path)!r} holds arrays {sorted(arrays)}, expected 'x' (or named inputs 'x.<name>') and "
                        "'y'; save it with numpy.savez(path, x=inputs, y=labels)")
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


def _named_inputs(path: Path, named: dict[str, np.ndarray], y: np.ndarray) -> tuple[Inputs, torch.Tensor]:
    """Named input arrays ``x.<name>`` and labels ``y`` of an npz file as ``(Inputs, y)``; integer
    arrays kept integers (int64), floating ones float32 (see the module docstring)."""
    if y.ndim != 1 or y.dtype.kind not in "biuf":
        raise DataError(f"{str(path)!r}: y has shape {y.shape} and dtype {y.dtype}; give one integer label per sample")
    if y.dtype.kind == "f" and not np.array_equal(y, np.round(y)):
        raise DataError(f"{str(path)!r}: labels with fractions; give integer class ids")
    tree = {}
    for name, a in named.items():
        if not name.isidentifier():
            raise DataError(f"{str(path)!r}: input array name 'x.{name}' is not an identifier; name them like "
                            "x.input_ids, x.attention_mask")
        if a.ndim == 0 or len(a) != len(y):
            raise DataError(f"{str(path)!r}: input array 'x.{name}' has shape {a.shape} but there are {len(y)} labels; "
                            "give every named input one row per sample")
        if a.dtype.kind not in "biuf":
            raise DataError(f"{str(path)!r}: input array 'x.{name}' has dtype {a.dtype}; give numbers (integer token "
                            "ids stay integers)")
        a = a.astype(np.float32) if a.dtype.kind == "f" else a.astype(np.int64) if a.dtype.kind in "iu" else a
        tree[name] = torch.from_numpy(np.ascontiguousarray(a))
    return Inputs(tree), torch.from_numpy(y.astype(np.int64))


def _class_id(name: str, num_classes: int | None, class_names: Sequence[str] | None, where: Path) -> int:
    if class_names and name in class_names:
        return list(class_names).index(name)
    if name.isdigit():
        return int(name)
    known = f" or one of the class names {list(class_names)[:10]}" if class_names else ""
    ids = f"0..{num_classes - 1}" if num_classes is not None else "(0, 1, ...)"
    raise DataError(f"{str(where)!r}: sub-folder {name!r} is not a class id {ids}{known}; name each "
                    "class folder by its class id (or declare class-names in the run config)")


GRAY_MODES = ("1", "L", "I", "I;16", "I;16B", "I;16L", "I;16N", "F")


def _is_gray(im) -> bool:
    return im.mode in GRAY_MODES


def _list_images(root: Path, num_classes: int | None, class_names: Sequence[str] | None) -> list:
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


__all__ = ["keep_decoded", "load_client_folder", "preload_client_folder"]


def kept_folders() -> int | None:
    """How many client folders are kept decoded now (None: keeping is off, :func:`keep_decoded`)."""
    return None if _KEPT is None else len(_KEPT)
