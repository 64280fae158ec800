"""The options every run has, checked: :class:`CommonConfig` (the fields of
:class:`fedproto.config.fields.CommonFields`, their checks against each other, the dataset's
defaults, and the run name), and which options can change a run's numbers
(:func:`result_fields_in`). :class:`fedproto.config.run_config.RunConfig` adds every method's own options
(docs/architecture.md, "Module map").
"""

from __future__ import annotations

import os
import re
from typing import Any

from pydantic import model_validator

from fedproto.config.fields import (
    _PLAIN_NAME,
    DATASETS,
    REGISTRY,
    RESULT_NEUTRAL,
    CommonFields,
)
from fedproto.errors import ConfigError, opt
from fedproto.models.names import zoo_name


def result_fields_in(cfg: dict, fields: dict) -> dict[str, Any]:
    """The fields of a config dict that can change a run's numbers: all run options but
    :data:`RESULT_NEUTRAL` and the options of other algorithms than the run's
    (:func:`fedproto.algorithms.method_options.owners`), and ``personal_layers`` for ResNet18 (whose only
    fully connected layer is its head, so both values are one split) and ``dp_reproducible_noise``
    without DP. Used to decide whether a checkpoint may be resumed and whether a reproduce cell is
    already done.

    Args:
        cfg: a config as a dict (``model_dump(mode="json")`` or a stored ``config.json``).
        fields: the option fields in force (:func:`fedproto.config.run_config.config_model`'s ``model_fields``).
    Returns:
        The subset of ``cfg`` as described, in ``cfg``'s order.
    """
    from fedproto.algorithms.method_options import owners

    algorithm = cfg.get("algorithm", CommonFields.model_fields["algorithm"].default)
    out = {k: v for k, v in cfg.items() if k in fields and k not in RESULT_NEUTRAL
           and (k in CommonFields.model_fields or algorithm in owners(k))}
    if all((z := zoo_name(m)) is not None and z.family == "resnet18" for m in str(cfg.get("model", "")).split(",")):
        out.pop("personal_layers", None)
    if out.get("dp", "off") == "off":
        out.pop("dp_reproducible_noise", None)  # the noise source acts only under DP
    return out


def method_defaults(algorithm: Any, fields: dict) -> dict[str, Any]:
    """The defaults that ``algorithm``'s own options (:func:`fedproto.algorithms.method_options.options_of`)
    give to run options other than the run options' defaults: a plug-in whose ``Options`` subclass
    ``FedProtoOptions`` with ``lambda_proto = Field(50.0, ...)`` runs with λ = 50 unless λ is given.
    The run's config then holds that value (its name, config.json, the resume check all see it).

    Args:
        algorithm: the run's algorithm name (anything else: no defaults).
        fields: the run options' fields (``model_fields`` of :func:`fedproto.config.run_config.config_model`).
    Returns:
        ``{field: default}`` of the fields whose default the method changes ({} for the library's methods).
    """
    from fedproto.plugins import BUILTIN, PLUGINS

    if not isinstance(algorithm, str) or algorithm in BUILTIN or algorithm not in PLUGINS:
        return {}
    from fedproto.algorithms.method_options import options_of

    out = {}
    for k, info in options_of(algorithm).model_fields.items():
        if k in fields and info.default_factory is None and info.default is not None \
                and not same_default(info.default, fields[k].default):
            out[k] = info.default
    return out


def same_default(a: Any, b: Any) -> bool:
    """Whether two option defaults are the same value (``1`` and ``1.0`` are; ``True`` and ``1`` are not)."""
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                             and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


class CommonConfig(CommonFields):
    """The options every run has, whatever its algorithm (data, partition, model, training, engine,
    output; declared in :class:`~fedproto.config.fields.CommonFields`); :class:`fedproto.config.run_config.RunConfig`
    adds every method's own options (:mod:`fedproto.algorithms.method_options`). Defaults are the paper's
    MNIST setting (§Experiments, app. A)."""

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
            for k, v in {**method_defaults(data.get("algorithm"), cls.model_fields), **defaults}.items():
                if data.get(k) is None:
                    data[k] = v
        return data

    def option_default(self, field: str) -> Any:
        """The default of ``field`` for this run: the dataset's (for the fields it fills, and λ), else
        the run's algorithm's own (:func:`method_defaults`: a plug-in's ``Options`` may change the
        default of an option it inherits), else the option's."""
        filled = REGISTRY[self.dataset].defaults()
        if field in filled:
            return filled[field]
        own = method_defaults(self.algorithm, type(self).model_fields)
        if field in own:
            return own[field]
        if field == "lambda_proto":
            return REGISTRY[self.dataset].lambda_proto
        return type(self).model_fields[field].default

    @model_validator(mode="after")
    def _check(self) -> CommonConfig:
        # ConfigError is a ValueError: pydantic keeps it (ctx["error"]) and _config_error passes it on whole
        if self.dataset not in DATASETS:
            import difflib

            near = difflib.get_close_matches(str(self.dataset), list(DATASETS), n=1)
            raise ConfigError(f"unknown dataset {self.dataset!r}", option="dataset", value=self.dataset,
                              hint=(f"did you mean {near[0]!r}? " if near else "")
                              + f"choose one of {', '.join(DATASETS)}")
        from fedproto.plugins import algorithm_names, unknown_algorithm

        if self.algorithm not in algorithm_names():
            raise unknown_algorithm(self.algorithm)
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
        from fedproto.algorithms.method_options import options_of

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
        return result_fields_in(self.model_dump(mode="json"), type(self).model_fields)

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
        from fedproto.algorithms.method_options import options_of

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

    def ignored_options(self) -> list[str]:
        """The options set to another value than their default that this run does not read: the
        options of other algorithms, those its algorithm's other options switch off (``trim``
        without ``aggregation trimmed``), the schedule's and optimizer's that do not apply.
        ``config.json`` lists them (``ignored_options``) beside their values, so a value there is
        not taken for one that acted."""
        out = []
        fields = type(self).model_fields
        for k in sorted(self._inactive_fields()):
            v = getattr(self, k) if k in fields else None
            if v is not None and v != fields[k].default and v != self.option_default(k):
                out.append(k)
        return out

    def name_options(self) -> dict[str, Any]:
        """The result-changing options (:func:`result_fields`) that differ from their defaults
        (the dataset's, for the fields it fills) and are not already spelled by the base of
        :meth:`run_name`; these extend the default run name, so two runs that differ in any of
        them get different folders."""
        base = {"algorithm", "dataset", "model", "seed", "partition", "classes", "ways", "shots", "clients", "alpha"}
        base -= {"clients"} if self.partition == "fewshot" and self.dataset != "custom" else set()
        skip = base | self.unused_fields() | self._inactive_fields()
        mine = result_fields_in(self.model_dump(mode="json"), type(self).model_fields)
        out = {}
        for k, v in mine.items():
            if k in skip:
                continue
            default = self.option_default(k)
            if k == "lambda_proto":
                v = self.lam
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

