"""The options of the library's methods: one typed model per method, torch-free.

Each method owns its options: the class here is its ``Options`` (``FedProx.Options is
FedProxOptions``), and :func:`fedproto.config.run_config.config_model` composes the run options from the
common ones (:class:`fedproto.config.run_config.RunConfig`'s own fields) and every method's, so each field
is a ``fedproto run`` flag, a TOML key, a ``federate`` keyword and a Flower run-config key, and
the options page lists it. A field counts for a run (its result fields, its name, the warning for
options an algorithm ignores) only when the run's algorithm owns it (:func:`owners`).

They are declared here rather than in each method's module because ``fedproto run --help``
builds its flags from them and must not import torch (tests/cli/test_startup.py); a method from
outside the library (:mod:`fedproto.plugins`) keeps its ``Options`` in its own module.

Each options class may declare, as class variables, what the engine checks without importing the
method: ``sends`` (what goes up: ``"nothing"``, ``"weights"``, ``"prototypes"``, ``"logits"``)
and ``class_ids`` (its messages carry class ids, so a simulated ``flip`` attack can act), and an
``inactive(cfg)`` hook naming its fields that the run's other options leave without effect.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, TypeVar

from pydantic import Field, ValidationError, model_validator

from fedproto.errors import ConfigError, opt
from fedproto.plugins import BUILTIN_ENTRY_POINTS, AlgorithmOptions

__all__ = ["BUILTIN_OPTIONS", "AlgorithmOptions", "FDOptions", "FedAvgOptions", "FedGHOptions", "FedPerOptions",
           "FedProtoOptions", "FedProxOptions", "FedRepOptions", "FedTGPOptions", "FeSEMOptions", "LGFedAvgOptions",
           "LocalOptions", "NoOptions", "ProtoClientOptions", "WeightsOptions", "builtin_options", "checked_options",
           "options_of", "owners"]

O = TypeVar("O", bound=AlgorithmOptions)


def checked_options(options: type[O], **values: Any) -> O:
    """``options(**values)``, checked by the options model (the bounds and choices of the run
    options, one place): what a method's constructor builds when called directly from Python.

    Raises:
        ValueError: a value outside its field's range or choices, as ``name=value: why``.
    """
    try:
        return options(**values)
    except ValidationError as e:
        first = e.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else options.__name__
        raise ValueError(f"{name}={values.get(name)!r}: {first['msg']}") from None


class NoOptions(AlgorithmOptions):
    """A method without options of its own (Local: sends nothing)."""

    sends: ClassVar[str] = "nothing"


class WeightsOptions(AlgorithmOptions):
    """A weight-sharing method without options of its own (FedAvg, LG-FedAvg)."""

    sends: ClassVar[str] = "weights"


class FedProxOptions(WeightsOptions):
    """FedProx (arXiv 1812.06127)."""

    prox_mu: float = Field(0.01, ge=0, le=1e6, description="FedProx proximal weight mu (arXiv 1812.06127)")


class FedPerOptions(WeightsOptions):
    """FedPer (arXiv 1912.00818): which layers stay on the client."""

    personal_layers: Literal["fc", "head"] = Field(
        "fc", description="FedPer/FedRep layers kept on the client: fc (every fully connected layer, tab. 1's "
        "Params) or head (the last layer only)")


class FedRepOptions(FedPerOptions):
    """FedRep (arXiv 2102.07078): FedPer's layers, head epochs first."""

    rep_head_epochs: int = Field(9, ge=1, le=100_000, description="FedRep head epochs per round (official code: "
                                 "9 head + 1 body)")

    @model_validator(mode="after")
    def _fedrep(self) -> Any:
        run: Any = self  # the composed run options (config.config_model: the common fields too), built at run time
        if getattr(run, "algorithm", "fedrep") == "fedrep" and getattr(run, "freeze_after", 0):
            raise ConfigError(f"{opt('freeze_after', run.freeze_after)}: FedRep already trains its head alone before "
                              "the body each round", option="freeze_after", value=run.freeze_after,
                              hint=f"use {opt('freeze_after', 0)} with fedrep")
        return self


class FeSEMOptions(WeightsOptions):
    """FeSEM (arXiv 2005.01026): clustered servers."""

    fesem_clusters: int = Field(3, ge=1, le=1_000_000, description="FeSEM clusters K (arXiv 2005.01026)")


class ProtoClientOptions(AlgorithmOptions):
    """The client side of prototype methods (FedProto's, which FedTGP reuses): λ, the distance,
    where local prototypes come from and nearest-prototype inference."""

    sends: ClassVar[str] = "prototypes"
    class_ids: ClassVar[bool] = True

    lambda_proto: Optional[float] = Field(None, ge=0.0, le=1e6, json_schema_extra={"aliases": ["lambda"]},
                                          description="λ, the weight of the prototype loss (app. A)")
    distance: Literal["mse", "squared_l2", "l2"] = Field(
        "mse", description="Prototype distance: mse (official code), squared_l2 (app. B) or l2 (main text). lambda "
                           "depends on it: mse = squared_l2 / d (d: embedding size), so lambda L under mse gives the "
                           "same loss as L / d under squared_l2; l2 (not squared, one term per class) has "
                           "no fixed conversion. The paper's lambda values (app. A) are tied to mse")
    proto_source: Literal["last_epoch", "after_training"] = Field(
        "last_epoch", description="Local prototypes from the last epoch's batches (official code) or from a "
        "pass after training (eq. 3)")
    proto_classes: Literal["own", "all"] = Field("own", description="Nearest-prototype inference among the "
                                                 "client's own classes or all classes")


class FedProtoOptions(ProtoClientOptions):
    """FedProto (arXiv 2105.00243): aggregation, the practitioner's options, robust aggregation and
    differential privacy of the uploaded prototypes."""

    aggregation: Literal["mean", "weighted", "median", "trimmed"] = Field(
        "mean", description="Global prototypes: mean (official code), weighted (eq. 6, convex), median or "
        "trimmed (see trim)")
    lambda_warmup: int = Field(0, ge=0, le=10_000_000, description="FedProto: rounds of λ warm-up, linear or "
                               "cosine (lambda_schedule) (0: constant λ)")
    lambda_schedule: Literal["linear", "cosine"] = Field("linear", description=(
        "FedProto: shape of the lambda warm-up over --lambda-warmup rounds"))
    proto_momentum: float = Field(0.0, ge=0.0, lt=1.0, description="FedProto: server prototype momentum β "
                                  "in [0, 1)")
    proto_normalize: bool = Field(False, description="FedProto: L2-normalize embeddings and prototypes in the "
                                  "loss and at inference")
    min_proto_samples: int = Field(1, ge=1, le=10_000_000, description="FedProto: the server ignores local "
                                   "prototypes from fewer samples")
    proto_dist_alert: float = Field(3.0, ge=0.0, le=1e6, description="FedProto: warn when a client's prototype "
                                    "distance exceeds this times the median (0: off)")
    trim: float = Field(0.2, ge=0.0, lt=0.5, description=(
        "FedProto, aggregation 'trimmed': fraction of a class's contributors cut from each end, per coordinate"))
    min_contributors: int = Field(1, ge=1, le=1_000_000, description=(
        "FedProto: a class gets (or changes) its global prototype only in rounds where at least this many "
        "clients send it"))
    exclude_outliers: float = Field(0.0, ge=0.0, le=1e6, description=(
        "FedProto: leave out of a round's aggregation the clients whose prototype distance has a robust "
        "z-score (median, MAD over clients) above this value (0: off; e.g. 3)"))
    class_check: float = Field(0.0, ge=0.0, le=1e6, description=(
        "FedProto: leave out of a round's aggregation every prototype nearer another class's global prototype "
        "than its own (once most clients are aligned), or whose log distance to its own has a robust z-score "
        "(over the round's prototypes) above this value (0: off; e.g. 3)"))
    dp: Literal["off", "prototypes", "full"] = Field("off", description=(
        "Differential privacy: prototypes (clipped, noised prototype release; guarantee for a fixed feature "
        "extractor) or full (DP-SGD local training + noised release: sample-level guarantee for all uploads)"))
    dp_noise: float = Field(1.0, ge=0.0, le=1e6, description="DP noise multiplier sigma (noise std / sensitivity)")
    dp_clip: float = Field(5.0, gt=0.0, le=1e9, description=(
        "DP: L2 bound C on each sample's embedding in the prototype release (near the typical embedding norm)"))
    dp_grad_clip: float = Field(1.0, gt=0.0, le=1e9, description="DP-SGD (dp=full): per-sample gradient L2 bound")
    dp_delta: float = Field(1e-5, gt=0.0, le=0.1, description=(
        "DP: the delta at which epsilon is reported (at most 0.1; usually below 1 / a client's samples)"))
    dp_reproducible_noise: bool = Field(False, description=(
        "DP: draw the noise (and DP-SGD's sampling) from the run's seed, for bit-for-bit reproducible DP runs in "
        "the simulator; VOIDS the guarantee against anyone who knows the seed, e.g. a server (refused under Flower)"))

    @classmethod
    def inactive(cls, cfg: Any) -> set[str]:
        """Fields left without effect by the run's other options (``trim`` without ``aggregation
        trimmed``, the DP options with ``dp off``, the warm-up's shape without a warm-up)."""
        off = set()
        if cfg.aggregation != "trimmed":
            off.add("trim")
        if cfg.dp == "off":
            off |= {"dp_noise", "dp_clip", "dp_grad_clip", "dp_delta"}
        elif cfg.dp != "full":
            off.add("dp_grad_clip")
        if not cfg.lambda_warmup:
            off.add("lambda_schedule")
        return off

    @model_validator(mode="after")
    def _privacy(self) -> Any:
        if not hasattr(self, "algorithm"):
            return self
        run: Any = self  # the composed run options (config.config_model: execution, workers too), built at run time
        if 0 < self.proto_dist_alert < 1:
            raise ConfigError(f"{opt('proto_dist_alert', self.proto_dist_alert)} would flag clients below the "
                              "median", option="proto_dist_alert", value=self.proto_dist_alert,
                              hint="use 0 (no warning) or a factor >= 1 (e.g. 3)")
        if self.dp == "off":
            return self
        if "dp" not in options_of(run.algorithm).model_fields:
            what = {"weights": "model weights", "logits": "per-class logits", "nothing": "nothing"}.get(
                getattr(options_of(run.algorithm), "sends", "messages"), "messages")
            raise ConfigError(f"{opt('dp', self.dp)} protects FedProto's prototypes; "
                              f"{opt('algorithm', run.algorithm)} sends {what}, which it does not cover",
                              option="dp", value=self.dp,
                              hint=f"use {opt('algorithm', 'fedproto')} or {opt('dp', 'off')}")
        if self.dp == "full" and run.execution == "batched":
            raise ConfigError(f"{opt('dp', 'full')} trains with DP-SGD on the sequential path", option="execution",
                              value=run.execution,
                              hint=f"use {opt('execution', 'auto')} or {opt('execution', 'sequential')}")
        if self.dp == "full" and self.distance == "l2":
            raise ConfigError(f"{opt('dp', 'full')} needs a loss that is a mean of per-sample terms; "
                              f"{opt('distance', 'l2')} compares a batch prototype", option="distance",
                              value=self.distance,
                              hint=f"use {opt('distance', 'mse')} or {opt('distance', 'squared_l2')}")
        if self.dp == "full" and run.workers > 1:
            raise ConfigError(f"{opt('workers', run.workers)}: worker processes train batched client groups on "
                              f"the CPU, and this run has {opt('dp', 'full')} (DP-SGD trains one client at a time)",
                              option="workers", value=run.workers, hint=f"use {opt('workers', 1)} (or 0 for auto)")
        return self


class ServerTrainingOptions(AlgorithmOptions):
    """Methods whose server trains something each round (FedTGP's prototype generator, FedGH's head)."""

    server_epochs: Optional[int] = Field(None, ge=1, le=1_000_000, description="FedTGP/FedGH server training "
                                         "passes per round (default: FedTGP 100, FedGH 1 as the FedGH paper)")
    server_lr: Optional[float] = Field(None, gt=0, le=1e6, description="FedTGP/FedGH server SGD step size "
                                       "(default: FedTGP 0.1, FedGH 0.01)")
    server_batch_size: Optional[int] = Field(None, ge=1, le=1_000_000, description="FedTGP/FedGH prototypes per "
                                             "server SGD step (default: FedTGP 10, FedGH 1 as the FedGH paper)")


class FedTGPOptions(ProtoClientOptions, ServerTrainingOptions):
    """FedTGP (arXiv 2401.03230): FedProto's client, a server that trains the global prototypes."""

    tgp_margin: float = Field(100.0, gt=0, le=1e12, description="FedTGP margin threshold tau: the adaptive margin "
                              "is min(largest nearest-class gap, tau) (arXiv 2401.03230)")


class FedGHOptions(ServerTrainingOptions):
    """FedGH (arXiv 2303.13137): prototypes up, a server-trained head down."""

    sends: ClassVar[str] = "prototypes"
    class_ids: ClassVar[bool] = True


class FDOptions(AlgorithmOptions):
    """FD (arXiv 1811.11479): per-class mean logits up, a distillation term in the client's loss."""

    sends: ClassVar[str] = "logits"
    class_ids: ClassVar[bool] = True

    fd_lambda: float = Field(1.0, ge=0, le=1e6, description="FD weight of the logit distillation term "
                             "(arXiv 1811.11479; PFLlib 1)")
    fd_temperature: float = Field(1.0, gt=0, le=1e6, description="FD distillation temperature T (the paper and "
                                  "PFLlib: 1)")


LocalOptions = NoOptions
FedAvgOptions = WeightsOptions
LGFedAvgOptions = WeightsOptions
"""The options of the methods that have none of their own (aliases, named after the method's class)."""


def builtin_options() -> dict[str, type[AlgorithmOptions]]:
    """The options of each of the library's methods, by name: for the method whose entry point is
    ``module:Class`` (:data:`fedproto.plugins.BUILTIN_ENTRY_POINTS`), ``ClassOptions`` of this module
    (the class's ``Options``: ``tests/algorithms/test_method_api.py`` checks they agree). Read without importing
    the methods, so ``fedproto run --help`` stays torch-free."""
    return {name: globals()[f"{value.partition(':')[2]}Options"] for name, value in BUILTIN_ENTRY_POINTS}


BUILTIN_OPTIONS: dict[str, type[AlgorithmOptions]] = builtin_options()
"""The options of each of the library's methods, by name (:func:`builtin_options`)."""


def options_of(algorithm: str) -> type[AlgorithmOptions]:
    """The options class of ``algorithm`` (a plug-in without ``Options``: :class:`NoOptions`-like
    defaults, sending weights)."""
    from fedproto.plugins import PLUGINS

    if algorithm in BUILTIN_OPTIONS:
        return BUILTIN_OPTIONS[algorithm]
    from fedproto.plugins import method_options

    return method_options(PLUGINS.get(algorithm)) or WeightsOptions


def owners(field: str) -> tuple[str, ...]:
    """The algorithms (the library's and the plug-ins) whose options declare ``field``."""
    from fedproto.plugins import PLUGINS

    names = [*BUILTIN_OPTIONS, *PLUGINS]
    return tuple(n for n in names if field in options_of(n).model_fields)
