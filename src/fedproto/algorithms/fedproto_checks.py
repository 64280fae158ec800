"""FedProto's server-side checks and words (docs/architecture.md, "Algorithm"): the reply and
message checks the engine runs before aggregating and on a checkpoint, the set-up checks before
round 1, the method's words in the health errors and its ``summary.json`` privacy entry.
:class:`ProtoServerChecks` is a part of :class:`fedproto.algorithms.fedproto.FedProto` (and of the
methods that subclass it); it reads the options FedProto sets on itself.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedproto.algorithms.server_state import Message


class ProtoServerChecks:
    """The server-side checks of a prototype method: replies of ``classes`` (K,) int,
    ``protos`` (K, d), ``counts`` (K,); reads ``num_classes``, ``embedding_dim`` and FedProto's
    options (``min_contributors``, ``min_proto_samples``, ``aggregation``, ``dp`` ...) from ``self``."""

    # what this part reads from the method it is a part of (FedProto sets them in its constructor)
    num_classes: int
    embedding_dim: int
    min_contributors: int
    min_proto_samples: int
    lambda_proto: float
    aggregation: str
    trim: float
    exclude_outliers: float
    class_check: float
    dp: str
    dp_noise: float
    dp_clip: float
    dp_grad_clip: float
    dp_delta: float
    dp_reproducible_noise: bool

    def reply_problems(self, cid: int, message: Message) -> tuple[Message, list[str]]:
        """A client's reply with its bad prototype rows dropped, and why each was dropped: rows
        whose values are not finite, whose class is outside 0..C-1 or whose count is below 1 or not
        a whole number, and the whole reply (``{}``) when no row is left or its arrays do not fit
        together ((K,) classes, (K, d) protos, (K,) counts with d the embedding size)."""
        try:
            c = np.asarray(message["classes"])
            p = np.asarray(message["protos"])
            n = np.asarray(message["counts"])
        except KeyError as e:
            return {}, [f"no {e.args[0]!r} entry"]
        if (c.ndim != 1 or p.ndim != 2 or n.shape != c.shape or len(p) != len(c) or c.dtype.kind not in "iu"
                or (len(c) and p.shape[1] != self.embedding_dim)):
            return {}, [f"arrays that do not fit: classes {c.shape} {c.dtype}, protos {p.shape}, counts {n.shape} "
                        f"(expected (K,) int, (K, {self.embedding_dim}), (K,))"]
        ok = np.ones(len(c), bool)
        why = []
        for j in range(len(c)):
            reason = ("values that are not finite" if not np.isfinite(p[j]).all() else
                      f"class {c[j]} outside 0..{self.num_classes - 1}" if not 0 <= c[j] < self.num_classes else
                      f"count {n[j]} below 1" if not n[j] >= 1 else
                      f"count {n[j]} not a whole number" if n[j] != np.round(n[j]) else "")
            if reason:
                ok[j] = False
                why.append(f"the prototype of class {c[j]}: {reason}")
        if len(c) and not ok.any():
            return {}, why  # nothing usable left
        return {"classes": c[ok], "protos": p[ok], "counts": n[ok]}, why

    def reply_problem(self, reply: Message, sent: Message, embedding_dim: int) -> str:
        """The form of a client's reply (the engine then drops bad rows with :meth:`reply_problems`):
        (K,) distinct integer ``classes``, (K, d) float ``protos`` with d the embedding size, (K,)
        numeric ``counts``, nothing else."""
        extra = sorted(set(reply) - {"classes", "protos", "counts"})
        if extra:
            return f"unexpected entries {extra[:5]}"
        c, p, n = reply.get("classes"), reply.get("protos"), reply.get("counts")
        if c is None or p is None or n is None:
            return "lacks 'classes', 'protos' or 'counts'"
        if c.ndim != 1 or c.dtype.kind not in "iu":
            return f"'classes' has shape {c.shape} and dtype {c.dtype}, expected (K,) integers"
        if len(np.unique(c)) != len(c):
            return "repeats a class id"
        if p.shape != (len(c), embedding_dim) or p.dtype.kind != "f":
            return (f"prototypes have shape {p.shape} and dtype {p.dtype}, expected ({len(c)}, {embedding_dim}) floats "
                    f"(embedding size {embedding_dim})")
        if n.shape != c.shape:
            return f"'counts' has shape {n.shape}, expected ({len(c)},)"
        return ""

    def message_problem(self, message: Message, embedding_dim: int) -> str:
        """A stored server message needs a (K,) integer ``classes`` within 0..C-1 and (K, d) ``protos``."""
        if "protos" not in message and "classes" not in message:
            return ""
        c, p = message.get("classes"), message.get("protos")
        C, d = self.num_classes, embedding_dim
        if c is None or p is None or c.ndim != 1 or c.dtype.kind not in "iu":
            return "has no proper 'classes' and 'protos' pair"
        if len(c) and (c.min() < 0 or c.max() >= C):
            return f"names classes outside 0..{C - 1} ({c.min()}..{c.max()})"
        if p.shape != (len(c), d):
            return f"prototypes have shape {p.shape}, expected ({len(c)}, {d}) (embedding size {d})"
        return ""

    def check_setup(self, cfg: Any, train_labels: list[np.ndarray]) -> None:
        """``min_proto_samples`` must leave some prototype to send: refused when it exceeds every
        client's count of every class; ``min_contributors`` must be reachable: refused when it
        exceeds the clients taking part in a round or the holders of every class."""
        if self.min_contributors > 1:
            from fedproto.errors import ConfigError, opt

            holders = np.zeros(self.num_classes, np.int64)
            for y in train_labels:
                if len(y):
                    holders[np.unique(np.asarray(y))] += 1
            p = float(getattr(cfg, "participation", 1.0))
            per_round = len(train_labels) if p == 1.0 else (int(p) if p > 1 else max(1, round(p * len(train_labels))))
            most = int(min(holders.max(initial=0), per_round))
            if self.min_contributors > most:
                raise ConfigError(f"{opt('min_contributors', self.min_contributors)} is more than any class ever has "
                                  f"in a round (at most {most}: {int(holders.max(initial=0))} clients hold the most "
                                  f"widely held class, {per_round} take part per round), so no global prototype "
                                  "would be made", option="min_contributors", value=self.min_contributors,
                                  hint=f"use {opt('min_contributors', most)} or less")
        if self.min_proto_samples > 1:
            most = max((int(np.bincount(np.asarray(y)).max()) for y in train_labels if len(y)), default=0)
            if self.min_proto_samples > most:
                from fedproto.errors import ConfigError, opt

                raise ConfigError(f"{opt('min_proto_samples', self.min_proto_samples)} is more than any client's "
                                  f"samples of a class (largest: {most}), so no prototype would reach the server",
                                  option="min_proto_samples", value=self.min_proto_samples,
                                  hint=f"use {opt('min_proto_samples', most)} or less")

    def setup_warnings(self, cfg: Any) -> list[str]:
        """``dp_reproducible_noise``: ignored without ``dp``; under ``dp`` the noise no longer
        protects against whoever knows the seed."""
        if not self.dp_reproducible_noise:
            return []
        if self.dp == "off":
            return ["dp_reproducible_noise: ignored, it acts with dp prototypes or full only"]
        return ["dp_reproducible_noise: the DP noise is drawn from the run's seed, so the privacy guarantee does not "
                "hold against anyone who knows the seed (use it for reproducible experiments only)"]

    def divergence_hint(self, cfg: Any) -> str:
        from fedproto.errors import opt

        out = f" or {opt('lambda_proto')} (now {self.lambda_proto})" if self.lambda_proto > 0 else ""
        if self.dp != "off":
            out += f", or {opt('dp_noise')} (now {self.dp_noise:g}) or {opt('dp_clip')} (now {self.dp_clip:g})"
        if getattr(cfg, "attackers", 0) and not self.class_check:
            if self.aggregation in ("mean", "weighted") and not self.exclude_outliers:
                out += (f"; with misbehaving clients ({opt('attack')}) the mean follows their prototypes: use "
                        f"{opt('aggregation', 'median')}, {opt('aggregation', 'trimmed')}, {opt('exclude_outliers')} "
                        f"or {opt('class_check', 3)}")
            else:
                out += (f"; with misbehaving clients ({opt('attack')}), where half of a class's senders misbehave the "
                        f"median, the trimmed mean and {opt('exclude_outliers')} follow them: {opt('class_check', 3)} "
                        "checks each prototype against the last global prototypes instead")
        return out

    def attack_fix(self, cfg: Any) -> str:
        """'' under ``mean``/``weighted`` without exclusion (:meth:`divergence_hint` names the robust
        rules already); else that the robust rule in force did not hold the attackers off."""
        from fedproto.errors import opt

        if self.aggregation in ("mean", "weighted") and not self.exclude_outliers:
            return ""
        rule = opt("aggregation", self.aggregation) + (f" with {opt('trim', self.trim)}"
                                                       if self.aggregation == "trimmed" else "")
        return (f"{rule}" + (f" and {opt('exclude_outliers', self.exclude_outliers)}" if self.exclude_outliers
                             else "") + f" did not hold them off: raise {opt('trim')} (trimmed), add "
                f"{opt('exclude_outliers')}, or lower {opt('attackers')}")

    def blowup_causes(self, cfg: Any) -> list[str]:
        """With ``dp``: the DP noise."""
        if self.dp == "off":
            return []
        return [f"the DP noise (dp_noise={self.dp_noise:g}, dp_clip={self.dp_clip:g}: the noise added to "
                "prototypes grows with both)"]

    def summary_entries(self, cfg: Any, per_client: list[dict[str, Any]]) -> dict[str, Any]:
        """``privacy`` under DP: the mode, noise, clips, delta, the clients' largest and mean ε (from
        their reports; under Flower NaN for a node that did not answer, none under ``dp=full``:
        each node keeps its own), the accountant and the neighbouring relation."""
        if self.dp == "off":
            return {}
        eps = [m["dp_epsilon"] for m in per_client if m.get("dp_epsilon", math.nan) == m.get("dp_epsilon")]
        privacy: dict[str, Any] = {
            "mode": self.dp, "noise_multiplier": self.dp_noise, "embedding_clip": self.dp_clip,
            "grad_clip": self.dp_grad_clip if self.dp == "full" else None, "delta": self.dp_delta,
            "epsilon_max": float(max(eps)) if eps else None, "epsilon_mean": float(np.mean(eps)) if eps else None,
            "accountant": "Opacus RDP (subsampled Gaussian per DP-SGD step, Gaussian per prototype release)",
            "neighbouring": "one training sample of a client added or removed, its label set unchanged (the label set "
                            "is public)" + ("; for a fixed feature extractor (the extractor's training is not covered)"
                                            if self.dp == "prototypes" else ""),
            "noise": "seeded by the run's seed (dp_reproducible_noise: no guarantee against whoever knows the seed)"
                     if self.dp_reproducible_noise else "the operating system's secure randomness",
        }
        if not eps:
            privacy["epsilon_note"] = ("each node logs its own epsilon: under dp=full it depends on the node's sample "
                                       "count, which the node does not send")
        return {"privacy": privacy}
