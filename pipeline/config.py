"""The one typed configuration of a pipeline run: file (JSON or YAML) plus overrides.

`load_config(path, overrides)` reads the file, applies `section.key=value` overrides
(values in YAML syntax: `train.rounds=5`, `data.inputs=[/data/a, /data/b]`), checks
every key and type, and validates the values by building the library objects they
configure (SyntheticConfig, SplitConfig, DedupConfig, TrainJobConfig, ...; the checks
are pipeline/config_checks.py). Every problem is a ValueError with one line, raised before
anything runs.

Layering, for every section: what the file and the overrides set overlays the section's
default key by key (the training sections' defaults are the recipes of
tff_algorithms.config.recipes, layered by its rule); a key set to null restores the library
default (TrainJobConfig's, or the section dataclass's), except for keys where null is
itself a value (`data.synthetic_public: null` renders no public data).

An algorithm's own settings are a section of `train` (or `pretrain.job`) named by its
registry entry (`train.fdml.groups_per_round`; docs/config.md). The flat keys of the
release before (`train.virtual_clients_per_round` of an fdml job) are moved there with
one deprecation line on stderr each (`tff_algorithms.algorithms.registry.user_layer`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from beam_jobs import copy_evidence
from pipeline import config_checks
from tff_algorithms import algorithms
from tff_algorithms.algorithms import rules
from tff_algorithms.base import bounded_load
from tff_algorithms.config import executors, job_config, recipes

# The image the Dockerfile builds (`docker build -t dp-fedemb:0.1.0 .`): every pipeline
# step, the TFF workers and the Beam SDK harness run in it. Tag = setup.py's version.
IMAGE = "dp-fedemb:0.1.0"


@dataclasses.dataclass(frozen=True)
class PipelineSection:
    name: str = "dp-fedemb"
    # Where the pipeline root, the MLMD store, the serving directory and the report go.
    output_dir: str = "dp-fedemb-run"
    enable_cache: bool = True
    # Container image of the components when compiled for Kubeflow or Airflow: the one the
    # repository's Dockerfile builds (docs/scaling.md, "The image").
    image: str = IMAGE
    beam_args: tuple[str, ...] = ("--runner=DirectRunner", "--direct_num_workers=1")


@dataclasses.dataclass(frozen=True)
class SyntheticSection:
    """A synthetic identity dataset (beam_jobs.synthetic.SyntheticConfig)."""

    # Many users with few images each: the privacy unit is the user, and the noise that
    # private training must overcome shrinks with the users per round.
    identities: int = 4000
    images_per_identity: int = 4
    image_size: int = 28
    channels: int = 1
    identities_per_user: int = 1
    seed: int = 0
    # photo or sketch (beam_jobs.synthetic.STYLES).
    style: str = "photo"
    # 0: every user holds identities of their own; N: N users draw identities_per_user
    # identities each from the one pool of `identities` (beam_jobs.synthetic).
    users_sharing_identities: int = 0


# The public pretraining data of the synthetic default: other identities (another seed),
# drawn as sketches. A domain apart from the private photos, as ImageNet is from faces in
# the paper; a public split carved from the same population as the private users would
# leave private training little to add (README, "Public pretraining data").
_SYNTHETIC_PUBLIC = SyntheticSection(identities=300, images_per_identity=10, seed=1, style="sketch")


@dataclasses.dataclass(frozen=True)
class DataSection:
    # Image folders, canonical TFRecords or TFF SQLite files; empty: synthetic data.
    inputs: tuple[str, ...] = ()
    # Public data for pretraining from separate sources (same formats): every record goes
    # to the public split, none is trained on privately or evaluated on.
    public_inputs: tuple[str, ...] = ()
    # Evaluation data from separate sources (same formats; split.mode held_out_images,
    # e.g. TFF Landmarks' own test split): every record goes to the test split, none is
    # trained on; the private users then fill train and validation (split.test_fraction 0).
    evaluation_inputs: tuple[str, ...] = ()
    max_bad_fraction: float = 0.01
    identity_feature: str | None = None
    # Images with more pixels are refused (counted bad) before decoding; None: the
    # library default, beam_jobs.schema.DEFAULT_MAX_IMAGE_PIXELS.
    max_image_pixels: int | None = None
    synthetic: SyntheticSection = SyntheticSection()
    # The public data rendered with the synthetic default (when inputs and public_inputs
    # are both empty); null: none.
    synthetic_public: SyntheticSection | None = _SYNTHETIC_PUBLIC


@dataclasses.dataclass(frozen=True)
class SplitSection:
    validation_fraction: float = 0.1
    test_fraction: float = 0.15
    # Identities (and their users) of data.inputs moved to the public split, for
    # non-private pretraining when no separate public data is given.
    public_fraction: float = 0.0
    seed: int = 0
    # The evaluation protocol (beam_jobs.split_protocols): identity_and_user (faces), identity
    # (EMNIST), held_out_images (landmarks, species), or auto: identity_and_user when no
    # identity is held by two users, otherwise a stop naming the modes.
    mode: str = "auto"
    # Stop when the split would drop more than this share of the private records.
    max_dropped_fraction: float = 0.1


@dataclasses.dataclass(frozen=True)
class DedupSection:
    """beam_jobs.dedup.DedupConfig: near duplicates are proposed by hash, verified by pixels."""

    # Hash bits (of 63) a pair may differ in to be verified at all.
    hamming_threshold: int = 16
    # Shifts probed, in pixels of the 32x32 thumbnail every image is compared at.
    max_shift: int = 2
    # Stop (after writing the dedup report) when dedup would remove more than this share
    # of the train or public split: more often a threshold wrong for the data than copies.
    max_removed_fraction: float = 0.1
    # A pair alike in shape is a copy only if the candidate carries the reference's own
    # fine detail (beam_jobs/copy_evidence.py, which holds the defaults): its noise
    # correlates >= min_shared_noise, or (a JPEG) re-encoding the reference reproduces it
    # within jpeg_tolerance grey levels; with a reference noise level under
    # min_reference_noise or fewer than min_noise_pixels flat pixels, shape decides alone.
    min_shared_noise: float = copy_evidence.MIN_SHARED_NOISE
    min_reference_noise: float = copy_evidence.MIN_REFERENCE_NOISE
    min_noise_pixels: int = copy_evidence.MIN_NOISE_PIXELS
    jpeg_tolerance: float = copy_evidence.JPEG_TOLERANCE


@dataclasses.dataclass(frozen=True)
class PartitionSection:
    num_shards: int = 4


@dataclasses.dataclass(frozen=True)
class PretrainSection:
    # public: train non-privately on the public split; import: use backbone_dir;
    # none: private training starts from a random backbone; private_contrastive: Logit-DP
    # contrastive training on the private training users themselves (labels unused),
    # charged to their budget with the private training (component PrivatePretrain).
    source: str = "public"
    backbone_dir: str = ""
    # TrainJobConfig fields over the source's recipe, over those of `train`: for public
    # the centralized run (rounds are epochs; it uses the server learning rate and
    # momentum; tff_algorithms.config.recipes.PRETRAIN), for private_contrastive the logit-dp
    # run (rounds are steps; recipes.PRIVATE_CONTRASTIVE). `pretrain.job.rounds=5`
    # changes the epochs (steps) only.
    job: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RuntimeSection:
    """The TFF workers private training runs on (tff_algorithms.federated.runtime.RuntimeConfig).

    executor: worker (TFF's worker_binary processes, the settings below) or in_process
    (the round's TFF-compiled form run by the training step's own TensorFlow, client work
    on every GPU it sees; docs/scaling.md, "Accelerators").
    worker_addresses: host:port of workers started by a cluster scheduler
    (docs/scaling.md); empty: `local_workers` workers started by the training step.
    Two or more split each round's virtual clients; DP noise is added once, after
    the merge. worker_ca, worker_cert, worker_key: PEM files for mutual TLS to the
    worker addresses, read where training runs; without them, an address that is
    not loopback needs allow_insecure_workers (an isolated network only).
    worker_intra_op_threads: threads one op of a local worker may use (0: every core).
    first_round_deadline_s, round_deadline_factor, min_round_deadline_s: how long a call
    to a worker may take (before a round was measured; else this many times the longest
    round, at least the minimum) before the worker counts as lost; max_worker_losses:
    lost workers a run survives (a local one restarted, a remote one dropped, the round
    run again from the same state), then one line and a re-run resumes
    (tff_algorithms/federated/liveness.py).
    """

    executor: str = "worker"
    worker_addresses: tuple[str, ...] = ()
    local_workers: int = 1
    worker_intra_op_threads: int = 1
    worker_ca: str | None = None
    worker_cert: str | None = None
    worker_key: str | None = None
    allow_insecure_workers: bool = False
    first_round_deadline_s: float = executors.FIRST_ROUND_DEADLINE_S
    round_deadline_factor: float = executors.ROUND_DEADLINE_FACTOR
    min_round_deadline_s: float = executors.MIN_ROUND_DEADLINE_S
    max_worker_losses: int = executors.MAX_WORKER_LOSSES


@dataclasses.dataclass(frozen=True)
class EvaluateSection:
    # A model whose epsilon exceeds this is never blessed.
    privacy_budget_epsilon: float = 10.0
    # The FAR whose recall is compared with the last blessed model: one of those the
    # evaluation reports (tff_algorithms.evaluation.metrics.DEFAULT_FARS).
    gate_far: float = 0.01
    # Blessed only if recall@gate_far >= baseline recall - this.
    max_recall_regression: float = 0.0
    # Bootstrap over held-out identities: the interval of every recall in the evaluation
    # and the report, and of the trained model's gain over the pretrained start.
    bootstrap_resamples: int = 1000
    confidence: float = 0.95


@dataclasses.dataclass(frozen=True)
class BudgetSection:
    """The cross-run privacy budget of the training users (tff_algorithms.privacy.budget)."""

    # The persistent ledger every run on the same users is charged to; empty:
    # OUTPUT/privacy_budget_ledger.json. Point several pipelines at one file to share it.
    ledger_path: str = ""
    # Total epsilon all private trainings on the same users may spend together,
    # composed across runs. The ledger keeps the value of the users' first charge: a
    # different one is refused unless `override` (recorded).
    dataset_epsilon: float = 10.0
    # Start a training that would exceed it anyway; recorded in the ledger and in ML
    # Metadata (PrivacyLedger property budget_overridden).
    override: bool = False
    # Accept a ledger whose chain or recorded charges disagree because you repaired it
    # on purpose (docs/privacy.md, "A budget per set of users"): sealed again as it is,
    # the repair recorded in the ledger and in ML Metadata.
    accept_repaired_ledger: bool = False


@dataclasses.dataclass(frozen=True)
class PushSection:
    # Versioned serving directory; empty: OUTPUT/serving.
    serving_dir: str = ""


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    pipeline: PipelineSection = PipelineSection()
    data: DataSection = DataSection()
    split: SplitSection = SplitSection()
    dedup: DedupSection = DedupSection()
    partition: PartitionSection = PartitionSection()
    pretrain: PretrainSection = PretrainSection()
    # TrainJobConfig fields (tff_algorithms.config.job_config) of the private training run, over
    # the default recipe (tff_algorithms.config.recipes.DEFAULT).
    train: Mapping[str, Any] = dataclasses.field(default_factory=lambda: recipes.recipe("default"))
    runtime: RuntimeSection = RuntimeSection()
    evaluate: EvaluateSection = EvaluateSection()
    budget: BudgetSection = BudgetSection()
    push: PushSection = PushSection()

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @property
    def synthetic_public(self) -> SyntheticSection | None:
        """The synthetic public dataset this run renders, if any."""
        data = self.data
        return None if data.inputs or data.public_inputs else data.synthetic_public

    @property
    def has_public_inputs(self) -> bool:
        """Whether public records come from sources of their own (not a split fraction)."""
        return bool(self.data.public_inputs) or self.synthetic_public is not None

    def split_config_dict(self) -> dict[str, Any]:
        """beam_jobs.split_protocols.SplitConfig fields."""
        return {
            **dataclasses.asdict(self.split),
            "public_inputs": self.has_public_inputs,
            "evaluation_inputs": bool(self.data.evaluation_inputs),
        }

    @property
    def serving_dir(self) -> str:
        return self.push.serving_dir or os.path.join(self.pipeline.output_dir, "serving")

    def budget_policy_dict(self) -> dict[str, Any]:
        """tff_algorithms.privacy.budget.BudgetPolicy fields of the private training run."""
        return {
            "ledger_path": os.path.abspath(
                self.budget.ledger_path
                or os.path.join(self.pipeline.output_dir, "privacy_budget_ledger.json")
            ),
            "total_epsilon": self.budget.dataset_epsilon,
            "override": self.budget.override,
            "accept_repaired_ledger": self.budget.accept_repaired_ledger,
        }

    def train_job_dict(self) -> dict[str, Any]:
        """The private run's TrainJobConfig as a dict (validated)."""
        return _train_job_config(self.train, "train").to_dict()

    def pretrain_job_dict(self) -> dict[str, Any]:
        """The pretraining run: for public, the centralized run (recipes.pretrain_values:
        `train`, every layer, the pretraining recipe, then pretrain.job); for
        private_contrastive, the logit-dp run (recipes.private_contrastive_values)."""
        if self.pretrain.source == config_checks.PRIVATE_CONTRASTIVE:
            values = recipes.private_contrastive_values(self.train, self.pretrain.job)
        else:
            values = recipes.pretrain_values(self.train, self.pretrain.job)
        chosen = algorithms.get(values["algorithm"])
        values = rules.without_inapplicable_defaults(values, self.pretrain.job, chosen)
        return _train_job_config(values, "pretrain.job").to_dict()


# Reading and checking.


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """`value` as `annotation`, or a one-line ValueError naming `key`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _coerce(value, inner, key)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, Mapping):
            raise ValueError(f"config {key} must be a mapping, got {bounded_load.shown(value)}")
        return _build_section(annotation, value, key)
    if origin is tuple:
        (item,) = {a for a in typing.get_args(annotation) if a is not Ellipsis}
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ValueError(f"config {key} must be a list, got {bounded_load.shown(value)}")
        return tuple(_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    if origin in (Mapping, dict) or annotation is Mapping:
        if not isinstance(value, Mapping):
            raise ValueError(f"config {key} must be a mapping, got {bounded_load.shown(value)}")
        return dict(value)
    if annotation is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config {key} must be true or false, got {bounded_load.shown(value)}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config {key} must be an integer, got {bounded_load.shown(value)}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config {key} must be a number, got {bounded_load.shown(value)}")
        if not math.isfinite(value):
            raise ValueError(f"config {key} must be finite, got {bounded_load.shown(value)}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ValueError(f"config {key} must be a string, got {bounded_load.shown(value)}")
        return value
    raise TypeError(f"unsupported config annotation {_type_name(annotation)} at {key}")


def _admits_none(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(
        None
    ) in typing.get_args(annotation)


def _build_section(section_type: type, values: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(section_type)
    names = [f.name for f in dataclasses.fields(section_type)]
    config_checks.check_keys(values, prefix)
    unknown = sorted(set(values) - set(names))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ValueError(
            f"unknown config key {where}{config_checks.shown(unknown[0])} ({config_checks.closest(unknown[0], names)}"
            f"known in {prefix or 'the top level'}: {', '.join(names)})"
        )
    fields = {f.name: f for f in dataclasses.fields(section_type)}
    # null restores the library default, except where None is itself a value of the key.
    values = {
        name: value
        for name, value in values.items()
        if value is not None or _admits_none(hints[name])
    }
    kwargs = {
        name: _coerce(
            _overlay_default(fields[name], values[name]),
            hints[name],
            f"{prefix}.{name}" if prefix else name,
        )
        for name in names
        if name in values
    }
    return section_type(**kwargs)


def _overlay_default(field: dataclasses.Field, value: Any) -> Any:
    """A mapping given for a section overlays the section's default, key by key: a
    section whose default differs from its type's defaults (the training recipe, the
    synthetic public data) keeps every key the user did not set. Recipe sections layer
    by `recipes.overlay`."""
    if not isinstance(value, Mapping):
        return value
    if field.default is not dataclasses.MISSING:
        default = field.default
    elif field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        return value
    if dataclasses.is_dataclass(default):
        return {**dataclasses.asdict(default), **value}
    if not isinstance(default, Mapping):
        return value
    if field.name == "train":
        value = _user_train_layer(value, value.get("algorithm", default.get("algorithm")), "train")
    # An algorithm with a recipe of its own (`Algorithm.recipe`: dp-sgd-centralized,
    # dp-last-layer) takes it between the section's default and what the user set.
    algorithm = algorithms.find(value.get("algorithm"))
    if algorithm is not None and algorithm.recipe is not None:
        default = recipes.own_recipe_values(default, algorithm.recipe)
    if field.name == "train":
        default = recipes.for_architecture(default, value.get("architecture"))
        chosen = algorithms.find(
            value.get("algorithm", default.get("algorithm", job_config.TrainJobConfig.algorithm))
        )
        if chosen is not None:
            return rules.without_inapplicable_defaults(
                recipes.overlay(default, value), value, chosen
            )
    return recipes.overlay(default, value)


# Deprecation lines already shown: a command reads its config more than once
# (`check_config`, then `load_config`), the user sees each line once.
_SHOWN_DEPRECATIONS: set[str] = set()


def _deprecated(message: str) -> None:
    if message not in _SHOWN_DEPRECATIONS:
        _SHOWN_DEPRECATIONS.add(message)
        print(f"dp-fedemb: warning: config {message}", file=sys.stderr)


def _user_train_layer(values: Mapping[str, Any], name: Any, key: str) -> dict[str, Any]:
    """The training values the user set under `key`, in the layout of algorithm `name`
    (`registry.user_layer`: an old flat key moved into the algorithm's section with one
    deprecation line); unchanged when the algorithm is unknown (refused later, with
    the known ones)."""
    algorithm = algorithms.find(name)
    if algorithm is None:
        return dict(values)
    config_checks.check_keys(values, key)
    try:
        return algorithms.registry.user_layer(
            values,
            algorithm,
            lambda name: f"{key}.{name}",
            lambda section, name: f"{key}.{section}.{name}",
            _deprecated,
        )
    except ValueError as e:
        raise ValueError(f"config {e}") from None


def _train_job_config(values: Mapping[str, Any], key: str) -> job_config.TrainJobConfig:
    config_checks.check_keys(values, key)
    names = config_checks.train_keys()
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(
            f"unknown config key {key}.{config_checks.shown(unknown[0])} "
            f"({config_checks.closest(unknown[0], names)}known: {', '.join(names)})"
        )
    try:
        return job_config.TrainJobConfig.from_dict(recipes.job_fields(values))
    except (TypeError, ValueError) as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"config {key}: {message}") from None


def _set_dotted(values: dict[str, Any], dotted_key: str, value: Any) -> None:
    *parents, leaf = dotted_key.split(".")
    if len(parents) >= bounded_load.MAX_DEPTH:
        raise ValueError(
            f"config override {config_checks.shown(dotted_key)} nests deeper than "
            f"{bounded_load.MAX_DEPTH} levels; config keys are section.key"
        )
    node = values
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(
                f"config override {config_checks.shown(dotted_key)}: "
                f"{config_checks.shown('.'.join(parents[: i + 1]))} is not a section"
            )
        node = child
    node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`section.key=value` (value in YAML syntax) -> (dotted key, value)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(
            f"override must look like section.key=value, got {bounded_load.shown(text)}"
        )
    key = key.strip()
    source = f"override {config_checks.shown(key)}"
    value = bounded_load.load_yaml(raw, source, depth=len(key.split("."))) if raw.strip() else ""
    return key, value


def read_config_file(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {bounded_load.shown_path(path)} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            # One character over the limit is enough for the loader to refuse the length.
            text = f.read(bounded_load.MAX_TEXT_CHARS + 1)
    except UnicodeDecodeError as e:
        raise ValueError(
            f"config file {bounded_load.shown_path(path)} is not UTF-8 text: {e.reason}"
        ) from None
    values = bounded_load.loader_for(path)(text, f"config file {bounded_load.shown_path(path)}")
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(
            f"config file {bounded_load.shown_path(path)} must hold a mapping of sections"
        )
    return values


def _pretrain_algorithm(source: str) -> str | None:
    """The algorithm a pretraining source trains with (its recipe's), or None."""
    if source == config_checks.PRIVATE_CONTRASTIVE:
        return recipes.private_contrastive_values({}, {})["algorithm"]
    if source == "public":
        return recipes.pretrain_values({}, {})["algorithm"]
    return None


def _built(values: Mapping[str, Any]) -> PipelineConfig:
    """The config of `values`, each training layer the user set in the layout of its
    algorithm (`train`'s: `_overlay_default`; `pretrain.job`'s here, once the source
    says which algorithm pretrains)."""
    config = _build_section(PipelineConfig, values, "")
    pretrain = config.pretrain
    algorithm = _pretrain_algorithm(pretrain.source)
    if algorithm is None or not pretrain.job:
        return config
    job = _user_train_layer(pretrain.job, algorithm, "pretrain.job")
    return dataclasses.replace(config, pretrain=dataclasses.replace(pretrain, job=job))


def config_from_dict(values: Mapping[str, Any]) -> PipelineConfig:
    config = _built(values)
    config_checks.validate(config)
    return config


def _values(path: str | None, overrides: Sequence[str]) -> dict[str, Any]:
    values = read_config_file(path) if path else {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(values, key, value)
    return values


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> PipelineConfig:
    """The validated config from an optional file and `section.key=value` overrides."""
    return config_from_dict(_values(path, overrides))


def check_config(path: str | None = None, overrides: Sequence[str] = ()) -> PipelineConfig:
    """The config's keys, types and the value checks that need no TensorFlow, TFF or
    Beam (about a second): what commands run before their heavy imports. `load_config`
    still validates everything."""
    config = _built(_values(path, overrides))
    config_checks.validate_light(config)
    return config
