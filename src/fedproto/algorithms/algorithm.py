"""The algorithm seam (docs/architecture.md, "Algorithm"): a method is an :class:`Algorithm`, its
client part (:class:`ClientPart`, here) and its server strategy (:class:`ServerPart`,
:mod:`fedproto.algorithms.server_part`), with the client's data and state (:class:`ClientData`,
:class:`ClientState`, :mod:`fedproto.algorithms.client_types`, re-exported here).

An algorithm never knows which engine runs it. Messages are ``dict[str, numpy.ndarray]``; their
size is the communication cost (:func:`message_size`). Client state (the personal model) never
leaves the client.

:meth:`Algorithm.client_update` is the reference composition of the client step
(``prepare`` -> ``objective`` -> local training -> ``finish``); the simulation engine may run the
training part of many clients at once (:func:`fedproto.training.train_group`) between the same
``prepare``/``finish`` calls, so both paths share every algorithm-specific line.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from fedproto.algorithms.client_types import ClientData as ClientData  # re-exported: the client part's data types
from fedproto.algorithms.client_types import ClientState as ClientState
from fedproto.algorithms.client_types import Message as Message
from fedproto.algorithms.client_types import SharedInputs as SharedInputs
from fedproto.algorithms.client_types import message_size as message_size
from fedproto.algorithms.requirements import ONE_EMBEDDING
from fedproto.algorithms.server_part import ServerPart
from fedproto.algorithms.server_state import Alert, ServerState  # noqa: F401 (re-exported for methods)
from fedproto.models.proto_model import ProtoModel
from fedproto.prototypes import embedding_health
from fedproto.training import (
    Objective,
    OptimConfig,
    Phase,
    TrainResult,
    frozen_params,
    make_plan,
    min_batch,
    predict,
    respect_frozen,
    train_client,
)
from fedproto.training.plans import Plan

if TYPE_CHECKING:
    from fedproto.plugins import AlgorithmOptions


HEALTH_KEYS = ("emb_norm", "nonfinite")
"""Per-client evaluation entries that describe the outputs, not a test accuracy
(:func:`fedproto.prototypes.embedding_health`): kept in ``clients.csv``, left out of the
accuracy summary."""


def optim_config(cfg: Any) -> OptimConfig:
    """The :class:`OptimConfig` of a run configuration."""
    # optimizer and lr schedule fields (the round is set per round with OptimConfig.at_round)
    return OptimConfig(cfg.lr, cfg.momentum, cfg.weight_decay, cfg.batch_size, cfg.drop_last,
                       augment=bool(getattr(cfg, "augment", False)), optimizer=cfg.optimizer,
                       lr_schedule=cfg.lr_schedule, lr_step_rounds=cfg.lr_step_rounds, lr_gamma=cfg.lr_gamma,
                       lr_min=cfg.lr_min, rounds=cfg.rounds)


class ClientPart(abc.ABC):  # noqa: B024 (every client hook has a default: nothing must be implemented)
    """The client part of an algorithm: what runs where the client's data is (the simulator's
    executors, a Flower node). It sees one client's state (:class:`ClientState`), the server's
    message to it and its data; it sends the server messages only.

    Hooks, in the order of a round: :meth:`prepare` (apply the server message, e.g. load global
    weights), :meth:`local_objective` (:meth:`objective` plus the two-stage and frozen-parameter
    rules), :meth:`plan` (the client's batches), training (an executor's), :meth:`finish` (the
    client's message); :meth:`client_update` composes them for one client. :meth:`evaluate` and
    :meth:`full_test_metrics` score the client's model; :meth:`join_message` is what a client sends
    when it joins; :meth:`client_report` what it reports about itself; :meth:`check_models` refuses
    models its options cannot train; :meth:`include` names the tensors it shares.

    An abstract base whose hooks all have a default (the client part of Local, which trains with
    cross-entropy and sends nothing); usable alone, without a server strategy:
    ``ClientPart(num_classes, opt, local_epochs).client_update(state, {}, data, 1, rng)``.

    Args:
        num_classes: C, the size of the label space. opt: the optimiser settings
            (:class:`~fedproto.training.OptimConfig`; the round's learning rate is passed to
            :meth:`client_update`). local_epochs: epochs of local training a round.
        freeze_after: two-stage training; the client part reads it only to refuse models with no
            known head (:meth:`check_models`); the stage itself comes in the message (``head_only``).
    """

    name: str = "base"
    """The method's registry name (the words of its errors and warnings)."""

    num_classes: int
    """C, the size of the label space (constructor argument)."""

    opt: OptimConfig
    """The optimiser settings (constructor argument; the set-up caps the batch size and sets the
    precision before round 1; the round's learning rate is passed to :meth:`client_update`)."""

    local_epochs: int
    """Epochs of local training a round (constructor argument)."""

    _said_trains_nothing: bool = False
    """Whether the log said once that the objective trains nothing (:meth:`local_objective`)."""

    freeze_after: int = 0
    """Two-stage training (practitioner's guide §4.3): after this round only the head trains (the
    server's messages carry ``head_only``); 0: off. The constructor argument of the same name."""

    def __init__(self, num_classes: int, opt: OptimConfig, local_epochs: int = 1, *, freeze_after: int = 0) -> None:
        self.num_classes = num_classes
        self.opt = opt
        self.local_epochs = local_epochs
        self.freeze_after = int(freeze_after)

    def include(self, model: ProtoModel) -> Callable[[str], bool] | None:
        """Which of ``model``'s tensors this method shares, as a predicate on their names (None:
        all of them). Called at set-up, on the first client's model, for the architecture check of
        a method whose ``model_needs`` is one architecture (the tensors compared), and by
        weight-sharing methods for their messages. Default: None."""
        return None

    def check_models(self, models: list[ProtoModel]) -> None:
        """Refuse client models this algorithm's options cannot train (raise ``ConfigError`` naming
        the clients); called before round 1. Default: with ``freeze_after``, every model needs a
        known head (:meth:`ProtoModel.is_head_param`)."""
        if self.freeze_after:
            headless = [i for i, m in enumerate(models) if not any(m.is_head_param(n) for n, _ in m.named_parameters())]
            if headless:
                from fedproto.errors import ConfigError

                raise ConfigError(f"freeze_after={self.freeze_after} trains the head alone, but the models of clients "
                                  f"{headless[:10]} name no head layer; give their head (fedproto.federation.Client"
                                  "(head=...)) or use freeze_after=0")

    def client_report(self, state: ClientState) -> dict[str, float]:
        """Per-client numbers kept by the client itself for ``clients.csv`` (e.g. privacy spent),
        name -> float; called once after the last round for the summary (on Flower, by the node
        with each evaluation). Default: none."""
        return {}

    def join_message(self, state: ClientState) -> Message:
        """What a client contributes to the server's first broadcast, sent once when it joins
        (default: nothing; weight-sharing methods: its initial weights)."""
        return {}

    def prepare(self, state: ClientState, message: Message) -> None:
        """Apply the server message to the client before training (e.g. load global weights).
        Called once a round per sampled client, before :meth:`local_objective`. Default: nothing."""
        return None

    def objective(self, state: ClientState, message: Message) -> Objective:
        """The local objective for this round, called once a round per sampled client after
        :meth:`prepare` (through :meth:`local_objective`), ``message`` being its downlink
        (default: cross-entropy, ``local_epochs``)."""
        return Objective(phases=[Phase(self.local_epochs)])

    def local_objective(self, state: ClientState, message: Message) -> Objective:
        """:meth:`objective` as every engine uses it: in the second stage (``head_only`` in the
        message, :meth:`broadcast`) each phase trains the head's parameters only; parameters the
        user froze (``requires_grad=False``, :func:`fedproto.training.frozen_params`) never train.

        Raises:
            ConfigError: the method's objective is malformed
                (:meth:`fedproto.training.objective.Objective.problem`), naming the method. An
                objective with no loss at all is logged once per run (the model is not trained).
        """
        obj = self.objective(state, message)
        why = (obj.problem() if isinstance(obj, Objective)
               else f"objective() returned {type(obj).__name__}, not an Objective")
        if why:
            from fedproto.errors import ConfigError

            raise ConfigError(f"method {self.name!r}: {why}")
        if obj.trains_nothing() and not self._said_trains_nothing:
            import logging

            self._said_trains_nothing = True
            logging.getLogger(__name__).warning(
                "method %r: client %d's objective has no loss this round (no classification loss, no term, no anchor): "
                "its model is not trained (said once per run)", self.name, state.cid)
        if "head_only" in message:
            head = state.model.is_head_param

            def head_of(t: Callable[[str], bool] | None) -> Callable[[str], bool]:
                def trains(n: str) -> bool:  # the head's parameters among those the phase trains
                    return head(n) and (t is None or t(n))

                return trains

            obj.phases = [Phase(p.epochs, head_of(p.trains), frozen_eval=True) for p in obj.phases]
        return respect_frozen(obj, frozen_params(state.model))

    def finish(self, state: ClientState, message: Message, data: ClientData, result: TrainResult) -> Message:
        """The client's reply after local training (each round, per sampled client): a
        ``dict[str, numpy.ndarray]`` (FedProto: ``classes`` (K,) int64, ``protos`` (K, d) float32,
        ``counts`` (K,)). ``result``: the :class:`~fedproto.training.TrainResult` (losses, steps;
        per-class embedding sums (C, d) and counts (C,) when the objective ``collect`` s). Default:
        the empty message (the client sends nothing)."""
        return {}

    def plan(self, state: ClientState, obj: Objective, n: int, rng: np.random.Generator) -> Plan:
        """The client's batch plan for this round (:func:`fedproto.training.make_plan` with its
        model's dropout masks and trailing-batch rule) over its ``n`` samples, drawn from ``rng``
        (the client's seeded generator of the round); called after :meth:`local_objective`, and
        every execution path takes it from here."""
        m = state.model
        return make_plan(n, obj.phases, self.opt, m.noise_widths(), m.dropout, rng, min_batch(m, self.opt.batch_size))

    def client_update(
        self, state: ClientState, message: Message, data: ClientData, round: int, rng: np.random.Generator,
        opt: OptimConfig | None = None,
    ) -> tuple[Message, TrainResult]:
        """The whole client step: :meth:`prepare`, :meth:`local_objective`, :meth:`plan`, training
        on the sequential path (:func:`fedproto.training.train_client`), :meth:`finish`.

        Contract: a method that overrides it replaces the client step everywhere; the batched
        executors then train its clients one after another (logged once), so the override runs
        on every executor. Override the smaller hooks instead to keep batched training.

        Args:
            state: the client's state. message: its downlink message. data: its data.
            round: the round (1-based). rng: the client's generator of this round.
            opt: the round's optimiser settings (its learning rate, :meth:`OptimConfig.at_round`),
                passed in by the executor; None: this algorithm's ``opt`` at ``round``.
        Returns:
            The client's reply message and its :class:`~fedproto.training.TrainResult`.
        """
        opt = opt if opt is not None else self.opt.at_round(round)
        self.prepare(state, message)
        obj = self.local_objective(state, message)
        res = train_client(state.model, data.x, data.y, self.plan(state, obj, len(data.y), rng), obj, opt)
        return self.finish(state, message, data, res), res

    def full_test_metrics(self, state: ClientState, message: Message, logits: torch.Tensor, h: torch.Tensor,
                          y: torch.Tensor) -> dict[str, float]:
        """Scores of a client's model on a test set of all classes (the full test split) from its
        outputs: logits (N, C), embeddings h (N, d), labels y (N,). Default: classifier accuracy
        (argmax over all C classes), in [0, 1]."""
        return {"acc": float((logits.argmax(1) == y).to(torch.float64).mean()) if len(y) else float("nan")}

    def evaluate(self, state: ClientState, message: Message, data: ClientData) -> dict[str, float]:
        """Classifier accuracy (argmax of the (n_test, C) logits) on the client's own test set, in
        [0, 1], and the outputs' health (:data:`HEALTH_KEYS`); called every ``eval_every`` rounds
        and after the last, with the round's server message."""
        logits, h = predict(state.model, data.test_x)
        n = len(data.test_y)
        acc = float((logits.argmax(1) == data.test_y).float().mean()) if n else float("nan")
        return {"acc": acc, **embedding_health(h, logits)}


class Algorithm(ClientPart, ServerPart):
    """A method: its name, its options and its two parts (:class:`ClientPart`, :class:`ServerPart`).
    A method's module subclasses this and overrides the hooks of either part; the executors call
    the client part only, the round loop the server part only. :meth:`ServerPart.aggregate` is
    abstract: a method without it cannot be instantiated (TypeError naming it).

    Attributes:
        name: registry name. shares_weights: True if messages carry model weights (such
            algorithms refuse heterogeneous client models).
    """

    name = "base"

    Options: ClassVar[type[AlgorithmOptions] | None] = None
    """The algorithm's own options (:class:`fedproto.plugins.AlgorithmOptions`; the library's methods:
    :mod:`fedproto.algorithms.method_options`), which become run options (flags, TOML keys, keywords);
    :meth:`from_config` fills ``self.options``."""

    options: Any = None
    """The values of :attr:`Options` (with those of the methods it subclasses,
    :func:`fedproto.plugins.method_options`) for this run, set by :meth:`from_config`; None for a
    method without options. Typed ``Any``: each method reads the fields of its own options model
    (the library's methods read their options here only, never from the run config)."""

    embedding_dim: int = 0
    """d, the clients' embedding size (the prototype size), given to :meth:`from_config`."""

    model_needs: ClassVar[str] = ONE_EMBEDDING
    """What the clients' models must share (:mod:`fedproto.algorithms.requirements`: one of
    ``NEEDS``), checked at set-up before round 1 on every front end (and by a Flower node for its
    embedding size). Default: one embedding size."""

    shares_weights: ClassVar[bool] = False
    """True if messages carry model weights (such algorithms refuse heterogeneous client models)."""

    sequential_only: bool = False
    """True when the client step cannot join the batched path (e.g. DP-SGD's per-sample gradients)."""

    secure_sum: ClassVar[str | None] = None
    """What secure aggregation (``secagg``) sums for this method, whose server step is then a
    function of the sum of the replies: ``"prototypes"`` (FedProto's per-class sums and counts) or
    ``"weights"`` (FedAvg's sample-weighted shared weights); None: the server step needs each reply
    (``secagg`` is refused). Holds for a subclass only while it keeps the declaring class's
    ``aggregate`` (:func:`fedproto.secagg.codec.secure_sum_of`)."""

    seed: int = 0
    """The run's seed (``seed`` option, given to :meth:`from_config`): see :meth:`generator`."""

    def __init__(self, num_classes: int, opt: OptimConfig, local_epochs: int = 1, *, freeze_after: int = 0) -> None:
        ClientPart.__init__(self, num_classes, opt, local_epochs, freeze_after=freeze_after)
        ServerPart.__init__(self, freeze_after=freeze_after)

    def initial_message(self, states: list[ClientState]) -> Message:
        """The server's first broadcast, built in-process from the clients' states (the simulator;
        both parts in one process): :meth:`initial_message_from` of every client's
        :meth:`join_message`, by client id. A weight-sharing method may check the clients' models
        here first (FedAvg names the clients whose models differ)."""
        return self.initial_message_from({s.cid: self.join_message(s) for s in states})

    def generator(self, *keys: int) -> np.random.Generator:
        """A numpy generator seeded from the run's seed and ``keys`` (e.g. the round, a client id,
        a number of the method's own): the same draws on every executor and process, on Flower's
        server and after a resume, and other draws for other keys or seeds. For torch:
        ``torch.Generator().manual_seed(int(alg.generator(round).integers(2**62)))``."""
        return np.random.default_rng([int(self.seed), *(int(k) for k in keys)])

    @classmethod
    def from_config(cls, cfg: Any, embedding_dim: int) -> Algorithm:
        """Build from a :class:`fedproto.config.run_config.RunConfig` (``cfg``; typed ``Any`` as the config is
        a layer above and composed at run time with the plug-ins' options): ``cls(num_classes, opt,
        local_epochs, freeze_after=...)``, then, for an algorithm with ``Options`` (its own typed
        options, :class:`fedproto.plugins.AlgorithmOptions`), ``self.options`` holding their values
        from the run config, ``self.embedding_dim`` and ``self.seed``. The one way a method's
        options reach it: its code reads ``self.options`` (a constructor called directly from
        Python builds the same object from its keywords, checked by the options model); a
        method's own ``from_config`` (a plug-in's) passes ``freeze_after`` to its constructor."""
        from fedproto.plugins import method_options

        alg = cls(cfg.num_classes, optim_config(cfg), cfg.local_epochs, freeze_after=cfg.freeze_after)
        alg.seed = int(cfg.seed)
        options = method_options(cls)
        if options is not None:
            alg.options = options(**{k: getattr(cfg, k) for k in options.model_fields})
        alg.embedding_dim = embedding_dim
        return alg

    @classmethod
    def from_run(cls, cfg: Any, embedding_dim: int) -> Algorithm:
        """What the engine builds a run's method with (``build_algorithm``, every front end):
        :meth:`from_config`, the method's own. A ``from_config`` that builds without the run's
        ``freeze_after`` or ``seed`` (a plug-in written before they were constructor arguments, or
        one that sets neither) gets them here, as the engine gave them before, so it runs as it
        did."""
        alg = cls.from_config(cfg, embedding_dim)
        if alg.freeze_after != cfg.freeze_after:  # only a from_config of its own that does not pass it
            alg.freeze_after = int(cfg.freeze_after)
        alg.seed = int(cfg.seed)  # a from_config of its own may not set it (Algorithm.generator reads it)
        return alg
