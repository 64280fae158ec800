"""Datasets: loading (with download and checksum verification) of MNIST, digits, FEMNIST, CIFAR-10."""

from fedproto.data.datasets import Dataset, load_dataset

__all__ = ["Dataset", "load_dataset"]
