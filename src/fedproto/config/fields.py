"""The common run options' declarations: each field of :class:`CommonFields` with its type, range,
default and description (the flags' help, TOML keys and docs/options.md are generated from them),
and the lists of options that never change a run's numbers or were added after results were
stored. Their checks, run names and the methods of a config are in :mod:`fedproto.config.common_options`;
the TOML reader and :func:`~fedproto.config.run_config.build_config` in :mod:`fedproto.config.run_config`
(docs/architecture.md, "Module map").
"""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from fedproto.data.registry import DATASETS as REGISTRY
from fedproto.models.names import MODEL_NAMES
from fedproto.plugins import BUILTIN

CLI_DATASETS = tuple(n for n in REGISTRY if n != "custom")
"""The datasets the command line runs (``custom`` holds your own clients, built from Python)."""

DATASETS = REGISTRY
"""Every dataset by name: :data:`fedproto.data.registry.DATASETS`."""


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=-]{0,199}")
"""A run name: one plain folder name (no path separators, spaces or shell-special characters)."""


RESULT_NEUTRAL = ("data_dir", "download", "out_dir", "name", "threads", "checkpoint_every", "group_size",
                  "proto_dist_alert", "device", "workers", "save_models", "tensorboard",
                  "secagg_threshold", "secagg_neighbours", "secagg_hide_labels")
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
               "secagg": False, "secagg_honest": 2, "secagg_min_contributors": 1, "precision": "fp32"}
"""Fields added after results were stored, with the behaviour older runs had: a stored config
without the field is compared as if it held this value (older FedPer/FedRep runs kept only the
last layer on the client, so they are run again under today's default ``fc``; the FedProto
practitioner options were off; every client took part in every round; no Dirichlet partition; clients
never shared training samples; DP noise was drawn from the run's seed; secure aggregation decoded every class's sum)."""



class CommonFields(BaseModel):
    """The declarations of the options every run has (:class:`fedproto.config.common_options.CommonConfig`
    adds their checks and methods). Defaults are the paper's MNIST setting (§Experiments, app. A)."""

    # strict: TOML `clients = true` or `lr = "0.1"` is an error, not 1 or 0.1; frozen: a config is
    # checked once as a whole (derive a new one with build_config(overrides={**cfg.model_dump(), ...}))
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    # data and partition
    dataset: str = Field("mnist", description="Dataset: " + " | ".join(CLI_DATASETS))
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
    algorithm: str = Field("fedproto", description=" | ".join(BUILTIN) + ", or the name of an installed plug-in "
                           "(its options are listed under Algorithm plug-ins)")
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
    # misbehaving clients, for experiments (fedproto.engine.attacks)
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
    secagg_min_contributors: int = Field(2, ge=1, le=1_000_000, description=(
        "secagg: a class's sum is decoded only over at least this many clients; a class held by fewer stays masked "
        "(its seeds are never revealed) and keeps its last global prototype; also the fewest clients a round's "
        "sum is decoded over"))
    secagg_hide_labels: bool = Field(True, description=(
        "secagg over Flower: nodes send no label set and no sample counts at join; the server learns per-class "
        "totals only (false: label sets and counts are sent, as without secagg)"))
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
    precision: Literal["fp32", "bf16", "fp16", "auto"] = Field(
        "fp32", description="Arithmetic of the training forward passes: fp32 | bf16 (autocast to bfloat16 on a CPU "
        "with native bf16 instructions, avx512_bf16 or amx_bf16, and on CUDA GPUs; elsewhere a warning and fp32) | "
        "fp16 (autocast to float16 with loss scaling, CUDA GPUs only) | auto (bf16 where native, else fp32); "
        "weights, losses, prototypes and aggregation stay float32; the precision used is summary.json's precision")
