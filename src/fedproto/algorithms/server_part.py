"""The server strategy of a method (docs/architecture.md, "Algorithm"): :class:`ServerPart`, the
hooks the round loop calls on the server, which sees messages only. :class:`fedproto.algorithms.algorithm.Algorithm`
joins it with the client part (:class:`fedproto.algorithms.algorithm.ClientPart`).

``ServerPart`` is an abstract base (as Flower's ``Strategy``): :meth:`ServerPart.aggregate` must be
implemented, every other hook has a default. It imports no client code (no model, no training) and
is usable alone: ``MyStrategy(freeze_after=0).aggregate(1, {cid: reply, ...})``.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from fedproto.algorithms.server_state import Message, ServerState


class ServerPart(abc.ABC):
    """The server strategy of an algorithm: what runs on the server, which sees messages only,
    never a client's state, model or data (docs/architecture.md, "Algorithm").

    Args:
        freeze_after: two-stage training (the ``freeze_after`` run option): after this round the
            server's messages carry ``head_only`` (:meth:`broadcast`); 0: off. The run's value is
            passed by :meth:`fedproto.algorithms.algorithm.Algorithm.from_config`; the engine writes
            nothing onto the object.

    Hooks: :meth:`initial_message_from` (the first broadcast from the clients' join messages),
    :meth:`aggregate` (the round's checked replies and the previous
    :class:`~fedproto.algorithms.server_state.ServerState` into the next one: message, metrics, alerts,
    checkpoint, run-folder files), :meth:`resume_state` (that state from a checkpoint),
    :meth:`broadcast` and :meth:`downlink` (what each client receives), the reply checks the engine
    runs before aggregating (:meth:`reply_problem`, :meth:`reply_problems`, :meth:`message_problem`),
    what the summary says (:meth:`eval_protocols`, :meth:`summary_entries`) and the checks and
    words of a whole federation (:meth:`check_setup`, :meth:`divergence_hint`, :meth:`attack_fix`,
    :meth:`blowup_causes`). Nothing the engine reads is kept on ``self``: what a round produced
    is the returned state.

    ``cfg`` in the set-up hooks is the run's :class:`fedproto.config.run_config.RunConfig` (typed ``Any``: the
    config is a layer above the methods and is composed at run time with the plug-ins' options).
    A message is ``dict[str, numpy.ndarray]`` both ways.
    """

    name: str = "base"
    """The method's registry name (the words of its errors and warnings)."""

    freeze_after: int = 0
    """Two-stage training: after this round only the head trains (:meth:`broadcast` adds
    ``head_only``); 0: off. Set by the constructor argument of the same name."""

    def __init__(self, *, freeze_after: int = 0) -> None:
        self.freeze_after = int(freeze_after)

    def check_setup(self, cfg: Any, train_labels: list[np.ndarray]) -> None:
        """Refuse a set-up this algorithm cannot use (raise ``ConfigError``), given the run's
        config and each client's (n_i,) training labels; called before round 1. Default: none."""
        return None

    def setup_warnings(self, cfg: Any) -> list[str]:
        """Warnings about this method's options the engine logs once before round 1, each one
        sentence naming the option (default: none)."""
        return []

    def divergence_hint(self, cfg: Any) -> str:
        """Options of this algorithm that can make training diverge, worded for the error the
        engine raises on a non-finite loss (called then only, by the ``Health`` observer; default:
        none)."""
        return ""

    def attack_fix(self, cfg: Any) -> str:
        """What to change when simulated misbehaving clients (``attack``) made an honest client
        diverge, worded for the engine's error ('' : nothing beyond the generic advice); called
        only when that error is raised."""
        from fedproto.errors import opt

        return (f"lower {opt('attack_scale')} or {opt('attackers')}, or run {opt('algorithm', 'fedproto')} with "
                f"{opt('aggregation', 'median')}")

    def blowup_causes(self, cfg: Any) -> list[str]:
        """This method's options that can make embeddings explode, each worded as a cause to
        check, named first in the engine's warning when embedding norms grow (default: none)."""
        return []

    def reply_problems(self, cid: int, message: Message) -> tuple[Message, list[str]]:
        """Validate client ``cid``'s reply before aggregation (each round, per reply, after
        :meth:`reply_problem` found the reply as a whole right): returns the reply with its bad parts
        dropped (``{}``: nothing usable; e.g. FedProto drops (K,) rows of ``classes``/``protos``
        (K, d)/``counts``) and one reason per dropped part; the engine logs them. Default:
        everything kept."""
        return message, []

    def message_problem(self, message: Message, embedding_dim: int) -> str:
        """What is wrong with a stored server message of this algorithm ('' if nothing), given d
        (``embedding_dim``); called on a resume, for the checkpoint's message. The engine checks
        types, finiteness and shapes against the first message itself. Default: nothing."""
        return ""

    def reply_problem(self, reply: Message, sent: Message, embedding_dim: int) -> str:
        """What is wrong with a client's reply ('' if nothing), checked by the engine before
        :meth:`aggregate` (a bad reply is dropped and logged, never aggregated).

        Args:
            reply: the client's message. The engine has checked already that it is a dict of
                numeric numpy arrays.
            sent: what this client received this round (:meth:`downlink`): the shapes a reply of
                weights must have.
            embedding_dim: d, the prototype size.
        Default: a reply must be empty (the algorithm sends nothing up).
        """
        return f"unexpected entries {sorted(reply)[:5]} (this algorithm sends nothing)" if reply else ""

    def initial_message_from(self, joins: dict[int, Message]) -> Message:
        """The server's first broadcast (before :meth:`broadcast` adds the round's entries) from the
        clients' join messages (``ClientPart.join_message``), keyed by client id, in increasing id
        order: each a ``dict[str, numpy.ndarray]`` (weight sharing: the client's initial weights).
        Called once before round 1 (on Flower, from the nodes' query replies). Default: empty. Lets a
        server that holds no client model (Flower) start."""
        return {}

    @abc.abstractmethod
    def aggregate(self, round: int, messages: dict[int, Message],
                  state: ServerState | None = None) -> ServerState | Message:
        """Combine the round's checked client messages, keyed by client id (with client sampling,
        the sampled clients only, in increasing id order), into the next server state.

        Contract: the server sees messages only, never a client's state, model or data
        (docs/architecture.md). Everything the round produces is returned, nothing is left on
        ``self`` for the engine to read back.

        Args:
            round: the round (1-based). messages: client id -> its reply.
            state: the previous :class:`~fedproto.algorithms.server_state.ServerState` (the initial
                message's before round 1; after a resume :meth:`resume_state`'s).
        Returns:
            A :class:`~fedproto.algorithms.server_state.ServerState` (the next message, the round's
            metrics entries, health alerts, the checkpoint, run-folder files), or, for a method with
            nothing else to keep, the next message alone (a plain dict; see
            :func:`~fedproto.algorithms.server_state.as_state`).
        """
        raise NotImplementedError

    def resume_state(self, message: Message, checkpoint: dict[str, Any]) -> ServerState:
        """The :class:`~fedproto.algorithms.server_state.ServerState` after a checkpoint's round, from its
        server message and its ``server_state`` (the ``checkpoint`` a :meth:`aggregate` returned);
        called once on a resume, before the first round run.
        Default: the message and the checkpoint as they are. A method that needs entries of the
        checkpoint raises ``KeyError`` when they are missing."""
        return ServerState(message, checkpoint=dict(checkpoint))

    def summary_entries(self, cfg: Any, per_client: list[dict[str, Any]]) -> dict[str, Any]:
        """Entries this algorithm adds to ``summary.json`` (e.g. FedProto's ``privacy`` block), given
        the run's options and the final per-client metrics (one dict of numbers per client, in
        client order); called once after the last round (default: none)."""
        return {}

    def broadcast(self, round: int, message: Message) -> Message:
        """The server message for round ``round`` (1-based), called once a round before the
        downlinks: ``message`` (from :meth:`initial_message_from` or :meth:`aggregate`) plus
        ``head_only`` ((1,) int8, ones) in the second stage, rounds after :attr:`freeze_after`."""
        if self.freeze_after and round > self.freeze_after:
            return {**message, "head_only": np.ones(1, np.int8)}
        return message

    def downlink(self, message: Message, cid: int) -> Message:
        """What client ``cid`` receives of the server message (default: all of it); called each
        round for every sampled client, after :meth:`broadcast`. The engine counts downlink cost
        from this per-client view (FeSEM sends each client its own centre)."""
        return message

    def eval_protocols(self) -> dict[str, str]:
        """What each accuracy key of :meth:`evaluate` scores (``summary.json``'s ``evaluation``):
        key -> one sentence; called once when the run's summary is written. Default: ``acc``, the
        personal protocol."""
        return {"acc": "personal: each client's own model after its local training of the last round, on the "
                       "client's own test set"}
