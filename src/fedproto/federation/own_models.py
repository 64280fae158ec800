"""A user's model as a :class:`~fedproto.models.proto_model.ProtoModel`: the adapters (a module returning
``(logits, embedding)``, a classifier split at its head, a projection to a shared embedding size),
the check before round 1 (:func:`adapt`) and shared initial weights. Importable from
:mod:`fedproto.federation`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fedproto.data.inputs import describe
from fedproto.errors import ModelError, first_line
from fedproto.models.proto_model import ProtoModel


class TupleModel(ProtoModel):
    """Adapter for a module whose ``forward(x)`` returns ``(logits (B, C), embedding (B, d))``.

    ``embed(x)`` runs the whole module and keeps the embedding. The module's own parameter names
    are kept under ``net.``; it has no known head, so FedPer/FedRep refuse it (give ``head``).
    """

    head_prefixes = ("net.\0",)  # matches no parameter: the head is unknown

    def __init__(self, net: nn.Module, embedding_dim: int, num_classes: int):
        super().__init__()
        self.net = net
        self.embedding_dim = int(embedding_dim)
        self.num_classes = int(num_classes)

    def forward(self, x, noise=None):
        out = self.net(x)
        tensor = (torch.Tensor, torch.fx.Proxy)  # a Proxy: the forward traced by fedproto.training.grouped_forward
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, tensor) for t in out)):
            raise ModelError(f"the model's forward returned a {type(out).__name__}, not (logits, embedding); give "
                             "head='<final layer>' for a plain classifier")
        logits, h = out
        return logits, h.flatten(1)

    def embed(self, x, noise=None):
        return self.forward(x)[1]


class HeadSplitModel(ProtoModel):
    """Adapter for a classifier split at its final layer ``head`` (a submodule name, dotted for
    nested ones): the embedding is the flattened input of that layer, the logits its output.

    Parameters keep their names under ``net.``; FedPer/FedRep treat ``net.<head>.*`` as the head.
    """

    def __init__(self, net: nn.Module, head: str, embedding_dim: int, num_classes: int):
        super().__init__()
        self.net = net
        self.head_name = head
        self.head_prefixes = (f"net.{head}.",)
        self.embedding_dim = int(embedding_dim)
        self.num_classes = int(num_classes)
        self._seen: list[torch.Tensor] = []
        net.get_submodule(head).register_forward_pre_hook(self._keep)

    def _keep(self, module, args):
        self._seen.append(args[0])

    def forward(self, x, noise=None):
        self._seen.clear()
        logits = self.net(x)
        if not self._seen:
            raise ModelError(f"the model's forward never called its head {self.head_name!r}")
        h = self._seen[-1]
        self._seen.clear()
        return logits, h.flatten(1)

    def embed(self, x, noise=None):
        return self.forward(x)[1]

    def head(self, h, noise=None):
        return self.net.get_submodule(self.head_name)(h)


class Projected(ProtoModel):
    """``model`` with a linear projection of its embedding to size ``d`` and a new linear head
    (d -> C): the practitioner's guide's advice for clients whose embedding sizes differ
    (§3.2: "add a projection layer"). Parameters: ``inner.*``, ``proj.*``, ``fc.*`` (the head), in the
    model's dtype and on its device (a float64 model stays float64)."""

    head_prefixes = ("fc.",)

    def __init__(self, model: ProtoModel, d: int):
        super().__init__()
        self.inner = model
        ref = next((t for t in model.parameters() if t.is_floating_point()), None)  # the model's dtype and device
        kw = {} if ref is None else {"dtype": ref.dtype, "device": ref.device}
        self.proj = nn.Linear(model.embedding_dim, d, **kw)
        self.fc = nn.Linear(d, model.num_classes, **kw)
        self.embedding_dim, self.num_classes = int(d), model.num_classes

    def embed(self, x, noise=None):
        return self.proj(self.inner.embed(x))

    def head(self, h, noise=None):
        return self.fc(h)


def with_projection(model: ProtoModel, d: int) -> ProtoModel:
    """Append a linear projection to embedding size ``d`` (and a new d -> C head); see :class:`Projected`.

    Raises:
        ModelError: ``model`` is a plain module (its embedding size is unknown until it is adapted):
            give ``Client(..., embedding_dim=d)`` instead, or :func:`adapt` it first.
    """
    if not isinstance(model, ProtoModel):
        raise ModelError(f"with_projection needs an adapted model; for a plain {type(model).__name__} give "
                         f"Client(model, train, test, embedding_dim={d}) (or fedproto.federation.adapt it first)")
    return model if model.embedding_dim == d else Projected(model, d)


def dtype_mismatch(model: nn.Module, sample: Any) -> str:
    """Why ``model`` cannot take ``sample`` for its dtypes, or "": its floating parameters and buffers
    differ in dtype (the first of each named), or the floating leaves of ``sample`` are not theirs.
    Used when a forward fails, so that "mat1 and mat2 must have the same dtype" is named as the mismatch it is."""
    from fedproto.data.inputs import Inputs, leaves

    def name(d: torch.dtype) -> str:
        return str(d).replace("torch.", "")

    inner = getattr(model, "net", None)  # the user's module inside the adapter: its own layer names
    user = inner if isinstance(inner, nn.Module) else model
    first: dict[torch.dtype, str] = {}
    for n, t in (*user.named_parameters(), *user.named_buffers()):
        if t.is_floating_point():
            first.setdefault(t.dtype, n)
    if len(first) > 1:
        (a, na), (b, nb) = list(first.items())[:2]
        return (f"its parameters mix {name(a)} ({na!r}) and {name(b)} ({nb!r}); give them one dtype, e.g. "
                f"model.float() or model.double(), before Client(model, ...)")
    tree = sample.tree if isinstance(sample, Inputs) else sample
    given = {t.dtype for t in leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()}
    if first and given and given != set(first):
        return (f"its inputs are {', '.join(sorted(map(name, given)))} and its parameters {name(next(iter(first)))}; "
                "give the inputs the model's dtype, or cast the model (model.float(), model.double())")
    return ""


def adapt(model: nn.Module, head: str | None, num_classes: int, sample: Any, cid: int = 0) -> ProtoModel:
    """Wrap ``model`` as a :class:`ProtoModel` and check it on ``sample`` (one input as the model
    takes it: a (1, ...) tensor, or a dict or tuple of them).

    Raises:
        ModelError: ``head`` is not a submodule (lists the candidates), the forward does not
            return what it must, or the logits are not (B, num_classes) (names client ``cid``).
    """
    if isinstance(model, ProtoModel):
        wrapped = model
    elif not isinstance(model, nn.Module):
        raise ModelError(f"client {cid}: model is a {type(model).__name__}, not a torch.nn.Module")
    elif head is not None:
        names = dict(model.named_modules())
        if head not in names or head == "":
            tail = [n for n in names if n][-5:]
            raise ModelError(f"client {cid}: the model has no layer {head!r}; its last layers are {tail}: name the "
                             "final (classifier) layer, e.g. head='fc'")
        wrapped = HeadSplitModel(model, head, 0, num_classes)
    else:
        wrapped = TupleModel(model, 0, num_classes)
    meta = [n for n, t in [*wrapped.named_parameters(), *wrapped.named_buffers()] if t.is_meta]
    if meta:
        raise ModelError(f"client {cid}: the model's weights are on the meta device (shapes only, no values; e.g. "
                         f"{meta[0]!r}); materialise it first: model.to_empty(device='cpu'), then load its weights "
                         "(load_state_dict), or build it without device='meta'")
    was = wrapped.training
    wrapped.eval()
    try:
        with torch.no_grad():
            out = wrapped(sample)
    except ModelError as e:
        raise e.prefixed(f"client {cid}: ") from None
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
        hint = ("its forward must return (logits, embedding), or give head='<final layer name>'" if head is None
                else "check the input shape")
        raise ModelError(f"client {cid}: the model failed on a training input of shape {describe(sample)} "
                         f"({type(e).__name__}: {str(e)[:160]}); {hint}") from None
    except RuntimeError as e:
        problem = dtype_mismatch(wrapped, sample)
        if problem:
            raise ModelError(f"client {cid}: dtype mismatch: {problem}") from None
        raise ModelError(f"client {cid}: the model failed on a training input of shape {describe(sample)} "
                         f"({type(e).__name__}: {first_line(e)[:200]})") from None
    finally:
        wrapped.train(was)
    logits, h = out
    if not isinstance(logits, torch.Tensor):
        raise ModelError(f"client {cid}: the model failed on a training input of shape {describe(sample)} (its "
                         f"forward returned a {type(logits).__name__}, not the logits tensor head={head!r} needs); if "
                         f"its forward returns (logits, embedding) itself, leave out head={head!r}")
    if not any(p.requires_grad for p in wrapped.parameters()):
        raise ModelError(f"client {cid}: the model has no trainable parameters")
    if logits.ndim != 2 or logits.shape != (1, num_classes):
        raise ModelError(f"client {cid}: the model's logits have shape {tuple(logits.shape)} for one input, "
                         f"expected (1, {num_classes}) (num_classes={num_classes})")
    if h.ndim != 2 or h.shape[0] != 1:
        raise ModelError(f"client {cid}: the embedding has shape {tuple(h.shape)} for one input, expected (1, d)")
    if head is not None:
        with torch.no_grad():
            again = wrapped.head(h)
        if again.shape != logits.shape or not torch.allclose(again, logits, rtol=1e-4, atol=1e-5):
            raise ModelError(f"client {cid}: layer {head!r} is not the model's final layer (its output is not the "
                             "logits); name the last layer, the one that outputs the class scores")
    if not isinstance(model, ProtoModel):
        wrapped.embedding_dim = int(h.shape[1])
    return wrapped


def share_initial_weights(models: Sequence[nn.Module]) -> list[list[int]]:
    """Give clients of one architecture identical initial weights (the ``shared_init`` option for your own models).

    Models whose state dicts hold the same names, shapes and dtypes (parameters and buffers) and that froze the
    same parameters (:func:`fedproto.training.frozen_params`) form a group; every model of a group gets the
    first one's (lowest client id's) trainable parameters and buffers, copied in place. What the user froze is
    left as it is: frozen parameters (``requires_grad=False``, e.g. a pretrained backbone) and the running
    statistics of BatchNorm layers whose parameters are all frozen (:func:`fedproto.training.frozen_batchnorms`)
    are not copied, and no ``requires_grad`` flag changes. Models of other architectures keep their weights.

    Args:
        models: the clients' models, in client order (changed in place).
    Returns:
        The groups of client indices (each sorted, in order of their first client), singletons included.
    """
    from fedproto.training import frozen_batchnorms, frozen_params

    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(models):
        key = (tuple((k, tuple(v.shape), v.dtype) for k, v in m.state_dict().items()), frozen_params(m))
        groups.setdefault(key, []).append(i)
    for members in groups.values():
        src = models[members[0]]
        frozen = frozen_params(src)
        fbn = {id(mod) for mod in frozen_batchnorms(src)}
        frozen_bn = {f"{n}.{b}" if n else b for n, mod in src.named_modules() if id(mod) in fbn
                     for b, _ in mod.named_buffers(recurse=False)}
        state = {k: v for k, v in src.state_dict().items() if k not in frozen and k not in frozen_bn}
        for i in members[1:]:
            with torch.no_grad():
                models[i].load_state_dict(state, strict=False)
    return list(groups.values())
