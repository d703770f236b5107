"""One training job: partition in, serving SavedModel + privacy ledger + metrics out.

`run_train_job(config, partition_dir, eval_records, output_dir)` is what `dp-fedemb
train` and the TFX trainer component call. It

1. builds the virtual-client schedule from the partition's user ids (mode "sampled"
   for DP-FedEmb / DP-FedAvg, "epoch" for DP-FTRL-FedEmb), the accounting spec from the
   schedule's participation statistics, and refuses to start when the planned rounds
   cost more than `max_epsilon`;
2. trains with `training.train` (TFF; data loaded inside TFF from virtual-client ids,
   `client_data`), checkpointing under OUTPUT/checkpoints, so re-running the same job
   resumes where it stopped and ends bit-for-bit where an uninterrupted run ends;
3. evaluates exact recall@FAR (1e-1, 1e-2, 1e-3) on the held-out `eval_records` every
   `evaluate_every` rounds and after the last;
4. writes OUTPUT/saved_model (backbone only, `export`), OUTPUT/ledger.json and
   OUTPUT/metrics.json.

`algorithm="centralized"` is the non-private oracle (also the pipeline's non-private
pretraining on public data): SGD with momentum over all training examples, one "round"
per epoch, learning rate and momentum from `server_learning_rate` / `server_momentum`
(the paper lists the centralized learning rate in its server column); the DP fields
are ignored. Its outputs have the same layout, with epsilon null and `private: false`.

delta: `TrainJobConfig.delta=None` resolves to N^-1.1 for N training users, which is
below 1/N as (epsilon, delta)-DP needs (N=6800 gives 6.1e-5, N=10M gives 2e-8).

What is published: metrics.json holds only held-out evaluation and privacy figures,
plus per-round counts of dropped and kept virtual clients (`CLIENT_COUNTS`: operations
figures about failed reads and stragglers, labelled as outside the DP guarantee);
training-user losses (not private) are never written. It omits the schedule seed and
the noise seed: sampling amplification assumes the sample is secret, and whoever knows
the noise seed can subtract the noise. OUTPUT/train_job.json and the checkpoints hold
both, so keep them as private as the training data. On a local OUTPUT the job does its
part (`secret_files`): OUTPUT (when the job creates it) and OUTPUT/checkpoints are 0700,
train_job.json, ledger.json and metrics.json 0600, replaced atomically, and a symlink
planted at any of these paths is refused.

Both seeds come from OS entropy unless a testing flag allows a fixed one. The schedule
seed is drawn when a job first claims OUTPUT and recorded in OUTPUT/train_job.json (not
in the config: a caller such as a TFX component publishes its config), so re-running the
job resumes with the same virtual clients; the noise seed lives in the checkpointed
aggregator state. `seed` seeds only what is public anyway (the initial backbone, the
local heads' initialisation, the oracle's shuffling) and says nothing about who trained.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from beam_jobs import partition, schedule, schema
from tff_algorithms import (
    accounting,
    aggregators,
    client_data,
    client_work,
    dropouts,
    export,
    metrics,
    models,
    processes,
    runtime,
    secret_files,
    training,
)
from tff_algorithms import budget as budget_lib
from tff_algorithms.ledger import PrivacyLedger

DP_FEDEMB = "dp-fedemb"
DP_FEDAVG = "dp-fedavg"
DP_FTRL_FEDEMB = "dp-ftrl-fedemb"
CENTRALIZED = "centralized"
# The paper's EMNIST noise multiplier (appendix D), when neither it nor a target is given.
DEFAULT_NOISE_MULTIPLIER = 0.62
AUTO = schedule.AUTO
ALGORITHMS = (DP_FEDEMB, DP_FEDAVG, DP_FTRL_FEDEMB, CENTRALIZED)

CHECKPOINT_DIR = "checkpoints"
SAVED_MODEL_DIR = "saved_model"
METRICS_FILE = "metrics.json"
LEDGER_FILE = "ledger.json"
JOB_FILE = "train_job.json"
JOB_FORMAT = "dp-fedemb-train-job/1"

_EMBED_BATCH = 256
# Fields that may differ when a job is re-run on the same output directory.
_RESUMABLE_CHANGES = frozenset({"evaluate_every", "max_epsilon"})
# Never published (module docstring).
_SECRET_FIELDS = ("schedule_seed", "noise_seed")
# Client-work counts of the applied attempt of each round, recorded in the history.
CLIENT_COUNTS = (*dropouts.DROP_REASONS, "dropped_clients", dropouts.KEPT_CLIENTS)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value: Any, low: float, high: float, *, low_open: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    above_low = value > low if low_open else value >= low
    if not (math.isfinite(value) and above_low and value < high):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g})"
        raise ValueError(f"{name} must be finite and in {interval}, got {value}")


@dataclasses.dataclass(frozen=True)
class TrainJobConfig:
    """Hyperparameters of one training job (defaults: paper, EMNIST small CNN, appendix D).

    Attributes:
      algorithm: one of `ALGORITHMS`.
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
      head_lr_scale: β2 / β1 of the client's head; None: 100 for the DP-FedEmb variants
        (paper, section 3.3) and 1 for DP-FedAvg, whose client trains backbone and global
        head with one optimizer (paper, Alg. 2): at 100 the global head's update fills the
        clipped delta and the backbone barely moves (BENCHMARKS.md, "Training").
      head_init / class_means_norm: how each local head starts (`client_work.ClientConfig`):
        `random` (the paper) or `class_means` (rows are the client's per-identity mean
        unit embeddings under the received backbone, of norm class_means_norm). Local
        heads only: DP-FedAvg's and the oracle's global head start from the model.
      head_loss / head_loss_scale / head_loss_margin: the loss on every head's logits,
        local, DP-FedAvg's and the oracle's (`client_work.HeadLossConfig`): `softmax`
        (the paper), `cosface` or `arcface`; scale s and margin m apply to the last two.
      local_epochs, batch_size, max_examples_per_client: local training (paper: 1, 32, 2048).
      head_capacity: rows of the local head; None means users_per_virtual_client, exact
        when every user holds one identity (faces). A round with examples beyond it stops
        the job with an error naming this field.
      architecture, embedding_size, image_size, channels: the backbone and its input.
      trainable_layers: layer-name patterns of the backbone layers training updates
        (`models.BackboneConfig.trainable_layers`); the others keep their initial
        (pretrained) values and are neither aggregated nor noised.
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
      restart_every_epoch: DP-FTRL only: restart the noise tree every epoch.
      max_epsilon: privacy budget; the job refuses to start when the planned rounds
        would cost more. None: no budget.
      over_selection: o; a round selects ceil(M(1 + o)) virtual clients and keeps the
        first M that report. Accounting uses the selected set's sampling
        (`tff_algorithms.dropouts`).
      min_report_fraction: a round with fewer than ceil(f·M) reporting virtual clients
        is retried with a fresh selection, never applied.
      max_round_attempts: attempts per round before the job stops with an error.
      max_local_steps / max_client_seconds: a virtual client needing more local steps
        or wall-clock seconds is a straggler and is dropped (None: no limit).
      failure_injection_rate: fraction of virtual clients made to fail their read, to
        measure dropout robustness (tests and benchmarks only).
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
    head_lr_scale: float | None = None
    head_init: str = client_work.HEAD_INIT_RANDOM
    class_means_norm: float = client_work.ClientConfig.class_means_norm
    head_loss: str = client_work.HeadLossConfig.loss
    head_loss_scale: float = client_work.HeadLossConfig.scale
    head_loss_margin: float = client_work.HeadLossConfig.margin
    local_epochs: int = 1
    batch_size: int = 32
    max_examples_per_client: int = 2048
    head_capacity: int | None = None
    architecture: str = models.SMALL_CNN
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
    restart_every_epoch: bool = False
    max_epsilon: float | None = None
    over_selection: float = 0.0
    min_report_fraction: float = 0.5
    max_round_attempts: int = 3
    max_local_steps: int | None = None
    max_client_seconds: float | None = None
    failure_injection_rate: float = 0.0
    trainable_layers: tuple[str, ...] = models.ALL_LAYERS

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
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
            _check_int(name, getattr(self, name), 1)
        if isinstance(self.virtual_clients_per_round, str):
            if self.virtual_clients_per_round != AUTO:
                raise ValueError(
                    f"virtual_clients_per_round must be an integer or {AUTO!r}, "
                    f"got {self.virtual_clients_per_round!r}"
                )
        else:
            _check_int("virtual_clients_per_round", self.virtual_clients_per_round, 1)
        if self.max_local_steps is not None:
            _check_int("max_local_steps", self.max_local_steps, 1)
        if self.max_client_seconds is not None:
            _check_number("max_client_seconds", self.max_client_seconds, 0, math.inf, low_open=True)
        _check_number("over_selection", self.over_selection, 0, 100, low_open=False)
        for name in ("min_report_fraction", "failure_injection_rate"):
            value = getattr(self, name)
            _check_number(name, value, 0, math.inf, low_open=False)
            if value > 1:
                raise ValueError(f"{name} must be a fraction in [0, 1], got {value}")
        for name in ("evaluate_every", "seed"):
            _check_int(name, getattr(self, name), 0)
        if self.head_capacity is not None:
            _check_int("head_capacity", self.head_capacity, 1)
        for name in ("testing_fixed_noise", "testing_fixed_schedule"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.schedule_seed is not None:
            _check_int("schedule_seed", self.schedule_seed, 0)
            if not self.testing_fixed_schedule:
                raise ValueError(
                    "a fixed schedule_seed makes the sampled users predictable and is for tests "
                    "only: production runs draw it from OS entropy; set testing_fixed_schedule "
                    "(--testing-fixed-schedule) to use one"
                )
        if self.noise_seed is not None:
            _check_int("noise_seed", self.noise_seed, 0)
            if not self.testing_fixed_noise:
                raise ValueError(
                    "a fixed noise_seed makes the DP noise predictable and is for tests only: "
                    "production runs draw it from OS entropy; set testing_fixed_noise "
                    "(--testing-fixed-noise) to use one"
                )
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {self.channels!r}")
        self._resolve_noise()
        if self.head_init not in client_work.HEAD_INITS:
            raise ValueError(
                f"head_init must be one of {client_work.HEAD_INITS}, got {self.head_init!r}"
            )
        for name in (
            "clip_norm",
            "client_learning_rate",
            "server_learning_rate",
            "class_means_norm",
            "head_loss_scale",
        ):
            _check_number(name, getattr(self, name), 0, math.inf, low_open=True)
        if self.head_lr_scale is not None:
            _check_number("head_lr_scale", self.head_lr_scale, 0, math.inf, low_open=True)
        _check_number("head_loss_margin", self.head_loss_margin, 0, math.pi / 2, low_open=False)
        if self.head_loss not in client_work.HEAD_LOSSES:
            raise ValueError(
                f"head_loss must be one of {client_work.HEAD_LOSSES}, got {self.head_loss!r}"
            )
        for name in ("client_momentum", "server_momentum"):
            _check_number(name, getattr(self, name), 0, 1, low_open=False)
        if self.delta is not None:
            _check_number("delta", self.delta, 0, 1, low_open=True)
        if self.max_epsilon is not None:
            _check_number("max_epsilon", self.max_epsilon, 0, math.inf, low_open=True)
        if not isinstance(self.restart_every_epoch, bool):
            raise ValueError(
                f"restart_every_epoch must be a boolean, got {self.restart_every_epoch!r}"
            )
        if self.restart_every_epoch and self.algorithm != DP_FTRL_FEDEMB:
            raise ValueError("restart_every_epoch applies only to dp-ftrl-fedemb")
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

    def _resolve_noise(self) -> None:
        if self.target_epsilon is None:
            if self.noise_multiplier is None:
                object.__setattr__(self, "noise_multiplier", DEFAULT_NOISE_MULTIPLIER)
            _check_number("noise_multiplier", self.noise_multiplier, 0, math.inf, low_open=False)
            return
        _check_number("target_epsilon", self.target_epsilon, 0, math.inf, low_open=True)
        if self.noise_multiplier is not None:
            raise ValueError(
                "give noise_multiplier or target_epsilon, not both: the noise multiplier is "
                "calibrated for the target (set noise_multiplier to null)"
            )
        if self.algorithm == CENTRALIZED:
            raise ValueError(
                "target_epsilon applies to the private algorithms; centralized has no noise"
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
        `accounting.CALIBRATION_RELATIVE_TOLERANCE`) whose planned schedule costs at most
        the target; the returned config carries that z and no target. A target that needs
        z above the virtual clients per round is refused as out of reach.
        """
        if self.virtual_clients_per_round == AUTO:
            largest = schedule.largest_virtual_clients_per_round(
                num_users, self.users_per_virtual_client, float(self.over_selection)
            )
            resolved = dataclasses.replace(self, virtual_clients_per_round=largest)
            config, source = resolved.calibrated_for(num_users)
            return config, {**source, "virtual_clients_per_round": AUTO}
        if self.algorithm != CENTRALIZED:
            schedule_shape_for(self, num_users)  # one line when the users cannot fill a round
        if self.target_epsilon is None:
            return self, {"source": "configured", "noise_multiplier": self.noise_multiplier}
        fixed = dataclasses.replace(self, noise_multiplier=1.0, target_epsilon=None)
        spec = accounting_spec_for(fixed, num_users)
        try:
            noise = accounting.calibrate_noise_multiplier(spec, float(self.target_epsilon))
        except accounting.TargetOutOfReach:
            noise = math.inf
        # Beyond z = M the noise on every coordinate of the averaged update exceeds the
        # norm of the largest update a client may send: nothing would be learnt.
        if noise > self.virtual_clients_per_round:
            raise ValueError(
                f"target_epsilon {self.target_epsilon:g} is out of reach for this schedule "
                f"({num_users} training users, {spec.users_per_round} per round, "
                f"{spec.rounds} rounds, delta {spec.delta:.3g}): it needs a noise multiplier "
                f"of {noise:.4g}, above the {self.virtual_clients_per_round} virtual clients "
                "per round that average it; raise the target or delta, or train on more "
                "users, for fewer rounds or with fewer users per round"
            )
        return dataclasses.replace(fixed, noise_multiplier=noise), {
            "source": "calibrated",
            "target_epsilon": self.target_epsilon,
            "training_users": num_users,
            "noise_multiplier": noise,
            "relative_tolerance": accounting.CALIBRATION_RELATIVE_TOLERANCE,
        }

    @property
    def backbone_config(self) -> models.BackboneConfig:
        return models.BackboneConfig(
            self.architecture,
            (self.image_size, self.image_size, self.channels),
            self.embedding_size,
            trainable_layers=self.trainable_layers,
        )

    @property
    def resolved_head_lr_scale(self) -> float:
        if self.head_lr_scale is not None:
            return float(self.head_lr_scale)
        if self.algorithm == DP_FEDAVG:
            return 1.0
        return client_work.ClientConfig.head_learning_rate_scale

    @property
    def head_loss_config(self) -> client_work.HeadLossConfig:
        return client_work.HeadLossConfig(
            self.head_loss, float(self.head_loss_scale), float(self.head_loss_margin)
        )

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (self.image_size, self.image_size, self.channels)

    @property
    def private(self) -> bool:
        if self.algorithm == CENTRALIZED:
            return False
        return self.target_epsilon is not None or self.noise_multiplier > 0

    def client_config(self) -> client_work.ClientConfig:
        return client_work.ClientConfig(
            backbone_learning_rate=self.client_learning_rate,
            head_learning_rate_scale=self.resolved_head_lr_scale,
            momentum=self.client_momentum,
            head_capacity=self.head_capacity or self.users_per_virtual_client,
            epochs=self.local_epochs,
            batch_size=self.batch_size,
            max_examples=self.max_examples_per_client,
            shuffle_buffer=self.max_examples_per_client,
            head_seed=self.seed,
            head_init=self.head_init,
            class_means_norm=self.class_means_norm,
            head_loss=self.head_loss_config,
            max_local_steps=self.max_local_steps,
            max_seconds=self.max_client_seconds,
            failure_injection_rate=float(self.failure_injection_rate),
        )

    def report_policy(self) -> dropouts.ReportPolicy:
        return dropouts.ReportPolicy(
            self.virtual_clients_per_round,
            float(self.over_selection),
            float(self.min_report_fraction),
            self.max_round_attempts,
        )

    def resolved_delta(self, num_users: int) -> float:
        return self.delta if self.delta is not None else float(num_users) ** -1.1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def public_dict(self) -> dict[str, Any]:
        """`to_dict` without the seeds (module docstring)."""
        return {k: v for k, v in self.to_dict().items() if k not in _SECRET_FIELDS}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainJobConfig:
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown training config fields: {', '.join(unknown)}")
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class TrainJobResult:
    """Where a finished job wrote its outputs, and its metrics.json content."""

    output_dir: str
    saved_model_dir: str
    metrics_path: str
    ledger_path: str
    metrics: dict[str, Any]

    @property
    def epsilon(self) -> float:
        value = self.metrics["epsilon"]
        return math.inf if value is None else value

    @property
    def recall_at_far(self) -> dict[str, float]:
        return self.metrics["recall_at_far"]


def fresh_schedule_seed() -> int:
    """A schedule seed from OS entropy, for production runs."""
    return secrets.randbits(62)


def schedule_shape_for(config: TrainJobConfig, num_users: int) -> schedule.ScheduleShape:
    """The counts of a federated job's schedule over `num_users` users (no seed needed).

    It selects `report_policy().selected_per_round` virtual clients per round (more
    than planned when over-selecting), so the accounting spec built from its
    participation statistics uses the selected set's sampling.
    """
    mode = schedule.EPOCH if config.algorithm == DP_FTRL_FEDEMB else schedule.SAMPLED
    return schedule.ScheduleShape(
        num_users,
        config.users_per_virtual_client,
        config.report_policy().selected_per_round,
        mode,
    )


def schedule_for(
    config: TrainJobConfig, num_users: int, schedule_seed: int | None = None
) -> schedule.VirtualClientSchedule:
    """The virtual-client schedule of a federated job over `num_users` users.

    `schedule_seed`: the job's seed (`run_train_job` passes the one it resolved); None
    takes `config.schedule_seed`, or draws a fresh one from OS entropy when that is None.
    """
    shape = schedule_shape_for(config, num_users)
    if schedule_seed is None:
        schedule_seed = (
            config.schedule_seed if config.schedule_seed is not None else fresh_schedule_seed()
        )
    return schedule.VirtualClientSchedule(
        shape.num_users,
        shape.users_per_virtual_client,
        shape.virtual_clients_per_round,
        schedule_seed,
        shape.mode,
    )


def accounting_spec_for(config: TrainJobConfig, num_users: int) -> accounting.AccountingSpec:
    """The accounting spec of the planned job (centralized: every user every epoch, no noise)."""
    if config.target_epsilon is not None:
        raise ValueError("the noise multiplier is not calibrated yet: use config.calibrated_for")
    delta = config.resolved_delta(num_users)
    if config.algorithm == CENTRALIZED:
        return accounting.AccountingSpec(num_users, num_users, config.rounds, 0.0, delta)
    stats = schedule_shape_for(config, num_users).participation_stats(config.rounds)
    is_tree = config.algorithm == DP_FTRL_FEDEMB
    return accounting.AccountingSpec(
        population=stats.sampling_units,
        users_per_round=stats.units_per_round,
        rounds=stats.rounds,
        noise_multiplier=config.noise_multiplier,
        delta=delta,
        mechanism=accounting.Mechanism.DPFTRL if is_tree else accounting.Mechanism.DPSGD,
        users_per_virtual_client=config.users_per_virtual_client,
        restart_every_epoch=config.restart_every_epoch,
        min_separation=stats.min_separation if is_tree and not config.restart_every_epoch else None,
    )


def _check_budget(config: TrainJobConfig, planned: accounting.PrivacyResult) -> None:
    if config.max_epsilon is not None and not planned.epsilon <= config.max_epsilon:
        cost = "infinite (no noise)" if math.isinf(planned.epsilon) else f"{planned.epsilon:.4g}"
        raise ValueError(
            f"over budget: {config.rounds} rounds of {config.algorithm} cost epsilon {cost} at "
            f"delta {planned.delta:.3g}, more than max_epsilon {config.max_epsilon:g}; refusing "
            "to start"
        )


# Records and evaluation.


def record_files(records: str) -> list[str]:
    """TFRecord files of `records`: a directory (records-*, or files named *tfrecord*) or a glob."""
    if tf.io.gfile.isdir(records):
        files = tf.io.gfile.glob(os.path.join(records, "records-*"))
        if not files:
            files = [
                os.path.join(records, name)
                for name in tf.io.gfile.listdir(records)
                if "tfrecord" in name and not tf.io.gfile.isdir(os.path.join(records, name))
            ]
    else:
        files = tf.io.gfile.glob(records)
    if not files:
        raise ValueError(f"no TFRecord files found at {records}")
    return sorted(files)


def _image_folder_files(root: str) -> list[tuple[str, str]]:
    """(identity, path) of ROOT/<user>/<identity>/<image> files."""
    pattern = os.path.join(root, "*", "*", "*")
    return sorted(
        (path.split(os.sep)[-2], path)
        for path in tf.io.gfile.glob(pattern)
        if path.lower().endswith((".png", ".jpg", ".jpeg"))
    )


def encoded_images(records: str) -> tf.data.Dataset:
    """(identity, encoded image) pairs from canonical TFRecords or an image folder."""
    if tf.io.gfile.isdir(records) and not tf.io.gfile.glob(os.path.join(records, "*tfrecord*")):
        files = _image_folder_files(records)
        if not files:
            raise ValueError(
                f"{records} holds neither TFRecords nor ROOT/user/identity/image files"
            )
        identities, paths = zip(*files)
        return tf.data.Dataset.from_tensor_slices((list(identities), list(paths))).map(
            lambda identity, path: (identity, tf.io.read_file(path))
        )
    files = record_files(records)
    compression = "GZIP" if files[0].endswith(".gz") else ""
    parsed = tf.data.TFRecordDataset(files, compression_type=compression).map(
        lambda s: tf.io.parse_single_example(s, schema.FEATURE_SPEC)
    )
    return parsed.map(lambda f: (f[schema.IDENTITY_KEY], f[schema.IMAGE_KEY]))


def _identities(records: str) -> np.ndarray:
    labels = np.array(
        [
            identity
            for identity, _ in encoded_images(records).map(lambda i, _: (i, 0)).as_numpy_iterator()
        ]
    )
    if len(labels) < 2 or len(np.unique(labels)) < 2:
        raise ValueError(
            f"evaluation needs at least two identities with images, {records} has fewer"
        )
    return labels


class HeldOutEvaluator:
    """Exact recall@FAR of backbone weights on held-out records, streamed in batches.

    The Keras backbone is built per call: building TFF computations creates Keras
    models in graph mode, which invalidates eager Keras models made before them.
    """

    def __init__(self, backbone_config: models.BackboneConfig, records: str) -> None:
        self.records = records
        self.labels = _identities(records)
        self._backbone_config = backbone_config
        self._images = encoded_images(records).map(
            lambda _, encoded: export.decode_image(encoded, backbone_config.image_shape)
        )

    def embeddings(self, weights: tff.learning.models.ModelWeights) -> np.ndarray:
        backbone = models.build_backbone(self._backbone_config)
        models.assign_backbone_weights(backbone, weights)
        return np.concatenate(
            [models.embed(backbone, batch).numpy() for batch in self._images.batch(_EMBED_BATCH)]
        )

    def __call__(self, weights: tff.learning.models.ModelWeights) -> dict[str, Any]:
        result = metrics.recall_at_far(self.embeddings(weights), self.labels)
        return {"recall_at_far": result.as_json_dict()}


def embed_saved_model(model_dir: str, records: str) -> tuple[np.ndarray, np.ndarray]:
    """(identity labels, embeddings) of every image in `records`, in reading order.

    `records`: canonical TFRecords (directory or glob) or an image folder. Images go
    through the model's own preprocessing (encoded bytes in).
    """
    if not tf.io.gfile.exists(os.path.join(model_dir, "saved_model.pb")):
        raise ValueError(f"{model_dir} is not a SavedModel (no saved_model.pb)")
    serve = tf.saved_model.load(model_dir).signatures[export.SIGNATURE]
    pairs = encoded_images(records).batch(_EMBED_BATCH)
    labels, embeddings = [], []
    for identity, encoded in pairs:
        labels.append(identity.numpy())
        embeddings.append(serve(**{export.INPUT_KEY: encoded})[export.OUTPUT_KEY].numpy())
    if not labels:
        raise ValueError(f"no images in {records}")
    return np.concatenate(labels), np.concatenate(embeddings)


def _verification(
    model_dir: str, records: str, labels: np.ndarray, embeddings: np.ndarray
) -> dict[str, Any]:
    result = metrics.recall_at_far(embeddings, labels)
    far_grid, recall_grid = metrics.roc_curve(embeddings, labels)
    return {
        "model": model_dir,
        "records": records,
        "images": int(len(labels)),
        "identities": int(len(np.unique(labels))),
        "recall_at_far": result.as_json_dict(),
        "thresholds": {format(k, "g"): v for k, v in result.threshold.items()},
        "genuine_pairs": result.num_genuine_pairs,
        "impostor_pairs": result.num_impostor_pairs,
        "roc": {"far": far_grid.tolist(), "recall": recall_grid.tolist()},
    }


def evaluate_saved_model(model_dir: str, records: str) -> dict[str, Any]:
    """Exact all-pairs recall@FAR and ROC points of a serving SavedModel on `records`."""
    return _verification(model_dir, records, *embed_saved_model(model_dir, records))


def compare_saved_models(
    model_dirs: dict[str, str],
    records: str,
    num_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """`evaluate_saved_model` of each model, with bootstrap intervals, on the same images.

    Each result gains "recall_at_far_interval" {far: [low, high]}: the percentile
    interval over identity resamples (metrics.bootstrap_recall_at_far). The first model
    also gains "versus" {other model: {far: {"difference", "interval"}}}: its recall minus
    the other's, with the interval of the PAIRED bootstrap (both scored on each resample),
    which is much narrower than the two separate intervals suggest.
    """
    embedded = {name: embed_saved_model(path, records) for name, path in model_dirs.items()}
    labels = next(iter(embedded.values()))[0]
    for name, (other_labels, _) in embedded.items():
        if not np.array_equal(other_labels, labels):
            raise ValueError(f"model {name!r} read {records} in another order")
    samples = metrics.bootstrap_recall_at_far(
        {name: e for name, (_, e) in embedded.items()},
        labels,
        metrics.DEFAULT_FARS,
        num_resamples,
        seed,
    )
    keys = [format(far, "g") for far in metrics.DEFAULT_FARS]
    results = {}
    for name, (_, embeddings) in embedded.items():
        results[name] = _verification(model_dirs[name], records, labels, embeddings)
        results[name]["recall_at_far_interval"] = {
            key: list(metrics.percentile_interval(samples[name][:, f], confidence))
            for f, key in enumerate(keys)
        }
    first, *others = list(embedded)
    results[first]["versus"] = {
        other: {
            key: {
                "difference": results[first]["recall_at_far"][key]
                - results[other]["recall_at_far"][key],
                "interval": list(
                    metrics.percentile_interval(
                        samples[first][:, f] - samples[other][:, f], confidence
                    )
                ),
            }
            for f, key in enumerate(keys)
        }
        for other in others
    }
    return results


# Training.


@dataclasses.dataclass
class _Outcome:
    backbone: tff.learning.models.ModelWeights
    ledger: PrivacyLedger
    history: list[dict[str, Any]]
    resumed_from_round: int


def _training_identity_vocabulary(
    reader: partition.PartitionReader, user_ids: list[str]
) -> np.ndarray:
    # The global head of DP-FedAvg and the oracle has one row per training identity:
    # O(training data) once, inherent to those baselines.
    identities = {
        reader_record.identity for u in user_ids for reader_record in reader.user_records(u)
    }
    return client_work.identity_keys_vocabulary(sorted(identities))


def _build_process(
    config: TrainJobConfig,
    plan: schedule.VirtualClientSchedule,
    reader: partition.PartitionReader,
    user_ids: list[str],
) -> tff.learning.templates.LearningProcess:
    client_config = config.client_config()
    common = dict(
        noise_multiplier=float(config.noise_multiplier),
        clip=float(config.clip_norm),
        clients_per_round=config.virtual_clients_per_round,
        noise_seed=config.noise_seed
        if config.noise_seed is not None
        else aggregators.fresh_noise_seed(),
        server_learning_rate=config.server_learning_rate,
        server_momentum=config.server_momentum,
        backbone_seed=config.seed,
        max_reports=config.report_policy().max_reports,
    )
    if config.algorithm == DP_FEDEMB:
        base = processes.build_dp_fedemb_process(config.backbone_config, client_config, **common)
    elif config.algorithm == DP_FTRL_FEDEMB:
        base = processes.build_dp_ftrl_fedemb_process(
            config.backbone_config,
            client_config,
            restart_every_rounds=plan.rounds_per_epoch if config.restart_every_epoch else None,
            **common,
        )
    else:
        vocabulary = _training_identity_vocabulary(reader, user_ids)
        base = processes.build_dp_fedavg_process(
            config.backbone_config, client_config, vocabulary, **common
        )
    image_shape = config.image_shape
    return processes.compose_with_client_loader(
        base,
        lambda vc_id: client_data.load_examples(vc_id, image_shape),
        client_config,
        client_data.expected_examples,
        client_data.seed_name,
    )


def _with_backbone(
    process: tff.learning.templates.LearningProcess,
    state: Any,
    backbone: tff.learning.models.ModelWeights,
) -> Any:
    weights = process.get_model_weights(state)
    if isinstance(weights.trainable, Mapping):  # DP-FedAvg: keep the initial global head
        weights = tff.learning.models.ModelWeights(
            trainable={**weights.trainable, "backbone": list(backbone.trainable)},
            non_trainable={**weights.non_trainable, "backbone": list(backbone.non_trainable)},
        )
    else:
        weights = backbone
    return process.set_model_weights(state, weights)


def _head_capacity_check(config: TrainJobConfig) -> Callable[[Mapping[str, Any], Any], None]:
    capacity = config.client_config().head_capacity

    def check(record: Mapping[str, Any], training_metrics: Any) -> None:
        dropped = int(training_metrics["client_work"]["examples_over_head_capacity"])
        if dropped:
            cause = (
                f"exceed the local head capacity {capacity}; raise head_capacity"
                if config.algorithm != DP_FEDAVG
                else "have identities outside the training vocabulary"
            )
            raise ValueError(f"round {record['round']}: {dropped} training examples {cause}")

    return check


def _train_federated(
    config: TrainJobConfig,
    partition_dir: str,
    reader: partition.PartitionReader,
    user_ids: list[str],
    spec: accounting.AccountingSpec,
    evaluator: HeldOutEvaluator,
    checkpoint_dir: str,
    pretrained: tff.learning.models.ModelWeights | None,
    progress: Callable[[Mapping[str, Any]], None] | None,
    *,
    schedule_seed: int,
) -> _Outcome:
    plan = schedule_for(config, len(user_ids), schedule_seed)
    process = _build_process(config, plan, reader, user_ids)
    ids = client_data.VirtualClientIds(partition_dir, plan, user_ids)
    initial_state = None
    if pretrained is not None:
        initial_state = _with_backbone(process, process.initialize(), pretrained)
    check_head = _head_capacity_check(config)

    def on_round(record: dict[str, Any], training_metrics: Any) -> None:
        check_head(record, training_metrics)
        # The record is saved after this call, so the counts survive a resume.
        work = training_metrics["client_work"]
        record["clients"] = {name: int(work[name]) for name in CLIENT_COUNTS}
        if progress is not None:
            progress(record)

    result, ledger = training.train(
        process,
        ids.for_round,
        PrivacyLedger(spec),
        lambda text: PrivacyLedger.from_json(text, expected_spec=spec),
        training.TrainingProgramConfig(
            config.rounds, checkpoint_dir, evaluate_every=config.evaluate_every
        ),
        evaluate=lambda state, _: evaluator(
            processes.backbone_model_weights(process.get_model_weights(state))
        ),
        initial_state=initial_state,
        on_round=on_round,
        report_policy=config.report_policy(),
    )
    backbone = processes.backbone_model_weights(process.get_model_weights(result.state))
    return _Outcome(backbone, ledger, result.history, result.resumed_from_round)


def _all_training_examples(
    reader: partition.PartitionReader, partition_dir: str, image_shape
) -> tf.data.Dataset:  # noqa: ANN001
    parts = sorted({reader.location(u).part_file for u in reader.user_ids()})
    files = [os.path.join(partition_dir, p) for p in parts]
    return tf.data.TFRecordDataset(files).map(lambda s: client_data.parse_example(s, image_shape))


def _train_centralized(
    config: TrainJobConfig,
    partition_dir: str,
    reader: partition.PartitionReader,
    user_ids: list[str],
    spec: accounting.AccountingSpec,
    evaluator: HeldOutEvaluator,
    checkpoint_dir: str,
    pretrained: tff.learning.models.ModelWeights | None,
    progress: Callable[[Mapping[str, Any]], None] | None,
) -> _Outcome:
    trainer = processes.CentralizedTrainer(
        config.backbone_config,
        _training_identity_vocabulary(reader, user_ids),
        learning_rate=config.server_learning_rate,
        batch_size=config.batch_size,
        momentum=config.server_momentum,
        head_loss=config.head_loss_config,
        seed=config.seed,
        initial_backbone=pretrained,
    )
    examples = _all_training_examples(reader, partition_dir, config.image_shape)
    epoch = tf.Variable(0, dtype=tf.int64)
    ledger_text = tf.Variable(PrivacyLedger(spec).to_json())
    history_text = tf.Variable("[]")
    # Ledger and history live in the checkpoint, so they are saved atomically with the weights.
    checkpoint = tf.train.Checkpoint(
        **trainer.checkpoint_objects(), epoch=epoch, ledger=ledger_text, history=history_text
    )
    manager = tf.train.CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=2)
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint)
    ledger = PrivacyLedger.from_json(ledger_text.numpy().decode(), expected_spec=spec)
    history = json.loads(history_text.numpy().decode())
    start = int(epoch.numpy())
    for e in range(start, config.rounds):
        began = time.perf_counter()
        trainer.train_epoch(examples, e)
        done = e + 1
        ledger.record_round(done)
        record: dict[str, Any] = {
            "round": done,
            "epsilon": ledger.epsilon,
            "round_seconds": time.perf_counter() - began,
        }
        if done == config.rounds or (config.evaluate_every and done % config.evaluate_every == 0):
            record["eval"] = evaluator(models.backbone_weights(trainer.backbone))
        history.append(record)
        if progress is not None:
            progress(record)
        epoch.assign(done)
        ledger_text.assign(ledger.to_json())
        history_text.assign(json.dumps(history))
        manager.save(checkpoint_number=done)
    return _Outcome(models.backbone_weights(trainer.backbone), ledger, history, start)


# Outputs.


def _json_ready(value: Any) -> Any:
    """Strict JSON: non-finite floats (infinite epsilon) become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


# Local outputs hold secrets (the schedule seed, the noise state): `secret_files` keeps
# them owner-only and never writes through a symlink. Cloud paths ("gs://...") have
# neither modes nor symlinks; the bucket's access control applies.
def _is_local(path: str) -> bool:
    return "://" not in path


def _make_dir(path: str, tighten_existing: bool = False) -> None:
    if _is_local(path):
        secret_files.private_dir(path, tighten_existing=tighten_existing)
    else:
        tf.io.gfile.makedirs(path)


def _read_text(path: str) -> str | None:
    if _is_local(path):
        return secret_files.read_text(path)
    if not tf.io.gfile.exists(path):
        return None
    with tf.io.gfile.GFile(path) as f:
        return f.read()


def _write_text(path: str, text: str) -> None:
    if _is_local(path):
        secret_files.write_text(path, text)
        return
    temporary = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with tf.io.gfile.GFile(temporary, "w") as f:
        f.write(text)
    tf.io.gfile.rename(temporary, path, overwrite=True)


def _export(
    config: TrainJobConfig, backbone: tff.learning.models.ModelWeights, output_dir: str
) -> str:
    final = os.path.join(output_dir, SAVED_MODEL_DIR)
    temporary = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
    export.export_serving_model(config.backbone_config, backbone, temporary)
    if tf.io.gfile.exists(final):
        tf.io.gfile.rmtree(final)
    tf.io.gfile.rename(temporary, final)
    return final


def _job_record(config: TrainJobConfig, reader: partition.PartitionReader) -> dict[str, Any]:
    return {
        "format": JOB_FORMAT,
        "config": config.to_dict(),
        "partition": {"users": reader.manifest["users"], "records": reader.manifest["records"]},
    }


@dataclasses.dataclass(frozen=True)
class _ClaimedJob:
    """What a job keeps in OUTPUT/train_job.json across re-runs.

    run_id: new for a new job, the recorded one on resume, so the cross-run budget
      charges a resumed job once.
    schedule_seed: `config.schedule_seed` (testing), else drawn from OS entropy for a
      new job and the recorded one on resume, so a resumed job samples the same users.
    """

    run_id: str
    schedule_seed: int


def _claim_output_dir(output_dir: str, job: dict[str, Any], config: TrainJobConfig) -> _ClaimedJob:
    """Records the job in OUTPUT, or checks that a re-run is the same job (resume)."""
    path = os.path.join(output_dir, JOB_FILE)
    run_id, schedule_seed = uuid.uuid4().hex, config.schedule_seed
    previous_text = _read_text(path)
    if previous_text is not None:
        previous = json.loads(previous_text)
        # Compared as JSON reads them back (tuples become lists).
        config_now = json.loads(json.dumps(job["config"]))
        changed = sorted(
            name
            for name in set(previous.get("config", {})) | set(config_now)
            if previous.get("config", {}).get(name) != config_now.get(name)
            and name not in _RESUMABLE_CHANGES
        )
        if previous.get("partition") != job["partition"]:
            changed.append("partition (users/records)")
        if changed:
            raise ValueError(
                f"{output_dir} holds a training job with different {', '.join(changed)}; "
                "use a new output directory"
            )
        run_id = previous.get("run_id") or run_id
        if not isinstance(previous.get("schedule_seed"), int):
            raise ValueError(f"{path} records no schedule seed; use a new output directory")
        schedule_seed = previous["schedule_seed"]
    if schedule_seed is None:
        schedule_seed = fresh_schedule_seed()
    _make_dir(output_dir)
    record = {**job, "run_id": run_id, "schedule_seed": schedule_seed}
    _write_text(path, json.dumps(record, indent=1, sort_keys=True))
    return _ClaimedJob(run_id, schedule_seed)


def _privacy_summary(
    config: TrainJobConfig, ledger: PrivacyLedger, planned: accounting.PrivacyResult
) -> dict[str, Any]:
    analysis = planned.analysis
    epsilon = ledger.epsilon
    private = config.private and math.isfinite(epsilon)
    if config.algorithm == CENTRALIZED:
        guarantee = "non-private: centralized oracle (no clipping, no noise)"
    elif not private:
        guarantee = "non-private: noise multiplier 0 (no DP guarantee)"
    else:
        guarantee = f"user-level ({epsilon:.4g}, {ledger.delta:.3g})-DP; {analysis}"
        # The guarantee assumes noise and samples nobody can predict; fixed seeds can be guessed.
        if config.noise_seed is not None:
            guarantee += "; TESTING ONLY: fixed noise seed, not a production guarantee"
        if config.schedule_seed is not None:
            guarantee += "; TESTING ONLY: fixed schedule seed, not a production guarantee"
    return {
        "private": private,
        "privacy": guarantee,
        "noise_seed_source": "os-entropy" if config.noise_seed is None else "fixed (testing)",
        "schedule_seed_source": "os-entropy" if config.schedule_seed is None else "fixed (testing)",
        "epsilon": epsilon,
        "delta": ledger.delta,
        "zcdp_rho": ledger.history[-1].zcdp_rho if ledger.history else None,
        "accounting": {
            "convention": planned.convention.value,
            "neighboring_relation": planned.neighboring_relation.value,
            "sensitivity_in_clips": planned.sensitivity_in_clips,
            "analysis": analysis,
        },
    }


def _client_failures(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Totals of the per-round client counts (None for centralized training)."""
    rounds = [record["clients"] for record in history if "clients" in record]
    if not rounds:
        return None
    return {
        **{name: sum(r[name] for r in rounds) for name in CLIENT_COUNTS},
        # Attempts below min_report_fraction, retried and never released (dropouts.py).
        "discarded_attempts": sum(
            len(record.get("discarded_attempts_kept_clients", ())) for record in history
        ),
        "note": "operations counts of training clients, not covered by the DP guarantee",
    }


def run_train_job(
    config: TrainJobConfig,
    partition_dir: str,
    eval_records: str,
    output_dir: str,
    pretrained_backbone: str | None = None,
    *,
    progress: Callable[[Mapping[str, Any]], None] | None = None,
    runtime_config: runtime.RuntimeConfig | None = None,
    budget: budget_lib.BudgetPolicy | None = None,
) -> TrainJobResult:
    """Trains (or resumes) one job and writes its outputs (module docstring).

    Args:
      config: hyperparameters.
      partition_dir: training users, partitioned by `beam_jobs.partition`.
      eval_records: held-out canonical records (directory or glob; `record_files`).
      output_dir: checkpoints, saved_model, ledger.json, metrics.json.
      pretrained_backbone: path accepted by `models.load_pretrained_backbone`.
      progress: called with each round's history record (round, epsilon, seconds, eval).
      runtime_config: the TFF workers to train on (several split each round's clients).
        None: the active runtime, or one local worker when none is active.
      budget: the cross-run budget of the training users (`budget.charge_run`): the job
        is charged its planned schedule before training, or refused. None: no
        cross-run budget (`max_epsilon` still bounds this run alone).

    Raises:
      ValueError: bad input (not a partition, no evaluation records, too few users for a
        round, over budget, a different job already in `output_dir`, ...).
    """
    started = time.perf_counter()
    reader = partition.PartitionReader(partition_dir)
    user_ids = reader.user_ids()
    config, noise_source = config.calibrated_for(len(user_ids))
    spec = accounting_spec_for(config, len(user_ids))
    planned = accounting.compute_privacy(spec)
    _check_budget(config, planned)
    evaluator = HeldOutEvaluator(config.backbone_config, eval_records)
    pretrained = (
        models.backbone_weights(
            models.load_pretrained_backbone(config.backbone_config, pretrained_backbone)
        )
        if pretrained_backbone
        else None
    )
    claimed = _claim_output_dir(output_dir, _job_record(config, reader), config)
    charge = None
    if budget is not None:  # the centralized oracle, noiseless, exceeds any budget
        charge = budget_lib.charge_run(
            budget, budget_lib.dataset_fingerprint(user_ids), len(user_ids), claimed.run_id, spec
        )
    checkpoint_dir = os.path.join(output_dir, CHECKPOINT_DIR)
    # Checkpoints carry the noise state and are written with the umask's modes: the
    # directory, which this job owns, is what keeps them private.
    _make_dir(checkpoint_dir, tighten_existing=True)
    arguments = (
        config,
        partition_dir,
        reader,
        user_ids,
        spec,
        evaluator,
        checkpoint_dir,
        pretrained,
        progress,
    )
    if config.algorithm == CENTRALIZED:
        outcome = _train_centralized(*arguments)
    else:
        if runtime_config is not None:
            # Its own runtime, nested over any active one (stopping it reinstates that).
            with runtime.TffRuntime(runtime_config):
                outcome = _train_federated(*arguments, schedule_seed=claimed.schedule_seed)
        else:
            owns_runtime = runtime.active() is None
            if owns_runtime:
                runtime.start(handle_signals=False)
            try:
                outcome = _train_federated(*arguments, schedule_seed=claimed.schedule_seed)
            finally:
                if owns_runtime:
                    runtime.stop()
    saved_model_dir = _export(config, outcome.backbone, output_dir)
    ledger_path = os.path.join(output_dir, LEDGER_FILE)
    _write_text(ledger_path, outcome.ledger.to_json())
    final_eval = outcome.history[-1]["eval"]
    summary = {
        "algorithm": config.algorithm,
        "recall_at_far": final_eval["recall_at_far"],
        **_privacy_summary(config, outcome.ledger, planned),
        "noise_multiplier_source": noise_source,
        "rounds": outcome.ledger.rounds_recorded,
        "rounds_are": "epochs over all training users"
        if config.algorithm == CENTRALIZED
        else "federated rounds",
        "resumed_from_round": outcome.resumed_from_round,
        "wall_seconds": time.perf_counter() - started,
        "evaluation": {
            "records": eval_records,
            "images": int(len(evaluator.labels)),
            "identities": int(len(np.unique(evaluator.labels))),
            "held_out": "identities and users never in training",
        },
        "training_users": len(user_ids),
        # d in the noise norm z*clip*sqrt(d)/M of the averaged update.
        "trained_parameters": sum(int(np.size(v)) for v in outcome.backbone.trainable),
        "frozen_parameters": sum(int(np.size(v)) for v in outcome.backbone.non_trainable),
        "client_failures": _client_failures(outcome.history),
        "history": outcome.history,
        "config": config.public_dict(),
        "saved_model": saved_model_dir,
        "ledger": ledger_path,
        "dataset_budget": charge.to_dict() if charge is not None else None,
    }
    summary = _json_ready(summary)
    metrics_path = os.path.join(output_dir, METRICS_FILE)
    _write_text(metrics_path, json.dumps(summary, indent=1, allow_nan=False))
    return TrainJobResult(output_dir, saved_model_dir, metrics_path, ledger_path, summary)
