"""In-process executors: the clients' models and data live in this process (:class:`~fedproto.engine.setup.Setup`).

The client step every executor composes from the algorithm's client part is :func:`client_step`;
:func:`custom_step` says when a method replaced it (docs/architecture.md, "Client part").

:class:`SequentialExecutor` trains one client after another with :func:`client_step`, the
reference every other executor is checked against (float64 equivalence tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fedproto.algorithms.algorithm import Algorithm, ClientData, ClientState, Message
from fedproto.engine.client_store import StoredClientState, borrowed, transient_modules
from fedproto.engine.executors.executor import ClientCheckpoint, Executor, RoundReplies
from fedproto.engine.seeding import client_rng, client_seed
from fedproto.engine.setup import Setup
from fedproto.models.proto_model import count_parameters
from fedproto.training import TrainResult


def client_step(alg: Algorithm, state: ClientState, message: Message, data: ClientData, seed: int,
                round: int) -> tuple[Message, TrainResult]:
    """One client's step in ``round``, as every executor runs it (the sequential executor, the
    Flower ClientApp, onboarding): torch's generator seeded by :func:`~fedproto.engine.seeding.client_seed`
    and the client's numpy generator :func:`~fedproto.engine.seeding.client_rng`, then
    :meth:`Algorithm.client_update` with the round's optimiser settings (``opt``: the round's
    learning rate; the algorithm's own ``opt`` is left as it is). Returns the client's message and its
    :class:`~fedproto.training.TrainResult`."""
    torch.manual_seed(client_seed(seed, round, state.cid))
    opt = alg.opt.at_round(round)  # the round's lr (lr_schedule), passed in on every executor
    return alg.client_update(state, message, data, round, client_rng(seed, round, state.cid), opt=opt)


def custom_step(alg: Algorithm) -> bool:
    """True when ``alg`` overrides :meth:`~fedproto.algorithms.algorithm.ClientPart.client_update`, the
    whole client step: only :func:`client_step` can honour it, so a batched executor sends its
    clients down that path (and says so once)."""
    from fedproto.algorithms.algorithm import ClientPart

    return getattr(type(alg), "client_update", None) is not ClientPart.client_update


class LocalExecutor(Executor):
    """An executor over a :class:`Setup` held in this process (base of the sequential and batched
    executors): evaluation, join messages, client rows and checkpoint state come from the set-up.

    Args:
        setup: the run's set-up (clients' states and data, the algorithm).
        seed: the run's seed (each client's randomness derives from it, :mod:`fedproto.engine.seeding`).
    """

    def __init__(self, setup: Setup, seed: int):
        self.setup, self.seed = setup, seed
        self.num_clients = len(setup.states)

    def available(self, round: int) -> list[int]:
        return list(range(self.num_clients))

    def join_messages(self) -> dict[int, Message]:
        alg = self.setup.algorithm
        out = {}
        for s in self.setup.states:
            with borrowed(s):  # a stored client's model is bound for the call only (store.py)
                out[s.cid] = alg.join_message(s)
        return out

    def initial_message(self, algorithm: Algorithm) -> Message:
        """:meth:`Algorithm.initial_message` of the clients' states (what the join messages would give; a
        weight-sharing method's architecture check then names the clients by their models)."""
        with transient_modules(self.setup.states):  # stored clients: no module kept per client (store.py)
            return algorithm.initial_message(self.setup.states)

    def train(self, round: int, sent: dict[int, Message],
              downlink: Callable[[int], Message] | None = None) -> RoundReplies:
        return RoundReplies(self.train_clients(round, sent), sent)

    def train_clients(self, round: int, sent: dict[int, Message]) -> dict[int, tuple[Message, TrainResult]]:
        """Client id -> (message, TrainResult) of one round (the sequential reference)."""
        alg, S, D = self.setup.algorithm, self.setup.states, self.setup.data
        out = {}
        for i in sent:
            with borrowed(S[i]):
                out[i] = client_step(alg, S[i], sent[i], D[i], self.seed, round)
        return out

    def evaluate(self, messages: dict[int, Message]) -> list[dict[str, float]]:
        alg, S, D = self.setup.algorithm, self.setup.states, self.setup.data
        out = []
        for i in range(self.num_clients):
            with borrowed(S[i]):
                out.append(alg.evaluate(S[i], messages[i], D[i]))
        return out

    def client_report(self, cid: int) -> dict[str, float]:
        return self.setup.algorithm.client_report(self.setup.states[cid])

    def left_out(self, history: list[dict[str, Any]], rounds: int) -> dict[int, str]:
        """Clients left out of the headline accuracy, and why: those whose test inputs, read from a
        Dataset, held NaN or inf in an item when read at evaluation, not when set-up read it
        (:data:`fedproto.federation.own_data.NAN_SCAN_ITEMS`; the items are in ``bad`` of its inputs)."""
        out: dict[int, str] = {}
        for i, d in enumerate(self.setup.data):
            bad = getattr(d.held_test_x, "bad", None)
            if bad:
                j = min(bad)
                out[i] = (f"its test data hold NaN or infinite values ({len(bad)} item(s), first item {j}'s {bad[j]}); "
                          "clean or drop them")
        return out

    def client_rows(self) -> list[dict[str, Any]]:
        rows = []
        for i, s in enumerate(self.setup.states):
            with borrowed(s) as m:
                rows.append({"client": i, "ways": len(s.classes), "classes": " ".join(map(str, s.classes)),
                             "train_samples": len(self.setup.data[i].y), "test_samples": len(self.setup.data[i].test_y),
                             "params": count_parameters(m)})
        return rows

    @property
    def precision_in_use(self) -> str:
        """The precision the clients train in (``fp32``, ``bf16`` or ``fp16``: the ``precision`` option
        resolved on the run's device by :func:`fedproto.engine.setup.build_setup`)."""
        return self.setup.algorithm.opt.precision

    def config_record(self) -> dict[str, Any]:
        return {"batch_size_in_force": int(self.setup.algorithm.opt.batch_size),
                "device_in_use": str(self.setup.device), "precision_in_use": self.precision_in_use,
                "partition_summary": self.setup.partition.summary()}

    def client_states(self) -> list[ClientCheckpoint]:
        return [{"model": s.row_store.state_dict(s.cid) if isinstance(s, StoredClientState) and not s.materialized
                 else s.model.state_dict(), "extra": dict(s.extra)} for s in self.setup.states]

    def restore_clients(self, states: list[ClientCheckpoint]) -> None:
        for s, c in zip(self.setup.states, states):
            if isinstance(s, StoredClientState) and not s.materialized:
                s.row_store.load_state_dict(s.cid, c["model"])
            else:
                s.model.load_state_dict(c["model"])
            s.extra = dict(c["extra"])

    def data_fingerprint(self) -> list[list[int]]:
        return [[len(d.y), len(d.test_y), int(d.y.sum()), int(d.test_y.sum())] for d in self.setup.data]


class SequentialExecutor(LocalExecutor):
    """One client after another (:func:`client_step`): the reference executor."""

    execution = "sequential"
