"""A FedProto round written the way the official code trains: a reference
loop to time fedproto's engine against.

What it models. The official FedProto code (github.com/yuetan031/FedProto, ``exps/federated_main.py``
and ``lib/update.py``) trains one client after another, each with a plain PyTorch loop. This module
does the same for the default MNIST setting (20 clients, ways 3, shots 100, stdev 2, batch 8,
λ = 1), on exactly fedproto's clients: the config comes from :func:`fedproto.config.run_config.build_config`
and the partition, client tensors and initial weights from :func:`fedproto.simulation.prepare`.
One round is:

* for each client in turn: a deep copy of its model; a fresh
  ``DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)``; a fresh
  ``SGD(lr=0.01, momentum=0.5)``; one local epoch of cross-entropy + λ·MSE(h, global prototype of
  each sample's label), the prototype term from round 2 on (when global prototypes exist). The
  target rows are filled sample by sample from a dict of global prototypes, and the embeddings of
  every training pass (train mode, so after Dropout2d) are appended sample by sample to per-label
  lists; the client's local prototype of a label is the mean of its list. The trained weights
  are copied back (``state_dict`` deep copy, ``load_state_dict``) after all clients have trained;
* server: per class, the unweighted mean of the local prototypes of the clients holding it.

The model is a plain ``nn.Module`` of the paper's shape (official ``CNNMnist``): conv 1->10 5x5,
maxpool 2, ReLU, conv 10->20 5x5, Dropout2d(0.5), maxpool 2, ReLU, fc 320->50 ReLU (the embedding
h), dropout 0.5, fc 50->10. Its weights start as a copy of fedproto's client models for the same
seed, so both start from the same point.

Where it differs from the official code (all on purpose, so that the work matches fedproto's
defaults and the timing measures the training loop, not data decoding):

* data: the official loader indexes the torchvision MNIST dataset, which makes a PIL image of
  each uint8 array and applies ``ToTensor`` and ``Normalize`` on every access. Here (default
  ``decode=True``) :class:`PerAccessMNIST` does the same per sample (PIL ``Image.fromarray``,
  /255, normalise) from the uint8 pixels recovered from fedproto's normalised copy (exactly:
  they round back to the same bytes); ``decode=False`` feeds the normalised tensors instead,
  leaving that per-sample cost out;
* last batch: the official loader drops the last partial batch (``drop_last=True``); here it
  follows fedproto's ``drop_last`` (default False: every sample is trained on);
* loss: the official model returns ``log_softmax`` and uses ``NLLLoss``; here ``cross_entropy``
  on the logits (the same value);
* collected embeddings are detached; the official code keeps each row attached to its autograd
  graph until the epoch ends (more memory, the same numbers);
* a client's per-client evaluation here is classifier accuracy only (argmax of the logits, eval
  mode, on the client's own test samples), not the official code's prototype-based accuracy;
* no logging, loss bookkeeping or per-round test passes between rounds.

Usage (one thread: the machine may be shared)::

    FEDPROTO_DATA=/path/to/data python benchmarks/official_style.py --rounds 3 --threads 1

Times measured here are the machine's of the moment; compare them with fedproto's only when
both ran on the same quiet machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset


class OfficialStyleCNN(nn.Module):
    """The paper's MNIST CNN as a plain module; ``forward`` returns (logits, embedding)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, conv2_channels: int = 20,
                 embedding_dim: int = 50, dropout: float = 0.5):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, conv2_channels, kernel_size=5)
        self.conv2_drop = nn.Dropout2d(dropout)
        self.fc1 = nn.Linear(conv2_channels * 4 * 4, embedding_dim)
        self.fc2 = nn.Linear(embedding_dim, num_classes)
        self.p = dropout

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = F.relu(F.max_pool2d(self.conv1(x), 2))
        out = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(out)), 2))
        h = F.relu(self.fc1(out.flatten(1)))
        logits = self.fc2(F.dropout(h, self.p, training=self.training))
        return logits, h


MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


class PerAccessMNIST(Dataset):
    """uint8 MNIST images turned into a normalised (1, 28, 28) float tensor on every access, as
    torchvision's ``MNIST`` with ``ToTensor()`` + ``Normalize((0.1307,), (0.3081,))`` does
    (PIL image, /255, normalise). ``pixels``: (n, 28, 28) uint8; ``labels``: (n,) int64."""

    def __init__(self, pixels: np.ndarray, labels: torch.Tensor):
        self.pixels, self.labels = pixels, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        img = Image.fromarray(self.pixels[i], mode="L")
        t = torch.from_numpy(np.array(img, dtype=np.uint8)).float().div_(255).unsqueeze(0)
        return t.sub_(MNIST_MEAN).div_(MNIST_STD), int(self.labels[i])


def to_pixels(x: torch.Tensor) -> np.ndarray:
    """fedproto's normalised MNIST tensor (n, 1, 28, 28) back to its uint8 pixels (n, 28, 28)."""
    return np.clip(np.rint((x[:, 0].double().numpy() * MNIST_STD + MNIST_MEAN) * 255), 0, 255).astype(np.uint8)


def local_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, global_protos: dict[int, torch.Tensor],
                lam: float, batch_size: int, lr: float, momentum: float, epochs: int, drop_last: bool,
                pixels: np.ndarray | None = None):
    """One client's local update. Returns (state_dict, {label: local prototype}, samples trained).
    With ``pixels`` the loader decodes each sample on access (:class:`PerAccessMNIST`)."""
    ds = PerAccessMNIST(pixels, y) if pixels is not None else TensorDataset(x, y)
    loader = DataLoader(ds, batch_size=batch_size, shuffle=True, drop_last=drop_last)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    model.train()
    collected: dict[int, list[torch.Tensor]] = {}
    seen = 0
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            logits, h = model(xb)
            loss = F.cross_entropy(logits, yb)
            if global_protos:
                target = h.detach().clone()
                for i, label in enumerate(yb.tolist()):
                    if label in global_protos:
                        target[i] = global_protos[label]
                loss = loss + lam * F.mse_loss(h, target)
            loss.backward()
            opt.step()
            seen += len(yb)
            for i, label in enumerate(yb.tolist()):
                collected.setdefault(label, []).append(h[i].detach())
    local = {}
    for label, rows in collected.items():
        acc = torch.zeros_like(rows[0])
        for r in rows:
            acc += r
        local[label] = acc / len(rows)
    return copy.deepcopy(model.state_dict()), local, seen


def aggregate(local_protos: list[dict[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Per class, the unweighted mean over the clients that hold it."""
    by_label: dict[int, list[torch.Tensor]] = {}
    for protos in local_protos:
        for label, p in protos.items():
            by_label.setdefault(label, []).append(p)
    return {label: torch.stack(ps).mean(0) for label, ps in by_label.items()}


@torch.no_grad()
def classifier_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return float((model(x)[0].argmax(1) == y).float().mean())


def official_round_times(cfg_overrides: dict | None = None, rounds: int = 3, threads: int | None = 1,
                         decode: bool = True) -> dict:
    """Run ``rounds`` official-style rounds on fedproto's own clients for the config
    ``build_config(overrides=cfg_overrides)`` (default: the paper's MNIST setting).

    Returns a dict: ``round_times_s`` (wall seconds per round, list), ``median_round_s``,
    ``samples_per_round`` (training samples passed through the models per round, all clients),
    ``clients``, ``accuracy`` (mean over clients of the classifier accuracy on each client's own
    test samples after the last round), ``accuracy_std`` and ``accuracy_per_client``.
    ``decode``: decode each MNIST sample on access as the official loader does (:class:`PerAccessMNIST`).
    """
    if threads:
        torch.set_num_threads(threads)
    from fedproto.config.run_config import build_config
    from fedproto.models.cnn import PaperCNN
    from fedproto.simulation import prepare

    overrides = {"rounds": rounds, **(cfg_overrides or {})}
    cfg = build_config(overrides=overrides)
    if cfg.algorithm != "fedproto" or cfg.device != "cpu":
        raise ValueError("the official-style loop models FedProto on the CPU")
    setup = prepare(cfg, progress=False)
    torch.manual_seed(cfg.seed)
    models = []
    for s in setup.states:
        m = s.model
        if not isinstance(m, PaperCNN) or m.kernel != 5:
            raise ValueError("the official-style loop models the paper CNN on 28x28 inputs (model cnn/cnn-mh)")
        ref = OfficialStyleCNN(m.in_channels, m.num_classes, m.conv2.out_channels, m.embedding_dim, m.dropout)
        ref.load_state_dict(m.state_dict())  # same start as fedproto's client
        models.append(ref)
    data = setup.data
    lam = cfg.lam
    pixels = [to_pixels(d.x) if decode and cfg.dataset == "mnist" else None for d in data]
    global_protos: dict[int, torch.Tensor] = {}
    times, samples = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        weights, local_protos, seen = [], [], 0
        for model, d, px in zip(models, data, pixels):
            w, protos, n = local_train(copy.deepcopy(model), d.x, d.y, global_protos, lam, cfg.batch_size,
                                       cfg.lr, cfg.momentum, cfg.local_epochs, cfg.drop_last, px)
            weights.append(w)
            local_protos.append(protos)
            seen += n
        for model, w in zip(models, weights):
            model.load_state_dict(w)
        global_protos = aggregate(local_protos)
        times.append(time.perf_counter() - t)
        samples.append(seen)
    accs = [classifier_accuracy(m, d.test_x, d.test_y) for m, d in zip(models, data)]
    return {
        "round_times_s": times,
        "median_round_s": statistics.median(times),
        "samples_per_round": samples[-1],
        "clients": len(models),
        "accuracy": statistics.fmean(accs),
        "accuracy_std": statistics.pstdev(accs),
        "accuracy_per_client": accs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides, JSON values (e.g. clients=10 seed=7)")
    args = ap.parse_args()
    overrides = {}
    for kv in args.set:
        k, _, v = kv.partition("=")
        try:
            overrides[k] = json.loads(v)
        except json.JSONDecodeError:
            overrides[k] = v
    out = official_round_times(overrides, args.rounds, args.threads or None)
    print(f"rounds: {args.rounds}, clients: {out['clients']}, samples per round: {out['samples_per_round']}")
    print("round times (s): " + ", ".join(f"{t:.3f}" for t in out["round_times_s"]))
    print(f"median round: {out['median_round_s']:.3f} s")
    print(f"classifier accuracy after the last round: {100 * out['accuracy']:.2f} ± {100 * out['accuracy_std']:.2f} "
          "% (mean ± std over clients)")


if __name__ == "__main__":
    main()
