"""The clients' weights at rest in one flat store (fedproto.engine.client_store): its size per
client, exact storing and restoring, and runs that give the per-client modules' numbers bit for bit."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import digits_config

from fedproto.config.run_config import build_config
from fedproto.engine.client_store import ClientStore, StoredClientState, borrowed, storable
from fedproto.models.cnn import PaperCNN
from fedproto.simulation import Simulation, prepare

# digits (scikit-learn 8x8), 6 clients, evaluated after round 1 too: the models' eval mode then
# reaches the batched forward of round 2 (the store keeps each client's mode)
BASE = dict(dataset="digits", clients=6, ways=3, shots=25, stdev=1, test_shots=10, rounds=2, model="cnn",
            eval_every=1, lr=0.05, threads=1, execution="batched", workers=1)

PAPER_CNN_PARAMS = 21_840  # conv1 260 + conv2 5,020 + fc1 16,050 + fc2 510 (MNIST shapes)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float32 tensor (NaN, -0.0 and denormals compare as bits)."""
    return t.detach().contiguous().view(torch.int32)


def test_store_holds_a_bounded_number_of_bytes_per_client():
    """N PaperCNN clients at rest: the store is N x 21,840 float32 plus 2 flag bytes per client
    (87,362 bytes; a module per client costs about 105 KB), and a stored client's Python state
    adds under 1 KB (no module, no parameter tensor per client)."""
    n = 3000
    store = ClientStore(PaperCNN(), n)
    assert store.params_per_client == PAPER_CNN_PARAMS
    assert store.rows.shape == (n, PAPER_CNN_PARAMS) and store.rows.dtype == torch.float32
    assert store.nbytes == n * (PAPER_CNN_PARAMS * 4 + 2) == 262_086_000
    classes = [np.array([0, 1, 2]) for _ in range(n)]
    tracemalloc.start()
    try:
        states = [StoredClientState.of(i, store, classes[i]) for i in range(n)]
        per_client, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert per_client / n < 1024
    assert not any(s.materialized for s in states)


def test_storing_and_restoring_a_client_model_is_exact():
    """A model's float32 weights, NaN, -0.0, denormals and infinities among them, go into a row and
    come back bit for bit (as a module, a state dict and a stacked group); writes through a module
    of the client land in the row."""
    torch.manual_seed(0)
    n = 5
    models = [PaperCNN() for _ in range(n)]
    special = torch.tensor([float("nan"), -0.0, 1e-45, float("inf"), -float("inf"), 3.4e38])
    with torch.no_grad():
        models[2].fc2.bias[:6] = special
    models[3].eval()
    store = ClientStore(models[0], n)
    for i, m in enumerate(models):
        store.put(i, m)
    assert store.filled.all()
    for i, m in enumerate(models):
        back = store.module(i)
        assert back is not m and back.training == m.training
        for (k, p), (k2, q) in zip(m.named_parameters(), back.named_parameters()):
            assert k == k2 and torch.equal(_bits(p), _bits(q))
        sd = store.state_dict(i)
        assert list(sd) == list(m.state_dict())
        assert all(torch.equal(_bits(sd[k]), _bits(v)) for k, v in m.state_dict().items())
    P = store.stacked([3, 1, 2])
    assert torch.equal(_bits(P["fc2.bias"][2]), _bits(models[2].fc2.bias))
    assert torch.equal(_bits(P["conv1.weight"][0]), _bits(models[3].conv1.weight))
    # write a stacked group back, then through a module of the client (its parameters are row views)
    P["fc1.weight"] += 1.0
    store.write([3, 1, 2], P)
    assert torch.equal(store.views(1)["fc1.weight"], models[1].fc1.weight.detach() + 1.0)
    own = store.module(4)
    with torch.no_grad():
        own.conv2.bias.fill_(0.25)
    assert (store.views(4)["conv2.bias"] == 0.25).all()
    # a state dict into a row: exact; a wrong one refused as nn.Module.load_state_dict refuses it
    store.load_state_dict(0, models[2].state_dict())
    assert torch.equal(_bits(store.rows[0]), _bits(torch.cat([p.detach().flatten() for p in models[2].parameters()])))
    with pytest.raises(RuntimeError, match="missing keys"):
        store.load_state_dict(0, {"fc1.weight": models[0].fc1.weight})
    with pytest.raises(RuntimeError, match="size mismatch"):
        store.load_state_dict(0, {**models[0].state_dict(), "fc2.bias": torch.zeros(3)})


def test_a_borrowed_model_keeps_no_module_and_the_clients_mode():
    """The engine's borrow binds the store's scratch module to the row and keeps nothing; the mode
    the client's hooks leave (eval after an evaluation) is the client's next time."""
    store = ClientStore(PaperCNN(), 3)
    for i in range(3):
        store.put(i, PaperCNN())
    s = StoredClientState.of(1, store, np.array([0, 1]))
    with borrowed(s) as m:
        assert s.model is m and m.training
        assert m.fc1.weight.data_ptr() == store.views(1)["fc1.weight"].data_ptr()
        m.eval()
    assert not s.materialized and not bool(store.training[1]) and bool(store.training[0])
    with borrowed(s) as m:
        assert not m.training
    # read outside the engine: a module of its own, kept, bound to the row
    own = s.model
    assert s.materialized and s.model is own
    assert own.fc1.weight.data_ptr() == store.views(1)["fc1.weight"].data_ptr()
    with borrowed(s) as m:
        assert m is own


def test_only_storable_models_go_into_a_store():
    from fedproto.models.resnet import ResNet18

    assert storable(PaperCNN())
    assert not storable(ResNet18(3, 10))  # BatchNorm buffers
    assert not storable(torch.nn.Linear(3, 2))  # no batched forward


def _run(store, float64=False, **over):
    cfg = build_config(overrides={**BASE, **over})
    setup = prepare(cfg, progress=False, client_store=store)
    if float64:
        setup.to_dtype(torch.float64)
    sim = Simulation(cfg, setup=setup, out=False)
    sim.run()
    accs = [r["acc"] for r in sim.evaluate()]
    return sim, accs


def _weights(sim) -> list[torch.Tensor]:
    out = []
    for s in sim.setup.states:
        with borrowed(s) as m:
            out.append(torch.cat([p.detach().flatten() for p in m.parameters()]).clone())
    return out


@pytest.mark.parametrize("algorithm,execution", [("fedproto", "batched"), ("fedprox", "batched"),
                                                 ("fedrep", "batched"), ("fedproto", "sequential")])
def test_a_stored_run_gives_the_modules_numbers_bit_for_bit(algorithm, execution, tmp_path):
    """float32, digits: the same weights (bits), accuracies and round metrics with the store in memory,
    in a file, and with one module per client; no module is built per client during the run."""
    runs = {}
    for store in (False, True, str(tmp_path)):
        sim, accs = _run(store, algorithm=algorithm, execution=execution)
        rows = [{k: v for k, v in r.items() if not k.endswith("_s") and "time" not in k} for r in sim.history]
        runs[str(store)] = (_weights(sim), accs, rows)
        if store is not False:
            assert all(isinstance(s, StoredClientState) and not s.materialized for s in sim.setup.states)
    ref = runs["False"]
    for key in ("True", str(tmp_path)):
        w, accs, rows = runs[key]
        assert accs == ref[1] and rows == ref[2]
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(w, ref[0]))
    start = _weights(Simulation(build_config(overrides=BASE), setup=prepare(build_config(overrides=BASE),
                                                                            progress=False), out=False))
    assert all(not torch.equal(a, b) for a, b in zip(ref[0], start))  # the clients trained


@pytest.mark.parametrize("algorithm", ["fedproto", "fedprox"])
def test_a_stored_run_equals_the_modules_in_float64(algorithm):
    """float64 (Setup.to_dtype casts the store): the store's run gives the modules' weights exactly."""
    a, accs_a = _run(False, algorithm=algorithm, float64=True)
    b, accs_b = _run(True, algorithm=algorithm, float64=True)
    wa, wb = _weights(a), _weights(b)
    assert wb[0].dtype == torch.float64 and b.setup.states[0].store.rows.dtype == torch.float64
    assert accs_a == accs_b
    assert all(torch.equal(x, y) for x, y in zip(wa, wb))


def test_a_file_store_is_removed_with_it(tmp_path):
    store = ClientStore(PaperCNN(), 4, tmp_path / "rows.f32", release_every=2)
    for i in range(4):
        store.put(i, PaperCNN())
    assert (tmp_path / "rows.f32").stat().st_size == 4 * PAPER_CNN_PARAMS * 4
    m = store.module(3)
    assert torch.equal(store.state_dict(3)["fc1.weight"], m.fc1.weight.detach())
    store.close()
    assert not (tmp_path / "rows.f32").exists()


def test_the_store_is_reported_where_used_and_its_variable_checked(monkeypatch, tmp_path):
    """Reported: FEDPROTO_CLIENT_STORE=2 made a folder named 2, a file path failed without naming the variable,
    and no output said whether the store was used. summary.json's ``client_store`` says it (None: modules)."""
    from fedproto.engine.setup import client_store_from_env
    from fedproto.errors import ConfigError

    assert client_store_from_env(" YES ") is True and client_store_from_env("off") is False
    assert client_store_from_env("~/store") == str(Path.home() / "store")
    (tmp_path / "f").write_text("x")
    for bad, why in [("2", "a number but not 0 or 1"), (str(tmp_path / "f"), "is a file, not a folder")]:
        with pytest.raises(ConfigError, match=why):
            client_store_from_env(bad)
    for env, want in [("0", None), ("1", "memory"), (str(tmp_path / "store"), "file")]:
        monkeypatch.setenv("FEDPROTO_CLIENT_STORE", env)
        summary = Simulation(digits_config(rounds=1, eval_every=0), out=False).run()
        assert summary["client_store"] == want
