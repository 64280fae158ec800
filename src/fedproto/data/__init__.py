"""Datasets: MNIST, digits, FEMNIST and CIFAR-10, with download and checksum verification.

:mod:`fedproto.data.registry` lists them (classes, shapes, the paper's defaults, the loader);
:func:`load_dataset` and :class:`Dataset` are imported on first use (they need torch).
"""

__all__ = ["Dataset", "load_dataset"]


def __getattr__(name: str):
    if name in __all__:
        from fedproto.data import datasets

        return getattr(datasets, name)
    raise AttributeError(f"module 'fedproto.data' has no attribute {name!r}")
