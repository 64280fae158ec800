"""``python -m fedproto.data.precache NAME [--root FOLDER] [--no-download]``: decode a dataset into the
decoded-dataset cache (:mod:`fedproto.data.decoded`) and exit.

Run it once on a machine before starting many processes that load the dataset with
``load_dataset(..., mapped=True)`` (Flower's simulation actors), or let them run it: they do, in a
child process, when the cache has no entry yet. Nothing is decoded when the entry is there.
Exit status 0; 1 with the loader's error (a missing or corrupt file, an unknown name) on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fedproto.data.datasets import load_dataset
from fedproto.errors import FedprotoError


def main(argv: Sequence[str] | None = None) -> int:
    """The command (module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m fedproto.data.precache",
                                 description="decode a dataset into the decoded-dataset cache")
    ap.add_argument("name", help="mnist, femnist, cifar10 (digits has no files: nothing to cache)")
    ap.add_argument("--root", default=None, help="the data folder searched first (as --data-dir)")
    ap.add_argument("--no-download", action="store_true", help="fail instead of downloading missing files")
    args = ap.parse_args(argv)
    try:
        ds = load_dataset(args.name, args.root, download=not args.no_download, progress=False, mapped=True)
    except FedprotoError as e:
        print(f"fedproto: {e}", file=sys.stderr)
        return 1
    print(f"fedproto: {ds!r} is in the decoded-dataset cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
