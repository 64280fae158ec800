"""The model zoo: the client models of ``fedproto run`` and how to build them from Python.

Every client model is a :class:`~fedproto.models.proto_model.ProtoModel`: ``embed(x) -> (B, d)``,
``head(h) -> (B, C)``, ``forward(x) -> (logits, h)``. The names the ``model`` option takes:

* ``cnn``: the paper's CNN (:class:`~fedproto.models.cnn.PaperCNN`, d = ``embedding_dim``, 50);
* ``cnn-mh``: FedProto-mh's CNNs, conv2 18 / 20 / 22 channels by thirds of the clients;
* ``resnet18``: ResNet18 (:class:`~fedproto.models.resnet.ResNet18`, d = 512), CIFAR-10's model;
* ``resnet18-mh``: FedProto-mh's ResNet18s (conv1/maxpool strides (1, 4) for the first half);
* ``projcnn:<c1>-<c2>``: a CNN of these conv widths ending in a projection to ``embedding_dim``
  (:class:`~fedproto.models.cnn.ProjectedCNN`);
* a comma list of these, one per client in turn (``projcnn:32-64,projcnn:16-32``).

From Python::

    from fedproto.models import build_model, build_client_models

    model = build_model("cnn", cid=0, in_channels=1, num_classes=10, input_size=28)
    logits, h = model(x)                     # x (B, 1, 28, 28) -> (B, 10), (B, 50)
    models = build_client_models("cnn-mh", num_clients=20, in_channels=1, num_classes=10, input_size=28)

A module of your own needs no zoo entry: :class:`fedproto.federation.Client` adapts it.
The names below are imported from their modules on first use (they need torch).
"""

__all__ = ["MODEL_NAMES", "PaperCNN", "ProjectedCNN", "ProtoModel", "ResNet18", "WrappedModel", "build_client_models",
           "build_model", "check_embedding_dims", "check_model_name", "load_pretrained"]

_WHERE = {"ProtoModel": "base", "WrappedModel": "base", "check_embedding_dims": "base", "PaperCNN": "cnn",
          "ProjectedCNN": "cnn", "ResNet18": "resnet", "load_pretrained": "resnet", "MODEL_NAMES": "zoo",
          "build_client_models": "zoo", "build_model": "zoo", "check_model_name": "zoo"}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"fedproto.models.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'fedproto.models' has no attribute {name!r}")
