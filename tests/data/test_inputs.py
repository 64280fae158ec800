"""Inputs as the model takes them (fedproto.data.inputs): integer token ids, tuples and dicts of
tensors, variable-length sequences through a collate function; the same numbers on every executor;
and each method's statement of what it needs from the clients' models (FD, Local: any embedding size)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from conftest import own_digits_clients
from torch import nn

from fedproto.algorithms.requirements import LABEL_SPACE, NOTHING, ONE_ARCHITECTURE, ONE_EMBEDDING, model_needs
from fedproto.data.inputs import Inputs, cast_floats, concat, pad_collate
from fedproto.errors import ConfigError, DataError, ModelError
from fedproto.federation import Client, federate

VOCAB, C = 24, 3
BOUND = 1e-9  # float64: the paths agree in logic where they agree to this relative bound


def token_task(n: int, seed: int, lengths=(6, 6)):
    """``n`` token sequences whose class is the token group (0-7, 8-15, 16-23) most of their tokens
    come from: ids (lists of int64 tensors, lengths drawn in ``lengths``) and labels (n,)."""
    g = np.random.default_rng(seed)
    y = g.integers(0, C, n)
    seqs = []
    for c in y:
        L = int(g.integers(lengths[0], lengths[1] + 1))
        own = g.random(L) < 0.7
        tok = np.where(own, 8 * c + g.integers(0, 8, L), g.integers(0, VOCAB, L))
        seqs.append(torch.as_tensor(tok, dtype=torch.long))
    return seqs, torch.as_tensor(y)


class TupleBag(nn.Module):
    """Takes ``(ids (B, L) int64, mask (B, L) int64)``: a masked mean of token embeddings, a hidden
    layer, a final ``fc``. Records the dtypes it is called with."""

    def __init__(self, d=8):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.hidden = nn.Sequential(nn.Linear(6, d), nn.ReLU())
        self.fc = nn.Linear(d, C)
        self.seen: set = set()

    def pool(self, ids, mask):
        m = mask.unsqueeze(-1).to(self.emb.weight.dtype)
        return (self.emb(ids) * m).sum(1) / m.sum(1).clamp_min(1.0)

    def forward(self, x):
        ids, mask = x
        if not torch.compiler.is_compiling() and not isinstance(ids, torch.fx.Proxy):
            self.seen.add((type(x).__name__, ids.dtype, mask.dtype))
        return self.fc(self.hidden(self.pool(ids, mask)))


class DictBag(TupleBag):
    """Takes a tokenizer's ``{"input_ids", "attention_mask"}``."""

    def forward(self, x):
        self.seen.add((type(x).__name__, x["input_ids"].dtype, x["attention_mask"].dtype))
        return self.fc(self.hidden(self.pool(x["input_ids"], x["attention_mask"])))


class TokenDataset(torch.utils.data.Dataset):
    """Items ``({"input_ids": (L_i,), "attention_mask": (L_i,)}, label)``, or ``(ids (L_i,), label)``
    with ``plain=True`` (for a collate function)."""

    def __init__(self, seqs, y, plain=False):
        self.seqs, self.y, self.plain = seqs, y, plain

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        return (s if self.plain else {"input_ids": s, "attention_mask": torch.ones_like(s)}), int(self.y[i])


def padded(seqs):
    """The whole list padded to its longest: (ids, mask), both (n, L_max) int64."""
    b = pad_collate(seqs)
    return b["input_ids"], b["attention_mask"]


def _weights(clients):
    return [torch.cat([p.detach().flatten() for p in c.model.parameters()]) for c in clients]


def _run(make, mode, **kw):
    clients = make()
    sim = federate(clients, C, out=False, eval_every=0, threads=1, execution=mode, rounds=2, lr=0.3, local_epochs=3,
                   batch_size=8, **kw)
    sim.setup.to_dtype(torch.float64)
    summary = sim.run()
    return clients, sim, summary


def _tuple_clients():
    out = []
    for i in range(3):
        seqs, y = token_task(40, seed=i)
        tseqs, ty = token_task(20, seed=100 + i)
        torch.manual_seed(0)  # one architecture, one initialisation: the batched path groups them
        out.append(Client(TupleBag(), (padded(seqs), y), (padded(tseqs), ty), head="fc"))
    return out


def _dict_dataset_clients():
    out = []
    for i in range(3):
        seqs, y = token_task(40, seed=i)
        tseqs, ty = token_task(20, seed=100 + i)
        torch.manual_seed(0)
        out.append(Client(DictBag(), TokenDataset(seqs, y), TokenDataset(tseqs, ty), head="fc"))
    return out


def test_inputs_structure_helpers():
    """Inputs index, cast and join leaf by leaf; integer leaves keep their dtype."""
    ids = torch.arange(12).reshape(4, 3)
    x = Inputs({"input_ids": ids, "w": torch.ones(4, 2)})
    assert len(x) == 4
    rows = x[torch.tensor([2, 0])]
    assert torch.equal(rows["input_ids"], torch.tensor([[6, 7, 8], [0, 1, 2]]))
    cast = cast_floats(rows, torch.float64)
    assert cast["input_ids"].dtype == torch.int64 and cast["w"].dtype == torch.float64
    both = concat([x, x])
    assert len(both) == 8 and torch.equal(both[5:6]["input_ids"], ids[1:2])
    with pytest.raises(ValueError, match=r"different numbers of rows \[3, 4\]"):
        Inputs((ids, torch.ones(3)))
    b = pad_collate([torch.tensor([5, 6, 7]), torch.tensor([9])])
    assert b["input_ids"].tolist() == [[5, 6, 7], [9, 0, 0]] and b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_token_id_inputs_train_on_every_executor(caplog):
    """A tuple of LongTensors held in memory and a Dataset of tokenizer dicts: the model gets its
    inputs as given (int64 ids, the tuple or dict) on every executor; sequential, auto and batched
    give the same weights in float64 (the tuple clients train batched under torch.func.vmap with
    execution='batched'; Dataset clients train sequentially, said once per client in the log)."""
    caplog.set_level(logging.INFO, logger="fedproto.engine.executors.paths")
    runs = {mode: _run(_tuple_clients, mode) for mode in ("sequential", "auto", "batched")}
    ref = _weights(runs["sequential"][0])
    for mode in ("auto", "batched"):
        for i, (p, q) in enumerate(zip(ref, _weights(runs[mode][0]))):
            assert ((p - q).norm() / p.norm()).item() < BOUND, (mode, i)
        for c in runs[mode][0]:
            assert {(t, a, b) for t, a, b in c.model.seen} == {("tuple", torch.int64, torch.int64)}
    assert (ref[0] - ref[1]).norm() > 1e-3  # the clients differ: the bound is no trivial one
    said = [r.getMessage() for r in caplog.records if "batched path with 2 other client(s)" in r.getMessage()]
    assert len(said) == 3 and "(1, 6) int64" in said[0]  # one line per client, its inputs named
    acc = runs["sequential"][2]["accuracy"]["acc"]["mean"]
    assert acc > 0.55  # 3 classes: chance is 1/3

    caplog.clear()
    druns = {mode: _run(_dict_dataset_clients, mode) for mode in ("sequential", "auto", "batched")}
    dref = _weights(druns["sequential"][0])
    for mode in ("auto", "batched"):
        for p, q in zip(dref, _weights(druns[mode][0])):
            assert torch.equal(p, q)  # every executor trains Dataset clients on the sequential path
        for c in druns[mode][0]:
            assert {(t, a, b) for t, a, b in c.model.seen} == {("dict", torch.int64, torch.int64)}
    said = [r.getMessage() for r in caplog.records if "read from a Dataset item by item" in r.getMessage()]
    assert len(said) == 6  # 3 clients x (auto, batched), once per run each
    # the same numbers as the tuple clients: only the structure of the inputs differs
    for p, q in zip(dref, ref):
        assert ((p - q).norm() / p.norm()).item() < BOUND


def test_variable_length_sequences_with_a_collate_function():
    """Sequences of 3-9 tokens read from a Dataset: refused without a collate function (naming
    pad_collate); with Client(collate=pad_collate) each batch is padded to its longest with a mask,
    and a masked model gives the same numbers as the same data padded once to the longest overall
    and held in memory (float64)."""
    def data(i):
        return token_task(40, seed=i, lengths=(3, 9)), token_task(20, seed=100 + i, lengths=(3, 9))

    def make(kind):
        out = []
        for i in range(3):
            (seqs, y), (tseqs, ty) = data(i)
            torch.manual_seed(0)
            if kind == "collate":
                out.append(Client(DictBag(), TokenDataset(seqs, y, plain=True), TokenDataset(tseqs, ty, plain=True),
                                  head="fc", collate=pad_collate))
            elif kind == "memory":
                ids, mask = padded(seqs)
                tids, tmask = padded(tseqs)
                out.append(Client(DictBag(), ({"input_ids": ids, "attention_mask": mask}, y),
                                  ({"input_ids": tids, "attention_mask": tmask}, ty), head="fc"))
            else:
                out.append(Client(DictBag(), TokenDataset(seqs, y, plain=True), TokenDataset(tseqs, ty, plain=True),
                                  head="fc"))
        return out

    with pytest.raises((DataError, ModelError), match=r"collate=fedproto\.data\.inputs\.pad_collate"):
        federate(make("none"), C, out=False)
    a = _weights(_run(lambda: make("collate"), "sequential")[0])
    b_clients, _, summary = _run(lambda: make("memory"), "batched")
    for p, q in zip(a, _weights(b_clients)):
        assert ((p - q).norm() / p.norm()).item() < BOUND
    assert summary["accuracy"]["acc"]["mean"] > 0.5


def test_fd_and_local_accept_different_embedding_sizes():
    """FD shares per-class logits and Local nothing: clients of embedding sizes 64 and 32 run; FedProto
    (one embedding size) and FedAvg (one architecture) refuse them, naming the methods that run them."""
    from conftest import DigitsTwoOut

    def make():
        clients = own_digits_clients(4)
        for i in (1, 3):
            torch.manual_seed(i)
            clients[i].model = DigitsTwoOut(32)
        return clients

    assert (model_needs(__import__("fedproto.algorithms", fromlist=["FD"]).FD), ) == (LABEL_SPACE,)
    for alg in ("fd", "local"):
        clients = make()
        before = [c.model.out.weight.detach().clone() for c in clients]
        sim = federate(clients, 10, algorithm=alg, rounds=2, lr=0.05, out=False, eval_every=0, threads=1)
        summary = sim.run()
        assert sorted({int(s.model.embedding_dim) for s in sim.setup.states}) == [32, 64]
        assert summary["accuracy"]["acc"]["mean"] > 0.5
        assert all(not torch.equal(c.model.out.weight, w) for c, w in zip(clients, before))  # each trained
    with pytest.raises(ModelError, match=r"d=32: clients \[1, 3\]; d=64: clients \[0, 2\].*fedproto needs one "
                                         r"embedding size.*as they are: .*algorithm='local'.*algorithm='fd'"):
        federate(make(), 10, out=False)
    with pytest.raises(ModelError, match=r"fedavg needs one architecture.*algorithm='fd'"):
        federate(make(), 10, algorithm="fedavg", out=False)
    same_d = own_digits_clients(2)
    same_d[1].model.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
    with pytest.raises(ConfigError, match=r"fedavg averages model weights.*differ at 'net.body.1.weight'.*"
                                          r"algorithm='fedproto'"):
        federate(same_d, 10, algorithm="fedavg", out=False)


def test_each_library_method_states_what_it_needs():
    """The statements the set-up check reads: weight averaging needs one architecture, prototype and
    head sharing one embedding size, FD the label space, Local nothing."""
    from fedproto.algorithms import ALGORITHMS

    want = {"fedavg": ONE_ARCHITECTURE, "fedprox": ONE_ARCHITECTURE, "fedper": ONE_ARCHITECTURE,
            "fedrep": ONE_ARCHITECTURE, "fesem": ONE_ARCHITECTURE, "fedproto": ONE_EMBEDDING,
            "fedtgp": ONE_EMBEDDING, "fedgh": ONE_EMBEDDING, "lgfedavg": ONE_EMBEDDING, "fd": LABEL_SPACE,
            "local": NOTHING}
    assert {n: model_needs(c) for n, c in ALGORITHMS.items()} == want


def test_dp_sgd_takes_token_ids_and_refuses_a_gru_naming_the_fix():
    """DP-SGD (dp='full', Opacus) trains embedding models on integer token ids; a GRU, for which Opacus
    has no per-sample gradients, is refused before round 1 naming opacus.layers.DPGRU."""
    clients = _tuple_clients()
    before = [c.model.emb.weight.detach().clone() for c in clients]
    summary = federate(clients, C, out=False, eval_every=0, threads=1, rounds=1, dp="full", dp_noise=1.0,
                       dp_clip=1.0).run()
    assert all(not torch.equal(c.model.emb.weight, w) for c, w in zip(clients, before))
    assert summary["privacy"]["epsilon_max"] > 0

    class GRUBag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.gru, self.fc = nn.Embedding(VOCAB, 6), nn.GRU(6, 8, batch_first=True), nn.Linear(8, C)

        def forward(self, x):
            return self.fc(self.gru(self.emb(x[0]))[1][-1])

    clients = _tuple_clients()
    clients[2].model = GRUBag()
    with pytest.raises(ConfigError, match=r"clients \[2\] have torch\.nn\.GRU layers.*opacus\.layers\.DPGRU"):
        federate(clients, C, out=False, dp="full", dp_noise=1.0, dp_clip=1.0)


def test_augment_is_refused_for_inputs_that_are_not_images():
    """augment's crops and flips act on (n, C, H, W) images: token-id clients are refused naming them."""
    with pytest.raises(ConfigError, match=r"augment=True crops and flips images .*clients \[0, 1, 2\]"):
        federate(_tuple_clients(), C, out=False, augment=True)
