"""FedProto's set-up check of the clients' models for ``dp="full"`` (DP-SGD, per-sample gradients):
:func:`check_dp_sgd_models`, which :meth:`fedproto.algorithms.fedproto.FedProto.check_models` runs
before round 1. The other checks of the method are :mod:`fedproto.algorithms.fedproto_checks`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedproto.models.proto_model import ProtoModel


def check_dp_sgd_models(models: list[ProtoModel]) -> None:
    """Refuse models DP-SGD cannot train: BatchNorm layers that train (their statistics mix the
    samples of a batch, so per-sample gradients do not exist), and recurrent layers that train
    (``nn.GRU``, ``nn.LSTM``, ``nn.RNN``: Opacus has per-sample gradients for its own
    ``DPGRU``/``DPLSTM``/``DPRNN`` only). Frozen BatchNorm layers (:func:`fedproto.training.frozen_batchnorms`)
    are allowed.

    Raises:
        ConfigError: naming the clients (the first 10) whose models hold such layers, and the fixes.
    """
    from torch import nn

    from fedproto.errors import ConfigError
    from fedproto.training import frozen_batchnorms

    def trains_bn(m: nn.Module) -> bool:
        frozen = {id(b) for b in frozen_batchnorms(m)}
        return any(isinstance(b, nn.modules.batchnorm._BatchNorm) and id(b) not in frozen for b in m.modules())

    bn = [i for i, m in enumerate(models) if trains_bn(m)]
    if bn:
        raise ConfigError(f"dp='full' trains with DP-SGD, which needs per-sample gradients, but the models of "
                          f"clients {bn[:10]} have BatchNorm layers that train; use models without BatchNorm "
                          "(e.g. GroupNorm, or model='cnn'), freeze them (requires_grad=False), or "
                          "dp='prototypes'")
    rnn = [(i, type(r).__name__) for i, m in enumerate(models) for r in m.modules()
           if isinstance(r, nn.RNNBase) and any(p.requires_grad for p in r.parameters())]
    if rnn:  # Opacus computes their per-sample gradients only as its own DPGRU / DPLSTM / DPRNN layers
        kind = rnn[0][1]
        raise ConfigError(f"dp='full' trains with DP-SGD, which needs per-sample gradients, but the models of "
                          f"clients {sorted({i for i, _ in rnn})[:10]} have torch.nn.{kind} layers, for which "
                          f"Opacus has none; use opacus.layers.DP{kind} in their place (the same layer with "
                          "per-sample gradients), freeze them (requires_grad=False), or dp='prototypes'")
