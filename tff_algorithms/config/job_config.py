"""The configuration of one training job.

`TrainJobConfig` holds a job's hyperparameters and validates each of them;
`current_layout` reads a recorded one. The schedule and the accounting spec a config
implies are `job_plan`'s. What differs between algorithms (their own settings and checks, their accounting and
schedule rules, which settings apply to them) is read from each one's
`algorithms.Algorithm` (`tff_algorithms/algorithms/`), never by comparing names;
shared negatives are configured and checked in `shared_negatives_config`.

An algorithm's own settings are its section (`registry.Section`: `dp_fedemb`, `fdml`,
`logit_dp`, `dp_sgd`; docs/config.md): `TrainJobConfig.settings` holds them, checked for its jobs
only; a section may name the shared schedule's counts in the algorithm's words
(`fdml.groups_per_round` sets `virtual_clients_per_round`). `to_dict` writes the section
and `from_dict` reads it, and a record of the release before (flat keys) too.

delta: `TrainJobConfig.delta=None` resolves to N^-1.1 for N training users, which is
below 1/N as (epsilon, delta)-DP needs (N=6800 gives 6.1e-5, N=10M gives 2e-8).

Seeds: the schedule seed (which users form each round's virtual clients) and the noise
seed come from OS entropy unless a testing flag allows a fixed one; neither is ever
published (`public_dict`): sampling amplification assumes the sample is secret, and
whoever knows the noise seed can subtract the noise. `seed` seeds only what is public
anyway (the initial backbone, the local heads' initialisation, the oracle's shuffling)
and says nothing about who trained.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from beam_jobs import schedule
from tff_algorithms import algorithms
from tff_algorithms.algorithms import rules
from tff_algorithms.algorithms.dp_fedemb.shared_negatives_config import SharedNegativesConfig
from tff_algorithms.base import validation
from tff_algorithms.config import client_config, job_plan, model_config, report_policy
from tff_algorithms.privacy import calibration

# The algorithms' names, for code that configures a job of one (tests, benchmarks);
# what each is and does is its `algorithms.Algorithm`.
DP_FEDEMB = algorithms.dp_fedemb.DP_FEDEMB.name
DP_FEDAVG = algorithms.dp_fedemb.DP_FEDAVG.name
DP_FTRL_FEDEMB = algorithms.dp_fedemb.DP_FTRL_FEDEMB.name
CENTRALIZED = algorithms.centralized.CENTRALIZED.name
LOGIT_DP = algorithms.logit_dp.LOGIT_DP.name
FDML = algorithms.fdml.FDML.name
DP_SGD_CENTRALIZED = algorithms.user_dp_sgd.DP_SGD_CENTRALIZED.name
DP_LAST_LAYER = algorithms.user_dp_sgd.DP_LAST_LAYER.name
# The paper's EMNIST noise multiplier (appendix D), when neither it nor a target is given.
DEFAULT_NOISE_MULTIPLIER = 0.62
AUTO = schedule.AUTO

# Never published (module docstring).
_SECRET_FIELDS = ("schedule_seed", "noise_seed")


@dataclasses.dataclass(frozen=True)
class TrainJobConfig:
    """Hyperparameters of one training job (defaults: paper, EMNIST small CNN, appendix D).

    Attributes:
      algorithm: a registered algorithm's name (`tff_algorithms.algorithms`).
      rounds: training rounds (epochs for `centralized`).
      noise_multiplier: z, noise std over the clip norm of one virtual client's update.
        None: `DEFAULT_NOISE_MULTIPLIER` (the paper's EMNIST value), unless target_epsilon
        is set.
      target_epsilon: instead of noise_multiplier: the noise multiplier is calibrated when
        the job starts, from the real number of training users (after dedup and
        partition), to the smallest z whose planned schedule costs at most this epsilon at
        `delta` (`calibrated_for`). The user count is treated as public, as the accounting
        itself does. Giving both fields is an error.
      clip_norm: γ, L2 clip of each virtual client's update.
      users_per_virtual_client: k.
      virtual_clients_per_round: M, also the fixed denominator of the aggregate; `auto`
        (`AUTO`): the largest M the training users fill at users_per_virtual_client
        (`schedule.largest_virtual_clients_per_round`), fixed with the noise when the job
        starts (`calibrated_for`). A round then takes nearly every user (no sampling
        amplification; the accountant charges for it): for small populations.
      client_learning_rate: β1 (backbone); the head uses head_lr_scale·β1.
      client_momentum: client SGD momentum (paper: 0.9).
      server_learning_rate / server_momentum: server SGD with momentum (paper: 0.9).
      server_optimizer: what applies dp-fedemb's and dp-fedavg's noised aggregate: `sgd`
        (server_momentum), `adam` or `lamb` (`rules.check_server_optimizer`).
      gradient_clip_norm: global L2 clip of each non-private centralized step's gradient
        (the pretraining of a large trunk, `recipes.pretrain_values`); None: no clip.
        Not the DP clip (`clip_norm`): a private algorithm refuses it
        (`rules.check_gradient_clip_norm`).
      head_lr_scale: β2 / β1 of the client's head; None: 100 for the DP-FedEmb variants
        (paper, section 3.3) and 1 for DP-FedAvg, whose client trains backbone and global
        head with one optimizer (paper, Alg. 2): at 100 the global head's update fills the
        clipped delta and the backbone barely moves (BENCHMARKS.md, "Training").
      head_init / class_means_norm: how each local head starts (`client_config.ClientConfig`):
        `random` (the paper) or `class_means` (rows are the client's per-identity mean
        unit embeddings under the received backbone, of norm class_means_norm). Local
        heads only: DP-FedAvg's and the oracle's global head start from the model.
      head_loss / head_loss_scale / head_loss_margin: the loss on every head's logits,
        local, DP-FedAvg's and the oracle's (`client_config.HeadLossConfig`): `softmax`
        (the paper), `cosface` or `arcface`; scale s and margin m apply to the last two.
      local_epochs, batch_size, max_examples_per_client: local training (paper: 1, 32, 2048).
      head_capacity: rows of the local head, a public setting (never sized from the
        data: docs/privacy.md); by default `ClientConfig`'s 64, room for 8 users of 8
        identities each (the paper's EMNIST head). None means users_per_virtual_client,
        exact when every user holds one identity (faces). A job whose virtual clients may
        hold more identities is refused before training (`jobs.local_heads`).
      architecture, embedding_size, image_size, channels: the backbone and its input
        (`model_config`: a built-in, or keras:<Name>, file:<path>,
        python:<module>:<function>).
      batch_norm: what the backbone's BatchNormalization layers become
        (`model_config.BATCH_NORM_MODES`; auto: freeze for file:, else group_norm).
      trainable_layers: layer-name patterns of the backbone layers training updates
        (`model_config.BackboneConfig.trainable_layers`); the others keep their initial
        (pretrained) values and are neither aggregated nor noised.
      cache_features: train a suffix of the backbone on cached outputs of its frozen
        prefix (`feature_cache`): None (the default) caches when the trained layers are
        a suffix and the algorithm is federated without shared negatives; True requires
        it (an error otherwise); False never caches.
      delta: None resolves to N^-1.1 (module docstring).
      evaluate_every: evaluate every this many rounds (0: only after the last).
      seed: backbone initialisation, local-head initialisation and the centralized
        oracle's shuffling. Public: none of it depends on which users train.
      schedule_seed: which users form the virtual clients of each round; None draws one
        from OS entropy when the job first runs and keeps it in OUTPUT/train_job.json
        (production: sampling amplification assumes nobody knows the sample). A fixed
        seed is refused unless `testing_fixed_schedule` is set.
      testing_fixed_schedule: the explicit testing flag that allows a fixed
        `schedule_seed`, to compare runs in tests and reproduce one; recorded in
        metrics.json.
      noise_seed: DP noise seed; None draws one from OS entropy (production). A fixed
        seed makes the noise predictable (whoever guesses it can subtract the noise),
        so it is refused unless `testing_fixed_noise` is set.
      testing_fixed_noise: the explicit testing flag that allows a fixed `noise_seed`:
        for tests and benchmarks only; recorded in metrics.json.
      settings: the algorithm's own settings (its `Algorithm.section`'s dataclass, or
        a mapping of its fields); None: their defaults. Must be None for an algorithm
        without a section; another algorithm's section at its defaults (what
        `dataclasses.replace(job, algorithm=...)` carries along) is dropped, and one set
        away from them refused. The DP-FedEmb family's `dp_fedemb` section
        (`tff_algorithms/algorithms/dp_fedemb/settings.py`) holds its tree restarts
        (`restart_every_epoch`) and straggler limits (`max_local_steps`,
        `max_client_seconds`).

    `logit-dp` (private contrastive training, `tff_algorithms.algorithms.logit_dp.training`)
    reads its `logit_dp` section: `rounds` steps, each sampling `users_per_step` users
    (n; the schedule's `virtual_clients_per_round`, one user each) without replacement
    by the same schedule as DP-FedEmb, one positive pair per user; per-pair logit
    gradients clipped to `clip_norm` (B); noise `noise_multiplier`·C(n, s, B), s its
    `scale`; momentum SGD with `server_learning_rate` / `server_momentum` on the noised
    sum over n. Head, local-training and dropout fields do not apply to it.

    `dp-sgd-centralized` and `dp-last-layer` (`tff_algorithms.algorithms.user_dp_sgd.training`, checked in
    `user_dp_sgd_config`) read their `dp_sgd` section the same way: `rounds` steps of
    `users_per_step` users, each user's gradient of its mean loss over at most
    `max_examples_per_client` examples clipped to `clip_norm`, noise
    `noise_multiplier`·clip_norm on the sum, accounted as DP-FedEmb with one user per
    virtual client. dp-last-layer trains the embedding layer alone (`trainable_layers`
    ["embedding"]), zero-initialised, under the softmax head.

    `fdml` (`tff_algorithms.algorithms.fdml.training`) reads its `fdml` section
    (`fdml_fields.FdmlSettings`): each round selects ceil(n(1 + over_selection)) users
    uniformly without replacement, n = `users_per_group` (g) x `groups_per_round` (the
    schedule's `users_per_virtual_client` x `virtual_clients_per_round`); each uploads
    `samples_per_user` embeddings; derivatives are clipped per row to
    `derivative_clip` (C_r), gradients to `clip_norm` (C_g). `noise_multiplier` is z,
    the round's noise relative to its sensitivities (`accounting_spec.Mechanism.FDML`),
    split as 1/z^2 = share/z^2 + (1 - share)/z^2 by `derivative_noise_share` (the
    derivatives' std is 2 sqrt(g s) z C_r / sqrt(share), the gradient sum's
    2 z C_g / sqrt(1 - share)); Adam on the server at `server_learning_rate`;
    `max_round_attempts` restarts of a round with too few uploads. Only users holding
    at least `samples_per_user` images train (the population the accountant counts).

    Other fields:
      max_epsilon: privacy budget; the job refuses to start when the planned rounds
        would cost more. None: no budget.
      over_selection: o; a round selects ceil(M(1 + o)) virtual clients and keeps the
        first M that report. Accounting uses the selected set's sampling
        (`tff_algorithms.federated.dropouts`).
      min_report_fraction: a round with fewer than ceil(f·M) reporting virtual clients
        is retried with a fresh selection, never applied.
      max_round_attempts: attempts per round before the job stops with an error.
      failure_injection_rate: fraction of virtual clients made to fail their read, to
        measure dropout robustness (tests and benchmarks only).
      shared_negatives: None (off), or `SharedNegativesConfig` (a mapping of its fields
        in JSON/YAML): DPLC-released cluster centers as fixed negative head rows, for
        dp-fedemb and dp-ftrl-fedemb; their cost is in the ledger.
    """

    algorithm: str = DP_FEDEMB
    rounds: int = 200
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    clip_norm: float = 1.0
    users_per_virtual_client: int = 8
    virtual_clients_per_round: int | str = 32
    client_learning_rate: float = 5e-3
    client_momentum: float = 0.9
    server_learning_rate: float = 0.02
    server_momentum: float = 0.9
    server_optimizer: str = model_config.SGD
    gradient_clip_norm: float | None = None
    head_lr_scale: float | None = None
    head_init: str = client_config.HEAD_INIT_RANDOM
    class_means_norm: float = client_config.ClientConfig.class_means_norm
    head_loss: str = client_config.HeadLossConfig.loss
    head_loss_scale: float = client_config.HeadLossConfig.scale
    head_loss_margin: float = client_config.HeadLossConfig.margin
    local_epochs: int = 1
    batch_size: int = 32
    max_examples_per_client: int = 2048
    head_capacity: int | None = client_config.ClientConfig.head_capacity
    architecture: str = model_config.SMALL_CNN
    batch_norm: str = model_config.BATCH_NORM_AUTO
    embedding_size: int = 128
    image_size: int = 28
    channels: int = 1
    delta: float | None = None
    evaluate_every: int = 10
    seed: int = 0
    schedule_seed: int | None = None
    testing_fixed_schedule: bool = False
    noise_seed: int | None = None
    testing_fixed_noise: bool = False
    max_epsilon: float | None = None
    over_selection: float = 0.0
    min_report_fraction: float = 0.5
    max_round_attempts: int = 3
    failure_injection_rate: float = 0.0
    trainable_layers: tuple[str, ...] = model_config.ALL_LAYERS
    shared_negatives: SharedNegativesConfig | None = None
    cache_features: bool | None = None
    settings: Any = None

    def __post_init__(self) -> None:
        algorithm = algorithms.get(self.algorithm)
        self._drop_another_sections_defaults(algorithm)
        if algorithm.section is None:
            if self.settings is not None:
                with_sections = ", ".join(algorithms.registry.sections())
                raise ValueError(
                    f"{self.algorithm} has no settings of its own (sections: "
                    f"{with_sections}): leave settings unset"
                )
        else:
            # Its own checks (the section's dataclass), for its jobs only.
            object.__setattr__(self, "settings", algorithm.section.build(self.settings))
        object.__setattr__(
            self, "shared_negatives", SharedNegativesConfig.from_value(self.shared_negatives)
        )
        if self.shared_negatives is not None and not algorithm.local_heads:
            local_heads = algorithms.names(lambda other: other.local_heads)
            raise ValueError(
                f"shared_negatives applies to {' and '.join(local_heads)} "
                f"(local heads), not {self.algorithm}"
            )
        for name in (
            "rounds",
            "users_per_virtual_client",
            "local_epochs",
            "batch_size",
            "max_examples_per_client",
            "embedding_size",
            "image_size",
            "max_round_attempts",
        ):
            validation.check_int(name, getattr(self, name), 1)
        if isinstance(self.virtual_clients_per_round, str):
            if self.virtual_clients_per_round != AUTO:
                raise ValueError(
                    f"virtual_clients_per_round must be an integer or {AUTO!r}, "
                    f"got {self.virtual_clients_per_round!r}"
                )
        else:
            validation.check_int("virtual_clients_per_round", self.virtual_clients_per_round, 1)
        validation.check_number("over_selection", self.over_selection, 0, 100, low_open=False)
        for name in ("min_report_fraction", "failure_injection_rate"):
            validation.check_fraction(name, getattr(self, name))
        for name in ("evaluate_every", "seed"):
            validation.check_int(name, getattr(self, name), 0)
        if self.head_capacity is not None:
            validation.check_int("head_capacity", self.head_capacity, 1)
        for name in ("testing_fixed_noise", "testing_fixed_schedule"):
            validation.check_bool(name, getattr(self, name))
        if self.schedule_seed is not None:
            validation.check_int("schedule_seed", self.schedule_seed, 0)
            if not self.testing_fixed_schedule:
                raise ValueError(
                    "a fixed schedule_seed makes the sampled users predictable and is for tests "
                    "only: production runs draw it from OS entropy; set testing_fixed_schedule "
                    "(--testing-fixed-schedule) to use one"
                )
        if self.noise_seed is not None:
            validation.check_int("noise_seed", self.noise_seed, 0)
            if not self.testing_fixed_noise:
                raise ValueError(
                    "a fixed noise_seed makes the DP noise predictable and is for tests only: "
                    "production runs draw it from OS entropy; set testing_fixed_noise "
                    "(--testing-fixed-noise) to use one"
                )
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {self.channels!r}")
        self._resolve_noise()
        if self.head_init not in client_config.HEAD_INITS:
            raise ValueError(
                f"head_init must be one of {client_config.HEAD_INITS}, got {self.head_init!r}"
            )
        for name in (
            "clip_norm",
            "client_learning_rate",
            "server_learning_rate",
            "class_means_norm",
            "head_loss_scale",
        ):
            validation.check_number(name, getattr(self, name), 0, low_open=True)
        if self.head_lr_scale is not None:
            validation.check_number("head_lr_scale", self.head_lr_scale, 0, low_open=True)
        rules.check_gradient_clip_norm(self)
        validation.check_number(
            "head_loss_margin", self.head_loss_margin, 0, math.pi / 2, low_open=False
        )
        if self.head_loss not in client_config.HEAD_LOSSES:
            raise ValueError(
                f"head_loss must be one of {client_config.HEAD_LOSSES}, got {self.head_loss!r}"
            )
        for name in ("client_momentum", "server_momentum"):
            validation.check_number(name, getattr(self, name), 0, 1, low_open=False)
        rules.check_server_optimizer(self)
        if self.delta is not None:
            validation.check_number("delta", self.delta, 0, 1, low_open=True)
        if self.max_epsilon is not None:
            validation.check_number("max_epsilon", self.max_epsilon, 0, low_open=True)
        if algorithm.check_job is not None:
            algorithm.check_job(self)
        if isinstance(self.trainable_layers, str) or not all(
            isinstance(p, str) for p in self.trainable_layers
        ):
            raise ValueError(
                f"trainable_layers must be a list of layer-name patterns, "
                f"got {self.trainable_layers!r}"
            )
        # JSON gives lists; a tuple keeps the config hashable.
        object.__setattr__(self, "trainable_layers", tuple(self.trainable_layers))
        # Checks the architecture against the input size.
        _ = self.backbone_config
        if self.cache_features is True:
            self._check_cache_features()

    def _drop_another_sections_defaults(self, algorithm: algorithms.Algorithm) -> None:
        """Another algorithm's section at its defaults, as a job of that algorithm
        carries it into `dataclasses.replace(job, algorithm=...)`, holds no choice:
        dropped (this algorithm's defaults apply). Set away from its defaults, it is
        refused in one line, never silently lost."""
        settings = self.settings
        own = algorithm.section
        for section in algorithms.registry.sections().values():
            if section is own or not isinstance(settings, section.settings):
                continue
            defaults = dataclasses.asdict(section.settings())
            changed = sorted(k for k, v in dataclasses.asdict(settings).items() if defaults[k] != v)
            if changed:
                raise ValueError(
                    f"settings hold {section.name}.{changed[0]}, a setting of "
                    f"{' and '.join(algorithms.registry.section_users(section.name))}, not of "
                    f"{self.algorithm}: leave settings unset"
                )
            object.__setattr__(self, "settings", None)
            return

    def _check_cache_features(self) -> None:
        reason = None
        if not algorithms.get(self.algorithm).cacheable:
            reason = f"{self.algorithm} does not train on client batches of images"
        elif self.shared_negatives is not None:
            reason = "shared negatives embed images with the whole backbone each release"
        else:
            from tff_algorithms.federated import feature_cache  # TensorFlow, only when asked for

            decision = feature_cache.cut_for(self.backbone_config)
            if decision.cut is None:
                reason = decision.reason
        if reason is not None:
            raise ValueError(
                f"cache_features is true but cannot apply: {reason}; set cache_features to "
                "false or null, or train a suffix of the backbone (trainable_layers such as "
                '["embedding"])'
            )

    def _resolve_noise(self) -> None:
        if self.target_epsilon is None:
            if self.noise_multiplier is None:
                object.__setattr__(self, "noise_multiplier", DEFAULT_NOISE_MULTIPLIER)
            validation.check_number("noise_multiplier", self.noise_multiplier, 0, low_open=False)
            return
        validation.check_number("target_epsilon", self.target_epsilon, 0, low_open=True)
        if self.noise_multiplier is not None:
            raise ValueError(
                "give noise_multiplier or target_epsilon, not both: the noise multiplier is "
                "calibrated for the target (set noise_multiplier to null)"
            )
        if not algorithms.get(self.algorithm).private:
            raise ValueError(
                f"target_epsilon applies to the private algorithms; {self.algorithm} has no noise"
            )
        if self.max_epsilon is not None and self.target_epsilon > self.max_epsilon:
            raise ValueError(
                f"target_epsilon {self.target_epsilon:g} exceeds max_epsilon "
                f"{self.max_epsilon:g}: lower the target or raise the budget"
            )

    def calibrated_for(self, num_users: int) -> tuple[TrainJobConfig, dict[str, Any]]:
        """The job with its virtual clients per round (when `auto`) and its noise
        multiplier fixed for `num_users` training users, and where that multiplier came
        from (for metrics.json). Refuses, in one line, a schedule the users cannot fill.

        With `target_epsilon`, the smallest z (within
        `calibration.CALIBRATION_RELATIVE_TOLERANCE`) whose planned schedule costs at most
        the target; the returned config carries that z and no target. A target that needs
        z above the virtual clients per round is refused as out of reach.
        """
        algorithm = algorithms.get(self.algorithm)
        if self.virtual_clients_per_round == AUTO:
            try:
                largest = schedule.largest_virtual_clients_per_round(
                    num_users, self.users_per_virtual_client, float(self.over_selection)
                )
            except ValueError as e:
                if algorithm.section is None:
                    raise
                raise ValueError(algorithm.section.in_own_words(str(e))) from None
            resolved = dataclasses.replace(self, virtual_clients_per_round=largest)
            config, source = resolved.calibrated_for(num_users)
            return config, {**source, "virtual_clients_per_round": AUTO}
        if algorithm.check_round_fill is not None:
            # One line when the users cannot fill a round.
            algorithm.check_round_fill(self, num_users)
        if self.shared_negatives is not None:
            self.shared_negatives.check_population(num_users)
        if self.target_epsilon is None:
            return self, {"source": "configured", "noise_multiplier": self.noise_multiplier}
        fixed = dataclasses.replace(self, noise_multiplier=1.0, target_epsilon=None)
        spec = job_plan.accounting_spec_for(fixed, num_users)
        try:
            noise = calibration.calibrate_noise_multiplier(
                spec, float(self.target_epsilon), releases=job_plan.release_plan_for(self)
            )
        except calibration.TargetOutOfReach:
            noise = math.inf
        # Beyond z = M the noise on every coordinate of the averaged update exceeds the
        # norm of the largest update a client may send: nothing would be learnt.
        if noise > self.virtual_clients_per_round:
            bound = f"the {self.virtual_clients_per_round} {algorithm.round_groups}"
            raise ValueError(
                f"target_epsilon {self.target_epsilon:g} is out of reach for this schedule "
                f"({num_users} training users, {spec.users_per_round} per round, "
                f"{spec.rounds} rounds, delta {spec.delta:.3g}): it needs a noise multiplier "
                f"of {noise:.4g}, above {bound}; raise the target or delta, or train on more "
                "users, for fewer rounds or with fewer users per round"
            )
        return dataclasses.replace(fixed, noise_multiplier=noise), {
            "source": "calibrated",
            "target_epsilon": self.target_epsilon,
            "training_users": num_users,
            "noise_multiplier": noise,
            "relative_tolerance": calibration.CALIBRATION_RELATIVE_TOLERANCE,
        }

    @property
    def backbone_config(self) -> model_config.BackboneConfig:
        return model_config.BackboneConfig(
            self.architecture,
            (self.image_size, self.image_size, self.channels),
            self.embedding_size,
            trainable_layers=self.trainable_layers,
            batch_norm=self.batch_norm,
        )

    @property
    def resolved_head_lr_scale(self) -> float:
        if self.head_lr_scale is not None:
            return float(self.head_lr_scale)
        default = algorithms.get(self.algorithm).default_head_lr_scale
        if default is not None:
            return default
        return client_config.ClientConfig.head_learning_rate_scale

    @property
    def head_loss_config(self) -> client_config.HeadLossConfig:
        return client_config.HeadLossConfig(
            self.head_loss, float(self.head_loss_scale), float(self.head_loss_margin)
        )

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (self.image_size, self.image_size, self.channels)

    @property
    def private(self) -> bool:
        if not algorithms.get(self.algorithm).private:
            return False
        return self.target_epsilon is not None or self.noise_multiplier > 0

    def client_config(self) -> client_config.ClientConfig:
        return client_config.ClientConfig(
            client_learning_rate=self.client_learning_rate,
            head_learning_rate_scale=self.resolved_head_lr_scale,
            momentum=self.client_momentum,
            head_capacity=self.head_capacity or self.users_per_virtual_client,
            local_epochs=self.local_epochs,
            batch_size=self.batch_size,
            max_examples=self.max_examples_per_client,
            shuffle_buffer=self.max_examples_per_client,
            head_seed=self.seed,
            head_init=self.head_init,
            class_means_norm=self.class_means_norm,
            head_loss=self.head_loss_config,
            # The family's straggler limits (its `dp_fedemb` section): only its jobs
            # build a client config.
            max_local_steps=self.settings.max_local_steps,
            max_seconds=self.settings.max_client_seconds,
            failure_injection_rate=float(self.failure_injection_rate),
            shared_negative_rows=(
                0 if self.shared_negatives is None else self.shared_negatives.num_clusters
            ),
            shared_negative_cap=(
                0.0 if self.shared_negatives is None else self.shared_negatives.negative_cap
            ),
        )

    def report_policy(self) -> report_policy.ReportPolicy:
        return report_policy.ReportPolicy(
            self.virtual_clients_per_round,
            float(self.over_selection),
            float(self.min_report_fraction),
            self.max_round_attempts,
        )

    def resolved_delta(self, num_users: int) -> float:
        return self.delta if self.delta is not None else float(num_users) ** -1.1

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        # Off (and the sgd server optimizer) is left out: the records of jobs from before
        # the field (train_job.json, metrics.json, golden runs) stay equal, so those jobs
        # still resume.
        for name in ("shared_negatives", "cache_features"):
            if values[name] is None:
                del values[name]
        if values["server_optimizer"] == model_config.SGD:
            del values["server_optimizer"]
        if values["batch_norm"] == model_config.BATCH_NORM_AUTO:
            del values["batch_norm"]
        # An algorithm's own settings as its section, with the schedule's counts in its
        # words; the jobs of algorithms without one record none.
        del values["settings"]
        section = algorithms.get(self.algorithm).section
        if section is not None:
            own = {key: values.pop(field) for key, field in section.shape.items()}
            for field in section.implied:
                del values[field]
            values[section.name] = {**own, **dataclasses.asdict(self.settings)}
        return values

    def public_dict(self) -> dict[str, Any]:
        """`to_dict` without the seeds (module docstring)."""
        return {k: v for k, v in self.to_dict().items() if k not in _SECRET_FIELDS}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainJobConfig:
        """The job of a record (`to_dict`'s, or the flat one of the release before) or of
        layered recipe and user values (`registry.product_layer`: the user's own layers
        already through `registry.user_layer`). None values mean the defaults."""
        algorithm = algorithms.get(values.get("algorithm", cls.algorithm))
        values = algorithms.registry.product_layer(values, algorithm)
        names = {f.name for f in dataclasses.fields(cls)} - {"settings"}
        unknown = sorted(set(values) - names - set(algorithms.registry.sections()))
        if unknown:
            raise ValueError(f"unknown training config fields: {', '.join(unknown)}")
        section = algorithm.section
        if section is not None:
            own = dict(values.pop(section.name))
            for key, field in section.shape.items():
                if own.get(key) is not None:
                    values[field] = own.pop(key)
                own.pop(key, None)
            values = {**values, **section.implied, "settings": own}
        return cls(**{k: v for k, v in values.items() if v is not None})


def current_layout(record: Mapping[str, Any]) -> dict[str, Any]:
    """A recorded job config (`to_dict` or `public_dict`, in OUTPUT/train_job.json or
    metrics.json) in this release's layout, unvalidated: the flat keys of the release
    before moved into its algorithm's section (`registry.product_layer`), so an output
    directory written before sections resumes, and a finished one is recognised. A
    section's settings the record lacks (keys added since, such as `dp_sgd.optimizer`)
    read as their defaults, which is what that release ran."""
    algorithm = algorithms.find(record.get("algorithm"))
    if algorithm is None:
        return dict(record)
    values = algorithms.registry.product_layer(record, algorithm)
    section = algorithm.section
    if section is not None:
        defaults = dataclasses.asdict(section.settings())
        values[section.name] = {**defaults, **values[section.name]}
    return values
