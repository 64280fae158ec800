"""Your own federation (fedproto.federation): a Dataset's items are the data (labels as the Dataset
yields them, dtypes kept: float64 trains in float64), a NaN is named before training, and the
docs' snippets run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SmallCNN, client_splits, digits_clients_partition
from torch import nn

from fedproto.errors import ConfigError, DataError, ModelError
from fedproto.federation import Client, federate


@pytest.fixture(scope="module")
def digits():
    return digits_clients_partition()


class Relabelled(torch.utils.data.Dataset):
    """A map-style Dataset with a ``targets`` attribute whose items carry other labels: through
    ``target_transform`` or through its own ``__getitem__`` (``remap``)."""

    def __init__(self, x, y, target_transform=None, remap=None):
        self.x, self._y = x, y.tolist()
        self.targets = list(self._y)  # what torchvision's datasets hold: the labels before any transform
        self.target_transform, self.remap = target_transform, remap
        self.reads = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.reads += 1
        y = self._y[i]
        if self.remap is not None:
            y = self.remap[y]
        return self.x[i], self.target_transform(y) if self.target_transform else y


class TorchvisionLike(Relabelled):
    """Stands for torchvision's MNIST/CIFAR10: ``__getitem__`` of a torchvision.datasets module."""

    def __getitem__(self, i):
        return super().__getitem__(i)


TorchvisionLike.__getitem__.__module__ = "torchvision.datasets.mnist"


def _relabelled_clients(digits, make):
    out = []
    for i, ((x, y), (tx, ty)) in enumerate(client_splits(*digits)):
        torch.manual_seed(i)
        out.append(Client(SmallCNN(), make(x, y), make(tx, ty), head="fc"))
    return out


@pytest.mark.parametrize("how", ["target_transform", "getitem"])
def test_labels_are_what_the_dataset_yields(digits, how):
    shift = {c: (c + 3) % 10 for c in range(10)}
    if how == "target_transform":
        make = lambda x, y: Relabelled(x, y, target_transform=lambda t: (t + 3) % 10)  # noqa: E731
    else:
        make = lambda x, y: Relabelled(x, y, remap=shift)  # noqa: E731
    clients = _relabelled_clients(digits, make)
    sim = federate(clients, 10, out=False, threads=1)
    for i, ((_, y), (_, ty)) in enumerate(client_splits(*digits)):
        assert torch.equal(sim.setup.data[i].y.cpu(), (y + 3) % 10)  # training labels
        assert torch.equal(sim.setup.data[i].test_y.cpu(), (ty + 3) % 10)  # scoring labels
        assert sorted(sim.setup.states[i].classes.tolist()) == sorted(((y + 3) % 10).unique().tolist())


def test_torchvision_targets_fast_path_only_when_the_items_agree(digits):
    from fedproto.federation import LABEL_CHECKS, dataset_labels

    (x, y), _ = next(client_splits(*digits))
    ds = TorchvisionLike(x, y)
    assert np.array_equal(dataset_labels(ds), y.numpy())
    assert ds.reads <= LABEL_CHECKS < len(ds)  # targets used, checked on a sample of the items
    ds = TorchvisionLike(x, y, target_transform=lambda t: (t + 1) % 10)  # a transform: every item is read
    assert np.array_equal(dataset_labels(ds), ((y + 1) % 10).numpy()) and ds.reads == len(ds)
    ds = TorchvisionLike(x, y)
    ds.targets[-1] = (ds.targets[-1] + 1) % 10  # targets that disagree with a sampled item (the last): not used
    labels = dataset_labels(ds)
    assert np.array_equal(labels, y.numpy()) and not np.array_equal(labels, ds.targets)


class PILImages(torch.utils.data.Dataset):
    def __init__(self, n):
        from PIL import Image

        self.items = [(Image.new("L", (8, 8), i), i % 3) for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([(torch.zeros(1, 8, 8), 0)])


class StrLabels(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], "cat" if i == 4 else int(self.y[i])


def test_errors_users_hit_name_the_value_and_the_fix(digits):
    from fedproto.errors import DataError, ModelError

    (x, y), test = next(client_splits(*digits))

    def fails(exc, pattern, **change):
        c = {"model": SmallCNN(), "train": (x, y), "test": test, "head": "fc", **change}
        with pytest.raises(exc, match=pattern):
            federate([Client(**c)], 10, out=False)

    fails(DataError, r"client 0: train: item 0's input is a PIL image \(PIL.Image.Image\), not a tensor; give the "
                     r"Dataset a tensor transform, e.g. transform=torchvision.transforms.ToTensor\(\)",
          train=PILImages(12))
    fails(DataError, r"client 0: cannot read train labels as integers: label 'cat' \(item 4\) is a str, not an "
                     r"integer class id; map each class to an id 0..C-1", train=StrLabels(x, y))
    fails(DataError, r"label 'dog' \(item 0\) is a str", test=(test[0], ["dog"] * len(test[0])))
    fails(DataError, r"label 'b' \(item 0\) is a str", train=(x, np.array(["b"] * len(x))))
    fails(DataError, r"client 0: train is an IterableDataset \(Stream\).*give a map-style Dataset", train=Stream())
    with torch.device("meta"):
        meta = SmallCNN()
    fails(ModelError, r"client 0: the model's weights are on the meta device.*model.to_empty\(device='cpu'\)",
          model=meta)


def test_the_readme_own_models_snippet_runs_as_pasted(capsys):
    """The README's own-models snippet was pseudocode (a SyntaxError when pasted): it is now run as written,
    and its five clients, each on its own four digits, end far above chance (25 % on four classes)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "fedproto.federation" in b]
    assert len(blocks) == 1
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    acc = scope["summary"]["accuracy"]["acc"]
    assert scope["summary"]["clients"] == 5 and acc["mean"] > 0.6, acc
    assert str(acc) in capsys.readouterr().out


class DtypeProbe(nn.Module):
    """A user's model that records the dtype of every floating input it is called with (a dict's ``x`` too)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.out = nn.Linear(8, 3)
        self.seen: set = set()

    def forward(self, x):
        x = x["x"] if isinstance(x, dict) else x
        self.seen.add(x.dtype)
        h = self.body(x)
        return self.out(h), h


class Rows(torch.utils.data.Dataset):
    """A map-style Dataset of (x row, label) items, x rows as numpy arrays or tensors."""

    def __init__(self, x, y, as_numpy=False):
        self.x, self.y, self.as_numpy = x, y, as_numpy

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return (self.x[i].numpy() if self.as_numpy else self.x[i]), int(self.y[i])


def _rows(seed, n=24, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    return (torch.randn(n, 4, generator=g, dtype=torch.float64) + 3 * y[:, None]).to(dtype), y


def test_float64_inputs_train_in_float64_on_every_route(caplog):
    import logging

    def stack(items):  # a user's collate: numpy rows -> one tensor, their dtype kept
        return torch.stack([torch.as_tensor(a) for a in items])

    routes = {"tensors": lambda x, y: (x, y), "arrays": lambda x, y: (x.numpy(), y.numpy()),
              "dict": lambda x, y: ({"x": x}, y), "dataset": lambda x, y: Rows(x, y),
              "dataset+collate": lambda x, y: Rows(x, y, as_numpy=True)}
    clients = []
    for i, (route, make) in enumerate(routes.items()):
        torch.manual_seed(i)
        (x, y), (tx, ty) = _rows(i), _rows(100 + i)
        clients.append(Client(DtypeProbe().double(), make(x, y), make(tx, ty),
                              collate=stack if route == "dataset+collate" else None))
    with caplog.at_level(logging.INFO, logger="fedproto.federation.own_data"):
        sim = federate(clients, num_classes=3, rounds=2, lr=0.05, local_epochs=5, threads=1, eval_every=0, out=False)
        summary = sim.run()
    assert "cast to" not in caplog.text  # float64 inputs, float64 models: nothing cast
    for route, c in zip(routes, clients):
        assert c.model.seen == {torch.float64}, route  # training and evaluation, every batch
        assert {p.dtype for p in c.model.parameters()} == {torch.float64}, route
    assert summary["accuracy"]["acc"]["mean"] > 0.5  # classes 3 apart in every feature: learnt in two rounds

    # float16 and float64 inputs of a float32 model: cast to float32 on every route, logged once per client and split
    clients = []
    for i, (route, make) in enumerate(routes.items()):
        (x, y), (tx, ty) = _rows(i, dtype=torch.float16 if i % 2 else torch.float64), _rows(100 + i)
        clients.append(Client(DtypeProbe(), make(x, y), make(tx, ty), collate=stack if "collate" in route else None))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedproto.federation.own_data"):
        federate(clients, num_classes=3, rounds=1, threads=1, eval_every=0, out=False).run()
    for route, c in zip(routes, clients):
        assert c.model.seen == {torch.float32}, route
    casts = [r.getMessage() for r in caplog.records if "cast to" in r.getMessage()]
    assert len(casts) == 2 * len(routes)
    assert casts[0].startswith("client 0: its train inputs are float64, cast to float32, the dtype of its model")
    assert casts[2].startswith("client 1: its train inputs are float16, cast to float32")

    # a float64 model with a projection appended (Client(embedding_dim=...)): the projection is float64 too
    proj = DtypeProbe().double()
    federate([Client(proj, *[_rows(s) for s in (0, 1)], embedding_dim=5)], num_classes=3, rounds=1, threads=1,
             eval_every=0, out=False).run()
    assert proj.seen == {torch.float64}

    # a model whose layers differ in dtype: the mismatch is named as such, with both dtypes and the fix
    mixed = DtypeProbe().double()
    mixed.out.float()
    with pytest.raises(ModelError, match=r"client 0: dtype mismatch: its parameters mix float64 \('body.0.weight'\) "
                                         r"and float32 \('out.weight'\); .*model.double\(\)"):
        federate([Client(mixed, *[_rows(s) for s in (0, 1)])], num_classes=3, rounds=1, threads=1, out=False)


class LaterNaN(Rows):
    """Rows whose NaN shows only from an item's second read on (a transform gone wrong later): the
    set-up's label pass reads every item clean."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        self.read = getattr(self, "read", set())
        first = i not in self.read
        self.read.add(i)
        return (torch.nan_to_num(x) if first else x), y


class DictRows(Rows):
    """Rows whose input is a dict ``{"x": row}`` (a field named in messages)."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return {"x": x}, y


def test_a_nan_inside_a_dataset_is_named_before_training(monkeypatch, tmp_path):
    from conftest import csv_rows

    import fedproto.federation.own_data as fdata

    def clients(bad_split=None, bad_item=13, cid=1, kind=Rows):
        out = []
        for i in range(3):
            (x, y), (tx, ty) = _rows(i, dtype=torch.float32), _rows(100 + i, dtype=torch.float32)
            if i == cid and bad_split is not None:
                (x if bad_split == "train" else tx)[bad_item, 2] = float("nan")
            torch.manual_seed(i)
            out.append(Client(DtypeProbe(), kind(x, y), kind(tx, ty)))
        return out

    opts = dict(num_classes=3, rounds=1, threads=1, eval_every=0)
    # every item of a small Dataset is scanned before round 1: the client, the split, the item and the field
    with pytest.raises(DataError, match=r"^client 1: train item 13: its input\['x'\] holds NaN or infinite values; "
                                        r"clean or drop that item"):
        federate(clients("train", kind=DictRows), out=False, **opts)
    with pytest.raises(DataError, match=r"^client 1: test item 13: its input holds NaN or infinite values"):
        federate(clients("test"), out=False, **opts)
    # a large Dataset: still every item, in the pass that reads its labels (NAN_SCAN_ITEMS: torchvision's only)
    monkeypatch.setattr(fdata, "NAN_SCAN_ITEMS", 4)
    with pytest.raises(DataError, match=r"^client 1: train item 13: its input holds NaN or infinite values"):
        federate(clients("train"), out=False, **opts)
    # NaN only on a later read: the training batch that reads it stops the run
    sim = federate(clients("train", kind=LaterNaN), out=False, **opts)
    with pytest.raises(DataError, match=r"^client 1: train item 13: its input holds NaN or infinite values"):
        sim.run()
    # a test item read at evaluation: its client is left out of the headline, with the reason
    summary = federate(clients("test", kind=LaterNaN), out=tmp_path / "run", **opts).run()
    why = "its test data hold NaN or infinite values (1 item(s), first item 13's input); clean or drop them"
    assert summary["left_out"] == {"1": why} and summary["clients_in_accuracy"] == 2
    rows = csv_rows(tmp_path / "run" / "clients.csv")
    assert [r["left_out"] for r in rows] == ["", why, ""]
    accs = [float(r["acc"]) for r in rows]
    assert summary["accuracy"]["acc"]["mean"] == pytest.approx((accs[0] + accs[2]) / 2, abs=1e-6)


def test_a_nan_in_nested_in_memory_inputs_names_the_item_and_field():
    """Reported: x["a"]["b"] with a NaN said only "train inputs hold NaN"; now as the Dataset route words it."""
    clients = []
    for i in range(2):
        (x, y), (tx, ty) = _rows(i, dtype=torch.float32), _rows(100 + i, dtype=torch.float32)
        if i == 1:
            x = x.clone()
            x[7, 1] = float("inf")
        clients.append(Client(NestedDict(), ({"a": {"b": x}}, y), ({"a": {"b": tx}}, ty)))
    with pytest.raises(DataError, match=r"^client 1: train item 7: its input\['a'\]\['b'\] holds NaN or infinite "
                                        r"values; clean or drop that item \(its row\)"):
        federate(clients, num_classes=3, rounds=1, threads=1, eval_every=0, out=False)


class NestedDict(nn.Module):
    """DtypeProbe's layers on an input dict {"a": {"b": rows}}."""

    def __init__(self):
        super().__init__()
        self.inner = DtypeProbe()

    def forward(self, x):
        return self.inner(x["a"]["b"])


class Widths(nn.Module):
    """A user's model whose hidden width is a parameter (the embedding stays 8)."""

    def __init__(self, width):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 8))
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.body(x)
        return self.out(h), h


def test_fedavg_refuses_two_widths_with_a_fix_for_your_own_models():
    (x, y), (tx, ty) = _rows(0, dtype=torch.float32), _rows(1, dtype=torch.float32)
    with pytest.raises(ConfigError) as e:
        federate([Client(Widths(8), (x, y), (tx, ty)), Client(Widths(16), (x, y), (tx, ty))], num_classes=3,
                 algorithm="fedavg", out=False)
    msg = str(e.value)
    assert "(16, 4) vs (8, 4)" in msg and "model='cnn'" not in msg  # no zoo model to a user with their own
    assert "Give every client a model of one architecture (the same class and layer sizes)" in msg
    assert "algorithm='fedproto'" in msg  # a method that runs these models as they are


def test_a_list_of_variable_length_sequences_in_memory_trains_with_collate():
    from fedproto.data.inputs import pad_collate

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 8)
            self.out = nn.Linear(8, 3)

        def forward(self, x):
            ids, mask = x["input_ids"], x["attention_mask"].unsqueeze(-1).float()
            h = (self.emb(ids) * mask).sum(1) / mask.sum(1).clamp_min(1.0)  # mean over the tokens, padding left out
            return self.out(h), h

    g = torch.Generator().manual_seed(0)
    y = torch.arange(24) % 3
    seqs = [torch.randint(6 * int(c), 6 * int(c) + 6, (3 + i % 5,), generator=g) for i, c in enumerate(y)]
    clients = [Client(Bag(), (seqs, y), (seqs[:12], y[:12]), collate=pad_collate) for _ in range(2)]
    summary = federate(clients, num_classes=3, rounds=2, local_epochs=3, lr=0.1, threads=1, eval_every=0,
                       out=False).run()
    assert summary["accuracy"]["acc"]["mean"] > 0.6  # tokens of disjoint ranges per class: learnt
    with pytest.raises(DataError, match=r"client 0: cannot read its train inputs"):  # without collate: refused
        federate([Client(Bag(), (seqs, y), (seqs, y))], num_classes=3, out=False)


def test_the_own_federation_page_s_snippets_run_or_say_they_are_fragments():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "own-federation.md").read_text(encoding="utf-8")
    script = (root / "examples" / "own_federation.py").read_text(encoding="utf-8").rstrip()
    blocks = re.findall(r"```python\n(.*?)\n```", page, re.S)
    assert len(blocks) >= 3 and blocks.count(script) == 1
    fragments = [b for b in blocks if b != script]
    assert all(re.match(r"# (a fragment|fragments)\b", b) for b in fragments), [b.splitlines()[0] for b in fragments]


def test_a_model_vmap_cannot_batch_is_named_by_its_own_class(caplog):
    import logging

    class ItemGate(nn.Module):
        """A classifier whose forward reads a value in Python (.item()): torch.func.vmap cannot batch it."""

        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
            self.fc = nn.Linear(8, 3)

        def forward(self, x):
            h = self.features(x)
            return self.fc(h * (1.0 if h.sum().item() >= 0 else 0.5))

    clients = [Client(ItemGate(), _rows(i, dtype=torch.float32), _rows(10 + i, dtype=torch.float32), head="fc")
               for i in range(2)]
    with caplog.at_level(logging.INFO, logger="fedproto.engine.executors.batched"):
        federate(clients, num_classes=3, rounds=1, threads=1, eval_every=0, execution="batched", out=False).run()
    msgs = [r.getMessage() for r in caplog.records if "torch.func.vmap cannot batch them" in r.getMessage()]
    assert msgs and msgs[0].startswith("ItemGate models train one client after another")
