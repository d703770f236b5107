"""Train an embedding model with user-level DP (or the centralized oracle) on a dataset.

`dp-fedemb train --data DIR --output OUT [--algorithm ... --rounds ...]`. DIR is an image
folder ROOT/<user_id>/<identity>/<image> or a directory of canonical TFRecords
(*.tfrecord*). The data is prepared under OUT/data with the Beam jobs (ingest, split by
identity and user, user-sharded partition of the train split), once: a re-run reuses it.
Training evaluates on OUT/data/split/validation; OUT/data/split/test stays untouched for
`dp-fedemb evaluate`. Outputs: OUT/metrics.json, OUT/saved_model, OUT/ledger.json.
Running the same command again resumes from the last checkpoint. Progress goes to stderr,
one line per round; the last stdout line is a JSON summary. OUT/train_job.json (the
schedule seed) and OUT/checkpoints (the noise seed) keep the secret seeds drawn from OS
entropy for resuming: keep them as private as the data.

This module is the command: its flags, their checks before TensorFlow is imported, and
running the job. What the flags make of a `TrainJobConfig` is `train_config`.
"""

import dataclasses
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from absl import flags

from beam_jobs import split_protocols  # no Beam or TensorFlow: the checks may use it
from pipeline import console
from pipeline.commands import algorithm_flags, checks, train_config, train_data
from tff_algorithms import algorithms
from tff_algorithms.algorithms import registry
from tff_algorithms.algorithms.dp_fedemb import shared_negatives_config
from tff_algorithms.base import job_files, owned_files
from tff_algorithms.config import client_config, executors, model_config, recipes
from tff_algorithms.config import job_config as job_config_lib
from tff_algorithms.privacy import accounting_spec

if TYPE_CHECKING:  # TFF is imported only when a command runs
    from tff_algorithms.federated.runtime import RuntimeConfig

# Old spelling -> the flag it was renamed to (issue 25), accepted with one deprecation
# line on stderr (`cli.main`) for one release: remove in the release after 0.1.0.
RENAMED_FLAGS = {
    "client-lr": "client-learning-rate",
    "server-lr": "server-learning-rate",
}


def define_flags(flag_values: flags.FlagValues) -> None:
    # Hyperparameter flags default to None, meaning the recipe's value, or where the
    # recipe has none TrainJobConfig's default (tff_algorithms/config/recipes.py).
    def define(kind: str, name: str, help_text: str, default: Any = None) -> None:
        getattr(flags, f"DEFINE_{kind}")(name, default, help_text, flag_values=flag_values)

    define("string", "data", "image folder or directory of canonical TFRecords")
    define("string", "output", "output directory (re-running with it resumes)")
    flags.DEFINE_enum(
        "recipe",
        "default",
        list(recipes.RECIPES),
        "hyperparameters the flags below overlay: default (the pipeline's private training, "
        "README) or paper (the paper's EMNIST appendix D values); centralized runs take the "
        "pretraining recipe over it",
        flag_values=flag_values,
    )
    define(
        "string",
        "algorithm",
        # The registered algorithms (tff_algorithms/algorithms/), each with its summary.
        " | ".join(f"{name}: {algorithms.get(name).summary}" for name in algorithms.names()),
    )
    define(
        "integer",
        "rounds",
        f"training rounds (epochs for centralized), 1 to {accounting_spec.MAX_ROUNDS:.0e}",
    )
    define(
        "float",
        "noise-multiplier",
        "noise std / clip norm of a virtual client's update, 0 to "
        f"{accounting_spec.MAX_NOISE_MULTIPLIER:g}",
    )
    define(
        "float",
        "target-epsilon",
        "instead of --noise-multiplier: calibrate it when training starts, from the real "
        "number of training users, to the smallest one whose schedule costs at most this "
        "epsilon (strict accounting) at the job's delta; in "
        f"(0, {accounting_spec.MAX_TARGET_EPSILON:g}]",
    )
    define("float", "clip-norm", "L2 clip of each virtual client's backbone update")
    define(
        "integer",
        "users-per-virtual-client",
        "users grouped into one virtual client (k); fdml: deprecated, use --fdml-users-per-group",
    )
    define(
        "string",
        "virtual-clients-per-round",
        "virtual clients per round (M), or auto: the largest the training users fill; "
        "fdml, logit-dp, dp-sgd-centralized, dp-last-layer: deprecated, use their "
        "--fdml-groups-per-round or --<section>-users-per-step",
    )
    define(
        "float", "client-learning-rate", "client (backbone) learning rate beta1 (was --client-lr)"
    )
    define("float", "client-momentum", "client SGD momentum")
    define(
        "float",
        "server-learning-rate",
        "server learning rate (centralized: its learning rate) (was --server-lr)",
    )
    define("float", "server-momentum", "server SGD momentum")
    define(
        "string",
        "server-optimizer",
        "dp-fedemb, dp-fedavg: what applies the noised aggregate: sgd (--server-momentum), "
        "adam or lamb (--server-momentum 0)",
    )
    define(
        "float",
        "head-lr-scale",
        "head learning rate / backbone learning rate (default: 100, dp-fedavg 1)",
    )
    define("string", "head-init", "local heads start as: random | class_means")
    define("float", "class-means-norm", "norm of a class_means head row (its logit scale)")
    define("string", "head-loss", "loss on the head logits: softmax | cosface | arcface")
    define("float", "head-loss-scale", "cosface/arcface: logit scale s")
    define("float", "head-loss-margin", "cosface/arcface: margin m")
    define("integer", "local-epochs", "local epochs per virtual client")
    define("integer", "batch-size", "local batch size")
    define("integer", "max-examples-per-client", "cap on examples per virtual client")
    define("integer", "head-capacity", "local head rows")
    define(
        "string",
        "architecture",
        "small_cnn | mobilenet_v2 | resnet50 | keras:<Name> (tf.keras.applications) | "
        "file:<path> (a saved Keras model) | python:<module>:<function> (a factory)",
    )
    define(
        "string",
        "batch-norm",
        "auto | freeze | group_norm: what the backbone's BatchNormalization layers become "
        "(auto: freeze for file:, group_norm otherwise)",
    )
    define("integer", "embedding-size", "embedding size")
    define("integer", "image-size", "backbone input side in pixels")
    define("integer", "channels", "backbone input channels (1 or 3)")
    define(
        "float",
        "delta",
        f"target delta in [{accounting_spec.MIN_DELTA:g}, 1) (default: training users ^ -1.1)",
    )
    define("integer", "evaluate-every", "evaluate on validation identities every N rounds")
    define("integer", "seed", "initialisation seed: backbone, local heads (public)")
    define(
        "integer",
        "schedule-seed",
        "fixed seed of which users train in which round, to reproduce a run; needs "
        "--testing-fixed-schedule (default: drawn from OS entropy, kept secret in "
        "OUTPUT/train_job.json for resuming)",
    )
    define(
        "boolean",
        "testing-fixed-schedule",
        "tests and reproduction only: allow a fixed --schedule-seed",
    )
    define("integer", "noise-seed", "fixed DP noise seed; needs --testing-fixed-noise")
    define(
        "boolean",
        "testing-fixed-noise",
        "tests and benchmarks only: allow a fixed --noise-seed (default: OS entropy)",
    )
    # Each algorithm's own settings (--fdml-groups-per-round, ...) and the flat flags
    # of the release before they replaced.
    algorithm_flags.define(flag_values)
    define("float", "max-epsilon", "privacy budget: refuse to start when the plan costs more")
    define(
        "list",
        "trainable-layers",
        "comma-separated layer-name patterns of the backbone layers that train (default: the "
        "recipe's, or every layer without --pretrained), e.g. embedding or conv1,gn1,embedding",
    )
    define(
        "string",
        "cache-features",
        "auto | true | false: train a suffix of the backbone (--trainable-layers after a "
        "frozen prefix) on the prefix's outputs computed once per image (default auto: "
        "whenever the trained layers allow it)",
    )
    define(
        "boolean",
        "shared-negatives",
        "dp-fedemb / dp-ftrl-fedemb: broadcast DPLC-released cluster centers of sampled "
        "training users as fixed negative rows of every local head; each release is charged "
        "to the run's epsilon (the --shared-negatives-* flags set it and imply this one)",
    )
    shared_defaults = shared_negatives_config.SharedNegativesConfig()
    shared_help = {
        "every_rounds": "release before every this many rounds (R)",
        "pool_users": "training users sampled per release, one class center each (n)",
        "num_clusters": "noisy cluster centers per release (Q)",
        "cluster_size": "class centers averaged per released center (T)",
        "margin": "cluster margin rho, radians in (0, pi]",
        "noise_multiplier": "DPLC noise std / the cluster mean's sensitivity (sigma)",
        "logit": "how local heads score a released center: row (s*cos(theta), one more head "
        "row) or cap (s*cos(max(theta - margin, 0)), PrivacyFace's Eq. 5 as written: a "
        "comparison mode, it cost recall in BENCHMARKS.md)",
    }
    kinds = {"margin": "float", "noise_multiplier": "float", "logit": "string"}
    for flag, field in train_config.SHARED_NEGATIVES_FLAGS.items():
        kind = kinds.get(field, "integer")
        define(
            kind,
            flag,
            f"shared negatives: {shared_help[field]} (default {getattr(shared_defaults, field)})",
        )
    define("string", "budget-ledger", "cross-run privacy budget ledger file (JSON; shared by runs)")
    define("float", "dataset-budget-epsilon", "total epsilon all runs on these users may spend")
    define(
        "boolean",
        "override-budget",
        "start even if the dataset budget would be exceeded (recorded in the ledger)",
        False,
    )
    define(
        "boolean",
        "accept-repaired-budget-ledger",
        "accept a budget ledger whose chain or records disagree because you repaired it on "
        "purpose (sealed again as it is; the repair is recorded in the ledger)",
        False,
    )
    define("string", "pretrained", "pretrained backbone (SavedModel or weights file)")
    define("float", "validation-fraction", "share of identities held out for validation", 0.1)
    define("float", "test-fraction", "share of identities held out for test", 0.1)
    define("integer", "split-seed", "seed of the identity split", 0)
    define(
        "string",
        "split-mode",
        "evaluation protocol of the split: identity_and_user (faces: held-out identities and "
        "their users), identity (EMNIST: held-out identities, shared users), held_out_images "
        "(landmarks: held-out users' images of training identities, genuine pairs across "
        "users), auto (identity_and_user when users hold disjoint identities, else a stop "
        "naming the modes) (default: identity_and_user)",
    )
    define("integer", "num-shards", "user shards of the training partition", 16)
    define(
        "string",
        "executor",
        "what runs each round: worker (TFF's worker_binary) or in_process (TFF's compiled "
        "round in this process, client work on every GPU TensorFlow sees)",
        executors.WORKER,
    )
    define("list", "workers", "host:port of remote TFF workers (default: local workers)", [])
    define("integer", "local-workers", "local TFF workers splitting each round's clients", 1)
    define(
        "integer",
        "worker-intra-op-threads",
        "threads one op of a local TFF worker may use; 0: every core (default: 1, the "
        "round's concurrent virtual clients fill the cores)",
        1,
    )
    define("string", "worker-ca", "PEM CA certificate that verifies the --workers (mutual TLS)")
    define("string", "worker-cert", "PEM client certificate presented to the --workers")
    define("string", "worker-key", "PEM private key of --worker-cert")
    define(
        "boolean",
        "allow-insecure-workers",
        "allow plaintext, unauthenticated gRPC to --workers that are not loopback (only on "
        "a network nothing else can reach: whoever reaches a worker reads the private data)",
        False,
    )
    define(
        "float",
        "first-round-deadline-s",
        "seconds a call to a TFF worker may take before any round was measured (the first, "
        "which compiles); a worker silent longer is lost",
        executors.FIRST_ROUND_DEADLINE_S,
    )
    define(
        "float",
        "round-deadline-factor",
        "a round's deadline, as a multiple of the longest round measured (at least 1)",
        executors.ROUND_DEADLINE_FACTOR,
    )
    define(
        "float",
        "min-round-deadline-s",
        "the shortest round deadline, in seconds",
        executors.MIN_ROUND_DEADLINE_S,
    )
    define(
        "integer",
        "max-worker-losses",
        "lost TFF workers a run survives (a local one restarted, a remote one dropped, the "
        "round run again from the same state); one more stops training, and the same "
        "command resumes",
        executors.MAX_WORKER_LOSSES,
    )
    define("string", "runner", "Beam runner for data preparation", "DirectRunner")
    define("string", "beam-args", "further Beam pipeline options, shell-quoted", "")


# `--help`'s groups (pipeline/help_screen.py), the flags a user needs first at the top;
# each algorithm's own section follows them (`help_groups`). tests/pipeline/test_help.py
# checks that every flag is in one.
HELP_GROUPS = (
    (
        "Start here",
        ("data", "output", "algorithm", "recipe", "target-epsilon", "delta", "rounds")
        + ("architecture", "pretrained"),
    ),
    (
        "Privacy and budget",
        ("noise-multiplier", "clip-norm", "max-epsilon")
        + ("budget-ledger", "dataset-budget-epsilon", "override-budget")
        + ("accept-repaired-budget-ledger",),
    ),
    (
        "Schedule and seeds",
        ("users-per-virtual-client", "virtual-clients-per-round", "evaluate-every", "seed")
        + ("schedule-seed", "noise-seed", "testing-fixed-schedule", "testing-fixed-noise"),
    ),
    (
        "Model",
        ("batch-norm", "embedding-size", "image-size", "channels", "trainable-layers")
        + ("cache-features",),
    ),
    (
        "Local and server steps",
        ("client-learning-rate", "client-momentum", "local-epochs", "batch-size")
        + ("max-examples-per-client", "server-learning-rate", "server-momentum")
        + ("server-optimizer",),
    ),
    (
        "Local heads",
        ("head-capacity", "head-init", "head-loss", "head-loss-scale", "head-loss-margin")
        + ("head-lr-scale", "class-means-norm"),
    ),
    (
        "Shared negatives (dp-fedemb family)",
        ("shared-negatives", "shared-negatives-every-rounds", "shared-negatives-pool-users")
        + ("shared-negatives-num-clusters", "shared-negatives-cluster-size")
        + ("shared-negatives-margin", "shared-negatives-noise-multiplier")
        + ("shared-negatives-logit",),
    ),
    (
        "Data preparation (Beam)",
        ("validation-fraction", "test-fraction", "split-seed", "split-mode", "num-shards")
        + ("runner", "beam-args"),
    ),
    (
        "Runtime (TFF workers)",
        ("executor", "workers", "local-workers", "worker-intra-op-threads", "worker-ca")
        + ("worker-cert", "worker-key", "allow-insecure-workers", "first-round-deadline-s")
        + ("round-deadline-factor", "min-round-deadline-s", "max-worker-losses"),
    ),
)


def help_groups(flag_values: flags.FlagValues) -> list[tuple[str, list[str]]]:
    """`HELP_GROUPS`, then each registered algorithm section's flags under the algorithms
    that read it."""
    del flag_values  # the groups are fixed; every flag of train is defined in them
    by_section: dict[str, list[str]] = {}
    for flag, (section, _) in algorithm_flags.section_flags().items():
        by_section.setdefault(section, []).append(flag)
    sections = [
        (f"{section} settings ({', '.join(registry.section_users(section))} only)", names)
        for section, names in by_section.items()
    ]
    return [(title, list(names)) for title, names in HELP_GROUPS] + sections


def _budget_policy(value: Mapping[str, Any]):  # noqa: ANN202 - imports TF lazily
    """The cross-run budget from --budget-ledger and --dataset-budget-epsilon, or None."""
    from tff_algorithms.privacy import budget

    ledger, total = value["budget-ledger"], value["dataset-budget-epsilon"]
    if (ledger is None) != (total is None):
        raise ValueError("--budget-ledger and --dataset-budget-epsilon go together")
    if ledger is None:
        return None
    return budget.BudgetPolicy(
        ledger, total, value["override-budget"], value["accept-repaired-budget-ledger"]
    )


def _train(value: Mapping[str, Any]) -> dict[str, Any]:
    from tff_algorithms.jobs import train_job

    config = train_config.job_config(value)
    budget_policy = _budget_policy(value)
    if not os.path.isdir(value["data"]):
        raise ValueError(f"--data {value['data']} is not a directory")
    split = {
        "validation_fraction": value["validation-fraction"],
        "test_fraction": value["test-fraction"],
        "public_fraction": 0.0,
        "seed": value["split-seed"],
    }
    if value["split-mode"] is not None:
        # Only when given: data prepared before the flag existed stays reusable.
        split["mode"] = value["split-mode"]
    beam_args = [f"--runner={value['runner']}", *shlex.split(value["beam-args"])]
    output = value["output"]
    prepared = train_data.prepare_data(
        value["data"],
        owned_files.create_entry(output, "data"),
        split,
        value["num-shards"],
        beam_args,
    )
    from beam_jobs import records_io, splits

    # The mode the split was made by (auto resolved): which evaluation pairs are genuine.
    split_summary = os.path.join(os.path.dirname(prepared.validation_dir), splits.SUMMARY_FILE)
    split_mode = records_io.read_json(split_summary).get("mode", split_protocols.IDENTITY_AND_USER)
    result = train_job.run_train_job(
        config,
        prepared.partition_dir,
        prepared.validation_dir,
        value["output"],
        value["pretrained"],
        progress=console.RoundProgress(config.rounds, stream=sys.stderr),
        budget=budget_policy,
        tensorboard_dir=owned_files.create_entry(output, "tensorboard"),
        split_mode=split_mode,
    )
    summary = {
        key: result.metrics[key]
        for key in ("algorithm", "recall_at_far", "epsilon", "delta", "private", "rounds")
    }
    summary.update(
        metrics=result.metrics_path,
        saved_model=result.saved_model_dir,
        ledger=result.ledger_path,
        test_data=prepared.test_dir,
        split_mode=split_mode,
        resumed_from_round=result.metrics["resumed_from_round"],
        dataset_budget=result.metrics["dataset_budget"],
        already_finished=result.already_finished,
    )
    if result.already_finished:
        print(
            f"dp-fedemb train: {output} holds this job, finished: nothing trained or written",
            file=sys.stderr,
        )
    return summary


# What a None (unset) TrainJobConfig field means, for --help.
_UNSET_MEANS = {
    "noise_multiplier": "{z}",
    "target_epsilon": "unset",
    "head_lr_scale": "100, dp-fedavg 1",
    "delta": "training users ^ -1.1",
    "schedule_seed": "drawn from OS entropy",
    "noise_seed": "drawn from OS entropy",
    "max_epsilon": "no budget",
}


def _default_text(field: str, value: Any) -> str:
    if value is None:
        return _UNSET_MEANS.get(field, "unset").format(z=job_config_lib.DEFAULT_NOISE_MULTIPLIER)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def help_defaults() -> dict[str, str]:
    """Flag -> its effective default under each recipe: the recipe's value, else
    TrainJobConfig's."""
    library = {
        field.name: field.default for field in dataclasses.fields(job_config_lib.TrainJobConfig)
    }
    shown = {}
    for flag, field in train_config.CONFIG_FLAGS.items():
        per_recipe = {}
        for name in recipes.RECIPES:
            values = recipes.recipe(name)
            if field == "noise_multiplier" and values.get("target_epsilon") is not None:
                per_recipe[name] = f"calibrated for --target-epsilon {values['target_epsilon']}"
            elif field in values:
                per_recipe[name] = _default_text(field, values[field])
            elif field in library:
                per_recipe[name] = _default_text(field, library[field])
        if not per_recipe:
            continue
        texts = set(per_recipe.values())
        if len(texts) == 1 and len(per_recipe) == len(recipes.RECIPES):
            shown[flag] = texts.pop()
        else:
            shown[flag] = ", ".join(
                f"{text} with --recipe={name}" for name, text in per_recipe.items()
            )
    shown.update(algorithm_flags.help_defaults(recipes.RECIPES))
    return shown


# Flags whose value must be one of a tff_algorithms module's names.
# --algorithm's: `algorithms.names()` when checked (an algorithm may register later).
_CHOICES = {
    "head-init": client_config.HEAD_INITS,
    "head-loss": client_config.HEAD_LOSSES,
    "batch-norm": model_config.BATCH_NORM_MODES,
    "server-optimizer": model_config.OPTIMIZERS,
    "cache-features": ("auto", "true", "false"),
    "split-mode": (split_protocols.AUTO, *split_protocols.MODES),
    "executor": executors.EXECUTORS,
}
_POSITIVE_INTS = (
    "rounds",
    "users-per-virtual-client",
    "local-epochs",
    "batch-size",
    "max-examples-per-client",
    "head-capacity",
    "embedding-size",
    "image-size",
    "num-shards",
    "local-workers",
)


def check(flag_values: flags.FlagValues, args: Sequence[str]) -> None:
    """Flags, paths and combinations, before TensorFlow is imported (issue 29)."""
    checks.no_arguments(args)
    value = {name: flag_values[name].value for name in flag_values}
    checks.required(flag_values, "data", "output")
    for needs_ledger in ("override-budget", "accept-repaired-budget-ledger"):
        if value[needs_ledger] and value["budget-ledger"] is None:
            raise ValueError(
                f"--{needs_ledger} needs --budget-ledger (and --dataset-budget-epsilon)"
            )
    if (value["budget-ledger"] is None) != (value["dataset-budget-epsilon"] is None):
        raise ValueError("--budget-ledger and --dataset-budget-epsilon go together; give both")
    if value["noise-seed"] is not None and not value["testing-fixed-noise"]:
        raise ValueError(
            "a fixed --noise-seed makes the DP noise predictable and is for tests only: "
            "drop it, or add --testing-fixed-noise in a test"
        )
    if value["schedule-seed"] is not None and not value["testing-fixed-schedule"]:
        raise ValueError(
            "a fixed --schedule-seed makes the sampled users predictable and is for tests "
            "only: drop it, or add --testing-fixed-schedule in a test"
        )
    if value["noise-multiplier"] is not None and value["target-epsilon"] is not None:
        raise ValueError("give at most one of --noise-multiplier and --target-epsilon")
    if value["architecture"] is not None:
        model_config.check_architecture(value["architecture"])
    layers = value["trainable-layers"]
    starts_trained = (value["architecture"] or "").startswith(model_config.FILE_PREFIX)
    if (
        layers is not None
        and layers != recipes.EVERY_LAYER
        and value["pretrained"] is None
        and not starts_trained
    ):
        raise ValueError(
            f"--trainable-layers {','.join(layers)} would keep the other layers at their "
            "random initial values: give --pretrained or a file: architecture, or drop "
            "--trainable-layers"
        )
    for name, choices in {"algorithm": algorithms.names(), **_CHOICES}.items():
        if value[name] is not None and value[name] not in choices:
            raise ValueError(
                f"--{name} must be one of {', '.join(choices)}, got "
                f"{checks.shown(repr(value[name]))}{checks.did_you_mean(value[name], choices)}"
            )
    planned = value["virtual-clients-per-round"]
    if planned is not None and planned != "auto":
        try:
            count = int(planned)
        except ValueError:
            hint = checks.did_you_mean(planned, ["auto"])
            raise ValueError(
                f"--virtual-clients-per-round must be a count or auto, got "
                f"{checks.shown(repr(planned))}{hint}"
            ) from None
        checks.number("virtual-clients-per-round", count, 1)
    for name in _POSITIVE_INTS:
        checks.number(name, value[name], 1)
    checks.number("worker-intra-op-threads", value["worker-intra-op-threads"], 0)
    # Old flags of an algorithm's own settings: one deprecation line each; another
    # algorithm's setting, or an old and a new flag that disagree: one error line; then
    # the settings' own checks (TensorFlow-free).
    given = train_config.config_values(value, algorithm_flags.warn_deprecated)
    section = train_config.chosen_algorithm(value).section
    if section is not None and section.name in given:
        section.build({k: v for k, v in given[section.name].items() if k not in section.shape})
    checks.number("rounds", value["rounds"], 1, accounting_spec.MAX_ROUNDS)
    if value["channels"] not in (None, 1, 3):
        raise ValueError(f"--channels must be 1 or 3, got {value['channels']}")
    for name in ("seed", "split-seed", "evaluate-every", "schedule-seed", "noise-seed"):
        checks.number(name, value[name], 0)
    checks.number(
        "noise-multiplier", value["noise-multiplier"], 0, accounting_spec.MAX_NOISE_MULTIPLIER
    )
    checks.number(
        "target-epsilon",
        value["target-epsilon"],
        0,
        accounting_spec.MAX_TARGET_EPSILON,
        low_open=True,
    )
    checks.number("delta", value["delta"], accounting_spec.MIN_DELTA, 1, high_open=True)
    for name in (
        "clip-norm",
        "client-learning-rate",
        "server-learning-rate",
        "head-lr-scale",
        "class-means-norm",
    ):
        checks.number(name, value[name], 0, low_open=True)
    for name in ("max-epsilon", "dataset-budget-epsilon", "head-loss-scale"):
        checks.number(name, value[name], 0, low_open=True)
    for name in ("client-momentum", "server-momentum"):
        checks.number(name, value[name], 0, 1, high_open=True)
    for flag, field in train_config.SHARED_NEGATIVES_FLAGS.items():
        if field == "logit":
            logits = shared_negatives_config.LOGITS
            if value[flag] is not None and value[flag] not in logits:
                raise ValueError(
                    f"--{flag} must be one of {', '.join(logits)}, got {checks.shown(value[flag])}"
                    + checks.did_you_mean(value[flag], logits)
                )
        elif field in ("margin", "noise_multiplier"):
            checks.number(flag, value[flag], 0, low_open=True)
        else:
            checks.number(flag, value[flag], 1)
    checks.number("head-loss-margin", value["head-loss-margin"], 0)
    for name in ("validation-fraction", "test-fraction"):
        checks.number(name, value[name], 0, 1, high_open=True)
    try:
        shlex.split(value["beam-args"])
    except ValueError as e:
        raise ValueError(f"--beam-args cannot be split as shell words: {e}") from None
    checks.input_path("data", value["data"], "dir")
    _check_output(value["data"], value["output"])
    if value["budget-ledger"] is not None:
        checks.output_file("budget-ledger", value["budget-ledger"])
    if value["pretrained"] is not None:
        checks.input_path("pretrained", value["pretrained"])
    for name in ("worker-ca", "worker-cert", "worker-key"):
        if value[name] is not None:
            checks.input_path(name, value[name], "file")


def _check_output(data: str, output: str) -> None:
    """--output is a directory the product owns (or a new one), apart from --data;
    claimed before anything is written."""
    if owned_files.is_local(output):
        owned_files.refuse_symlink(output, "--output")
        if owned_files.overlapping(data, output):
            raise ValueError(
                f"--data {checks.shown(data)} lies inside --output {checks.shown(output)}: "
                "the job would write among your images; give an --output outside --data"
            )
        if owned_files.overlapping(output, data):
            raise ValueError(
                f"--output {checks.shown(output)} lies inside --data {checks.shown(data)}: "
                "a later run would read the job's files as images; give an --output "
                "outside --data"
            )
    checks.output_dir("output", output)
    owned_files.claim(
        output,
        "train",
        legacy_marker=job_files.JOB_FILE,
        legacy_names=job_files.TRAIN_OUTPUT_NAMES,
    )


def _keep_log(output: str) -> None:
    """The full log into OUTPUT/logs; a failure to keep it (a full disk) is a warning and
    never hides the job's own outcome."""
    if not os.path.isdir(output):
        return
    try:
        owned_files.create_entry(output, console.LOG_DIR)
    except OSError as e:
        print(
            f"dp-fedemb train: warning: could not keep the full log under {output} "
            f"({e.strerror or type(e).__name__})",
            file=sys.stderr,
        )
        return
    console.keep_log_in(output, "train")


def runtime_config_of(value: Mapping[str, Any]) -> "RuntimeConfig":
    """The `runtime.RuntimeConfig` the runtime flags in `value` (flag name -> value) ask
    for; a ValueError names a setting that cannot work."""
    from tff_algorithms.federated import runtime

    return runtime.RuntimeConfig(
        executor=value["executor"],
        worker_addresses=tuple(value["workers"]),
        local_workers=value["local-workers"],
        worker_intra_op_threads=value["worker-intra-op-threads"],
        worker_ca=value["worker-ca"],
        worker_cert=value["worker-cert"],
        worker_key=value["worker-key"],
        allow_insecure_workers=value["allow-insecure-workers"],
        first_round_deadline_s=value["first-round-deadline-s"],
        round_deadline_factor=value["round-deadline-factor"],
        min_round_deadline_s=value["min-round-deadline-s"],
        max_worker_losses=value["max-worker-losses"],
    )


def run(flag_values: flags.FlagValues, args: Sequence[str]) -> int:
    if args:
        raise ValueError(f"unexpected arguments: {' '.join(args)}")
    value = {name: flag_values[name].value for name in flag_values}
    for name in ("data", "output"):
        if not value[name]:
            raise ValueError(f"--{name} is required")
    from tff_algorithms.federated import runtime

    # Started before anything can fail, so TFF's own import-time context never lingers
    # (its worker manager fails noisily at exit); SIGTERM/SIGINT stop the workers.
    try:
        runtime_config = runtime_config_of(value)
    except ValueError:
        if runtime.active() is None:
            runtime.release_import_time_context()
        raise
    # Under a caller's runtime (a test calling main in-process) no workers are started
    # unless flags ask for some; an unreadable TLS file fails before any is reached.
    summary = None
    with runtime.session(runtime_config):
        try:
            summary = _train(value)
        finally:
            # A finished job re-run wrote nothing, and keeps no log of doing nothing.
            if summary is None or not summary["already_finished"]:
                _keep_log(value["output"])
    print(json.dumps(summary, sort_keys=True))
    return 0
