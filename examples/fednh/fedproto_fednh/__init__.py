"""FedNH (Dai et al., "Tackling Data Heterogeneity in Federated Learning with Class Prototypes",
AAAI 2023, arXiv 2212.02758) as a fedproto algorithm plug-in: the worked example of
docs/architecture.md ("Plug-ins").

The server holds one prototype per class on the unit sphere, drawn uniformly at random from the
run's seed before round 1 (``Algorithm.generator``). They are the classifier: a client scores an
embedding h against class c as ``s * cos(h, P_c)`` and trains its body with cross-entropy on those
cosine logits, which replaces the built-in cross-entropy of the model's head
(``Objective.classification``); the head gets no gradient. A client sends its local prototypes (its
class means of the last epoch's embeddings, normalised, with their counts); the server averages them per
class, weighted by counts, and smooths: ``P_c <- normalise(rho * P_c + (1 - rho) * normalise(mean_c))``
for the classes sent this round. Personalised as the library's prototype methods: the bodies stay on
the clients (FedNH's paper also averages the bodies' weights; not done here, so clients may differ
in architecture and share only the embedding size).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedproto.algorithms import Algorithm
from fedproto.algorithms.proto_steps import Rows
from fedproto.algorithms.requirements import ONE_EMBEDDING
from fedproto.algorithms.server_state import ServerState
from fedproto.plugins import AlgorithmOptions
from fedproto.prototypes import embedding_health, local_prototypes
from fedproto.training import LossTerm, Objective, Phase, predict

__all__ = ["CosineCE", "FedNH", "FedNHOptions", "cosine_logits", "sphere_prototypes"]


class FedNHOptions(AlgorithmOptions):
    """FedNH's options (``--fednh-smoothing``, ``--fednh-scale``)."""

    sends: ClassVar[str] = "prototypes"
    class_ids: ClassVar[bool] = True

    fednh_smoothing: float = Field(0.9, ge=0.0, lt=1.0, description="FedNH: rho, the weight of the previous "
                                   "round's class prototypes in the server's smoothing, in [0, 1)")
    fednh_scale: float = Field(10.0, gt=0.0, le=1000.0, description="FedNH: s, the scale of the cosine logits "
                               "s * cos(h, P_c)")


def sphere_prototypes(rng: np.random.Generator, num_classes: int, d: int) -> np.ndarray:
    """``num_classes`` points drawn uniformly on the unit sphere of R^d (normalised Gaussians), (C, d) float32."""
    p = rng.standard_normal((num_classes, d))
    return (p / np.linalg.norm(p, axis=1, keepdims=True)).astype(np.float32)


def cosine_logits(h: torch.Tensor, protos: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * cos(h, P_c)`` for embeddings h (..., B, d) and prototypes (C, d): (..., B, C)."""
    return scale * F.normalize(h, dim=-1) @ F.normalize(protos.to(h.dtype), dim=-1).T


class CosineCE(LossTerm):
    """Cross-entropy of the cosine logits against the server's prototypes: FedNH's classification
    loss (``Objective.classification``), the weighted batch mean."""

    per_sample = True

    def __init__(self, protos: torch.Tensor, scale: float):
        self.protos, self.scale = protos, float(scale)

    def __call__(self, logits, h, y, w):
        z = cosine_logits(h, self.protos, self.scale)
        ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), reduction="none").reshape(y.shape)
        return (ce * w).sum(-1) / w.sum(-1).clamp_min(1.0)


class FedNH(Algorithm):
    """FedNH: server class prototypes on the unit sphere, smoothed each round, as every client's
    classifier (cosine logits). Messages: down ``protos`` (C, d) float32; up ``classes`` (K,),
    ``protos`` (K, d) (normalised class means), ``counts`` (K,)."""

    name = "fednh"
    Options = FedNHOptions
    model_needs = ONE_EMBEDDING

    # server
    def initial_message_from(self, joins):
        return {"protos": sphere_prototypes(self.generator(0), self.num_classes, self.embedding_dim)}

    def message_problem(self, message, embedding_dim):
        p = message.get("protos")
        return "" if p is not None and p.shape == (self.num_classes, embedding_dim) else "protos is not (C, d)"

    def reply_problem(self, reply, sent, embedding_dim):
        if set(reply) != {"classes", "protos", "counts"}:
            return f"unexpected entries {sorted(reply)[:5]} (FedNH sends classes, protos, counts)"
        k = len(reply["classes"])
        if reply["protos"].shape != (k, embedding_dim) or reply["counts"].shape != (k,):
            return f"protos {reply['protos'].shape} / counts {reply['counts'].shape} do not fit {k} classes"
        if not np.isfinite(reply["protos"]).all() or (reply["counts"] < 1).any():
            return "prototypes that are not finite, or counts below 1"
        if ((reply["classes"] < 0) | (reply["classes"] >= self.num_classes)).any():
            return f"class ids outside 0..{self.num_classes - 1}"
        return ""

    def aggregate(self, round, messages, state=None):
        old = np.asarray(state.message["protos"], np.float64)
        rows = Rows.of(messages)
        new = old.copy()
        rho = self.options.fednh_smoothing
        sent = np.unique(np.concatenate(rows.classes)) if rows.classes else np.zeros(0, np.int64)
        for c in sent:
            mean = sum((n[k == c, None] * p[k == c]).sum(0) for k, p, n in zip(rows.classes, rows.protos, rows.counts))
            mean = mean / max(np.linalg.norm(mean), 1e-12)
            v = rho * old[c] + (1 - rho) * mean
            new[c] = v / max(np.linalg.norm(v), 1e-12)
        shift = float(np.mean(1 - (new[sent] * old[sent]).sum(1))) if len(sent) else 0.0
        return ServerState({"protos": new.astype(np.float32)}, metrics={"proto_shift": shift})

    # client
    def objective(self, state, message):
        protos = torch.as_tensor(message["protos"])
        return Objective(phases=[Phase(self.local_epochs)], collect=True,
                         classification=CosineCE(protos, self.options.fednh_scale))

    def finish(self, state, message, data, result):
        classes, protos, counts = local_prototypes(result.sums, result.counts)
        protos = protos / np.maximum(np.linalg.norm(protos, axis=1, keepdims=True), 1e-12)
        return {"classes": classes, "protos": protos.astype(np.float32), "counts": counts}

    def evaluate(self, state, message, data):
        logits, h = predict(state.model, data.test_x)
        z = cosine_logits(h, torch.as_tensor(message["protos"]).to(h.device), self.options.fednh_scale)
        acc = float((z.argmax(1).cpu() == data.test_y).double().mean()) if len(data.test_y) else float("nan")
        return {"acc": acc, **embedding_health(h, z)}

    def eval_protocols(self):
        return {"acc": "personal: each client's body with the server's class prototypes as its classifier "
                       "(argmax of the cosine logits), on the client's own test set"}
