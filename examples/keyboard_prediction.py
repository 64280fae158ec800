"""Keyboard next-word prediction across phone brands (the practitioner's guide's second use case):
each brand's keyboard learns from its own users' texts, with its own model, and never uploads
them.

    pip install "fedproto[examples]"
    python examples/keyboard_prediction.py                 # the table of docs/usecase-keyboard.md
    python examples/keyboard_prediction.py --rounds 3 --seeds 1

Data: the Lee news corpus that gensim ships inside its package (``gensim/test/test_data/
lee_background.cor``: 300 Australian news articles, about 60,000 words), read from the installed
files, no download. Words are lowercased; the vocabulary is the 1,000 most frequent words (id 0
pads, 1,001 stands for any other word). The task: given up to the 6 previous words of an
article, predict the next word among the 10 most frequent ones (a keyboard's top suggestions;
positions whose next word is another are left out). The articles are dealt out to 6 brands
(``--clients``), 50 each: each brand's users write about their own stories (user skew), and 20% of
a brand's articles are its test texts. Inputs are what a tokenizer gives, a dict
``{"input_ids": (n, 6) int64, "attention_mask": (n, 6) int64}`` (contexts shorter than 6 words
are padded on the left), passed to the models as they are.

Brands 0, 2, 4 run an embedding bag (the mean of the context's word embeddings, then a hidden
layer); brands 1, 3, 5 a GRU over the context. Both end in a 32-d embedding and a final ``fc``.

Prints a Markdown table: FedProto, Local and FD over 3 seeds (top-1 accuracy of each brand's own
model on its own test texts, mean over brands).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn
from usecase_table import NAMES, add_arguments, compare

from fedproto.federation import Client

VOCAB = 1000
PAD, UNK = 0, VOCAB + 1
CONTEXT = 6
CLASSES = 10
EMBEDDING = 32


class BagNet(nn.Module):
    """The masked mean of the context's word embeddings -> a hidden layer (32-d embedding) -> ``fc``."""

    def __init__(self, num_classes: int = CLASSES, embedding_dim: int = EMBEDDING):
        super().__init__()
        self.emb = nn.Embedding(VOCAB + 2, 32, padding_idx=PAD)
        self.hidden = nn.Sequential(nn.Linear(32, embedding_dim), nn.ReLU())
        self.fc = nn.Linear(embedding_dim, num_classes)

    def forward(self, x):
        mask = x["attention_mask"].unsqueeze(-1).to(self.emb.weight.dtype)
        mean = (self.emb(x["input_ids"]) * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        return self.fc(self.hidden(mean))


class GRUNet(nn.Module):
    """A GRU over the context's word embeddings (left-padded, so its last step is the last word);
    its last hidden state (32-d embedding) -> ``fc``."""

    def __init__(self, num_classes: int = CLASSES, embedding_dim: int = EMBEDDING):
        super().__init__()
        self.emb = nn.Embedding(VOCAB + 2, 24, padding_idx=PAD)
        self.gru = nn.GRU(24, embedding_dim, batch_first=True)
        self.fc = nn.Linear(embedding_dim, num_classes)

    def forward(self, x):
        _, h = self.gru(self.emb(x["input_ids"]))
        return self.fc(h[-1])


def bag_model(num_classes: int = CLASSES, embedding_dim: int = EMBEDDING) -> nn.Module:
    """A Flower node's model factory (node config ``model="keyboard_prediction:bag_model"``)."""
    return BagNet(num_classes, embedding_dim)


def gru_model(num_classes: int = CLASSES, embedding_dim: int = EMBEDDING) -> nn.Module:
    """A Flower node's model factory (node config ``model="keyboard_prediction:gru_model"``)."""
    return GRUNet(num_classes, embedding_dim)


def corpus_path() -> Path:
    """The Lee background corpus inside the installed gensim package (found without importing it)."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit('this example reads a corpus gensim ships: pip install "fedproto[examples]"')
    return Path(spec.submodule_search_locations[0]) / "test" / "test_data" / "lee_background.cor"


@functools.cache
def articles() -> tuple[list[list[int]], list[str]]:
    """Every article as word ids, and the 10 target words (the most frequent), ids 1..10."""
    docs = [re.findall(r"[a-z]+(?:'[a-z]+)?", line.lower()) for line in corpus_path().read_text().splitlines()]
    counts = Counter(w for d in docs for w in d)
    words = [w for w, _ in counts.most_common(VOCAB)]
    ids = {w: i + 1 for i, w in enumerate(words)}
    return [[ids.get(w, UNK) for w in d] for d in docs], words[:CLASSES]


def samples(docs: list[list[int]]):
    """(dict of (n, CONTEXT) int64 input_ids and attention_mask, (n,) labels 0..9): every position of
    ``docs`` whose next word is a target, with up to CONTEXT previous words (left-padded)."""
    ids, mask, y = [], [], []
    for d in docs:
        for t in range(1, len(d)):
            if 1 <= d[t] <= CLASSES:
                ctx = d[max(0, t - CONTEXT):t]
                ids.append([PAD] * (CONTEXT - len(ctx)) + ctx)
                mask.append([0] * (CONTEXT - len(ctx)) + [1] * len(ctx))
                y.append(d[t] - 1)
    x = {"input_ids": torch.tensor(ids, dtype=torch.long), "attention_mask": torch.tensor(mask, dtype=torch.long)}
    return x, torch.tensor(y, dtype=torch.long)


def cap(split, n: int, rng: np.random.Generator):
    """At most ``n`` samples of a split, drawn without replacement."""
    x, y = split
    keep = torch.as_tensor(np.sort(rng.permutation(len(y))[:n]))
    return {k: v[keep] for k, v in x.items()}, y[keep]


def brand_split(seed: int, clients: int = 6, train: int = 1000, test: int = 200):
    """Per brand: (train, test) as (dict of inputs, labels); articles dealt out by ``seed``."""
    docs, _ = articles()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(docs))
    out = []
    for b in range(clients):
        mine = [docs[i] for i in order[b::clients]]
        n_test = max(1, len(mine) // 5)
        out.append((cap(samples(mine[n_test:]), train, rng), cap(samples(mine[:n_test]), test, rng)))
    return out


def make_clients(seed: int, clients: int = 6) -> list[Client]:
    """The brands of ``seed``: an embedding bag at even brands, a GRU at odd ones."""
    torch.manual_seed(seed)
    return [Client(BagNet() if b % 2 == 0 else GRUNet(), train, test, head="fc")
            for b, (train, test) in enumerate(brand_split(seed, clients))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, rounds=10)
    parser.add_argument("--clients", type=int, default=6, help="phone brands")
    args = parser.parse_args(argv)
    _, targets = articles()
    print(f"next-word targets: {', '.join(targets)}")
    runs = [(f"{NAMES.get(m, m)} (embedding bag and GRU)", m, lambda s: make_clients(s, args.clients))
            for m in args.methods]
    return compare(runs, CLASSES, args.seeds, title=f"Next-word prediction at {args.clients} brands",
                   rounds=args.rounds, lr=0.05, momentum=0.9, batch_size=32, threads=args.threads)


if __name__ == "__main__":
    main()
