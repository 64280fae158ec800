"""The DP noise a client adds has the standard deviation the privacy accountant assumes.

The accountant (:func:`fedproto.prototypes.dp.epsilon`) is told a noise multiplier σ: each Gaussian
mechanism adds noise of standard deviation σ times its L2 sensitivity. Here the noise is measured
on what actually leaves (or changes on) a client, on every path that trains one (the sequential
simulator, the batched executor, a Flower node), and compared with σ x sensitivity:

* the prototype release (``dp="prototypes"``): sensitivity √2·C for the vector (per-class sums of
  embeddings clipped to C, C x per-class counts) (:data:`fedproto.prototypes.dp.RELEASE_SENSITIVITY`), so
  each coordinate of a class sum carries noise of std σ·√2·C and each count σ·√2. The test
  recomputes the clean sums and counts from the client's trained model and data itself;
* DP-SGD (``dp="full"``): each step adds noise of std σ·G (G: ``dp_grad_clip``) to the sum of the
  clipped per-sample gradients and divides by the expected batch size B, so with plain SGD at
  learning rate η a round of k steps moves each weight by η/B times (clipped gradients + noise of
  std √k·σ·G).

The empirical std over thousands of coordinates must lie inside a chi-square confidence interval
(two-sided, 1e-6) of the assumed one, widened only by the bounded terms named where they arise. A
noise 10 times smaller, or none, lies far outside.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import digits_config
from scipy.stats import chi2

from fedproto.engine.loop import Observer
from fedproto.simulation import Simulation

ALPHA = 1e-6  # two-sided: a correct implementation fails one of these checks about once in 10^5 runs

RELEASE = dict(dp="prototypes", dp_noise=1.0, dp_clip=5.0, clients=6, ways=3, shots=25, stdev=1, rounds=6)
"""Prototype release: σ = 1, C = 5; 6 clients x 3 classes x 50 coordinates x 6 rounds = 5,400 sum
coordinates and 108 counts. Classes hold >= 20 samples, so a noisy count (std 1.41) never nears 1."""

DPSGD = dict(dp="full", dp_noise=50.0, dp_grad_clip=1.0, clients=2, ways=2, shots=10, stdev=0, rounds=1,
             lr=0.001, momentum=0.0, weight_decay=0.0, batch_size=8, local_epochs=1)
"""DP-SGD: σ = 50, G = 1, plain SGD (no momentum, no weight decay) so that a round's weight change is
η/B x (sum of clipped gradients + noise). 20 samples per client, 3 steps, 6,480 weights per client."""


def std_interval(n: int) -> tuple[float, float]:
    """The (1 - ALPHA) interval of sqrt(mean of n squared N(0, 1) draws): (low, high) factors."""
    return math.sqrt(chi2.ppf(ALPHA / 2, n) / n), math.sqrt(chi2.ppf(1 - ALPHA / 2, n) / n)


def clean_release(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, classes, clip: float):
    """What the release would be without noise, computed here: per class of ``classes`` the sum of
    the eval-mode embeddings clipped to L2 norm ``clip`` (K, d) and the sample count (K,)."""
    was = model.training
    model.eval()
    with torch.no_grad():
        h = model(x)[1].to(torch.float64)
    model.train(was)
    h = h * torch.clamp(clip / h.norm(dim=1), max=1.0)[:, None]
    h, yy = h.numpy(), y.numpy()
    sums = np.stack([h[yy == c].sum(0) for c in classes])
    counts = np.array([(yy == c).sum() for c in classes], np.float64)
    return sums, counts


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).to(torch.float64).numpy()


class Measure(Observer):
    """On the round loop: for every reply, the noise of the release (its sums times its counts less
    the clean sums; its counts less the clean counts) and each client's weight change in the round.

    ``model_of(cid)``: the client's model after the round's training; ``data_of(cid)``: (x, y)."""

    def __init__(self, model_of, data_of, clip: float, before: dict[int, np.ndarray]):
        self.model_of, self.data_of, self.clip, self.before = model_of, data_of, clip, before
        self.sum_noise: list[np.ndarray] = []
        self.count_noise: list[np.ndarray] = []
        self.moves: list[tuple[int, np.ndarray]] = []

    def replies(self, loop, round, replies):
        for cid, (msg, _) in sorted(replies.replies.items()):
            model = self.model_of(cid)
            x, y = self.data_of(cid)
            classes, protos, counts = (np.asarray(msg[k]) for k in ("classes", "protos", "counts"))
            sums, n = clean_release(model, x, y, classes, self.clip)
            # the release sends S~/n~ and rint(n~): protos x counts is S~ up to a factor counts/n~
            # within 1 +- 0.5/n~ (n~ >= 19 here), a variance change below 0.1% (tested bound: 1%)
            self.sum_noise.append(protos.astype(np.float64) * counts[:, None] - sums)
            self.count_noise.append(counts - n)
            w = flat(model)
            self.moves.append((cid, w - self.before[cid]))
            self.before[cid] = w


def simulate(execution: str, **kw) -> Measure:
    """Run the simulator with ``execution`` and measure every client's release and weight change.
    ``batched`` under ``dp="full"`` is the batched executor of ``execution="auto"`` (DP-SGD clients
    train on the sequential path; ``execution="batched"`` is refused with ``dp="full"``)."""
    if execution == "batched" and kw.get("dp") == "full":
        execution = "auto"
    cfg = digits_config(execution=execution, **({"group_size": 8} if execution == "batched" else {}), **kw)
    sim = Simulation(cfg, out=False)
    states, data = sim.setup.states, sim.setup.data
    m = Measure(lambda i: states[i].model, lambda i: (data[i].x, data[i].y), cfg.dp_clip,
                {i: flat(s.model) for i, s in enumerate(states)})
    sim.loop.observers.append(m)
    sim.run()
    m.n = {i: len(d.y) for i, d in enumerate(data)}
    return m


def flower_node(monkeypatch, tmp_path, **kw) -> Measure:
    """Run the Flower engine against the real ClientApp (nodes in this process, contexts kept as a
    SuperNode keeps them) and measure every node's release and weight change; the nodes' models are
    read from their contexts, their data and initial weights from a simulator of the same config."""
    pytest.importorskip("flwr")
    from flower_helpers import LocalGrid, _user_config
    from flwr.supercore.task_identity import TaskIdentity

    from fedproto.flower import client_app
    from fedproto.flower.records import run_config
    from fedproto.flower.server_app import FlowerEngine

    for k, v in {"_run_id": 1, "_node_id": 0, "_task_id": 0}.items():  # as flower_helpers.flower_process
        monkeypatch.setattr(TaskIdentity, k, v)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    uc = _user_config(**{**dict(eval_every=0, threads=1), **kw})
    cfg = run_config(uc)
    ref = Simulation(cfg, out=False)
    grid = LocalGrid(uc, list(range(cfg.clients)))
    eng = FlowerEngine(cfg, grid, out=False)

    def model_of(cid):
        model = ref.setup.states[cid].model
        sd = grid.contexts[eng.nodes[cid]].state[client_app.STATE_MODEL].to_torch_state_dict()
        model.load_state_dict(sd)
        return model

    data = ref.setup.data
    m = Measure(model_of, lambda i: (data[i].x, data[i].y), cfg.dp_clip,
                {i: flat(s.model) for i, s in enumerate(ref.setup.states)})
    eng.loop.observers.append(m)
    eng.run()
    m.n = {i: len(d.y) for i, d in enumerate(data)}
    return m


def check_release(m: Measure) -> None:
    """The noise of the class sums has std σ·√2·C and that of the counts σ·√2 (rounding to whole
    counts adds 1/12 to its variance), each within the chi-square interval."""
    s = RELEASE["dp_noise"] * math.sqrt(2.0) * RELEASE["dp_clip"]
    e = np.concatenate([a.ravel() for a in m.sum_noise])
    assert e.size >= 5000
    lo, hi = std_interval(e.size)
    got = math.sqrt(np.mean(e**2))
    assert lo * s < got < hi * s * 1.01, (got, s, lo, hi)
    assert abs(e.mean()) < 6 * s / math.sqrt(e.size)  # centred
    c = np.concatenate(m.count_noise)
    sc = math.sqrt((RELEASE["dp_noise"] * math.sqrt(2.0)) ** 2 + 1 / 12)
    lo, hi = std_interval(c.size)
    got = math.sqrt(np.mean(c**2))
    assert lo * sc < got < hi * sc, (got, sc, lo, hi)


def check_dp_sgd(m: Measure) -> None:
    """A round of k = epochs x ceil(n / B) steps moves the weights by -η/B x (sum of the clipped
    per-sample gradients + noise of std √k·σ·G per weight). The clipped gradients sum to at most
    (samples drawn) x G <= k·n·G in norm, so the norm of -move x B/η lies within k·n·G of the
    noise's norm, whose chi-square interval is [lo, hi] x √(kP)·σ·G for P weights."""
    sigma, G, lr, B = DPSGD["dp_noise"], DPSGD["dp_grad_clip"], DPSGD["lr"], DPSGD["batch_size"]
    assert len(m.moves) == DPSGD["clients"]
    for cid, move in m.moves:
        n = m.n[cid]
        k = DPSGD["local_epochs"] * -(-n // B)
        assert n >= B  # the expected batch size q x n is then B itself
        z = -move * B / lr
        P = z.size
        lo, hi = std_interval(P)
        want = math.sqrt(k * P) * sigma * G
        slack = k * n * G
        got = float(np.linalg.norm(z))
        assert lo * want - slack < got < hi * want + slack, (cid, got, want, slack, lo, hi)
        assert slack < 0.02 * want  # the bound is tight enough to tell a 10x smaller noise


@pytest.mark.parametrize("path", ["sequential", "batched", pytest.param("flower", marks=pytest.mark.flower)])
@pytest.mark.parametrize("mechanism", ["release", "dp_sgd"])
def test_dp_noise_has_the_standard_deviation_the_accountant_assumes(mechanism, path, monkeypatch, tmp_path):
    """The prototype release (``dp="prototypes"``) and DP-SGD (``dp="full"``; the batched executor
    trains its clients on the sequential path) on the simulator's two executors and on a Flower node:
    the measured noise has the std σ x sensitivity that :func:`fedproto.prototypes.dp.epsilon` accounts."""
    kw = RELEASE if mechanism == "release" else DPSGD
    m = flower_node(monkeypatch, tmp_path, **kw) if path == "flower" else simulate(path, **kw)
    (check_release if mechanism == "release" else check_dp_sgd)(m)
