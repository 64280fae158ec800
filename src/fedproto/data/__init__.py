"""Datasets: MNIST, digits, FEMNIST and CIFAR-10, with download and checksum verification."""

from fedproto.data.datasets import Dataset, load_dataset

__all__ = ["Dataset", "load_dataset"]
