"""One Optuna study of ``fedproto tune``: its storage, the trials (each a run scored on the
clients' validation data), and the workers that fill it, in this process or ``--jobs N`` spawned
processes, each with its own storage connection.

The budget is a count of the study's trials (finished or running; a trial interrupted by Ctrl-C
or a killed process does not count, and is run again), so the same command run again resumes a
stopped study and adds only the trials missing. Taking a trial is done under a lock file in the
output folder, so processes on one machine never overshoot the count; processes on several
machines sharing one database (``--storage``) may overshoot it by one trial each.

Seeding: the trial that is the study's n-th is sampled by a TPE sampler seeded with ``(seed, n)``,
so a study stopped and resumed samples what an uninterrupted one does (one process; with several
the order of finishing trials varies).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedproto.errors import ConfigError, FedprotoError
from fedproto.tuning.space import Dimension

METRICS = ("acc", "acc_proto", "acc_global")
"""What a trial is scored on: the mean over clients of this validation accuracy (``acc``: the
classifier; ``acc_proto``: nearest prototype; ``acc_global``: the global model, FedAvg-like methods)."""


@dataclass
class StudySpec:
    """Everything a worker process needs to fill one study (picklable).

    Attributes:
        storage: an Optuna storage URL (``sqlite:///OUT/study.db``). study_name: the study's name.
        method: the algorithm tuned. base: the fixed run options (dataset, rounds, ...).
        space: the dimensions searched. trials: the study's budget in trials (None: time only).
        deadline: ``time.time()`` after which no trial starts (None: trials only).
        seed: the sampler's, the split's and every trial's run seed. val_fraction: each class's held-out share.
        metric: one of :data:`METRICS`. lock: the lock file taken while a trial is drawn.
        fingerprint: what the study is made with (:func:`fingerprint`).
        clients: your own federation's ``make_clients(seed)`` (:mod:`fedproto.tuning.own`; None:
            the named dataset of ``base``). num_classes: their classes.
    """

    storage: str
    study_name: str
    method: str
    base: dict[str, Any]
    space: dict[str, Dimension]
    trials: int | None
    deadline: float | None
    seed: int
    val_fraction: float
    metric: str
    lock: str
    fingerprint: dict = field(default_factory=dict)
    clients: Callable[[int], Any] | None = None
    num_classes: int | None = None


def sqlite_url(path: Path) -> str:
    """The SQLite URL of a database file (absolute, so every process opens the same file)."""
    return "sqlite:///" + str(Path(path).resolve())


def _storage(url: str):
    import optuna

    if url.startswith("sqlite"):  # several processes write one file: wait for the lock instead of failing
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}})
    return url


def _pruner(startup: int, rounds: int):
    """The median rule from a quarter of the rounds on (at least round 2): early rounds' validation
    accuracy on small validation sets says little about the last round's."""
    import optuna

    return optuna.pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=max(2, rounds // 4))


def _rounds(spec: StudySpec) -> int:
    """The rounds of the study's runs (federate's default 20 for your own clients)."""
    if "rounds" in spec.base:
        return int(spec.base["rounds"])
    if spec.clients is not None:
        return 20
    from fedproto.config.run_config import build_config

    return build_config(None, spec.base).rounds


def open_study(spec: StudySpec, create: bool = False):
    """The study in ``spec.storage`` (created when ``create`` and missing). A study made with
    other options (space, method, base options, split, metric) is refused.

    Raises:
        ConfigError: the stored study's options differ (names them), or ``spec.storage`` is no
            storage Optuna can open.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        storage = _storage(spec.storage)
        if create:
            study = optuna.create_study(study_name=spec.study_name, storage=storage, direction="maximize",
                                        load_if_exists=True)
        else:
            study = optuna.load_study(study_name=spec.study_name, storage=storage)
    except (ValueError, ImportError, KeyError) as e:
        raise ConfigError(f"--storage {spec.storage!r}: Optuna cannot open it ({e}); give a database URL such as "
                          "sqlite:///study.db or postgresql://user@host/db") from None
    except Exception as e:  # sqlalchemy's errors: a path that cannot be written, a server that does not answer
        raise ConfigError(f"--storage {spec.storage!r}: {type(e).__name__}: {str(e).splitlines()[0]}; check the "
                          "URL and that the database can be reached and written") from None
    stored = study.user_attrs.get("fedproto")
    if stored is None and create:
        startup = max(2, min(10, (spec.trials or 30) // 3))
        study.set_user_attr("fedproto", {**spec.fingerprint, "startup": startup})
        stored = study.user_attrs["fedproto"]
    if stored is not None:
        differ = sorted(k for k in spec.fingerprint if stored.get(k) != spec.fingerprint[k])
        if differ:
            was, now = dict(stored.get("options") or {}), spec.fingerprint.get("options", {})
            named = [f"{k} (stored {was.get(k)!r}, now {now.get(k)!r})" for k in sorted(set(was) | set(now))
                     if was.get(k) != now.get(k)]
            named += [f"{k} (stored {stored.get(k)!r}, now {spec.fingerprint[k]!r})" for k in differ if k != "options"]
            raise ConfigError(f"study {spec.study_name!r} in {spec.storage} was made with other "
                              f"{', '.join(differ)}: {'; '.join(named)}; resume it with the same options, or start "
                              "a new one with another --study-name or --out")
    study.pruner = _pruner(int((stored or {}).get("startup", 3)), _rounds(spec))
    return study


def fingerprint(method: str, base: dict, space: dict[str, Dimension], val_fraction: float, metric: str,
                seed: int) -> dict:
    """What a study is made with (stored in it as a user attribute; JSON)."""
    from fedproto.config.run_config import build_config, result_fields

    options = result_fields(build_config(None, base).model_dump())
    return json.loads(json.dumps({"method": method, "options": options,
                                  "space": {k: d.spec() for k, d in sorted(space.items())},
                                  "val_fraction": val_fraction, "metric": metric, "seed": seed}, default=str))


@contextmanager
def file_lock(path: str):
    """An exclusive lock on ``path`` (created) for the block; processes of one machine take turns."""
    import fcntl

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def counted(study) -> int:
    """The trials that count against the budget: finished or running, not interrupted."""
    from optuna.trial import TrialState

    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.state != TrialState.WAITING and not t.user_attrs.get("interrupted"))


def reap(study) -> int:
    """Mark the running trials of dead processes of this machine as interrupted (FAIL): they no
    longer count, and are run again. Returns how many were marked."""
    from optuna.trial import TrialState

    host, n = socket.gethostname(), 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid = t.user_attrs.get("pid")
        if t.user_attrs.get("host") == host and isinstance(pid, int) and pid != os.getpid() and not _alive(pid):
            study._storage.set_trial_user_attr(t._trial_id, "interrupted", True)
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            n += 1
    return n


def _draw(study, spec: StudySpec):
    """The next trial (None when the budget or the time is spent), under the lock."""
    import optuna

    with file_lock(spec.lock):
        reap(study)
        n = counted(study)
        late = spec.deadline is not None and time.time() >= spec.deadline
        if late or (spec.trials is not None and n >= spec.trials):
            return None
        startup = int(study.user_attrs.get("fedproto", {}).get("startup", 3))
        study.sampler = optuna.samplers.TPESampler(seed=(int(spec.seed) * 1_000_003 + n) % 2**32,
                                                   n_startup_trials=startup)
        trial = study.ask()
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", os.getpid())
        return trial


def run_trial(spec: StudySpec, trial) -> float:
    """One trial: its options sampled, the run trained on the clients' training rows minus their
    validation rows, reported each round to the pruner. Returns the final validation metric
    (mean over clients).

    Raises:
        optuna.TrialPruned: the pruner stopped it. FedprotoError: the options or the run failed.
    """
    import optuna

    from fedproto.config.run_config import build_config
    from fedproto.simulation import Simulation
    from fedproto.tuning.split import tuning_setup

    params = {k: d.suggest(trial) for k, d in spec.space.items()}
    options = {**spec.base, **params, "eval_every": 1, "seed": spec.seed}
    if spec.clients is not None:  # your own federation
        from fedproto.tuning.own import own_simulation

        sim = own_simulation(spec.clients, spec.num_classes, options, spec.val_fraction, spec.seed)
    else:
        cfg = build_config(None, options)
        sim = Simulation(cfg, setup=tuning_setup(cfg, spec.val_fraction, spec.seed), out=False)
    cfg = sim.cfg
    key = f"{spec.metric}_mean"

    def on_round(row: dict) -> None:
        if key in row and row[key] is not None and math.isfinite(row[key]):
            trial.report(float(row[key]), int(row["round"]))
            if row["round"] < cfg.rounds and trial.should_prune():
                raise optuna.TrialPruned(f"pruned after round {row['round']}")

    sim.on_round = on_round
    t0 = time.perf_counter()
    summary = sim.run()
    trial.set_user_attr("wall_s", round(time.perf_counter() - t0, 3))
    acc = summary["accuracy"].get(spec.metric)
    if acc is None:
        raise ConfigError(f"--metric {spec.metric}: {cfg.algorithm} does not report it (it reports "
                          f"{', '.join(summary['accuracy'])}); pick one of those")
    return float(acc["mean"])


def work(spec: StudySpec, on_trial: Callable[[Any], None] | None = None) -> int:
    """Fill the study: draw trials until the budget or the time is spent. Returns the trials run.

    A trial whose options or run fail (:class:`FedprotoError`, e.g. a diverged loss) is FAIL with
    its message in the user attribute ``error``; Ctrl-C marks the running trial interrupted and
    re-raises.
    """
    import optuna
    from optuna.trial import TrialState

    study = open_study(spec)
    ran = 0
    while (trial := _draw(study, spec)) is not None:
        try:
            value = run_trial(spec, trial)
        except optuna.TrialPruned:
            study.tell(trial, state=TrialState.PRUNED)
        except KeyboardInterrupt:
            trial.set_user_attr("interrupted", True)
            study.tell(trial, state=TrialState.FAIL)
            raise
        except FedprotoError as e:
            if isinstance(e, ConfigError) and e.message.startswith("--metric"):
                study.tell(trial, state=TrialState.FAIL)
                raise
            trial.set_user_attr("error", str(e))
            study.tell(trial, state=TrialState.FAIL)
        except BaseException as e:  # a bug: the trial is failed (not left running), the error goes on
            trial.set_user_attr("error", f"{type(e).__name__}: {e}"[:2000])
            study.tell(trial, state=TrialState.FAIL)
            raise
        else:
            study.tell(trial, value)
        ran += 1
        if on_trial is not None:
            on_trial(study)
    return ran


def _worker(spec: StudySpec, threads: int, errors) -> None:
    """In a spawned process: torch's threads, then :func:`work`; an error goes to ``errors`` as
    (FedprotoError or not, its text)."""
    import torch

    torch.set_num_threads(threads)
    try:
        work(spec)
    except KeyboardInterrupt:
        pass
    except BaseException as e:
        ours = isinstance(e, FedprotoError)
        errors.put((ours, str(e) if ours else f"{type(e).__name__}: {e}"))


def run_parallel(spec: StudySpec, jobs: int, threads: int, on_poll: Callable[[Any], None] | None = None) -> None:
    """Fill the study with ``jobs`` spawned processes (each its own storage connection and
    ``threads`` torch threads); ``on_poll(study)`` about once a second while they run. Ctrl-C
    (or SIGTERM, which the command line reads as Ctrl-C) or a worker's error stops the others at
    once: their running trials are interrupted and run again when the study resumes (:func:`reap`).

    Raises:
        ConfigError: a worker's FedprotoError (its message). RuntimeError: a worker's other error,
            or a worker that died.
    """
    import multiprocessing

    from fedproto.reproduce.side_by_side import thread_environment

    study = open_study(spec)
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(spec, threads, errors)) for _ in range(jobs)]
    failure = None
    try:
        with thread_environment(threads):
            for p in procs:
                p.start()
        while any(p.is_alive() for p in procs) and failure is None:
            alive = next((p for p in procs if p.is_alive()), None)
            if alive is not None:
                alive.join(timeout=1.0)
            if on_poll is not None:
                on_poll(study)
            failure = None if errors.empty() else errors.get()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
    if failure is None and not errors.empty():
        failure = errors.get()
    if failure is not None:
        fedproto_error, text = failure
        raise (ConfigError if fedproto_error else RuntimeError)(f"a trial process stopped: {text}")
    dead = [p.exitcode for p in procs if p.exitcode]
    if dead:
        raise RuntimeError(f"{len(dead)} trial process(es) died (exit codes {dead}: killed, or out of memory?); run "
                           "the same command again to resume the study")


__all__ = ["METRICS", "StudySpec", "counted", "file_lock", "fingerprint", "open_study", "reap", "run_parallel",
           "run_trial", "sqlite_url", "work"]
