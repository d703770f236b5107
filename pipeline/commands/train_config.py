"""`dp-fedemb train`'s flags as a `TrainJobConfig`.

`job_config` layers the flags given over --recipe and over what the algorithm starts
from; `config_values` reads the given flags (the `TrainJobConfig` fields passed straight
through, --shared-negatives-*, the algorithm's own settings); `chosen_algorithm` is the
job's algorithm. The command itself (flag definitions, checks, running the job) is
`pipeline.commands.train`.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from pipeline.commands import algorithm_flags
from tff_algorithms import algorithms
from tff_algorithms.algorithms import rules
from tff_algorithms.algorithms.dp_fedemb import shared_negatives_config
from tff_algorithms.config import job_config as job_config_lib
from tff_algorithms.config import recipes

# The TrainJobConfig fields passed straight through as flags: each flag is its field's
# name in kebab case (--client-learning-rate sets client_learning_rate). An algorithm's
# own settings have flags of their own (`algorithm_flags`: --fdml-groups-per-round).
_CONFIG_FIELDS = (
    "algorithm",
    "rounds",
    "noise_multiplier",
    "target_epsilon",
    "clip_norm",
    "users_per_virtual_client",
    "virtual_clients_per_round",
    "client_learning_rate",
    "client_momentum",
    "server_learning_rate",
    "server_momentum",
    "server_optimizer",
    "head_lr_scale",
    "head_init",
    "class_means_norm",
    "head_loss",
    "head_loss_scale",
    "head_loss_margin",
    "local_epochs",
    "batch_size",
    "max_examples_per_client",
    "head_capacity",
    "architecture",
    "batch_norm",
    "embedding_size",
    "image_size",
    "channels",
    "delta",
    "evaluate_every",
    "seed",
    "schedule_seed",
    "testing_fixed_schedule",
    "noise_seed",
    "testing_fixed_noise",
    "max_epsilon",
)
CONFIG_FLAGS = {field.replace("_", "-"): field for field in _CONFIG_FIELDS}
# train.shared_negatives (issue 22): --shared-negatives turns it on with the defaults of
# shared_negatives_config.SharedNegativesConfig; each --shared-negatives-FIELD sets FIELD (and turns
# it on).
SHARED_NEGATIVES_FLAGS = {
    f"shared-negatives-{field.name.replace('_', '-')}": field.name
    for field in dataclasses.fields(shared_negatives_config.SharedNegativesConfig)
}


def chosen_algorithm(value: Mapping[str, Any]) -> algorithms.Algorithm:
    """The job's algorithm: --algorithm, else the recipe's, else TrainJobConfig's."""
    recipe = recipes.recipe(value["recipe"])
    return algorithms.get(
        value["algorithm"] or recipe.get("algorithm", job_config_lib.TrainJobConfig.algorithm)
    )


def config_values(value: Mapping[str, Any], warn: Any = None) -> dict[str, Any]:
    """The TrainJobConfig values given on the command line (others keep their
    defaults), the algorithm's own settings as its section (`algorithm_flags`; `warn`:
    where the deprecation lines of old flags go, None: silently, `check` showed them)."""
    given = {field: value[name] for name, field in CONFIG_FLAGS.items() if value[name] is not None}
    planned = given.get("virtual_clients_per_round")
    if planned is not None and planned != "auto":
        try:
            given["virtual_clients_per_round"] = int(planned)
        except ValueError:
            raise ValueError(
                f"--virtual-clients-per-round must be a count or auto, got {planned!r}"
            ) from None
    if value["trainable-layers"] is not None:
        given["trainable_layers"] = list(value["trainable-layers"])
    if value["cache-features"] not in (None, "auto"):
        given["cache_features"] = value["cache-features"] == "true"
    # Boolean flags default to None; an explicit false keeps the config's default too.
    for name in ("testing-fixed-noise", "testing-fixed-schedule"):
        if not value[name]:
            given.pop(CONFIG_FLAGS[name], None)
    shared = {
        field: value[flag]
        for flag, field in SHARED_NEGATIVES_FLAGS.items()
        if value[flag] is not None
    }
    if value["shared-negatives"] or shared:
        given["shared_negatives"] = shared
    return algorithm_flags.user_values(value, given, chosen_algorithm(value), warn)


# The module tff_algorithms.config.job_config is imported as job_config_lib: this name is public.
def job_config(value: Mapping[str, Any]) -> job_config_lib.TrainJobConfig:
    """The TrainJobConfig of parsed flags: the flags given over --recipe, over what the
    algorithm starts from (`Algorithm.starting_values`: centralized, the pretraining
    recipe; logit-dp, the private contrastive recipe; dp-sgd-centralized and
    dp-last-layer, their own recipe; over --recipe), by recipes' layering rule."""
    given = config_values(value)
    values = recipes.for_architecture(recipes.recipe(value["recipe"]), given.get("architecture"))
    algorithm = chosen_algorithm(value)
    values = algorithm.starting_values(values)
    if value["pretrained"] is None and not algorithm.keeps_recipe_layers:
        # The recipe's layers fine-tune a pretrained backbone (recipes.check_start): from
        # a random one, every layer trains.
        values["trainable_layers"] = list(recipes.EVERY_LAYER)
    # The recipes' flat counts move into the algorithm's section below the flags' (from_dict).
    layered = rules.without_inapplicable_defaults(recipes.overlay(values, given), given, algorithm)
    return job_config_lib.TrainJobConfig.from_dict(recipes.job_fields(layered))
