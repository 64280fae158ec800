"""Grouped forward of G stacked models built from standard layers, for the generic batched path.

:func:`fedproto.training.train_group_generic` runs a model under ``torch.func.vmap`` over the
clients' stacked weights. For small CNNs on CPU that is no faster than training the clients one by
one: ``vmap`` turns each convolution into a grouped one but hands the stacked maps to pooling and
to the elementwise ops in a layout their CPU kernels handle slowly. This module runs the same
computation with G-grouped operations on one channels-last layout instead (as the paper CNN's
hand-written :meth:`fedproto.models.cnn.PaperCNN.grouped_forward` does):

* a 4-d activation of the G clients is one (B, G*C, H, W) channels-last tensor (client g's
  channels at g*C .. g*C + C - 1); ``Conv2d`` -> ``conv2d`` with ``groups=G``; pooling and ReLU
  act on it as they are;
* flattening to 2-d gives (G, B, F); ``Linear`` -> ``baddbmm`` with the stacked weights.

The model's forward is traced once with ``torch.fx`` (:func:`grouped_graph`); a model whose graph
holds anything outside the few supported operations (:data:`SUPPORTED`) is left to ``vmap``. The
traced graph drops layers no result reads and pools before ReLU where a ReLU feeds a max-pool
(the same numbers on a quarter of the map).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import fx, nn

_POOLS = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
_ELEMENTWISE = (nn.ReLU, nn.Identity)
SUPPORTED = ("Conv2d (zeros padding), Linear, ReLU, Identity, Flatten(1, -1), Dropout(p=0), MaxPool2d, AvgPool2d, "
             "AdaptiveAvgPool2d, AdaptiveMaxPool2d (not returning indices); F.relu / torch.relu / .relu(); "
             "torch.flatten(x, 1) / .flatten(1); a (logits, embedding) tuple output")
"""What a model's traced forward may hold to run on the grouped path."""


def _is_flatten(node: fx.Node) -> bool:
    args = list(node.args[1:]) + list(node.kwargs.values())
    return args in ([1], [1, -1])


def _is_noise_check(node: fx.Node) -> bool:
    """The check torch.fx adds for the ``noise=None`` the forward is traced with."""
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "_assert_is_none"


def grouped_graph(model: nn.Module) -> tuple[fx.GraphModule | None, str | None]:
    """Trace ``model`` (a :class:`fedproto.models.proto_model.ProtoModel`: ``forward(x, noise=None)``
    returning ``(logits (B, C), h (B, d))``) for :func:`grouped_call`.

    Returns:
        ``(graph, None)``, or ``(None, reason)`` where the model cannot run grouped: tracing fails
        (Python control flow on tensors), an operation outside :data:`SUPPORTED`, a module that
        holds buffers (BatchNorm), an active dropout, or explicit noise masks.
    """
    if getattr(model, "noise_widths", dict)():
        return None, "explicit dropout masks (noise_widths)"
    if any(True for _ in model.buffers()):
        return None, "buffers (BatchNorm statistics)"
    try:
        gm = fx.symbolic_trace(model, concrete_args={"noise": None})
    except Exception as e:  # noqa: BLE001 - any tracing failure: not this path
        return None, f"torch.fx cannot trace the forward ({type(e).__name__})"
    mods = dict(gm.named_modules())
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or _is_noise_check(node):
            continue
        ok = False
        if node.op == "call_module":
            m = mods[node.target]
            if (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks):
                return None, f"module {node.target!r} has hooks"
            if isinstance(m, nn.Conv2d):
                ok = m.groups == 1 and m.padding_mode == "zeros" and isinstance(m.padding, tuple)
            elif isinstance(m, nn.Flatten):
                ok = m.start_dim == 1 and m.end_dim == -1
            elif isinstance(m, nn.Dropout):
                ok = m.p == 0
            elif isinstance(m, (nn.MaxPool2d, nn.AdaptiveMaxPool2d)):
                ok = not m.return_indices
            else:
                ok = type(m) in (nn.Linear, *_ELEMENTWISE, nn.AvgPool2d, nn.AdaptiveAvgPool2d)
        elif node.op == "call_function":
            ok = (node.target in (F.relu, torch.relu) and len(node.args) == 1
                  and not any(node.kwargs.values())) or (
                node.target is torch.flatten and _is_flatten(node))
        elif node.op == "call_method":
            ok = (node.target == "relu" and len(node.args) == 1) or (node.target == "flatten" and _is_flatten(node))
        if not ok:
            return None, f"unsupported operation {node.op} {node.target}"
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        return None, "the traced forward does not return a (logits, embedding) pair"
    gm.graph.eliminate_dead_code()  # e.g. a wrapped model's own classifier that a projection replaces
    _pool_before_relu(gm)
    return gm, None


def _pool_before_relu(gm: fx.GraphModule) -> None:
    """Rewrite ``relu -> max-pool`` as ``max-pool -> relu`` in place where the ReLU feeds only the pool.

    Both give the same numbers: ReLU is monotone, so the largest of a window after ReLU is the
    ReLU of its largest (max-pooling pads with -inf), and the gradient reaches the same input (the
    window's first largest) or is zero in both orders. Pooling first runs the ReLU and its backward
    on a map a quarter the size (2x2 pooling); that is how the paper CNN's hand-written
    :meth:`~fedproto.models.cnn.PaperCNN.grouped_forward` orders them.
    """
    mods = dict(gm.named_modules())

    def is_relu(n: fx.Node) -> bool:
        return ((n.op == "call_module" and type(mods[n.target]) is nn.ReLU)
                or (n.op == "call_function" and n.target in (F.relu, torch.relu)) or
                (n.op == "call_method" and n.target == "relu"))

    for pool in list(gm.graph.nodes):
        if not (pool.op == "call_module" and type(mods[pool.target]) in (nn.MaxPool2d, nn.AdaptiveMaxPool2d)):
            continue
        relu = pool.args[0]
        if not (isinstance(relu, fx.Node) and is_relu(relu) and len(relu.users) == 1):
            continue
        src = cast(fx.Node, relu.args[0])  # a traced ReLU's input is a node of the graph
        pool.replace_all_uses_with(relu)  # the pool's users now read the ReLU ...
        relu.replace_input_with(src, pool)  # ... which reads the pool ...
        pool.replace_input_with(relu, src)  # ... which reads the ReLU's input
        pool.append(relu)  # keep the graph in topological order
    gm.graph.lint()
    gm.recompile()


def grouped_forward(gm: fx.GraphModule, params: dict[str, torch.Tensor], xg: torch.Tensor,
                    G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The traced forward of :func:`grouped_graph` for G clients whose inputs are already in the grouped layout.

    Args:
        gm: the traced model (its modules give the configuration; their weights are not used).
        params: parameter name -> stacked parameter (G, *shape), as ``named_parameters`` names them.
        xg: (B, G*C, H, W) channels-last images (client g's channels at g*C .. g*C + C - 1), or
            (G, B, F) feature vectors.
        G: the number of clients.
    Returns:
        ``(logits (G, B, C), h (G, B, d))``: client g's forward with its own parameters ``params[k][g]``.
    Raises:
        ValueError: an activation of another rank than 2 or 4 reaches an operation, or a 4-d one an
            operation for 2-d ones (``Linear``).
    """
    B = xg.shape[0] if xg.dim() == 4 else xg.shape[1]
    mods = dict(gm.named_modules())
    env: dict[fx.Node, torch.Tensor | None] = {}  # None: the noise placeholder, or x when not an image/feature

    def flat(t: torch.Tensor) -> torch.Tensor:  # grouped 4-d or (G, B, F) -> (G, B, F)
        if t.dim() == 3:
            return t
        return t.reshape(B, G, -1).transpose(0, 1)

    first = next(iter(gm.graph.nodes))
    for node in gm.graph.nodes:
        if node.op == "placeholder":  # x, then noise (traced as None)
            env[node] = (xg if xg.dim() in (3, 4) else None) if node is first else None
            continue
        if _is_noise_check(node):
            continue
        if node.op == "output":
            # operations' outputs: tensors (None is only ever a placeholder's value)
            logits, h = (cast(torch.Tensor, env[a]) for a in node.args[0])
            return flat(logits), flat(h)
        a = env[node.args[0]]
        if a is None or a.dim() not in (3, 4):
            raise ValueError(f"grouped forward: {node.target} got an input of unsupported rank")
        if node.op == "call_module":
            m, k = mods[node.target], node.target
            if isinstance(m, (nn.Conv2d, *_POOLS)) and a.dim() != 4:
                raise ValueError(f"grouped forward: {type(m).__name__} {k!r} got a 2-d input")
            if isinstance(m, nn.Conv2d):
                w = params[f"{k}.weight"]
                b = params[f"{k}.bias"].reshape(-1) if m.bias is not None else None
                env[node] = F.conv2d(a, w.reshape(-1, *w.shape[2:]), b, m.stride, m.padding, m.dilation, G)
            elif isinstance(m, nn.Linear):
                if a.dim() != 3:
                    raise ValueError(f"grouped forward: Linear {k!r} got a 4-d input")
                w = params[f"{k}.weight"].transpose(1, 2)
                env[node] = (torch.baddbmm(params[f"{k}.bias"].unsqueeze(1), a, w) if m.bias is not None
                             else torch.bmm(a, w))
            elif isinstance(m, nn.Flatten):
                env[node] = flat(a)
            else:  # pooling, ReLU, Identity, Dropout(p=0): the modules act per channel
                env[node] = m(a)
        elif node.target in ("flatten", torch.flatten):
            env[node] = flat(a)
        else:  # relu
            env[node] = F.relu(a)
    raise AssertionError("graph without output")  # pragma: no cover


def grouped_input(x: torch.Tensor) -> torch.Tensor:
    """(G, B, C, H, W) -> the grouped (B, G*C, H, W) channels-last layout of :func:`grouped_forward`;
    (G, B, F) is returned as it is."""
    if x.dim() != 5:
        return x
    G, B = x.shape[:2]
    return x.transpose(0, 1).reshape(B, G * x.shape[2], *x.shape[3:]).contiguous(memory_format=torch.channels_last)


def grouped_call(gm: fx.GraphModule, params: dict[str, torch.Tensor],
                 x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the traced forward of :func:`grouped_graph` for G clients at once.

    Args:
        gm: the traced model (its modules give the configuration; their weights are not used).
        params: parameter name -> stacked parameter (G, *shape), as ``named_parameters`` names them.
        x: (G, B, C, H, W) or (G, B, F) inputs, client g's samples at ``x[g]``.
    Returns:
        ``(logits (G, B, C), h (G, B, d))``: client g's forward with its own parameters ``params[k][g]``.
    Raises:
        ValueError: inputs of another rank, an activation of another rank than 2 or 4 reaching an
            operation, or a 4-d one an operation for 2-d ones (``Linear``).
    """
    if x.dim() not in (3, 5):
        raise ValueError(f"grouped forward: inputs of shape {tuple(x.shape)}; expected (G, B, C, H, W) or (G, B, F)")
    return grouped_forward(gm, params, grouped_input(x), x.shape[0])


__all__ = ["SUPPORTED", "grouped_call", "grouped_forward", "grouped_graph", "grouped_input"]
