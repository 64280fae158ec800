"""Worker processes for the batched engine (fedproto.engine.executors.worker_pool)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import flat_weights, float64_sim

from fedproto.config.run_config import build_config
from fedproto.engine.executors.batched import balanced_parts
from fedproto.engine.executors.worker_pool import (
    CLIENTS_PER_WORKER,
    THREADS_PER_WORKER,
    WorkerPool,
    _Blocks,
    plan_workers,
)
from fedproto.errors import ConfigError
from fedproto.models.cnn import PaperCNN
from fedproto.simulation import Simulation
from fedproto.training import Objective, OptimConfig, Phase

# digits (scikit-learn 8x8), 6 clients; every client of a round is batched, so 2 workers split them.
# threads=2 is the run's budget in all: 2 processes of one thread each (no process above what
# OMP_NUM_THREADS=1 allows)
BASE = dict(dataset="digits", clients=6, ways=3, shots=25, stdev=1, test_shots=10, rounds=2, model="cnn",
            eval_every=0, lr=0.05, threads=2, execution="batched")


@pytest.fixture
def shm_blocks(monkeypatch) -> list[str]:
    """Names of the shared-memory blocks the worker pools of the test create (so the test can check
    that they are gone, whatever else on the machine uses /dev/shm)."""
    created: list[str] = []
    empty = _Blocks.empty  # every block is made here (_Blocks.new too)

    def recording_empty(self, shape, dtype):
        spec, view = empty(self, shape, dtype)
        created.append(spec.name)
        return spec, view

    monkeypatch.setattr(_Blocks, "empty", recording_empty)
    return created


@pytest.mark.parametrize("algorithm", ["fedproto", "fedprox", "fedrep"])
def test_workers_match_one_process_float64(algorithm, shm_blocks):
    """In float64, 2 processes (main + 1 worker) give the one-process weights within 1e-12
    relative and the same accuracies: the split only changes which process trains a client.
    FedProto exercises the prototype objective, FedProx the stacked reference weights, FedRep
    phases that train part of the model (closures made picklable)."""
    weights, accs = {}, {}
    for workers in (1, 2):
        sim = float64_sim(build_config(overrides={**BASE, "algorithm": algorithm, "workers": workers}))
        sim.run()
        assert sim.executor.pool is None  # closed when the run ended
        weights[workers] = flat_weights(sim)
        accs[workers] = [r["acc"] for r in sim.evaluate()]
    assert weights[2][0].dtype == torch.float64
    assert accs[2] == accs[1]
    worst = max(((a - b).norm() / b.norm()).item() for a, b in zip(weights[2], weights[1]))
    assert worst < 1e-12
    # the clients really trained (weights moved from their start) on both paths
    start = flat_weights(float64_sim(build_config(overrides={**BASE, "algorithm": algorithm})))
    assert min((a - s).norm().item() for a, s in zip(weights[2], start)) > 1e-3
    assert len(shm_blocks) >= 10  # inputs, labels and 8 stacked weights
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in shm_blocks)  # shared memory freed


def test_workers_float32_same_accuracy():
    """In float32 the processes agree to rounding (exact where each process's stacks keep the
    one-process shapes; oneDNN may pick another kernel for another group width)."""
    out = {}
    for workers in (1, 2):
        sim = Simulation(build_config(overrides={**BASE, "workers": workers}), out=False)
        summary = sim.run()
        assert summary["processes"] == workers
        out[workers] = (flat_weights(sim), summary["accuracy"]["acc"]["mean"])
    worst = max(((a - b).norm() / b.norm()).item() for a, b in zip(out[2][0], out[1][0]))
    assert worst < 1e-4
    assert abs(out[2][1] - out[1][1]) < 0.05


def test_plan_workers_by_cores_and_clients():
    # auto: one process per THREADS_PER_WORKER threads and per CLIENTS_PER_WORKER clients
    assert (CLIENTS_PER_WORKER, THREADS_PER_WORKER) == (8, 2)
    assert plan_workers(0, 2, 20) == (1, 2)  # a 2-core machine: one process
    assert plan_workers(0, 4, 20) == (2, 2)
    assert plan_workers(0, 16, 20) == (2, 8)
    assert plan_workers(0, 64, 10_000) == (32, 2)
    assert plan_workers(0, 1, 20) == (1, 1)  # --threads 1: one process
    assert plan_workers(0, 16, 12) == (1, 16)  # too few clients for two
    assert plan_workers(0, 8, 40, rounds=9) == (1, 8)  # too short to repay a worker's start
    assert plan_workers(2, 2, 20, rounds=1) == (2, 1)  # asked for
    # explicit: kept, at least one thread each, never more processes than clients
    assert plan_workers(3, 2, 20) == (3, 1)
    assert plan_workers(4, 16, 20) == (4, 4)
    assert plan_workers(8, 4, 5) == (5, 1)
    # nothing batched, or a GPU: one process
    assert plan_workers(4, 8, 1) == (1, 8)
    assert plan_workers(0, 8, 100, "cuda:0") == (1, 8)


def test_balanced_parts_split_by_samples():
    sizes = [396, 198, 400, 495, 495, 198, 198, 297, 198, 300, 500, 500, 200, 300, 495, 495, 198, 495, 500, 297]
    parts = balanced_parts(list(range(20)), sizes, 2)
    assert parts == [[0, 1, 5, 8, 10, 13, 14, 17, 18, 19], [2, 3, 4, 6, 7, 9, 11, 12, 15, 16]]
    assert [sum(sizes[i] for i in p) for p in parts] == [3577, 3578]  # of 7155
    assert balanced_parts([0, 1, 2], [10, 10, 10], 3) == [[0], [1], [2]]
    assert balanced_parts([5, 6, 7, 8], [1, 9, 5, 5], 2) == [[5, 6], [7, 8]]
    assert balanced_parts([0, 1], [1, 1], 5) == [[0], [1]]  # never an empty part
    assert balanced_parts([4, 7], [5, 5], 1) == [[4, 7]]


def test_workers_refused_where_they_cannot_act():
    with pytest.raises(ConfigError, match="needs a thread per process") as e:
        build_config(overrides={**BASE, "threads": 1, "workers": 2})
    assert "use workers=1 or fewer, or raise threads to 2 or more" in str(e.value)
    for bad, word in ((dict(execution="sequential"), "sequential"), (dict(dp="full"), "DP-SGD"),
                      (dict(device="cuda"), "cuda")):
        with pytest.raises(ConfigError, match=word) as e:
            build_config(overrides={**BASE, "execution": "auto", **bad, "workers": 2})
        assert "workers=2" in str(e.value) and "use workers=1" in str(e.value)  # the API spelling (CLI: --workers)
    with pytest.raises(ConfigError):
        build_config(overrides={**BASE, "workers": -1})


def test_worker_error_names_the_cause():
    """A worker that raises stops the run with its traceback (here: phases that do not fit)."""
    models = {i: PaperCNN(input_size=8) for i in range(2)}
    xs = {i: torch.randn(5, 1, 8, 8) for i in range(2)}
    ys = {i: torch.zeros(5, dtype=torch.long) for i in range(2)}
    pool = WorkerPool(models, xs, ys, 1, 1)
    try:
        obj = Objective(phases=[Phase(1)])
        pool.submit(0, [([0, 1], [], obj, None)], [[models[0], models[1]]], OptimConfig())
        with pytest.raises(RuntimeError, match="worker process 1 failed") as e:
            pool.collect(0, [[models[0], models[1]]])
        assert "IndexError" in str(e.value)
    finally:
        pool.close()
    pool.close()  # twice is harmless


def _tiny_pool():
    models = {i: PaperCNN(input_size=8) for i in range(2)}
    xs = {i: torch.randn(5, 1, 8, 8) for i in range(2)}
    ys = {i: torch.zeros(5, dtype=torch.long) for i in range(2)}
    return models, WorkerPool(models, xs, ys, 1, 1)


def test_worker_killed_names_the_signal():
    """A worker killed (OOM killer, kill -9) stops the run with an error naming it and the signal,
    whether it dies while training (collect) or between rounds (submit)."""
    import signal

    for step in ("collect", "submit"):
        models, pool = _tiny_pool()
        try:
            worker = pool.processes[0]
            assert os.getsid(worker.pid) != os.getsid(0)  # Ctrl-C in a terminal does not reach it
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            with pytest.raises(RuntimeError) as e:
                if step == "collect":
                    pool.collect(0, [])
                else:
                    obj = Objective(phases=[Phase(1)])
                    pool.submit(0, [([0, 1], [], obj, None)], [[models[0], models[1]]], OptimConfig())
            msg = str(e.value)
            assert msg.startswith("worker process 1 died (") and "killed by SIGKILL" in msg, msg
            assert "(;" not in msg
        finally:
            pool.close()


def test_interrupt_in_main_part_is_not_masked_by_workers(monkeypatch, shm_blocks):
    """Ctrl-C while the main process trains its part: KeyboardInterrupt comes out, not the error of
    a worker that died meanwhile (before the fix: "worker process 1 died"), and the shared memory
    is freed."""
    import fedproto.engine.executors.batched as batched

    sim = Simulation(build_config(overrides={**BASE, "workers": 2}), out=False)
    procs = []

    def interrupted(*a, **k):
        procs.extend(sim.executor.pool.processes)
        procs[0].kill()  # e.g. a signal to the whole process group
        procs[0].wait()
        raise KeyboardInterrupt

    monkeypatch.setattr(batched, "train_group", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sim.run()
    assert len(procs) == 1
    assert sim.executor.pool is None
    assert shm_blocks and not any(os.path.exists(f"/dev/shm/{n}") for n in shm_blocks)
