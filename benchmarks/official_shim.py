"""Run the official FedProto code (github.com/yuetan031/FedProto) on this machine, unchanged in
its training, to time it against ``fedproto run``.

What the shim changes, and only that (the official training, sampling, models, aggregation and
evaluation run as they are in ``exps/federated_main.py`` and ``lib/``):

* ``torchvision`` (which does not import beside this project's torch build) is replaced by a
  stand-in module holding ``datasets.MNIST``, ``transforms.{Compose, ToTensor, Normalize}`` and an
  empty ``models`` (imported by ``lib/models/models.py``, not used for MNIST); the CIFAR
  transforms ``lib/utils.py`` builds at import are placeholders that refuse to run.
  The MNIST stand-in reads the same IDX files with fedproto's reader
  (:func:`fedproto.data.mnist._read_idx`, MD5-checked) and behaves as torchvision's does: ``data``
  a uint8 tensor (N, 28, 28), ``targets`` / ``train_labels`` int64 labels, and each access makes a
  PIL image (mode ``L``) and applies the transform (``ToTensor``: /255 to a float (1, 28, 28)
  tensor; ``Normalize``: (x - mean) / std).
* ``tensorboardX.SummaryWriter`` (not installed) is ``torch.utils.tensorboard.SummaryWriter``,
  which writes the same event files; ``tqdm`` (not installed) is the identity.
* ``torch.set_num_threads(--threads)``; the process runs in a scratch folder, so the official
  code's ``../tensorboard/`` and ``./*.npy`` outputs land there.

Usage (the official code from a checkout or a bare git mirror of it; the remaining arguments go
to the official ``federated_main.py``)::

    FEDPROTO_DATA=/path/to/data python benchmarks/official_shim.py --official /path/to/FedProto \\
        --threads 1 -- --rounds 20 --local_bs 8

It prints the official code's own output and, last, one JSON line with the wall and CPU seconds
of the whole process up to then.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import resource
import runpy
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

_START = time.perf_counter()


def _checkout(source: Path, scratch: Path) -> Path:
    """A work tree of the official code: ``source`` itself, or extracted from a bare git dir."""
    if (source / "exps" / "federated_main.py").is_file():
        return source
    tree = scratch / "FedProto"
    tree.mkdir()
    archive = subprocess.run(["git", "--git-dir", str(source), "archive", "HEAD"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def _stand_ins() -> None:
    import numpy as np
    import torch
    from PIL import Image

    from fedproto.data.datasets import candidate_roots
    from fedproto.data.mnist import _MNIST_FILES, _mnist_files_in, _read_idx

    class Compose:
        def __init__(self, transforms):
            self.transforms = transforms

        def __call__(self, x):
            for t in self.transforms:
                x = t(x)
            return x

    class ToTensor:
        def __call__(self, pic):
            a = np.array(pic, dtype=np.uint8, copy=True)
            return torch.from_numpy(a).view(1, *a.shape).float().div(255)

    class Normalize:
        def __init__(self, mean, std):
            self.mean = torch.tensor(mean).view(-1, 1, 1)
            self.std = torch.tensor(std).view(-1, 1, 1)

        def __call__(self, x):
            return (x - self.mean) / self.std

    class CifarOnly:  # built at import by lib/utils.py for CIFAR; never applied to MNIST
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, x):
            raise NotImplementedError("the shim covers MNIST only")

    class MNIST(torch.utils.data.Dataset):
        def __init__(self, root, train=True, download=False, transform=None):
            found = [f for r in candidate_roots(None) for d in (r / "mnist", r)
                     if (f := _mnist_files_in(d)) is not None]
            if not found:
                raise SystemExit("no MNIST IDX files found; set FEDPROTO_DATA")
            files = found[0]
            prefix = "train" if train else "t10k"
            images = _read_idx(files[f"{prefix}-images-idx3-ubyte"], (None, 28, 28),
                               _MNIST_FILES[f"{prefix}-images-idx3-ubyte"])
            labels = _read_idx(files[f"{prefix}-labels-idx1-ubyte"], (None,),
                               _MNIST_FILES[f"{prefix}-labels-idx1-ubyte"])
            self.data = torch.from_numpy(images.copy())
            self.targets = torch.from_numpy(labels.astype(np.int64))
            self.transform = transform

        @property
        def train_labels(self):
            return self.targets

        def __len__(self):
            return len(self.data)

        def __getitem__(self, index):
            img = Image.fromarray(self.data[index].numpy(), mode="L")
            if self.transform is not None:
                img = self.transform(img)
            return img, int(self.targets[index])

    tv = types.ModuleType("torchvision")
    tv.datasets = types.ModuleType("torchvision.datasets")
    tv.transforms = types.ModuleType("torchvision.transforms")
    tv.models = types.ModuleType("torchvision.models")  # imported by lib/models/models.py, unused
    tv.datasets.MNIST = MNIST
    for cls in (Compose, ToTensor, Normalize):
        setattr(tv.transforms, cls.__name__, cls)
    tv.transforms.RandomCrop = tv.transforms.RandomHorizontalFlip = CifarOnly
    sys.modules.update({"torchvision": tv, "torchvision.datasets": tv.datasets,
                        "torchvision.transforms": tv.transforms, "torchvision.models": tv.models})

    from torch.utils.tensorboard import SummaryWriter

    tbx = types.ModuleType("tensorboardX")
    tbx.SummaryWriter = SummaryWriter
    tq = types.ModuleType("tqdm")
    tq.tqdm = lambda it, *a, **k: it
    sys.modules.update({"tensorboardX": tbx, "tqdm": tq})
    for module in (tv, tv.datasets, tv.transforms, tv.models, tbx, tq):  # torch._dynamo asks for specs
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--official", type=Path, required=True,
                        help="the official code: a checkout or a bare git dir of it")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="-- then federated_main.py's arguments")
    args = parser.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    import torch

    torch.set_num_threads(args.threads)
    _stand_ins()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        tree = _checkout(args.official.resolve(), scratch)
        work = scratch / "run" / "exps"
        work.mkdir(parents=True)
        os.chdir(work)
        sys.argv = [str(tree / "exps" / "federated_main.py"), *rest]
        runpy.run_path(sys.argv[0], run_name="__main__")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    wall, cpu = time.perf_counter() - _START, usage.ru_utime + usage.ru_stime
    print(f'{{"official_wall_s": {wall:.2f}, "official_cpu_s": {cpu:.2f}}}')


if __name__ == "__main__":
    main()
