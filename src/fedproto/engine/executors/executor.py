"""The executor seam (docs/architecture.md, "Executor"): what runs the client step of a round's clients.

The round loop (:mod:`fedproto.engine.loop`) never trains a client itself: it hands the round's
sampled clients and their downlink messages to an :class:`Executor` and gets their replies back.
Executors: :class:`~fedproto.engine.executors.in_process.SequentialExecutor` (one client after
another: the reference), :class:`~fedproto.engine.executors.batched.BatchedExecutor` (clients of
one architecture as one batched computation, optionally on worker processes; it must match the
reference in float64) and :class:`fedproto.flower.flower_executor.FlowerExecutor` (each client on its
own SuperNode; it must give the simulator's numbers for the same clients and seed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch

from fedproto.algorithms.algorithm import Algorithm, Message
from fedproto.training import TrainResult


class ClientCheckpoint(TypedDict):
    """One client's state in a checkpoint (:meth:`Executor.client_states`)."""

    model: dict[str, torch.Tensor]  # its model's state dict
    extra: dict[str, Any]  # ClientState.extra


@dataclass
class RoundReplies:
    """What an executor returns for one round.

    Attributes:
        replies: client id -> (its message, its :class:`~fedproto.training.TrainResult`), for the
            clients that replied (``TrainResult`` losses are None where a node sends none, under DP).
        sent: client id -> the downlink message it was sent: the round's, plus those of clients an
            executor asked in addition (Flower's retry of a round below ``min-replies``).
        status: extra entries of the round's metrics row describing delivery (Flower: ``sampled``,
            ``replied``, ``failed``, ``unavailable``, ``timed_out``, ``rejoined``); empty in-process.
    """

    replies: dict[int, tuple[Message, TrainResult]]
    sent: dict[int, Message]
    status: dict[str, Any] = field(default_factory=dict)


class Executor:
    """Runs the client side of a federation for the round loop.

    Subclasses implement :meth:`train` and :meth:`evaluate`; the others have in-process defaults
    in :class:`~fedproto.engine.executors.in_process.LocalExecutor`.

    Attributes:
        num_clients: m, the clients of the federation (ids ``0..m-1``).
        execution: how clients train, for ``summary.json`` (``sequential``, ``batched``, ``flower``).
        processes: processes that trained clients (``summary.json``'s ``processes``).
        membership_changes: True when clients may join during the run (Flower): the run folder's
            ``config.json`` is then rewritten with :meth:`config_record` after every evaluation.
    """

    num_clients: int = 0
    execution: str = "sequential"
    processes: int = 1
    membership_changes = False

    def available(self, round: int) -> list[int]:
        """The sorted ids of the clients that can take part in ``round`` (the loop samples
        ``participation`` of them)."""
        raise NotImplementedError

    def join_messages(self) -> dict[int, Message]:
        """Each client's :meth:`~fedproto.algorithms.algorithm.Algorithm.join_message`, by client id
        (the server builds its first broadcast from them)."""
        raise NotImplementedError

    def initial_message(self, algorithm: Algorithm) -> Message:
        """The server's first broadcast before :meth:`~fedproto.algorithms.algorithm.Algorithm.broadcast`:
        :meth:`~fedproto.algorithms.algorithm.Algorithm.initial_message_from` of the :meth:`join_messages`."""
        return algorithm.initial_message_from(self.join_messages())

    def train(self, round: int, sent: dict[int, Message],
              downlink: Callable[[int], Message] | None = None) -> RoundReplies:
        """Run the client step of round ``round`` for the clients in ``sent`` (client id -> its
        downlink message) and return their replies. ``downlink(cid)``: the message of a client the
        executor asks in addition (Flower's retry of a round below ``min-replies``)."""
        raise NotImplementedError

    def evaluate(self, messages: dict[int, Message]) -> list[dict[str, float]]:
        """Per-client metrics, a list indexed by client id (NaN for a client that could not be
        evaluated); ``messages`` maps every client id to its downlink view of the server message."""
        raise NotImplementedError

    def client_report(self, cid: int) -> dict[str, float]:
        """What client ``cid`` reports about itself for ``clients.csv`` (e.g. its ε)."""
        return {}

    def client_rows(self) -> list[dict[str, Any]]:
        """Per client, in id order: ``client``, ``ways``, ``classes``, ``train_samples``,
        ``test_samples``, ``params`` (None where unknown)."""
        raise NotImplementedError

    def config_record(self) -> dict[str, Any]:
        """What ``config.json`` holds besides the options (set-up in force, partition, nodes)."""
        return {}

    def who(self, cid: int) -> str:
        """How logs name client ``cid``."""
        return f"client {cid}"

    def client_states(self) -> list[ClientCheckpoint] | None:
        """The clients' state for a checkpoint (model state dict and extras per client), or None
        where the clients keep their own state (Flower nodes)."""
        return None

    def restore_clients(self, states: list[ClientCheckpoint]) -> None:
        """Load :meth:`client_states` from a checkpoint. Raises ``KeyError``/``RuntimeError`` when
        they do not fit."""

    def data_fingerprint(self) -> list[list[int]] | None:
        """Per client: train and test sample counts and label sums (a resumed run must have the
        interrupted one's data), or None where the server cannot know them."""
        return None

    def close(self) -> None:
        """Release what the executor holds (worker processes); never raises."""
