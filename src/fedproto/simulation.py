"""The in-process front end of the engine: :class:`Simulation` runs a configured experiment with
every client in this process.

It builds the run (:func:`fedproto.engine.setup.prepare`), picks the executor (sequential or
batched, :mod:`fedproto.engine.executors`), hangs the observers on the round loop (run folder,
checkpoints, health checks, progress, embeddings, the full test split, simulated attacks) and
runs :class:`fedproto.engine.loop.RoundLoop`, the loop the Flower ServerApp runs too.

Seeding: the partition, each client's model initialisation and each client's per-round
randomness (batch order, dropout masks) come from ``numpy.random.SeedSequence([seed, round,
client])``-style streams (:mod:`fedproto.engine.seeding`), so results do not depend on the
executor or client order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from fedproto.algorithms.algorithm import Message
from fedproto.config.run_config import RunConfig
from fedproto.engine.attack_stage import SimulatedAttack
from fedproto.engine.executors.batched import BatchedExecutor
from fedproto.engine.executors.executor import Executor
from fedproto.engine.executors.in_process import SequentialExecutor
from fedproto.engine.lifecycle import check_observers, run_rounds, standard_observers
from fedproto.engine.loop import Observer, RoundLoop
from fedproto.engine.observers.embeddings import Embeddings
from fedproto.engine.observers.fulltest import FullTest, full_test_evaluation
from fedproto.engine.observers.health import Health
from fedproto.engine.observers.tensorboard_log import tensorboard_observers
from fedproto.engine.setup import Setup, prepare
from fedproto.errors import ConfigError
from fedproto.models.proto_model import ProtoModel
from fedproto.outputs.checkpoint import load_checkpoint
from fedproto.outputs.run_folder import PREVIOUS, RunDir
from fedproto.secagg import install as install_secagg

log = logging.getLogger(__name__)


def make_executor(cfg: RunConfig, setup: Setup) -> Executor:
    """The in-process executor of ``cfg.execution``: :class:`SequentialExecutor` for
    ``sequential``, else :class:`BatchedExecutor` (``auto``: the hand-written batched path where a
    model has one; ``batched``: the generic path too)."""
    if cfg.execution == "sequential":
        return SequentialExecutor(setup, cfg.seed)
    return BatchedExecutor(setup, cfg.seed, cfg.execution, cfg.group_size, cfg.workers, cfg.threads, cfg.rounds)


class Simulation:
    """Run a configured experiment in-process.

    Args:
        cfg: the validated :class:`RunConfig`.
        setup: a prebuilt :class:`~fedproto.engine.setup.Setup` (else built from cfg).
        out: run directory path (None: ``cfg.out_dir / cfg.run_name()``; False: write nothing).
        on_round: optional callback(row) after each round (used for the progress bar).
        progress: show download progress while building the set-up.
        executor: the executor that runs the clients (an :class:`~fedproto.engine.executors.executor.Executor`
            over this set-up; default :func:`make_executor` of ``cfg.execution``).
        observers: your own :class:`~fedproto.engine.loop.Observer` s, called after the run folder
            and checkpoint writers and before the progress callback (the Flower ServerApp takes the
            same, :class:`fedproto.flower.server_app.FlowerEngine`).
    Raises:
        ConfigError: ``cfg`` is not a RunConfig, an entry of ``observers`` is not an Observer,
            ``out`` is neither a path, None nor False, or
            ``cfg.tensorboard`` is on for a run folder without the ``tensorboard`` package (before
            the run folder is made; with ``out=False`` it is only a warning: nothing is written).
    """

    def __init__(self, cfg: RunConfig, setup: Setup | None = None, out: str | Path | None | bool = None,
                 on_round: Callable[[dict], None] | None = None, progress: bool = False,
                 executor: Executor | None = None, observers: Sequence[Observer] = ()):
        if not isinstance(cfg, RunConfig):
            raise ConfigError(f"Simulation needs a RunConfig (from fedproto.build_config), not a {type(cfg).__name__}")
        if out is True or not (out is None or out is False or isinstance(out, (str, Path, RunDir))) or out == "":
            raise ConfigError(f"out={out!r}: give a run directory path, None (out_dir/name) or False (write nothing)")
        self.cfg = cfg
        if cfg.tensorboard and out is False:
            log.warning("tensorboard is on but this run writes no run folder (out=False): no TensorBoard events")
        elif cfg.tensorboard:  # a missing extra is an error before the set-up and the run folder exist
            from fedproto.engine.observers.tensorboard_log import require_tensorboard

            require_tensorboard()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.setup = setup or prepare(cfg, progress=progress)
        self.on_round = on_round
        if out is False:
            self.run_dir = None
        elif isinstance(out, RunDir):
            self.run_dir = out
        else:
            self.run_dir = RunDir(out if out is not None else Path(cfg.out_dir) / cfg.run_name())
        self.executor = executor if executor is not None else make_executor(cfg, self.setup)
        # secure aggregation (fedproto.secagg): the clients' replies masked, the server sums them
        server, self.executor = install_secagg(cfg, self.setup.algorithm, self.executor)
        self.attack = SimulatedAttack(cfg, len(self.setup.states))
        self.health = Health(cfg, self.attack.attackers, self.setup.data, self.setup.algorithm)
        self.user_observers = check_observers(observers)
        self.loop = RoundLoop(cfg, server, self.executor, self.setup.embedding_dim,
                              self._observers(), [self.attack])
        self._ran = False

    def _observers(self) -> list:
        # the shared order (fedproto.engine.lifecycle): a round's row is in metrics.jsonl, then in a checkpoint,
        # then the user's observers see it, before the progress callback
        before = [self.attack, *([FullTest(self.setup)] if self.cfg.eval_full_test else [])]
        return standard_observers(self.cfg, self.health, self.run_dir, self.config_record, self._notify,
                                  checkpoint_every=self.cfg.checkpoint_every, before=before,
                                  run_folder=[Embeddings(self.setup, self.run_dir),
                                              *tensorboard_observers(self.cfg, self.run_dir)] if self.run_dir else [],
                                  user=self.user_observers, models=lambda: self.models)

    def _notify(self, row: dict) -> None:
        if self.on_round:  # read at each round: a caller may set it after construction
            self.on_round(row)

    @property
    def models(self) -> list[ProtoModel]:
        """The client models, indexed by client id: the objects training updates, so after :meth:`run`
        they hold the trained weights, and the objects the reported accuracies were measured on
        (``model(x)`` gives ``(logits (B, C), embedding (B, d))``; call ``.eval()`` first).

        With your own clients (:func:`fedproto.federation.federate`) each is the adapter around your
        module: your module is its ``net`` (:class:`~fedproto.federation.HeadSplitModel`,
        :class:`~fedproto.federation.TupleModel`) and is trained in place. Where ``embedding_dim`` added a
        projection the model is a :class:`~fedproto.federation.Projected`: your module (``.inner.net``)
        holds the trained body, but its own final layer is not used nor trained; predict with this
        object. ``save_models`` also writes them to ``models.pt`` (:func:`fedproto.outputs.run_folder.load_models`).
        """
        return [s.model for s in self.setup.states]

    @property
    def message(self) -> Message:
        """The server message of the next round (after :meth:`run`: the final global prototypes or weights)."""
        return self.loop.message

    @property
    def history(self) -> list[dict]:
        """The metrics rows of the rounds run so far (``metrics.jsonl``)."""
        return self.loop.history

    @property
    def attackers(self) -> frozenset[int]:
        """The simulated misbehaving clients (options ``attack``, ``attackers``)."""
        return self.attack.attackers

    @property
    def train_norm(self) -> dict[int, float]:
        """Client -> the largest L2 norm of its training embeddings in its last round."""
        return self.health.train_norm

    def rounds_trained(self) -> list[int]:
        """Per client: the rounds of this run (so far) in which it trained and replied."""
        return self.loop.rounds_trained()

    def evaluate(self) -> list[dict]:
        """Per-client metrics on each client's own test set (list indexed by client id)."""
        alg = self.setup.algorithm
        return self.executor.evaluate({i: alg.downlink(self.loop.message, i) for i in range(len(self.setup.states))})

    def full_test_evaluation(self) -> dict | None:
        """Every client's model and their ensemble on the full test split
        (:func:`fedproto.engine.observers.fulltest.full_test_evaluation`)."""
        return full_test_evaluation(self.setup, self.loop.message, self.cfg.num_classes)

    def config_record(self) -> dict:
        """What ``config.json`` holds: the options, the λ, batch size and device in force, the
        partition, where the data came from (``data_source``: the folders searched, in order). For your
        own clients (dataset ``custom``) the options the run did not use
        (:meth:`RunConfig.unused_fields`: the partition's, the zoo models') are ``null`` and
        ``embedding_dim`` is your models' embedding size; ``ignored_options`` names the options set
        that the run's algorithm and options leave without effect (:meth:`RunConfig.ignored_options`)."""
        record = self.cfg.model_dump()
        if self.cfg.dataset == "custom":
            record.update(dict.fromkeys(self.cfg.unused_fields()))
            record["embedding_dim"] = int(self.setup.embedding_dim)
        return {**record, "lambda_proto_in_force": self.cfg.lam, "ignored_options": self.cfg.ignored_options(),
                "data_source": self._data_source(), **self.executor.config_record()}

    def _data_source(self) -> dict:
        """Where the data came from: ``data_dir`` alone said nothing when ``$FEDPROTO_DATA`` supplied it."""
        import os

        from fedproto.data.datasets import DATA_ENV, candidate_roots

        if self.cfg.dataset == "custom":
            return {"kind": "your clients' own data (fedproto.federation)"}
        if self.cfg.dataset == "digits":
            return {"kind": "scikit-learn's bundled digits (no files)"}
        return {"kind": "files", "data_dir": self.cfg.data_dir, DATA_ENV: os.environ.get(DATA_ENV) or None,
                "searched": [str(p) for p in candidate_roots(self.cfg.data_dir)]}

    def close(self) -> None:
        """Stop this simulation's worker processes, if any (:meth:`run` does so when it ends)."""
        self.executor.close()

    def run(self, resume: bool = False) -> dict:
        """Run all rounds; returns the summary dict (also written to ``summary.json``).

        Args:
            resume: continue from the run directory's checkpoint when there is one (else start at
                round 1). Checkpoints are written every ``cfg.checkpoint_every`` rounds and removed
                when the run finishes; see :mod:`fedproto.outputs.checkpoint`.
        Raises:
            CheckpointMismatch: the checkpoint was written under other options.
            CheckpointError: it is damaged or does not fit.
            TrainingError: the loss diverged.
        """
        if self._ran:
            raise ConfigError("this Simulation has run already (its models are trained); build a new Simulation "
                              "to run again")
        try:
            if not self.run_dir:
                return self._run(resume)
            self.run_dir.acquire()  # one process per run folder
            try:
                return self._run(resume)
            finally:
                self.run_dir.release()
        finally:
            self.close()

    def _run(self, resume: bool) -> dict:
        self._ran = True
        loop = self.loop
        loop.message = loop.initial_message()  # may refuse the set-up (weight sharing across architectures)
        if not self.run_dir:
            if self.cfg.save_models:
                log.warning("save_models: this run writes no run directory (out=False); the trained models are in "
                            "Simulation.models")
            return loop.run()
        rd = self.run_dir
        ck = rd.checkpoint
        if ck.exists() and not ck.is_file():
            raise ConfigError(f"{str(ck)!r} is not a file; remove it (the checkpoint goes there)")
        has_ckpt = ck.is_file()
        if has_ckpt and not resume:
            from fedproto.errors import opt

            prev = rd.path / PREVIOUS
            kept = (f" (an earlier finished run waits in {str(prev)!r} until the interrupted one finishes)"
                    if prev.is_dir() else "")
            raise ConfigError(f"{str(rd.path)!r} holds an interrupted run's checkpoint{kept}: add {opt('resume')} to "
                              f"continue it, or delete {str(ck)!r} (or pick another {opt('name')}) to start anew")
        if resume and not has_ckpt:
            if (rd.path / "summary.json").is_file():
                from fedproto.errors import opt

                raise ConfigError(f"the run in {str(rd.path)!r} has finished (summary.json) and has no checkpoint: "
                                  f"nothing to resume; drop {opt('resume')} to run it again")
            log.warning("no checkpoint in %s: starting at round 1", rd.path)
        resumed = resume and has_ckpt
        return run_rounds(loop, rd, load_checkpoint(ck) if resumed else None, str(ck))
