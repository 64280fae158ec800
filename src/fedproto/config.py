"""Validated run configuration: defaults < TOML file (``--config``) < command-line flags.

Every value is checked before any training starts; errors are :class:`fedproto.errors.ConfigError`
naming the field, the bad value and what is allowed.

Size: about 700 lines: the common options' fields with their descriptions (the flags' help and the
options page are generated from them), their checks, run names and the TOML reader, kept together so
an option's declaration and its checks sit side by side.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedproto.data.registry import DATASETS as REGISTRY
from fedproto.errors import NO_VALUE, UNKNOWN, ConfigError, RawValue, opt, register_option_names, same_value
from fedproto.models.names import MODEL_NAMES, zoo_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DATASETS = REGISTRY
"""Every dataset by name: :data:`fedproto.data.registry.DATASETS`."""


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=-]{0,199}")
"""A run name: one plain folder name (no path separators, spaces or shell-special characters)."""


RESULT_NEUTRAL = ("data_dir", "download", "out_dir", "name", "threads", "checkpoint_every", "group_size",
                  "proto_dist_alert", "device", "workers", "save_models", "tensorboard",
                  "secagg_threshold", "secagg_neighbours")
"""RunConfig fields that never change a run's numbers (where files are, how many threads, how
many clients one batched computation holds)."""

ADDED_FIELDS = {"personal_layers": "head", "lambda_warmup": 0, "proto_momentum": 0.0, "proto_normalize": False,
               "min_proto_samples": 1, "participation": 1.0, "alpha": 0.5, "min_client_samples": 10, "classes": None,
               "device": "cpu",
               "trim": 0.2, "min_contributors": 1, "exclude_outliers": 0.0, "lambda_schedule": "linear",
               "freeze_after": 0, "eval_full_test": False, "dp": "off", "dp_noise": 1.0, "dp_clip": 5.0,
               "dp_grad_clip": 1.0, "dp_delta": 1e-5, "attack": "none", "attackers": 0, "attack_scale": 100.0,
               "overlap": False, "dp_reproducible_noise": True, "class_check": 0.0, "optimizer": "sgd",
               "lr_schedule": "constant", "lr_step_rounds": 30, "lr_gamma": 0.1, "lr_min": 0.0, "shared_init": False,
               "secagg": False, "secagg_honest": 2}
"""Fields added after results were stored, with the behaviour older runs had: a stored config
without the field is compared as if it held this value (older FedPer/FedRep runs kept only the
last layer on the client, so they are run again under today's default ``fc``; the FedProto
practitioner options were off; every client took part in every round; no Dirichlet partition; clients
never shared training samples; DP noise was drawn from the run's seed)."""


def result_fields(cfg: dict) -> dict[str, Any]:
    """The fields of a config dict that can change a run's numbers: all run options but
    :data:`RESULT_NEUTRAL` and the options of other algorithms than the run's
    (:func:`fedproto.algorithms.options.owners`), and ``personal_layers`` for ResNet18 (whose only
    fully connected layer is its head, so both values are one split) and ``dp_reproducible_noise``
    without DP. Used to decide whether a checkpoint may be resumed and whether a reproduce cell is
    already done."""
    from fedproto.algorithms.options import owners

    algorithm = cfg.get("algorithm", CommonConfig.model_fields["algorithm"].default)
    fields = config_model().model_fields
    out = {k: v for k, v in cfg.items() if k in fields and k not in RESULT_NEUTRAL
           and (k in CommonConfig.model_fields or algorithm in owners(k))}
    if all((z := zoo_name(m)) is not None and z.family == "resnet18" for m in str(cfg.get("model", "")).split(",")):
        out.pop("personal_layers", None)
    if out.get("dp", "off") == "off":
        out.pop("dp_reproducible_noise", None)  # the noise source acts only under DP
    return out


class CommonConfig(BaseModel):
    """The options every run has, whatever its algorithm (data, partition, model, training, engine,
    output); :class:`RunConfig` adds every method's own options (:mod:`fedproto.algorithms.options`).
    Defaults are the paper's MNIST setting (§Experiments, app. A)."""

    # strict: TOML `clients = true` or `lr = "0.1"` is an error, not 1 or 0.1; frozen: a config is
    # checked once as a whole (derive a new one with build_config(overrides={**cfg.model_dump(), ...}))
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    # data and partition
    dataset: str = Field("mnist", description="Dataset: " + " | ".join(n for n in REGISTRY if n != "custom"))
    classes: Optional[int] = Field(None, ge=2, le=1_000_000, json_schema_extra={"python_only": True},
                                   description="Number of classes C of your own clients (dataset custom, which "
                                   "fedproto.federation.federate sets with it; not for the command line)")
    data_dir: Optional[str] = Field(None, description="Folder with the dataset files (else $FEDPROTO_DATA, "
                                    "else the user cache)")
    download: bool = Field(True, description="Download missing files (checked against checksums)")
    clients: int = Field(20, ge=1, le=1_000_000, description="Number of clients m")
    ways: int = Field(3, ge=1, le=100_000, description="Average classes per client n")
    shots: int = Field(None, ge=1, le=10_000_000, validate_default=False,
                       description="Average training samples per class k (paper: 100; the shared 5% FEMNIST "
                       "sample holds too few writers' samples for that: use about 10 there)")
    stdev: int = Field(None, ge=0, le=10_000_000, validate_default=False,
                       description="Spread of n and k across clients (tab. 1)")
    test_shots: int = Field(None, ge=1, le=10_000_000, validate_default=False,
                            description="Test samples per own class per client")
    overlap: bool = Field(False, description="Partition fewshot: where a class runs short, let clients share its "
                          "training samples (each client's own samples stay distinct; off: disjoint clients, a "
                          "short class is an error)")
    noise: Literal["uniform", "gaussian"] = Field("uniform", description="How n and k spread across clients: "
                                                  "uniform (official code) or gaussian (paper)")
    partition: Literal["fewshot", "natural", "dirichlet"] = Field(
        "fewshot", description="fewshot (n-way k-shot, paper), natural (one client per FEMNIST writer) or "
        "dirichlet (label skew, see alpha)")
    alpha: float = Field(0.5, gt=0.0, le=1e6, description="Dirichlet concentration for partition dirichlet "
                         "(0.1: strong skew, 100: about IID)")
    min_client_samples: int = Field(10, ge=1, le=10_000_000, description="Dirichlet: redraw until every client "
                                    "holds this many training samples")
    augment: bool = Field(False, description="Random crop (pad 4) and horizontal flip at train time (CIFAR-10)")
    # method and model
    algorithm: str = Field("fedproto", description="fedproto | local | fedavg | fedprox | fedper | fedrep | fesem | "
                           "fedtgp | fd | fedgh | lgfedavg")
    model: str = Field(None, validate_default=False, description=" | ".join(MODEL_NAMES).replace("[,...]", "")
                       + ", or a comma list of these, one per client in turn")
    pretrained: Optional[str] = Field(None, description="ResNet18 state dict file (torchvision layout) loaded "
                                      "into all but conv1, bn1 and fc")
    embedding_dim: int = Field(50, ge=1, le=65_536, description="Embedding (prototype) size d of the zoo models "
                               "that take one (cnn, projcnn; resnet18's is 512)")
    dropout: float = Field(0.5, ge=0.0, lt=1.0, description="Dropout p of the CNN")
    # training
    rounds: int = Field(None, ge=1, le=10_000_000, validate_default=False,
                        description="Communication rounds (tab. 1)")
    local_epochs: int = Field(1, ge=1, le=100_000, description="Local epochs per round")
    participation: float = Field(1.0, gt=0.0, le=1_000_000, description="Clients per round: a fraction in "
                                 "(0, 1] (max(1, round(fraction x clients)) take part) or a whole number of "
                                 "clients; 1: every client, as in the paper")
    batch_size: int = Field(8, ge=1, le=10_000_000, description="Local batch size (app. A)")
    lr: float = Field(0.01, gt=0.0, le=100.0, description="Learning rate (of round 1 under lr_schedule step or "
                      "cosine)")
    momentum: float = Field(0.5, ge=0.0, lt=1.0, description="SGD momentum (optimizer sgd only)")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="Weight decay (L2 added to the gradient for sgd "
                                "and adam, decoupled for adamw)")
    optimizer: Literal["sgd", "adam", "adamw"] = Field("sgd", description=(
        "Local optimizer: sgd (paper, app. A), adam or adamw (torch.optim's classes; betas 0.9, 0.999 and eps 1e-8, "
        "torch's defaults; a fresh optimizer each round)"))
    lr_schedule: Literal["constant", "step", "cosine"] = Field("constant", description=(
        "Learning rate over rounds: constant; step (times lr_gamma every lr_step_rounds rounds); cosine (from lr at "
        "round 1 to lr_min at the last round)"))
    lr_step_rounds: int = Field(30, ge=1, le=10_000_000, description=(
        "lr_schedule step: rounds between two lr decays (round r trains at lr x lr_gamma^((r-1) // lr_step_rounds))"))
    lr_gamma: float = Field(0.1, gt=0.0, le=1.0, description="lr_schedule step: factor of each lr decay (at most 1; "
                            "above 1 the lr would grow without bound)")
    lr_min: float = Field(0.0, ge=0.0, le=100.0, description="lr_schedule cosine: lr of the last round (at most lr)")
    shared_init: bool = Field(False, description=(
        "Clients of one architecture start from identical initial weights (those client 0 would get; for your own "
        "models: the first client's with the same parameter names and shapes); off: each client seeded apart, as "
        "the official code"))
    drop_last: bool = Field(False, json_schema_extra={"off_flag": "--keep-last"},
                            description="Skip the last partial batch of every epoch (official code)")
    # stages and evaluation (practitioner's guide §4.3; off by default)
    freeze_after: int = Field(0, ge=0, le=10_000_000, description=(
        "Two-stage training: after this round only the head trains, the feature extractor is frozen (0: off)"))
    eval_full_test: bool = Field(False, description=(
        "Also evaluate each client's model, and the ensemble of all client models, on the full test split "
        "(all classes) after the last round"))
    # misbehaving clients, for experiments (fedproto.attacks)
    attack: Literal["none", "scale", "random", "nan", "flip"] = Field("none", description=(
        "Simulated misbehaving clients: their messages scaled, random, NaN, or with class ids flipped"))
    attackers: int = Field(0, ge=0, le=1_000_000, description="Number of misbehaving clients (drawn from the seed)")
    attack_scale: float = Field(100.0, ge=-1e12, le=1e12, description="Factor of attack 'scale'")
    # secure aggregation (fedproto.secagg; needs the flower extra)
    secagg: bool = Field(False, description=(
        "Secure aggregation (SecAgg+): the server learns only the sums of the clients' replies (fedproto mean or "
        "weighted, fedavg, fedprox, fedper, fedrep; needs pip install \"fedproto[flower]\")"))
    secagg_threshold: float = Field(0.5, ge=0.0, lt=1.0, description=(
        "secagg: shares needed to rebuild a client's masks, as more than this fraction of its share group (0.5: a "
        "majority); also how many may collude (fewer than that)"))
    secagg_neighbours: int = Field(0, ge=0, le=1_000_000, description=(
        "secagg: each client masks and shares with this many others, nearest in a ring of the round's clients "
        "(SecAgg+); 0: with all of them (SecAgg)"))
    secagg_honest: int = Field(2, ge=1, le=1_000_000, description=(
        "secagg with dp prototypes: the fewest honest clients assumed in each class's sum; each client adds noise "
        "of multiplier dp_noise / sqrt(this), so such a sum carries dp_noise's"))
    # engine and output
    execution: Literal["auto", "sequential", "batched"] = Field(
        "auto", description="Train clients one after another (sequential), many as one batched computation "
        "(batched), or pick (auto)")
    group_size: int = Field(128, ge=1, le=1_000_000, description="Most clients trained as one batched "
                            "computation")
    eval_every: int = Field(10, ge=0, le=10_000_000, description="Evaluate every N rounds and after the last "
                            "(0: only after the last)")
    checkpoint_every: int = Field(0, ge=0, le=10_000_000, description="Write a checkpoint every N rounds, "
                                  "removed when the run finishes (0: none)")
    save_models: bool = Field(False, description=(
        "Write every client's trained model (its state_dict, client order) to models.pt in the run directory"))
    tensorboard: bool = Field(False, description=(
        "Also log the per-round metrics as TensorBoard scalars in the run directory's tensorboard/ folder (needs "
        "pip install \"fedproto[tensorboard]\"; metrics.jsonl is written in any case)"))
    seed: int = Field(1234, ge=0, lt=2**32, description="Random seed (partition, models, sampling)")
    out_dir: str = Field("runs", min_length=1, description="Parent folder of run directories")
    name: Optional[str] = Field(None, description="Run directory name (default: derived from the options)")
    threads: int = Field(0, ge=0, le=1024, description="CPU threads of the run in all, shared by its worker "
                         "processes (0: torch's default, one per core)")
    workers: int = Field(0, ge=0, le=1024, description="Processes that train batched client groups in parallel, "
                         "the main one included (0: auto: one per 2 threads, at most one per 8 clients of a round, "
                         "for runs of 10 rounds or more; 1: one process)")
    device: str = Field("cpu", pattern=r"^(auto|cpu|cuda|cuda:\d{1,3}|mps)$",
                        description="Where clients train: auto | cpu | cuda | cuda:N | mps (auto: the first "
                        "CUDA GPU if torch sees one)")

    @model_validator(mode="before")
    @classmethod
    def _dataset_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("device"), str):
            data = {**data, "device": data["device"].strip().lower()}  # "CUDA", " cpu" are the devices meant
        if isinstance(data, dict):
            ds = data.get("dataset", "mnist")
            defaults = REGISTRY.get(ds, REGISTRY["mnist"]).defaults() if isinstance(ds, str) else {}
            data = dict(data)
            for k in ("data_dir", "out_dir", "pretrained"):  # "~/data" means the home folder
                if isinstance(data.get(k), str) and data[k].startswith("~"):
                    data[k] = os.path.expanduser(data[k])
            for k in ("data_dir", "pretrained"):
                if isinstance(data.get(k), str) and data[k]:
                    # stored absolute in config.json, so `fedproto onboard` and --resume find it from any folder
                    data[k] = os.path.abspath(data[k])
            for k, v in defaults.items():
                if data.get(k) is None:
                    data[k] = v
        return data

    @model_validator(mode="after")
    def _check(self) -> CommonConfig:
        # ConfigError is a ValueError: pydantic keeps it (ctx["error"]) and _config_error passes it on whole
        if self.dataset not in DATASETS:
            raise ConfigError(f"unknown dataset {self.dataset!r}", option="dataset", value=self.dataset,
                              hint=f"choose one of {', '.join(DATASETS)}")
        from fedproto.plugins import algorithm_names

        if self.algorithm not in algorithm_names():
            raise ConfigError(f"unknown algorithm {self.algorithm!r}", option="algorithm", value=self.algorithm,
                              hint=f"choose one of {', '.join(algorithm_names())}")
        from fedproto.errors import ModelError
        from fedproto.models.zoo import check_model_name

        if self.dataset == "custom":
            if self.classes is None:
                raise ConfigError(f"{opt('dataset', 'custom')} needs {opt('classes')}, the number of classes of "
                                  "your labels", option="classes", hint="fedproto.federation.federate sets it")
            if self.model != "custom" or self.partition != "fewshot":
                raise ConfigError(f"{opt('dataset', 'custom')} brings its own models and clients",
                                  option="model", value=self.model,
                                  hint=f"leave {opt('model')} and {opt('partition')} out "
                                  "(fedproto.federation.federate builds them)")
        elif self.classes is not None:
            raise ConfigError(f"{opt('classes', self.classes)} applies to {opt('dataset', 'custom')} only; "
                              f"{self.dataset} has {REGISTRY[self.dataset].classes} classes", option="classes",
                              value=self.classes, hint=f"leave {opt('classes')} out")
        try:
            if self.dataset != "custom":
                check_model_name(self.model)
        except ModelError as e:
            raise ConfigError(e.message, option="model", value=self.model, hint=e.hint) from None
        if self.name is not None and not _PLAIN_NAME.fullmatch(self.name):
            raise ConfigError(f"{opt('name', self.name)} is not a plain folder name", option="name", value=self.name,
                              hint="use letters, digits and '.', '_', '-', '+', '=' (starting with a letter, digit "
                              "or '_'; at most 200 characters; no '/', spaces or other symbols)")
        specs = {m.strip() for m in self.model.split(",")}
        fixed = {z.fixed_embedding for z in map(zoo_name, specs) if z is not None}
        if all(zoo_name(m) is not None for m in specs) and fixed == {512} and self.embedding_dim not in (50, 512):
            raise ConfigError(f"{opt('embedding_dim', self.embedding_dim)} does not apply to {self.model}: its "
                              "embedding is the 512-d layer4 output", option="embedding_dim",
                              value=self.embedding_dim,
                              hint=f"leave {opt('embedding_dim')} out (it sets cnn and projcnn models)")
        n_specs = len(self.model.split(","))
        if self.dataset != "custom" and n_specs > self.clients:
            raise ConfigError(f"{opt('model', self.model)} lists {n_specs} models but "
                              f"{opt('clients', self.clients)}, so some would never be used", option="model",
                              value=self.model, hint="list at most one model per client")
        if self.participation > self.clients and self.participation == int(self.participation):
            raise ConfigError(f"{opt('participation', int(self.participation))} is more than "
                              f"{opt('clients', self.clients)}", option="participation", value=self.participation,
                              hint=f"give at most {self.clients} clients per round, or a fraction in (0, 1]")
        if self.participation > 1 and (self.participation != int(self.participation)
                                       or self.participation > self.clients):
            raise ConfigError(f"{opt('participation', self.participation)} is neither a fraction nor a whole "
                              "number of clients", option="participation", value=self.participation,
                              hint=f"give a fraction in (0, 1] or a whole number of clients per round, at most "
                              f"{opt('clients', self.clients)}")
        if self.attackers > self.clients:
            raise ConfigError(f"{opt('attackers', self.attackers)} is more than {opt('clients', self.clients)}",
                              option="attackers", value=self.attackers, hint=f"use at most {self.clients}")
        if (self.attack == "none") != (self.attackers == 0):
            raise ConfigError(f"{opt('attack', self.attack)} with {opt('attackers', self.attackers)}",
                              option="attack", value=self.attack, hint="give both (an attack other than 'none' and "
                              "a number of attackers >= 1) or neither")
        if self.attackers and self.attackers == self.clients:
            raise ConfigError(f"{opt('attackers', self.attackers)} makes every client misbehave, leaving no honest "
                              "client to measure", option="attackers", value=self.attackers,
                              hint=f"use at most {self.clients - 1}")
        from fedproto.algorithms.options import options_of

        sends = options_of(self.algorithm)
        if self.attackers and sends.sends == "nothing":
            raise ConfigError(f"{opt('attack', self.attack)} alters what a client sends, and "
                              f"{opt('algorithm', self.algorithm)} sends nothing", option="attack", value=self.attack,
                              hint=f"use another algorithm or {opt('attack', 'none')}")
        if self.attack == "flip" and not getattr(sends, "class_ids", False):
            raise ConfigError(f"{opt('attack', 'flip')} attaches prototypes to other classes; "
                              f"{opt('algorithm', self.algorithm)} sends weights without class ids, so it would "
                              "change nothing", option="attack", value=self.attack,
                              hint="use attack scale, random or nan")
        if self.workers > 1 and self.threads and self.workers > self.threads:
            raise ConfigError(f"{opt('workers', self.workers)} needs a thread per process, and "
                              f"{opt('threads', self.threads)} is the run's budget in all", option="workers",
                              value=self.workers, hint=f"use {opt('workers', self.threads)} or fewer, or raise "
                              f"{opt('threads')} to {self.workers} or more")
        if self.workers > 1:
            where = ("sequential execution" if self.execution == "sequential"
                     else f"device {self.device}" if self.device not in ("cpu", "auto") else None)
            if where:
                raise ConfigError(f"{opt('workers', self.workers)}: worker processes train batched client groups on "
                                  f"the CPU, and this run has {where}", option="workers", value=self.workers,
                                  hint=f"use {opt('workers', 1)} (or 0 for auto)")
        if self.overlap and (self.partition != "fewshot" or self.dataset == "custom"):
            raise ConfigError(f"{opt('overlap', True)} shares training samples between the clients of "
                              f"{opt('partition', 'fewshot')}; " + (
                                  f"{opt('dataset', 'custom')} brings its own clients" if self.dataset == "custom"
                                  else f"{opt('partition', self.partition)} gives every sample to one client"),
                              option="overlap", value=self.overlap, hint=f"leave {opt('overlap')} out")
        if self.lr_schedule == "cosine" and self.lr_min > self.lr:
            raise ConfigError(f"{opt('lr_min', self.lr_min)} is above {opt('lr', self.lr)}: the cosine schedule "
                              "decays from lr to lr_min", option="lr_min", value=self.lr_min,
                              hint=f"use {opt('lr_min')} in [0, {self.lr}] (0: decay to zero)")
        C = self.num_classes
        if self.dataset != "custom" and self.ways > C:
            raise ConfigError(f"{opt('ways', self.ways)} is more than the {C} classes of {self.dataset}",
                              option="ways", value=self.ways, hint=f"use {opt('ways', C)} or fewer")
        return self

    def result_fields(self) -> dict[str, Any]:
        """The fields that can change a run's numbers (all but :data:`RESULT_NEUTRAL`), JSON-ready;
        a checkpoint resumes, and a reproduce cell is skipped, only when these match."""
        return result_fields(self.model_dump(mode="json"))

    @property
    def num_classes(self) -> int:
        """C: the dataset's number of classes (``classes`` for dataset ``custom``)."""
        return self.classes if self.dataset == "custom" else REGISTRY[self.dataset].classes

    @property
    def lam(self) -> float:
        """λ in force: the given value, or the paper's for the dataset (app. A)."""
        return self.lambda_proto if self.lambda_proto is not None else REGISTRY[self.dataset].lambda_proto

    def unused_fields(self) -> set[str]:
        """The fields this run does not read, given its dataset and partition: for your own
        clients (dataset ``custom``) the partition's and the zoo models' options (the data and the
        models are yours; ``embedding_dim`` is what your models give), for ``natural`` the
        few-shot and Dirichlet options, for ``dirichlet`` the few-shot ones, for ``fewshot`` the
        Dirichlet ones."""
        fewshot = {"ways", "shots", "stdev", "noise", "overlap"}
        dirichlet = {"alpha", "min_client_samples"}
        if self.dataset == "custom":
            return fewshot | dirichlet | {"partition", "test_shots", "dropout", "pretrained", "embedding_dim",
                                          "data_dir", "download"}
        return {"natural": fewshot | dirichlet | {"test_shots"}, "dirichlet": fewshot,
                "fewshot": dirichlet}[self.partition]

    def _inactive_fields(self) -> set[str]:
        """Fields whose value this run's other options leave without effect: the options of other
        algorithms, those its own algorithm's options switch off (``Options.inactive``: ``trim``
        without ``aggregation trimmed``, the DP options with ``dp off``...), ``attack_scale`` without
        the ``scale`` attack, the schedule's and the optimizer's that do not apply."""
        from fedproto.algorithms.options import options_of

        mine = options_of(self.algorithm)
        off = {k for k in type(self).model_fields if k not in CommonConfig.model_fields and k not in mine.model_fields}
        off |= mine.inactive(self) if hasattr(mine, "inactive") else set()
        if self.attack != "scale":
            off.add("attack_scale")
        if self.lr_schedule != "step":
            off |= {"lr_step_rounds", "lr_gamma"}
        if self.lr_schedule != "cosine":
            off.add("lr_min")
        if self.optimizer != "sgd":
            off.add("momentum")
        return off

    def name_options(self) -> dict[str, Any]:
        """The result-changing options (:func:`result_fields`) that differ from their defaults
        (the dataset's, for the fields it fills) and are not already spelled by the base of
        :meth:`run_name`; these extend the default run name, so two runs that differ in any of
        them get different folders."""
        base = {"algorithm", "dataset", "model", "seed", "partition", "classes", "ways", "shots", "clients", "alpha"}
        base -= {"clients"} if self.partition == "fewshot" and self.dataset != "custom" else set()
        skip = base | self.unused_fields() | self._inactive_fields()
        filled = REGISTRY[self.dataset].defaults()
        mine = result_fields(self.model_dump(mode="json"))
        out = {}
        for k, v in mine.items():
            if k in skip:
                continue
            default = type(self).model_fields[k].default
            if k in filled:
                default = filled[k]
            elif k == "lambda_proto":
                v, default = self.lam, REGISTRY[self.dataset].lambda_proto
            if v != default:
                out[k] = v
        return out

    def run_name(self) -> str:
        """The run directory's name: ``name`` if given, else ``algorithm-dataset[-model]-nN-kK-sSEED``
        (``-natural-mM-sSEED``, ``-dirA-mM-sSEED`` for those partitions; ``algorithm-custom-mM-sSEED``
        for your own clients; the model only when it is not the dataset's default), followed by
        every other result-changing option that differs from its default (:meth:`name_options`),
        as ``-<option><value>`` (``-lr0.05-lambda_proto2``); when those would make the name longer
        than 160 characters, by the first ones and ``-h<hash>`` of all of them. The paper's
        default run keeps its short name (``fedproto-mnist-n3-k100-s1234``)."""
        if self.name:
            return self.name
        if self.dataset == "custom":
            base = f"{self.algorithm}-custom-m{self.clients}-s{self.seed}"
        else:
            model = ""
            if self.model != REGISTRY[self.dataset].model:
                model = "-" + re.sub(r"[^A-Za-z0-9.-]+", "_", self.model)[:60]
            if self.partition == "natural":
                base = f"{self.algorithm}-{self.dataset}{model}-natural-m{self.clients}-s{self.seed}"
            elif self.partition == "dirichlet":
                base = f"{self.algorithm}-{self.dataset}{model}-dir{self.alpha:g}-m{self.clients}-s{self.seed}"
            else:
                base = f"{self.algorithm}-{self.dataset}{model}-n{self.ways}-k{self.shots}-s{self.seed}"
        extra = self.name_options()
        parts = [f"-{NAME_ABBREV.get(k, k)}{_name_value(v)}" for k, v in extra.items()]
        name = base + "".join(parts)
        if len(name) > 160:
            import hashlib
            import json

            digest = hashlib.sha1(json.dumps(extra, sort_keys=True).encode()).hexdigest()[:10]
            keep = ""
            for p in parts:
                if len(base) + len(keep) + len(p) + 12 > 160:
                    break
                keep += p
            name = f"{base}{keep}-h{digest}"
        return name


def _compose(name: str, bases: tuple[type, ...]) -> type:
    """A pydantic model of the given bases (their fields and validators), as :data:`RunConfig` is."""
    from pydantic import create_model

    return create_model(name, __base__=bases, __module__=__name__)


def _builtin_options() -> tuple[type, ...]:
    from fedproto.algorithms.options import BUILTIN_OPTIONS

    seen: list[type] = []
    for o in BUILTIN_OPTIONS.values():  # one base per options class (several methods share one)
        if o not in seen and not any(issubclass(s_, o) for s_ in seen):
            seen = [s_ for s_ in seen if not issubclass(o, s_)] + [o]
    return tuple(seen)


RunConfig = _compose("RunConfig", (*_builtin_options(), CommonConfig))
RunConfig.__doc__ = """One run: the common options (:class:`CommonConfig`) and every method's own
(:mod:`fedproto.algorithms.options`), validated together. Build it with :func:`build_config`
(defaults < TOML file < overrides); :func:`config_model` adds the options of algorithm plug-ins.
Defaults are the paper's MNIST setting (§Experiments, app. A)."""


NAME_ABBREV = {"clients": "m", "rounds": "r", "lambda_proto": "lambda", "local_epochs": "E", "batch_size": "B",
               "participation": "frac"}
"""Short spellings of options in default run names (:meth:`RunConfig.run_name`); others keep their field name."""


def _name_value(v: Any) -> str:
    """An option value as a run name spells it: ``0.05``, ``1e-05``, ``on``/``off`` for booleans,
    other text with characters outside ``[A-Za-z0-9.+-]`` replaced by ``_``. A float is written
    short (``{v:g}``) when that reads back as ``v``, else in full (``0.1234567``), so that two
    values never share a name."""
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, float):
        return f"{v:g}" if float(f"{v:g}") == v else repr(v)
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", str(v))[:40]


_MODELS: dict[int, type[RunConfig]] = {}


FLOWER_KEYS = ("round_timeout", "min_replies", "round_retries", "wait_nodes", "class_names", "resume_from",
               "poll_interval")
"""Keys of a Flower run config that are no run option (:class:`fedproto.flower.common.FlowerOptions`;
kept equal to ``fedproto.flower.common.FLOWER_KEYS`` by a test)."""


def taken_names() -> dict[str, str]:
    """The names a plug-in's option may not have, and why: the run options, their aliases and
    their off switches (``no_<boolean>``), and the Flower run config's own keys."""
    taken = {f: "is a fedproto option" for f in RunConfig.model_fields}
    taken.update({a: f"is another spelling of fedproto's option {f!r}" for a, f in KEY_ALIASES.items()})
    taken.update({f"no_{f}": f"is the off switch of fedproto's option {f!r} (--no-{f.replace('_', '-')})"
                  for f, info in RunConfig.model_fields.items() if info.annotation is bool})
    taken.update({k: "is a key of the Flower run config (FlowerOptions)" for k in FLOWER_KEYS})
    return taken


def config_model() -> type[RunConfig]:
    """The run options in force: :class:`RunConfig`, plus the ``Options`` of every algorithm
    registered from outside the library (:mod:`fedproto.plugins`) as a subclass of it
    (so a config is still a RunConfig). Flags, TOML keys, keywords and the options page come from
    its fields; rebuilt when a registration adds options.

    Raises:
        ConfigError: a plug-in's option has the name of another option (names both).
    """
    from fedproto.plugins import own_fields, plugin_options, version

    plugins = plugin_options()
    key = version()
    if key not in _MODELS:
        # a plug-in that subclasses a library method shares its options (already RunConfig's)
        plugins = [(n, o) for n, o in plugins if not issubclass(RunConfig, o)]
        for name, opts in plugins:  # registered before this module was imported: not checked then
            bad = sorted(k for k in own_fields(opts) if k in taken_names())
            if bad:
                from fedproto.plugins import unregister

                unregister(name)  # one bad plug-in must not break the runs of every algorithm
                raise ConfigError(f"algorithm {name!r} declares the option {bad[0]!r}, which "
                                  f"{taken_names()[bad[0]]}; rename it (e.g. with the algorithm's name as prefix); "
                                  f"{name!r} is unregistered")
        if not plugins:
            _MODELS[key] = RunConfig
        else:
            seen = {k: "fedproto" for k in RunConfig.model_fields}
            for name, opts in plugins:
                for k in sorted(own_fields(opts)):
                    if k in seen:
                        other = "is a fedproto option" if seen[k] == "fedproto" else f"algorithm {seen[k]!r} declares"
                        raise ConfigError(f"algorithm {name!r} declares the option {k!r}, which {other}; rename it "
                                          "(e.g. with the algorithm's name as prefix)")
                    seen[k] = name
            from pydantic import create_model

            bases = [RunConfig]
            for _, o in plugins:  # once each (plug-ins may share an options class)
                if not any(issubclass(b, o) for b in bases):
                    bases.append(o)
            _MODELS[key] = create_model("RunConfig", __base__=tuple(bases), __module__=__name__)
    return _MODELS[key]


def toml_value(value: Any) -> str:
    """``value`` as a TOML file writes it: ``"3"`` (a string keeps its quotes), ``true``,
    ``["cnn"]``, ``1979-05-27``, ``{a = 1}``."""
    import json
    import math

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and not isinstance(value, RawValue):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def _format(key: str, value: Any, file: Path) -> str:
    """A value read from a TOML file, named as the user wrote it: ``rounds = "3" in 'run.toml'``."""
    return f"{key} = {toml_value(value)} in {str(file)!r}"


def _config_error(err: ValidationError, from_file: dict[str, tuple[str, Any]] | None = None,
                  file: Path | None = None) -> ConfigError:
    """One ConfigError for all problems pydantic found: the option, the value and the hint of
    the first, the messages of all (option references kept for each front end to word).

    ``from_file`` maps the fields whose value came from the TOML ``file`` (not overridden) to
    (the key as written there, the value read): those values are named as the TOML line, not as
    a flag."""
    from_file = from_file or {}

    def where(option: str, value: Any) -> str | None:  # a reference to a value read from the file
        if option in from_file and value is not NO_VALUE and same_value(value, from_file[option][1]):
            return _format(from_file[option][0], from_file[option][1], file)
        return None

    lines = []
    first: dict[str, Any] = {}
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigError):
            cause = cause.rewritten(where)
            lines.append(cause.message if not cause.hint else f"{cause.message}; {cause.hint}")
            first = first or {"option": cause.option, "value": cause.value}
        elif e["type"] == "extra_forbidden":
            key, place = (from_file[loc][0], f" in {str(file)!r}") if loc in from_file else (loc, "")
            lines.append(f"unknown option {key!r}{place}" + opt(UNKNOWN + key))
            first = first or {"option": loc, "value": e.get("input")}
        elif "input" in e and e["loc"]:
            ref = where(loc, e["input"]) or opt(loc, e["input"])
            lines.append(f"{ref}: {e['msg'].removeprefix('Value error, ')}")
            first = first or {"option": loc, "value": e["input"]}
        else:
            lines.append(e["msg"].removeprefix("Value error, "))
    causes = [(e.get("ctx") or {}).get("error") for e in err.errors()]
    if len(causes) == 1 and isinstance(causes[0], ConfigError):
        c = causes[0].rewritten(where)
        return ConfigError(f"invalid configuration: {c.message}", option=c.option, value=c.value, hint=c.hint)
    return ConfigError("invalid configuration: " + "; ".join(lines), **first)


def _aliases() -> dict[str, str]:
    """Each alias -> its field, from the fields' ``json_schema_extra["aliases"]`` (as
    :func:`fedproto.options.aliases` reads them; config does not import options, options imports config)."""
    out = {}
    for name, info in RunConfig.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        out.update({a: name for a in extra.get("aliases", ())})
    return out


register_option_names(lambda: RunConfig.model_fields)


KEY_ALIASES = _aliases()
"""Other names accepted for options in TOML files, ``--set`` and Flower run configs (each field's
``json_schema_extra["aliases"]``): ``lambda`` for ``lambda_proto``; ``-`` may stand for ``_``."""


def _register_name_check() -> None:
    """Let :func:`fedproto.plugins.register` refuse a plug-in option named like a run option."""
    from fedproto import plugins

    if taken_names not in plugins.NAME_CHECKS:
        plugins.NAME_CHECKS.append(taken_names)


_register_name_check()


def normal_key(key: str) -> str:
    """An option name as a RunConfig field: ``-`` read as ``_``, :data:`KEY_ALIASES` applied."""
    key = key.replace("-", "_") if isinstance(key, str) else key
    return KEY_ALIASES.get(key, key)


def _normal_keys(data: dict[str, Any], file: Path | None = None,
                 given: dict[str, str] | None = None) -> dict[str, Any]:
    """Option names with ``-`` read as ``_`` and :data:`KEY_ALIASES` applied; a name given twice
    that way is a ConfigError. ``given`` (when passed) receives each field's name as written."""
    out: dict[str, Any] = {}
    given = {} if given is None else given
    for k, v in data.items():
        key = normal_key(k)
        if key in out:
            where = f" in {str(file)!r}" if file else ""
            raise ConfigError(f"option {key!r} is given twice{where} (as {given[key]!r} and {k!r}); keep one")
        out[key], given[key] = v, k
    return out


def build_config(file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Merge defaults, an optional TOML file and overrides (None values are ignored).

    TOML keys are the field names of :class:`RunConfig`, at the top level or under a ``[run]``
    table (both may be used in one file; only the same key in both places is refused); ``-`` may
    stand for ``_`` and ``lambda`` for ``lambda_proto`` (:data:`KEY_ALIASES`).

    Raises:
        ConfigError: missing/unreadable/invalid TOML, unknown keys, a key given twice, or invalid
            values.
    """
    if isinstance(file, dict):
        raise ConfigError("build_config's first argument is a TOML file path; pass options as "
                          "build_config(overrides={...})")
    if overrides is not None and not isinstance(overrides, dict):
        raise ConfigError(f"overrides must be a dict of option names to values, not a {type(overrides).__name__}")
    overrides = {k: (str(v) if isinstance(v, Path) else v) for k, v in (overrides or {}).items() if v is not None}
    data: dict[str, Any] = {}
    if file is not None:
        p = Path(file)
        if not p.is_file():
            what = "is not a regular file" if p.exists() else "does not exist"
            raise ConfigError(f"config file {str(p)!r} {what}", hint="pass an existing TOML file")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8-sig"))  # a leading BOM is not an error
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        if "run" in data and isinstance(data["run"], dict):
            top = {k: v for k, v in data.items() if k != "run"}
            both = sorted(set(_normal_keys(top, p)) & set(_normal_keys(data["run"], p)))
            if both:
                raise ConfigError(f"config file {str(p)!r} sets {', '.join(both)} both at the top level and under "
                                  "[run]; keep one")
            data = {**top, **data["run"]}
        written: dict[str, str] = {}
        data = _normal_keys(data, p, written)
        from_file = {k: (written[k], v) for k, v in data.items()}
    else:
        from_file, p = {}, None
    for k, v in _normal_keys(overrides or {}).items():
        if v is not None:
            data[k] = v
            from_file.pop(k, None)
    try:
        return config_model()(**data)
    except ValidationError as e:
        raise _config_error(e, from_file, p) from None
