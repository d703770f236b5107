"""Checks of a pipeline config's values (`pipeline/config.py` builds the config):
`validate_light` needs no TensorFlow or Beam (what commands run before their heavy
imports), `validate` builds the library objects the values configure. Every problem is
a ValueError with one line naming the key; the message helpers here keep them one line
and suggest the closest known name."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from beam_jobs import split_protocols  # no Beam or TensorFlow: the light checks use it
from tff_algorithms import algorithms
from tff_algorithms.base import bounded_load, owned_files
from tff_algorithms.config import client_config, job_config, model_config, recipes

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig

PRETRAIN_SOURCES = ("public", "import", "none", "private_contrastive")
PRIVATE_CONTRASTIVE = "private_contrastive"


def closest(name: str, known: Sequence[str]) -> str:
    """'did you mean X; ' for the known key closest to `name`, or ''."""
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.5)
    return f"did you mean {match[0]}? " if match else ""


def suggest(value: str, known: Sequence[str]) -> str:
    """' (did you mean X?)' for the known value closest to `value`, or ''."""
    hint = closest(value, known).strip()
    return f" ({hint})" if hint else ""


def shown(text: str) -> str:
    """A key or path for an error message: escaped when it holds line breaks or control
    characters, so every error stays one line; capped in length."""
    return bounded_load.shown_name(text)


def check_keys(values: Mapping[str, Any], prefix: str) -> None:
    # YAML allows numbers, lists and nulls as keys; the config only ever has names.
    for name in values:
        if not isinstance(name, str):
            where = f" in {prefix}" if prefix else ""
            raise ValueError(f"config keys must be names, got {bounded_load.shown(name)}{where}")


# TrainJobConfig's fields and their annotations as written (e.g. 'float | None');
# `settings` is written as the algorithm's section (`_train_keys`).
_TRAIN_FIELD_TYPES = {
    field.name: str(field.type)
    for field in dataclasses.fields(job_config.TrainJobConfig)
    if field.name != "settings"
}


def train_keys() -> list[str]:
    """The keys of `train` and `pretrain.job`: TrainJobConfig's fields and the registered
    algorithms' sections (an algorithm may register later)."""
    return [*_TRAIN_FIELD_TYPES, *algorithms.registry.sections()]


# TrainJobConfig fields whose value is one of a module's names.
_TRAIN_CHOICES = {
    "head_init": client_config.HEAD_INITS,
    "head_loss": client_config.HEAD_LOSSES,
    "batch_norm": model_config.BATCH_NORM_MODES,
    "server_optimizer": model_config.OPTIMIZERS,
}

# TrainJobConfig annotations the light check understands (annotation text -> test).
_LIGHT_TYPES = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "None": lambda v: v is None,
}

_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "a boolean", "str": "a string"}


def _check_train_light(values: Mapping[str, Any], key: str) -> None:
    """Unknown keys and non-finite numbers of a TrainJobConfig mapping, without TF."""
    check_keys(values, key)
    known = train_keys()
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(
            f"unknown config key {key}.{shown(unknown[0])} "
            f"({closest(unknown[0], known)}known: {', '.join(known)})"
        )
    sections = algorithms.registry.sections()
    for name, value in values.items():
        if name in sections:
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"config {key}.{name} must be a mapping of its settings")
            settings = sections[name].keys()
            unknown = sorted(set(value or {}) - set(settings), key=str)
            if unknown:
                raise ValueError(
                    f"unknown config key {key}.{name}.{shown(str(unknown[0]))} "
                    f"({closest(str(unknown[0]), settings)}known: {', '.join(settings)})"
                )
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"config {key}.{name} must be finite, got {bounded_load.shown(value)}")
        kinds = {part.strip() for part in _TRAIN_FIELD_TYPES[name].split("|")}
        if value is None or not kinds <= set(_LIGHT_TYPES):
            continue
        if not any(_LIGHT_TYPES[kind](value) for kind in kinds):
            wanted = " or ".join(_TYPE_WORDS[kind] for kind in sorted(kinds - {"None"}))
            raise ValueError(
                f"config {key}: {name} must be {wanted}, got {bounded_load.shown(value)}"
            )
        if name == "architecture" and isinstance(value, str):
            try:
                model_config.check_architecture(value)
            except ValueError as error:
                raise ValueError(f"config {key}: {error}") from None
        choices = _TRAIN_CHOICES.get(name)
        if choices and isinstance(value, str) and value not in choices:
            raise ValueError(
                f"config {key}: {name} must be one of {', '.join(choices)}, got "
                f"{bounded_load.shown(value)}{suggest(value, choices)}"
            )


def validate_light(config: PipelineConfig) -> None:
    """The checks of `validate` that need no library import (TF-free, fast)."""
    if not config.pipeline.name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(
            f"config pipeline.name must be letters, digits, - or _, got {bounded_load.shown(config.pipeline.name)}"
        )
    if not config.pipeline.output_dir:
        raise ValueError("config pipeline.output_dir must not be empty")
    for key in ("inputs", "public_inputs", "evaluation_inputs"):
        for source in getattr(config.data, key):
            if "://" in source:
                continue
            if not os.path.exists(source):
                raise ValueError(f"config data.{key}: {shown(source)} does not exist")
            if owned_files.overlapping(config.pipeline.output_dir, source):
                raise ValueError(
                    f"config pipeline.output_dir {shown(config.pipeline.output_dir)} lies in "
                    f"data.{key} {shown(source)}: a later run would read the pipeline's files "
                    "as inputs; give an output directory outside it"
                )
    if config.data.evaluation_inputs and config.split.mode != split_protocols.HELD_OUT_IMAGES:
        raise ValueError(
            "config data.evaluation_inputs needs split.mode held_out_images (their images "
            f"are evaluated on training identities), got {bounded_load.shown(config.split.mode)}"
        )
    if config.data.evaluation_inputs and config.split.test_fraction:
        raise ValueError(
            "config data.evaluation_inputs is the test split: set split.test_fraction to 0 "
            f"(got {config.split.test_fraction}; no private user is held out for test)"
        )
    if not 0.0 <= config.data.max_bad_fraction <= 1.0:
        raise ValueError(
            f"config data.max_bad_fraction must be in [0, 1], got {config.data.max_bad_fraction}"
        )
    if config.data.max_image_pixels is not None and config.data.max_image_pixels < 1:
        raise ValueError(
            f"config data.max_image_pixels must be >= 1, got {config.data.max_image_pixels}"
        )
    if config.partition.num_shards < 1:
        raise ValueError(
            f"config partition.num_shards must be >= 1, got {config.partition.num_shards}"
        )
    # Before the job config is built: its own errors would hide that this is the wrong step.
    algorithm = config.train.get("algorithm")
    # Private training of the final model (pretraining-only algorithms run as a
    # pretrain.source).
    private = algorithms.names(lambda spec: spec.pipeline_trains)
    if algorithm not in private:
        raise ValueError(
            f"config train.algorithm must be one of {', '.join(private)} (private training), "
            f"got {bounded_load.shown(algorithm)}"
            + (suggest(algorithm, private) if isinstance(algorithm, str) else "")
        )
    _check_train_light(config.train, "train")
    _check_train_light(config.pretrain.job, "pretrain.job")
    pretrain = config.pretrain
    if pretrain.source not in PRETRAIN_SOURCES:
        raise ValueError(
            f"config pretrain.source must be one of {', '.join(PRETRAIN_SOURCES)}, got "
            f"{bounded_load.shown(pretrain.source)}{suggest(pretrain.source, PRETRAIN_SOURCES)}"
        )
    if pretrain.source == "none":
        recipes.check_start(config.train, pretrained=False, where="config train.")
    if pretrain.source == "import" and not os.path.isdir(pretrain.backbone_dir):
        raise ValueError(
            f"config pretrain.backbone_dir {bounded_load.shown(pretrain.backbone_dir)} is not a "
            "directory (pretrain.source is import)"
        )
    if pretrain.source == "public" and (
        config.split.public_fraction <= 0 and not config.has_public_inputs
    ):
        raise ValueError(
            "config pretrain.source is public but there is no public data: give "
            "data.public_inputs or split.public_fraction > 0"
        )
    evaluate = config.evaluate
    if not evaluate.privacy_budget_epsilon > 0:
        raise ValueError(
            f"config evaluate.privacy_budget_epsilon must be > 0, got {evaluate.privacy_budget_epsilon}"
        )
    if not 0 <= evaluate.max_recall_regression <= 1:
        raise ValueError(
            f"config evaluate.max_recall_regression must be in [0, 1], got {evaluate.max_recall_regression}"
        )
    if evaluate.bootstrap_resamples < 1:
        raise ValueError(
            f"config evaluate.bootstrap_resamples must be >= 1, got {evaluate.bootstrap_resamples}"
        )
    if not 0 < evaluate.confidence < 1:
        raise ValueError(f"config evaluate.confidence must be in (0, 1), got {evaluate.confidence}")


def validate(config: PipelineConfig) -> None:
    """Checks values by building the library objects they configure; one-line errors."""
    validate_light(config)
    from beam_jobs import dedup, synthetic

    def check(what: str, build) -> None:
        try:
            build()
        except ValueError as e:
            raise ValueError(f"config {what}: {str(e).splitlines()[0]}") from None

    for key in ("synthetic", "synthetic_public"):
        section = getattr(config.data, key)
        if section is not None:
            check(
                f"data.{key}", lambda s=section: synthetic.SyntheticConfig(**dataclasses.asdict(s))
            )
    check("split", lambda: split_protocols.SplitConfig(**config.split_config_dict()))
    check("dedup", lambda: dedup.DedupConfig(**dataclasses.asdict(config.dedup)))
    config.train_job_dict()
    from beam_jobs import records_io
    from tff_algorithms.federated import runtime

    check("pipeline.beam_args", lambda: records_io.pipeline_options(config.pipeline.beam_args))
    check("runtime", lambda: runtime.RuntimeConfig(**dataclasses.asdict(config.runtime)))
    if config.pretrain.source in ("public", PRIVATE_CONTRASTIVE):
        config.pretrain_job_dict()
    from tff_algorithms.evaluation import metrics
    from tff_algorithms.privacy import budget

    check("budget", lambda: budget.BudgetPolicy(**config.budget_policy_dict()))
    if config.evaluate.gate_far not in metrics.DEFAULT_FARS:
        raise ValueError(
            f"config evaluate.gate_far must be one of {list(metrics.DEFAULT_FARS)}, "
            f"got {config.evaluate.gate_far}"
        )
