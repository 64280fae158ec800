"""fedproto: federated prototype learning (FedProto, arXiv 2105.00243)."""

__version__ = "0.1.0"
