"""Argument functions shared by the benchmark scripts (run as ``python benchmarks/<script>.py``, so
this folder is first on ``sys.path``)."""

from __future__ import annotations

import argparse


def positive(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is less than 1")
    return n
